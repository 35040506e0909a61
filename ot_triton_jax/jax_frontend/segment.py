"""``ot_triton_jax.segment_sinkhorn``: OTT's ragged batch, the clouds concatenated with their segments.

OTT's ``ott.tools.segment_sinkhorn.segment_sinkhorn`` conventions: x (N, d) and y (M, d) hold
the points of ``num_segments`` problems, given as sizes of consecutive segments
(``num_per_segment_x / _y``) or ids in any order (``segment_ids_x / _y``; ``indices_are_sorted`` is
accepted and not needed: the ids are read on the host, and unsorted ones grouped); optional concatenated
weights ``weights_x / _y`` (default: uniform 1 / n_k within each segment). The result is the
``reg_ot_cost`` of each segment pair (num_segments,), each problem solved with
:func:`ot_triton_jax.sinkhorn`'s conventions and options (``**kwargs``: ``epsilon``,
``threshold``, ``tau_a``, ...).

As OTT does, each segment is padded to ``max_measure_size`` (default: the largest segment; a fixed
value keeps the shapes, and so the compiled solve, across calls) with zero-weight points (copies
of its first point, so the padding is absent from every sum and from the derivatives) and the
problems are solved by ``jax.vmap`` of :func:`ot_triton_jax.sinkhorn`, whose loop runs all of them
in one block-sparse launch per half-step (:mod:`.batched_loop`). Each problem's cost, iterations
and derivatives (in x, y, the weights, ``jax.jvp(jax.grad)``) are those of its single solve.
The segment sizes fix the shapes: they must be concrete (numbers, or arrays read outside
``jax.jit``), as OTT's ``max_measure_size`` is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from ..core.batch_layout import check_measure_size, segment_order, segment_sizes
from .sinkhorn_solver import sinkhorn

__all__ = ["segment_sinkhorn"]


def _padded(values: jax.Array, sizes: list[int], width: int, fill_first: bool) -> jax.Array:
    """(S, width, ...) from the concatenated (sum sizes, ...) ``values``: segment k's rows, then
    copies of its first row (``fill_first``) or zeros."""
    starts = np.cumsum([0] + sizes[:-1])
    idx = np.array([[s + min(j, n - 1) for j in range(width)] for s, n in zip(starts, sizes)])
    out = values[idx]
    if not fill_first:
        mask = np.arange(width)[None, :] < np.asarray(sizes)[:, None]
        out = jnp.where(mask.reshape(mask.shape + (1,) * (values.ndim - 1)), out, 0)
    return out


def _weights(w, sizes: list[int], width: int, name: str) -> jax.Array:
    if w is None:
        return jnp.asarray(np.array([[1.0 / n if j < n else 0.0 for j in range(width)] for n in sizes]),
                           jnp.float32)
    w = jnp.asarray(w)
    if w.ndim != 1 or w.shape[0] != sum(sizes):
        raise ValueError(f"weights_{name} must be a vector of one weight per point of {name} ({sum(sizes)}); "
                         f"got shape {w.shape}")
    return _padded(w, sizes, width, fill_first=False)


def _equal_masses(wx, wy, sx: list[int], sy: list[int], kwargs: dict) -> None:
    """Eagerly (concrete weights, strict marginals): every segment pair has equal masses. Under
    ``jax.jit`` a pair that does not gets NaN, as :func:`ot_triton_jax.sinkhorn` gives."""
    if kwargs.get("tau_a", 1.0) != 1.0 or kwargs.get("tau_b", 1.0) != 1.0:
        return
    try:
        ma = np.add.reduceat(np.asarray(wx, np.float64), np.cumsum([0] + sx[:-1])) if wx is not None \
            else np.ones(len(sx))
        mb = np.add.reduceat(np.asarray(wy, np.float64), np.cumsum([0] + sy[:-1])) if wy is not None \
            else np.ones(len(sy))
    except Exception:  # traced weights: checked by the solver (NaN outputs)
        return
    bad = np.nonzero(np.abs(ma - mb) > 1e-5 * np.maximum(np.abs(ma), 1e-30))[0]
    if bad.size:
        k = int(bad[0])
        raise ValueError(f"segment {k}: weights_x and weights_y must have the same total mass per segment "
                         f"(balanced OT); got {ma[k]:.8g} and {mb[k]:.8g} (or pass tau_a / tau_b < 1)")


def segment_sinkhorn(
    x: jax.Array,
    y: jax.Array,
    num_segments: int | None = None,
    *,
    segment_ids_x: Any = None,
    segment_ids_y: Any = None,
    num_per_segment_x: Sequence[int] | Any = None,
    num_per_segment_y: Sequence[int] | Any = None,
    weights_x: jax.Array | None = None,
    weights_y: jax.Array | None = None,
    max_measure_size: int | None = None,
    indices_are_sorted: bool = False,
    **kwargs: Any,
) -> jax.Array:
    """The ``reg_ot_cost`` (num_segments,) of each segment pair of the concatenated clouds x (N, d),
    y (M, d) (module docstring: OTT's conventions; the padding; ``kwargs`` are
    :func:`ot_triton_jax.sinkhorn`'s options, ``epsilon`` required). Every segment needs at least
    one point on each side. Differentiable in x, y and the weights like the single solves."""
    x, y = jnp.asarray(x), jnp.asarray(y)
    if x.ndim != 2 or y.ndim != 2:
        raise ValueError(f"x and y must be (N, d) and (M, d) concatenated clouds; got shapes {x.shape}, {y.shape}")
    sx = segment_sizes("x", x.shape[0], num_per_segment_x, segment_ids_x, num_segments)
    sy = segment_sizes("y", y.shape[0], num_per_segment_y, segment_ids_y, num_segments)
    if len(sx) != len(sy):
        raise ValueError(f"x and y have different numbers of segments: {len(sx)} and {len(sy)}")
    if "a" in kwargs or "b" in kwargs:
        raise TypeError("segment_sinkhorn takes the weights as weights_x and weights_y (concatenated)")
    ox, oy = segment_order(segment_ids_x), segment_order(segment_ids_y)
    if ox is not None:  # the points of each segment made consecutive (no cost depends on their order)
        x, weights_x = x[ox], None if weights_x is None else jnp.asarray(weights_x)[ox]
    if oy is not None:
        y, weights_y = y[oy], None if weights_y is None else jnp.asarray(weights_y)[oy]
    _equal_masses(weights_x, weights_y, sx, sy, kwargs)
    size = check_measure_size(max_measure_size, sx, sy)
    wn, wm = (max(sx), max(sy)) if size is None else (size, size)
    xs, ys = _padded(x, sx, wn, True), _padded(y, sy, wm, True)
    a, b = _weights(weights_x, sx, wn, "x"), _weights(weights_y, sy, wm, "y")
    return jax.vmap(lambda u, v, p, q: sinkhorn(u, v, p, q, **kwargs).reg_ot_cost)(xs, ys, a, b)
