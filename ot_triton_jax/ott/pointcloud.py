"""An OTT-JAX ``PointCloud`` whose streaming operations run this library's kernels.

:class:`PointCloud` subclasses ``ott.geometry.pointcloud.PointCloud`` (OTT-JAX 0.6): every OTT
solver and tool that takes a geometry (``Sinkhorn``, ``LinearProblem``, ``sinkhorn_divergence``,
implicit or unrolled differentiation, ``jax.vmap``) uses it unchanged, and the operations a
Sinkhorn solve repeats become streaming passes over tiles of the two clouds (:mod:`.geometry_ops`).
OTT's ``GromovWasserstein`` solver accepts it as well and gives OTT's results; it reads only the
cost (``to_LRCGeometry``, or ``apply_cost``, ``apply_square_cost`` and ``cost_matrix``, the last
two dense as in OTT) and runs its inner Sinkhorn solves on a dense linearized geometry, so no
kernel runs there.
"""

from __future__ import annotations

from typing import Any, Literal

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from ott.geometry import costs
from ott.geometry import pointcloud as ott_pointcloud

import ot_triton_jax.ott.geometry_ops as ops  # a module import: no edge to this package

SCALE_COST_OPTIONS = ("mean", "max_cost", "median", "max_norm", "max_bound")
PRECISIONS = ("float32", "tf32")


