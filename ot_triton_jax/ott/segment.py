"""OTT-JAX's ``segment_sinkhorn`` tool on this library's :class:`~ot_triton_jax.ott.PointCloud`.

``ott.tools.segment_sinkhorn.segment_sinkhorn`` builds OTT's own ``PointCloud`` for every segment, so
it cannot be pointed at another geometry class. :func:`segment_sinkhorn` takes the same arguments
and does the same work with the streaming geometry: OTT's ``segment_point_cloud`` cuts ``x`` and
``y`` into ``num_segments`` measures padded to ``max_measure_size`` (padding points at the origin
with weight 0; default weights 1 / size within each segment), and ``jax.vmap`` runs OTT's
``Sinkhorn(**sinkhorn_kwargs)`` on ``LinearProblem(PointCloud(x_k, y_k, **kwargs), a_k, b_k)``,
returning the ``reg_ot_cost`` of every segment. Everything OTT's solver offers (momentum,
Anderson, initializers, implicit or unrolled differentiation) applies unchanged; only the
geometry's passes run on the kernels. As in OTT the problems are balanced.

This is OTT's solver on OTT's padding; ``ot_triton_jax.segment_sinkhorn`` is the library's own
ragged solve (one packed launch per half-step, no padding, each segment its own stop).
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from ott.geometry import segment as ott_segment
from ott.problems.linear import linear_problem
from ott.solvers.linear import sinkhorn as ott_sinkhorn

from .pointcloud import PointCloud

__all__ = ["segment_sinkhorn"]


def segment_sinkhorn(x: jnp.ndarray, y: jnp.ndarray, num_segments: int | None = None,
                     max_measure_size: int | None = None, cost_fn: Any = None,
                     segment_ids_x: jnp.ndarray | None = None, segment_ids_y: jnp.ndarray | None = None,
                     indices_are_sorted: bool = False, num_per_segment_x: tuple[int, ...] | None = None,
                     num_per_segment_y: tuple[int, ...] | None = None, weights_x: jnp.ndarray | None = None,
                     weights_y: jnp.ndarray | None = None,
                     sinkhorn_kwargs: Mapping[str, Any] = MappingProxyType({}), **kwargs: Any) -> jnp.ndarray:
    """The Sinkhorn ``reg_ot_cost`` of every segment pair, shape (num_segments,): OTT-JAX 0.6's
    ``ott.tools.segment_sinkhorn.segment_sinkhorn`` with :class:`PointCloud` as the geometry.

    Segments are given either by ``segment_ids_x`` / ``segment_ids_y`` (ids in [0, num_segments);
    ``num_segments`` and ``max_measure_size`` are then required) or by ``num_per_segment_x`` /
    ``num_per_segment_y`` (contiguous segments, tuples of Python ints), exactly as in OTT.
    ``cost_fn``: None or ``ott.geometry.costs.SqEuclidean()`` (the geometry's only cost);
    ``kwargs`` go to :class:`PointCloud` (``epsilon``, ``relative_epsilon``, ``scale_cost``,
    ``precision``); ``sinkhorn_kwargs`` to ``ott.solvers.linear.sinkhorn.Sinkhorn``.
    Differentiable and jittable as OTT's (``num_per_segment_*`` static)."""
    if segment_ids_x is None and segment_ids_y is None:
        if num_per_segment_x is None or num_per_segment_y is None:
            raise ValueError("segment_sinkhorn: give segment_ids_x and segment_ids_y (with num_segments and "
                             "max_measure_size), or num_per_segment_x and num_per_segment_y")
    elif segment_ids_x is None or segment_ids_y is None:
        raise ValueError("segment_sinkhorn: segment_ids_x and segment_ids_y go together; got only one of them")
    elif num_segments is None or max_measure_size is None:
        raise ValueError("segment_sinkhorn: with segment ids, pass num_segments and max_measure_size "
                         "(the number of segments and the padded size of each), as OTT requires")
    pad = jnp.zeros((1, x.shape[1]), dtype=x.dtype)  # OTT's padder for the squared Euclidean cost
    common = dict(num_segments=num_segments, max_measure_size=max_measure_size,
                  indices_are_sorted=indices_are_sorted, padding_vector=pad)
    xs, ax, _ = ott_segment.segment_point_cloud(x, weights_x, segment_ids=segment_ids_x,
                                                num_per_segment=num_per_segment_x, **common)
    ys, by, _ = ott_segment.segment_point_cloud(y, weights_y, segment_ids=segment_ids_y,
                                                num_per_segment=num_per_segment_y, **common)
    if xs.shape[0] != ys.shape[0]:
        raise ValueError(f"segment_sinkhorn: x and y must hold the same number of segments, got {xs.shape[0]} "
                         f"and {ys.shape[0]}")
    solver = ott_sinkhorn.Sinkhorn(**sinkhorn_kwargs)

    def one(xk, yk, ak, bk):
        geom = PointCloud(xk, yk, cost_fn=cost_fn, **kwargs)
        return solver(linear_problem.LinearProblem(geom, a=ak, b=bk)).reg_ot_cost

    return jax.vmap(one)(xs, ys, ax, by)
