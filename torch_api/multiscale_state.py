"""The multiscale solve's state (``MultiscaleResult.state``) as nested tuples of tensors.

The JAX twin (``ot_triton_jax.jax_frontend.samples_loss_multiscale``) keeps the state that the
gradient and the HVP need as JAX arrays between its forward and backward passes (a pytree of
arrays, zero-copy through DLPack): :func:`pack` flattens the state to nested tuples whose leaves
are tensors or None (int64 indices as int32, boolean masks as uint8, everything contiguous),
:func:`unpack` rebuilds it from such tuples (of tensors again).

state = (final (4), plans {name: (src Cloud, tgt Cloud, g_old, logw, ranges)}, prm, perms (2),
extra {"keep": None or (3 masks), "labels": (2), "weights": (2), "means": (4, None for a plan
without)}).
"""

from __future__ import annotations

import torch

from .kernel_ops import Cloud

PLANS = ("xy", "yx", "xx", "yy")


def _leaf(t):
    if t is None:
        return None
    if t.dtype == torch.int64:
        t = t.to(torch.int32)
    elif t.dtype == torch.bool:
        t = t.to(torch.uint8)
    return t.detach().contiguous()


def _cloud(c: Cloud) -> tuple:
    return tuple(_leaf(t) for t in (c.x, c.hi, c.lo, c.sqnorm, c.scale))


def pack(state: tuple) -> tuple:
    final, plans, prm, perms, extra = state
    packed_plans = tuple((_cloud(src), _cloud(tgt), _leaf(g), _leaf(lw), _leaf(rng))
                         for src, tgt, g, lw, rng in (plans[k] for k in PLANS))
    keep = None if extra["keep"] is None else tuple(_leaf(k) for k in extra["keep"])
    return (tuple(_leaf(p) for p in final), packed_plans, _leaf(prm), tuple(_leaf(p) for p in perms), keep,
            tuple(_leaf(t) for t in extra["labels"]), tuple(_leaf(t) for t in extra["weights"]),
            tuple(_leaf(t) for t in extra["means"]))


def unpack(packed: tuple) -> tuple:
    final, packed_plans, prm, perms, keep, labels, weights, means = packed
    plans = {k: (Cloud(*src), Cloud(*tgt), g, lw, rng) for k, (src, tgt, g, lw, rng) in zip(PLANS, packed_plans)}
    extra = {"keep": keep, "labels": tuple(labels), "weights": tuple(weights), "means": tuple(means)}
    return tuple(final), plans, prm, tuple(perms), extra