@jtu.register_pytree_node_class
class PointCloud(ott_pointcloud.PointCloud):
    r"""Two point clouds with the squared Euclidean cost, served by streaming Triton kernels.

    The geometry of OTT-JAX's ``PointCloud`` (same constructor, same pytree, same results up to
    float32 rounding) with

    .. math::

        C_{ij} = s\,\|x_i - y_j\|^2, \qquad s = 1 / \mathrm{scale\_cost}
        \ (\text{OTT's } \texttt{inv\_scale\_cost}).

    Operations that stream (memory O((n + m) d), one to three passes of the kernels, each with
    derivatives in every array input, of any order):

    * ``apply_lse_kernel(f, g, eps, vec, axis)``: for ``axis=1``
      :math:`\varepsilon \log|\sum_j v_j e^{(f_i + g_j - C_{ij})/\varepsilon}| - f_i` and its
      sign (``vec=None``: v = 1, sign ``[1.0]``); ``axis=0`` sums over i instead and removes
      :math:`g_j`. Hence ``update_potential``, the Sinkhorn half-step.
    * ``marginal_from_potentials``, ``apply_transport_from_potentials`` (P v with
      :math:`P_{ij} = e^{(f_i + g_j - C_{ij})/\varepsilon}`, one pass for a whole batch of
      vectors), ``apply_kernel`` (K v, :math:`K_{ij} = e^{-C_{ij}/\varepsilon}`), hence
      ``marginal_from_scalings``, ``update_scaling`` and ``apply_transport_from_scalings``
      (:math:`u_i K_{ij} v_j` applied to the batch, no potentials needed).
    * ``apply_cost`` with a linear ``fn`` (OTT's own squared-Euclidean factorisation),
      ``mean_cost_matrix`` and ``std_cost_matrix`` (closed forms, :func:`.geometry_ops.std_cost`;
      the latter sets the default ``epsilon``), ``scale_cost`` a number, ``"mean"`` (closed form),
      ``"max_norm"`` or ``"max_bound"``.

    Operations that keep OTT's behaviour and memory: ``cost_matrix``, ``kernel_matrix``,
    ``transport_from_potentials``, ``transport_from_scalings`` (they return n x m matrices),
    ``apply_cost`` with a non-linear ``fn`` (hence ``apply_square_cost``) and ``to_LRCGeometry``
    (OTT's low-rank factors of x and y). ``scale_cost="max_cost"`` or ``"median"`` is
    computed once per geometry from the n x m cost matrix (OTT's rule; with ``batch_size`` set,
    OTT computes ``"max_cost"`` over row blocks of that size and refuses ``"median"``).

    Derivatives: ``jax.grad``, ``jax.jvp``, ``jax.hessian`` and ``jax.vmap`` apply to every
    streamed operation in x, y, f, g, vec, epsilon and the cost scale (the plan product is a JAX
    primitive with JVP, transpose and batching rules: :mod:`.plan_product`), so OTT's implicit
    differentiation (the default), its unrolled differentiation (``implicit_diff=None``) and
    Hessian-vector products (``jax.jvp`` of ``jax.grad``) run on the kernels.

    Args:
      x: points (n, d).
      y: points (m, d); None: x.
      cost_fn: None or ``ott.geometry.costs.SqEuclidean()``; the kernels compute no other cost.
      epsilon: OTT's ``epsilon`` (a float or an ``Epsilon`` schedule; None: 0.05 times the
        standard deviation of the cost entries).
      relative_epsilon: OTT's ``relative_epsilon`` (``"mean"`` or ``"std"``).
      scale_cost: a positive number (C divided by it) or one of ``"mean"``, ``"max_cost"``,
        ``"median"``, ``"max_norm"``, ``"max_bound"``.
      batch_size: OTT's ``batch_size``: only the operations kept from OTT use it.
      precision: the kernels' cross-term precision: ``"float32"`` (default) or ``"tf32"``.

    Results of the streamed operations are float32 (the kernels compute in float32).
    """

    def __init__(
        self,
        x: jax.Array,
        y: jax.Array | None = None,
        cost_fn: costs.CostFn | None = None,
        epsilon: Any = None,
        relative_epsilon: Literal["mean", "std"] | None = None,
        scale_cost: float | Literal["mean", "max_cost", "median", "max_norm", "max_bound"] = 1.0,
        batch_size: int | None = None,
        precision: Literal["float32", "tf32"] = "float32",
        **kwargs: Any,
    ):
        if cost_fn is not None and type(cost_fn) is not costs.SqEuclidean:
            raise ValueError(f"PointCloud: cost_fn={cost_fn!r} is not supported: the kernels compute the "
                             "squared Euclidean cost only; pass cost_fn=None or ott.geometry.costs.SqEuclidean(), "
                             "or use ott.geometry.pointcloud.PointCloud for other costs")
        if isinstance(scale_cost, str) and scale_cost not in SCALE_COST_OPTIONS:
            raise ValueError(f"PointCloud: scale_cost={scale_cost!r} is not supported; pass a positive number "
                             f"or one of {SCALE_COST_OPTIONS}")
        if precision not in PRECISIONS:
            raise ValueError(f"PointCloud: precision={precision!r}; pass one of {PRECISIONS}")
        super().__init__(x, y, cost_fn=cost_fn, batch_size=batch_size, scale_cost=scale_cost, epsilon=epsilon,
                         relative_epsilon=relative_epsilon, **kwargs)
        self._precision = precision

    # ------------------------------------------------------------------ pytree (OTT's, plus precision)

    def tree_flatten(self):  # noqa: D102
        children, aux = super().tree_flatten()
        return children, {**aux, "precision": self._precision}

    # ------------------------------------------------------------------ streamed operations

    def _s(self) -> jax.Array:
        return jnp.asarray(self.inv_scale_cost, jnp.float32)

    def _sides(self, axis: int):
        """(rows, cols) of the reduction: axis 1 sums over y (rows x), axis 0 over x (rows y)."""
        if axis not in (0, 1):
            raise ValueError(f"PointCloud: axis={axis!r}; pass 0 (sum over x) or 1 (sum over y)")
        return (self.x, self.y) if axis == 1 else (self.y, self.x)

    def apply_lse_kernel(self, f: jax.Array, g: jax.Array, eps: float | jax.Array, vec: jax.Array | None = None,
                         axis: int = 0) -> tuple[jax.Array, jax.Array]:
        r"""(value, sign): for ``axis=1``, :math:`\varepsilon\log|\sum_j v_j
        e^{(f_i + g_j - C_{ij})/\varepsilon}| - f_i` (n,) and its sign (``[1.0]`` when ``vec`` is
        None, v = 1); for ``axis=0`` the same summed over i, minus :math:`g_j` (m,). An infinite
        potential on the output side passes through (OTT's convention). One LSE pass, plus one
        plan pass with ``vec``."""
        rows, cols = self._sides(axis)
        f_out, g_in = (f, g) if axis == 1 else (g, f)
        return ops.lse(rows, cols, f_out, g_in, eps, self._s(), vec, self._precision)

    def apply_kernel(self, vec: jax.Array, eps: float | jax.Array | None = None, axis: int = 0) -> jax.Array:
        r""":math:`K^\top v` (``axis=0``, v of size n) or :math:`K v` (``axis=1``, v of size m),
        :math:`K_{ij} = e^{-C_{ij}/\varepsilon}` (``eps`` None: the geometry's epsilon); ``vec`` may
        have a trailing batch axis. One pass."""
        rows, cols = self._sides(axis)
        return ops.kernel_apply(rows, cols, self.epsilon if eps is None else eps, self._s(), vec, self._precision)

    def marginal_from_potentials(self, f: jax.Array, g: jax.Array, axis: int = 0) -> jax.Array:
        r"""The marginal of :math:`P_{ij} = e^{(f_i + g_j - C_{ij})/\varepsilon}`: :math:`P^\top 1`
        (``axis=0``, size m) or :math:`P 1` (``axis=1``, size n). One pass."""
        rows, cols = self._sides(axis)
        f_rows, g_cols = (f, g) if axis == 1 else (g, f)
        return ops.marginal(rows, cols, f_rows, g_cols, self.epsilon, self._s(), self._precision)

    def apply_transport_from_potentials(self, f: jax.Array, g: jax.Array, vec: jax.Array,
                                        axis: int = 0) -> jax.Array:
        r""":math:`P^\top v` (``axis=0``) or :math:`P v` (``axis=1``) for ``vec`` of shape
        (size,) or (batch, size), :math:`P_{ij} = e^{(f_i + g_j - C_{ij})/\varepsilon}`; the result
        has vec's layout. One pass for the whole batch."""
        rows, cols = self._sides(axis)
        f_rows, g_cols = (f, g) if axis == 1 else (g, f)
        v = vec if vec.ndim == 1 else vec.T
        out = ops.transport(rows, cols, f_rows, g_cols, self.epsilon, self._s(), v, self._precision)
        return out if vec.ndim == 1 else out.T

    def apply_transport_from_scalings(self, u: jax.Array, v: jax.Array, vec: jax.Array,
                                      axis: int = 0) -> jax.Array:
        r"""The plan :math:`u_i K_{ij} v_j` applied to ``vec`` (size,) or (batch, size):
        transposed for ``axis=0``. One kernel pass for the whole batch (scalings need no
        potentials; they underflow where OTT's do)."""
        left, right = (u, v) if axis == 1 else (v, u)
        w = right * vec  # (size,) or (batch, size)
        out = self.apply_kernel(w if vec.ndim == 1 else w.T, eps=self.epsilon, axis=axis)
        return left * out if vec.ndim == 1 else (left[:, None] * out).T

    # ------------------------------------------------------------------ summaries of the cost

    @property
    def inv_scale_cost(self) -> jax.Array:  # noqa: D102
        if isinstance(self._scale_cost, str) and self._scale_cost == "mean":
            return 1.0 / ops.mean_cost(self.x, self.y)
        return super().inv_scale_cost

    @property
    def mean_cost_matrix(self) -> jax.Array:
        """The mean entry of :attr:`cost_matrix`, in closed form (no n x m matrix)."""
        return self.inv_scale_cost * ops.mean_cost(self.x, self.y)

    @property
    def std_cost_matrix(self) -> jax.Array:
        """The (population) standard deviation of the entries of :attr:`cost_matrix`, in closed
        form (:func:`ot_triton_jax.ott.geometry_ops.std_cost`; no n x m matrix)."""
        return self.inv_scale_cost * ops.std_cost(self.x, self.y)
