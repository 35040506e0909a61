"""Leading batch dimensions in the JAX API: x (B, n, d) and y (B, m, d).

:func:`ot_triton_jax.sinkhorn`, :func:`ot_triton_jax.sinkhorn_divergence` and :func:`ot_triton_jax.hvp`
given 3-D clouds run ``jax.vmap`` of the single call over the leading axis of x, y, a (B, n), b (B, m)
(None: uniform weights for every problem) and hvp's direction, so the batch takes the vmapped path,
which folds into the packed launches (:mod:`.batching`): the outputs are the single call's pytree
with a leading (B,) axis, each problem's numbers those of its single call. Scalars (epsilon,
scale_cost, threshold), options and a label table are shared by the batch; labels are mapped rows
(B, n), (B, m); other per-point arrays (a warm start) are not mapped here: pass them through an
explicit ``jax.vmap``.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp

from ..core import checks as rules


def is_batch(x, y) -> bool:
    """Whether the call got leading batch dimensions (a 3-D x or y)."""
    return jnp.ndim(x) == 3 or jnp.ndim(y) == 3


def over_batch(fn: Callable, x, y, a, b, mapped: tuple = (), what: str = "the call", rows: dict | None = None,
               **unmapped):
    """``jax.vmap(fn)`` over the leading axis of x, y, a, b (None stays None), ``mapped`` and the
    values of ``rows`` (name -> (array (B, n) or (B, m), "x" or "y"), checked against the clouds;
    passed after ``mapped``); the ``unmapped`` keyword arrays must be None (they raise, naming the
    argument and the fix)."""
    shape = lambda v: None if v is None else tuple(jnp.shape(v))  # noqa: E731
    rows = rows or {}
    per_problem = {"a": (shape(a), "x"), "b": (shape(b), "y")}
    per_problem.update({name: (shape(v), side) for name, (v, side) in rows.items()})
    rules.batch_shapes(jnp.shape(x), jnp.shape(y), per_problem, "array")
    for name, value in unmapped.items():
        if value is not None:
            raise NotImplementedError(f"{what} on a (B, n, d) batch takes no {name}: call it under jax.vmap with "
                                      f"{name} mapped as you need")
    extra = tuple(v for v, _ in rows.values())
    in_axes = (0, 0, None if a is None else 0, None if b is None else 0) + (0,) * len(mapped) + tuple(
        None if v is None else 0 for v in extra)
    return jax.vmap(fn, in_axes=in_axes)(x, y, a, b, *mapped, *extra)
