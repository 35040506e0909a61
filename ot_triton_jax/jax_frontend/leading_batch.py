"""Leading batch dimensions in the JAX API: x (B, n, d) and y (B, m, d).

:func:`ot_triton_jax.sinkhorn`, :func:`ot_triton_jax.sinkhorn_divergence` and :func:`ot_triton_jax.hvp`
given 3-D clouds run ``jax.vmap`` of the single call over the leading axis of x, y, a (B, n), b (B, m)
(None: uniform weights for every problem) and hvp's direction, so the batch takes the vmapped path,
which folds into the packed launches (:mod:`.batching`): the outputs are the single call's pytree
with a leading (B,) axis, each problem's numbers those of its single call. Scalars (epsilon,
scale_cost, threshold) and options are shared by the batch; per-point arrays other than those (a
warm start, labels) are not mapped here: pass them through an explicit ``jax.vmap``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def is_batch(x, y) -> bool:
    """Whether the call got leading batch dimensions (a 3-D x or y)."""
    return jnp.ndim(x) == 3 or jnp.ndim(y) == 3


def over_batch(fn: Callable, x, y, a, b, mapped: tuple = (), what: str = "the call", **unmapped):
    """``jax.vmap(fn)`` over the leading axis of x, y, a, b (None stays None) and ``mapped``; the
    ``unmapped`` keyword arrays must be None (they raise, naming the argument and the fix)."""
    if jnp.ndim(x) != 3 or jnp.ndim(y) != 3 or jnp.shape(x)[0] != jnp.shape(y)[0]:
        raise ValueError(f"a batch takes x (B, n, d) and y (B, m, d) with the same B; got shapes "
                         f"{tuple(jnp.shape(x))} and {tuple(jnp.shape(y))}")
    B = jnp.shape(x)[0]
    for name, w, size in (("a", a, jnp.shape(x)[:2]), ("b", b, jnp.shape(y)[:2])):
        if w is not None and tuple(jnp.shape(w)) != tuple(size):
            raise ValueError(f"{name} must be a ({B}, {size[1]}) array of weights per problem (or None); "
                             f"got shape {tuple(jnp.shape(w))}")
    for name, value in unmapped.items():
        if value is not None:
            raise NotImplementedError(f"{what} on a (B, n, d) batch takes no {name}: call it under jax.vmap with "
                                      f"{name} mapped as you need")
    in_axes = (0, 0, None if a is None else 0, None if b is None else 0) + (0,) * len(mapped)
    return jax.vmap(fn, in_axes=in_axes)(x, y, a, b, *mapped)
