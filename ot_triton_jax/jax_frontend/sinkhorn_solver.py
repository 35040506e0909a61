"""``ot_triton_jax.sinkhorn``: entropic OT between point clouds in JAX, OTT-JAX conventions.

The JAX twin of ``torch_api.sinkhorn``: same signature, defaults, loop and
kernels (launch plans are shared, see :mod:`ot_triton_jax.core.launch_plans`).

Conventions (those of ``ott.solvers.linear.sinkhorn.Sinkhorn`` on
``ott.geometry.pointcloud.PointCloud(x, y, epsilon=epsilon, scale_cost=scale_cost)``):

* cost C_ij = |x_i - y_j|^2 / scale_cost, epsilon absolute;
* plan P_ij = exp((f_i + g_j - C_ij) / epsilon): no a (x) b factor, so f carries
  epsilon*log a (f_i = -inf where a_i = 0; likewise g);
* alternating updates, g first, then f:
      g_j <- eps log b_j - eps LSE_i((f_i - C_ij)/eps)
      f_i <- eps log a_i - eps LSE_j((g_j - C_ij)/eps)
* the marginal error ||P^T 1 - b||_1 is measured after iteration ``it`` (0-based)
  when ``it % inner_iterations == inner_iterations - 1`` and ``it >= min_iterations``,
  and after the last iteration ``max_iterations - 1``; ``errors[k]`` holds the
  error of the k-th block of ``inner_iterations`` iterations (+inf: run but not
  measured, -1: not run). After a measured block the loop stops if the error is
  below ``threshold`` or not finite. ``converged`` = no NaN in ``errors`` and
  ``errors[-1] < threshold``. ``n_iters`` = iterations run, never more than
  ``max_iterations`` (OTT runs whole blocks, so it differs from this only when
  ``max_iterations`` is not a multiple of ``inner_iterations``).
  When ``min_iterations == max_iterations`` the loop is a fixed-length
  ``lax.scan`` (no stopping test), otherwise a ``lax.while_loop`` over blocks.
* ``reg_ot_cost`` = sum_{a>0} a (f - eps log a) + sum_{b>0} b (g - eps log b)
  + eps (sum a sum b - sum P), OTT's dual objective at the final (f, g); with
  precision "float32" sum P comes from one pass with an unbiased cross term
  ("fixed4", kernels/tiles.py; the tensor cores' truncation shrinks <x, y> by ~1e-7
  relative), with "tf32" sum P = sum a, its value after the final f-update
  (exactly what ``torch_api.sinkhorn`` computes).

The marginal error of a state is read off the *next* g-update for free
(kernels/lse.py): n iterations cost n f-updates and n + 1 g-updates.

Derivatives: ``reg_ot_cost`` is differentiable in x, y, a, b, epsilon and
scale_cost by the envelope theorem (potentials held fixed, OTT's Danskin
mode; two streaming passes). Its gradient in x, y, a, b is itself
differentiable (:mod:`.implicit`: the JVP solves the implicit system by
streaming CG), so ``jax.jvp(jax.grad(...))``, ``jax.hessian`` and vmapped HVPs
work; derivatives in the weights are taken along mass-preserving directions
(:mod:`ot_triton_jax.core.implicit_derivatives`). ``f``, ``g``, ``apply`` and
``marginal`` carry the implicit VJP (OTT's ImplicitDiff) in x, y, a, b; f and g
are defined up to (f + t, g - t), and their derivative is that of the potentials
with sum_{a>0} f - sum_{b>0} g held fixed (exact for every gauge-invariant
function of them). Second derivatives through epsilon or scale_cost raise
``NotImplementedError``.

jit: epsilon, scale_cost, threshold, the weights and ``init`` are traced
arguments, so new values never retrace or recompile; sizes, iteration counts,
``precision`` and ``backend`` are static.

Bad input: shapes, dtypes and static arguments are checked at trace time;
values (finite points, non-negative weights with equal mass, epsilon > 0) are
checked when they are concrete (eager calls), exactly as ``torch_api``
(the rules of :mod:`ot_triton_jax.core.checks`). Under ``jax.jit`` values are
tracers: if any of x, y, a, b, epsilon, scale_cost, threshold is not finite, a
weight is negative, a or b has no positive entry, sum a and sum b differ by more
than 1e-5 relative, or epsilon/scale_cost/threshold <= 0, the solver runs no
iteration and returns NaN f, g, reg_ot_cost and errors with ``converged=False``
and ``n_iters=0``; in every case the loop is bounded by ``max_iterations``.

Unbalanced (OTT's ``LinearProblem(geom, a, b, tau_a, tau_b)``): with tau_a or tau_b < 1 the
marginal of a (resp. b) is KL-relaxed with rho = eps tau / (1 - tau)
(:mod:`ot_triton_jax.core.unbalanced`), a and b may have any masses, and

* the updates are damped: g <- tau_b (eps log b - eps LSE_i((f_i - C_ij)/eps)), then
  f <- tau_a (...), the loop as above;
* the error is ||P^T 1 - b exp(-g/rho_b)||_1 (OTT's ||P 1 - a exp(-f/rho_a)||_1 + that, whose
  first term is zero after the f-update);
* ``reg_ot_cost`` = div_a + div_b + eps (sum a sum b - sum P), OTT's ``compute_kl_reg_cost``
  (div as in ``core.unbalanced.ott_marginal_term``);
* first derivatives as OTT's defaults: in x, y the envelope formula above, in a, b, epsilon,
  scale_cost the partial derivatives of that formula at fixed potentials;
* second derivatives along x, y (``jax.jvp(jax.grad(...))``, ``jax.hessian`` in x, y,
  :func:`ot_triton_jax.hvp`) differentiate those gradients with the potentials moving, and f,
  g, ``apply``, ``marginal`` carry the implicit VJP of the relaxed fixed point
  P 1 = a e^{-f/rho_a}, P^T 1 = b e^{-g/rho_b} (no gauge), both by CG on the relaxed system
  (:mod:`ot_triton_jax.core.implicit_solve`); tangents in a, b of the gradient raise
  ``NotImplementedError``;
* tau_a, tau_b are static (a new value retraces); ``jax.vmap`` over the other inputs works.

Batching: ``jax.vmap`` works on every input. When epsilon, scale_cost and threshold are shared
by the batch and there are no labels, the problems' solve loops run as one packed loop with one
block-sparse launch per half-step for the whole batch (:mod:`.batched_loop`; each problem keeps
its own stopping rule, iterations and errors); otherwise the loop runs once per problem
(:func:`.batching.loop_over_batch`, a ``lax.map``). The passes after the loop (cost, gradients,
``apply``, the CG of second derivatives) run once per problem. Ragged batches:
:func:`ot_triton_jax.segment_sinkhorn`.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from ..core import checks as rules, multiscale_rules as mrules, unbalanced
from ..core.multiscale_rules import MultiscaleOptions
from ..core.options import LoopOptions
from . import kernel_ops
from .checks import (
    READER, check_backend, check_balanced, check_iterations, check_pair, check_points, check_positive,
    check_tau, check_weights, inputs_ok,
)
from ..core.implicit_solve import ImplicitOptions, implicit_options
from .derivatives import KernelConfig, plan_mass, reg_ot_cost
from .implicit import ImplicitConfig, potentials, transport
from .kernel_ops import F32
from .batched_loop import vmappable_solve
from .label_inputs import by_label, checked, pair_clouds, swapped, values_ok
from .leading_batch import is_batch, over_batch
from .loops import ott_params
from .sinkhorn_multiscale import MultiscaleSinkhornOutput, number as multiscale_number, sinkhorn_multiscale

__all__ = ["sinkhorn", "SinkhornOutput", "MultiscaleOptions", "MultiscaleSinkhornOutput"]


# ----------------------------------------------------------------------------- output


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["f", "g", "reg_ot_cost", "errors", "converged", "n_iters",
                 "x", "y", "a", "b", "epsilon", "scale_cost", "threshold", "labels"],
    meta_fields=["inner_iterations", "precision", "backend", "implicit", "taus"],
)
@dataclasses.dataclass(frozen=True)
class SinkhornOutput:
    """Result of :func:`sinkhorn` (a pytree: returnable from ``jax.jit``).

    Attributes:
      f, g: dual potentials (float32), OTT convention (f carries eps log a; -inf where a = 0).
      reg_ot_cost: 0-d float32, differentiable in x, y, a, b, epsilon, scale_cost.
      errors: (ceil(max_iterations / inner_iterations),) float32 marginal errors
        (OTT convention: +inf not measured, -1 not run).
      converged: bool, no NaN in ``errors`` and ``errors[-1] < threshold``.
      n_iters: int32, Sinkhorn iterations run (each is a g- then an f-update).
      x, y, a, b: the problem (float32), epsilon, scale_cost, threshold (0-d float32).
      labels: (label_x int32, label_y int32, label_cost float32) of a labelled cost, or None.
    """

    f: jax.Array
    g: jax.Array
    reg_ot_cost: jax.Array
    errors: jax.Array
    converged: jax.Array
    n_iters: jax.Array
    x: jax.Array
    y: jax.Array
    a: jax.Array
    b: jax.Array
    epsilon: jax.Array
    scale_cost: jax.Array
    threshold: jax.Array
    inner_iterations: int = 10
    precision: str = "float32"
    backend: str | None = None
    implicit: ImplicitOptions = ImplicitOptions()
    taus: tuple[float, float] = (1.0, 1.0)
    labels: tuple | None = None

    @property
    def potentials(self) -> tuple[jax.Array, jax.Array]:
        return self.f, self.g

    def _transport(self, v2: jax.Array, axis: int) -> jax.Array:
        cfg = ImplicitConfig(self.precision, self.backend, self.implicit, self.taus)
        src, tgt, fs, gt = (self.y, self.x, self.g, self.f) if axis == 0 else (self.x, self.y, self.f, self.g)
        labels = swapped(self.labels) if axis == 0 else self.labels
        return transport(cfg, src, tgt, fs, gt, self.epsilon, 1.0 / self.scale_cost, v2, labels)

    def apply(self, v: jax.Array, axis: int = 0) -> jax.Array:
        """Matrix-free transport of ``v`` (OTT's and torch_api's axis convention).

        axis=0: ``v`` is indexed by the x points, shape (n,) or (n, k); returns P^T v.
        axis=1: ``v`` is indexed by the y points, shape (m,) or (m, k); returns P v.
        Differentiable in x, y, a, b (through the potentials) and v; in epsilon and
        scale_cost it raises.
        """
        axis = rules.axis(axis)
        k = self.x.shape[0] if axis == 0 else self.y.shape[0]
        rules.transport_vector(READER, v, k, axis, None)
        v = jnp.asarray(v)
        out = self._transport(v.reshape(v.shape[0], -1).astype(F32), axis)
        return out.reshape((out.shape[0],) + tuple(v.shape[1:]))

    def marginal(self, axis: int) -> jax.Array:
        """OTT's ``marginal(axis)``: axis=0 gives P^T 1 (size m), axis=1 gives P 1 (size n).
        Differentiable as :meth:`apply`."""
        axis = rules.axis(axis)
        k = self.x.shape[0] if axis == 0 else self.y.shape[0]
        return self._transport(jnp.ones((k, 1), F32), axis)[:, 0]

    def marginals(self) -> tuple[jax.Array, jax.Array]:
        """(P 1, P^T 1): row (size n) and column (size m) marginals, as torch_api."""
        return self.marginal(1), self.marginal(0)

    @property
    def transport_mass(self) -> jax.Array:
        return jnp.sum(self.marginal(1))


# ----------------------------------------------------------------------------- solver


def solve_problem(x32, y32, a32, b32, eps, scale, threshold, init, opts: LoopOptions, backend,
                  implicit: ImplicitOptions = ImplicitOptions(), taus=(1.0, 1.0), labels=None) -> SinkhornOutput:
    """The traced body of :func:`sinkhorn` on float32 inputs (eps, scale, threshold: 0-d float32);
    ``taus`` = (tau_a, tau_b), static floats (checked by the caller); ``labels``: (label_x,
    label_y, label_cost) of a labelled cost (:mod:`.label_inputs`) or None."""
    s = 1.0 / scale
    balanced = unbalanced.is_balanced(*taus)
    ok = inputs_ok(x32, y32, a32, b32, eps, scale, threshold, positive=(eps, scale, threshold),
                   nonneg=(a32, b32), balanced=((a32, b32),) if balanced else (), empty_pair=(a32, b32)
                   ) & values_ok(labels)

    sg = jax.lax.stop_gradient
    a_s, b_s, prm = sg(a32), sg(b32), ott_params(sg(eps), sg(s), taus)
    if init is None:
        f0 = jnp.where(a_s > 0, 0.0, -jnp.inf).astype(F32)
        g0 = jnp.where(b_s > 0, 0.0, -jnp.inf).astype(F32)
    else:
        f0, g0 = (sg(v).astype(F32) for v in init)
    xs, ys, loop_labels = sg(x32), sg(y32), labels
    if labels is not None:  # the loop runs on clouds grouped by label, f and g return in the caller's order
        (px, ix), (py, iy) = by_label(labels[0]), by_label(labels[1])
        xs, a_s, f0, ys, b_s, g0 = xs[px], a_s[px], f0[px], ys[py], b_s[py], g0[py]
        loop_labels = (labels[0][px], labels[1][py], labels[2])
    X, Y = pair_clouds(xs, ys, loop_labels, backend)
    # under vmap the problems run in one packed loop (each stops on its own error; batched_loop)
    solve = vmappable_solve(opts, backend, taus)
    f, g, errors, n_iters = solve(X, Y, a_s, b_s, prm, sg(threshold), f0, g0, ok)
    if labels is not None:
        f, g = f[ix], g[iy]
        X, Y = pair_clouds(sg(x32), sg(y32), labels, backend)

    nan = jnp.float32(jnp.nan)
    f = jnp.where(ok, f, nan)
    g = jnp.where(ok, g, nan)
    errors = jnp.where(ok, errors, nan)
    n_iters = jnp.where(ok, n_iters, 0)
    converged = ok & ~jnp.any(jnp.isnan(errors)) & (errors[-1] < threshold)
    kcfg = KernelConfig(opts.precision, backend, implicit, taus)
    # "tf32": sum P = sum a after the f-update when balanced; a relaxed problem needs the pass
    tf32_total = (lambda: jnp.sum(a32)) if balanced else (lambda: jnp.sum(kernel_ops.apply_plan(
        X, Y, f, g, prm, precision=opts.precision, backend=backend)[1]))
    cost = reg_ot_cost(kcfg, x32, y32, a32, b32, eps, s, f, g, plan_mass(X, Y, f, g, prm, kcfg, tf32_total),
                       labels)
    f_out, g_out = potentials(kcfg, x32, y32, a32, b32, eps, s, f, g, labels)
    return SinkhornOutput(
        f=f_out, g=g_out, reg_ot_cost=cost, errors=errors, converged=converged, n_iters=n_iters,
        x=x32, y=y32, a=a32, b=b32, epsilon=eps, scale_cost=scale, threshold=threshold,
        inner_iterations=opts.inner_iterations, precision=opts.precision, backend=backend, implicit=implicit,
        taus=taus, labels=labels)


def as_f32(*vals):
    return tuple(jnp.asarray(v).astype(F32) for v in vals)


@functools.partial(jax.jit, static_argnames=("opts", "backend", "implicit", "taus"))
def _sinkhorn_jit(x, y, a, b, eps, scale, threshold, init, opts, backend, implicit, taus=(1.0, 1.0), labels=None):
    x32, y32, a32, b32, eps, scale, threshold = as_f32(x, y, a, b, eps, scale, threshold)
    return solve_problem(x32, y32, a32, b32, eps, scale, threshold, init, opts, backend, implicit, taus, labels)


def check_taus(tau_a, tau_b) -> tuple[float, float]:
    """OTT's (tau_a, tau_b) as static Python floats in (0, 1] (:func:`.checks.check_tau`)."""
    return check_tau("tau_a", tau_a), check_tau("tau_b", tau_b)


def check_problem(x, y, a, b, epsilon, scale_cost, taus=(1.0, 1.0)):
    """The checks every OTT-convention operation runs; returns (x, y, a, b) as arrays. Equal
    masses are required only when both marginals are strict (``taus`` = (1, 1))."""
    x = check_points("x", x)
    y = check_points("y", y)
    check_pair(x, y)
    a = check_weights("a", a, x, "x")
    b = check_weights("b", b, y, "y")
    if unbalanced.is_balanced(*taus):
        check_balanced(a, b)
    check_positive("epsilon", epsilon)
    check_positive("scale_cost", scale_cost)
    return x, y, a, b


def sinkhorn(
    x: jax.Array,
    y: jax.Array,
    a: jax.Array | None = None,
    b: jax.Array | None = None,
    *,
    epsilon: Any,
    scale_cost: Any = 1.0,
    threshold: Any = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    init: tuple[jax.Array, jax.Array] | None = None,
    backend: str | None = None,
    implicit: ImplicitOptions | None = None,
    multiscale: MultiscaleOptions | None = None,
    tau_a: float = 1.0,
    tau_b: float = 1.0,
    label_x: jax.Array | None = None,
    label_y: jax.Array | None = None,
    label_cost: jax.Array | None = None,
) -> SinkhornOutput | MultiscaleSinkhornOutput:
    """Entropic OT between point clouds x (n, d) and y (m, d) with OTT-JAX conventions.

    See the module docstring for the exact conventions, derivatives and the
    behaviour on bad input. ``a``/``b`` default to uniform weights 1/n, 1/m and
    must have equal total mass. ``epsilon``, ``scale_cost`` and ``threshold`` may
    be traced (changing them never recompiles). ``precision`` is "float32"
    (float32-accurate) or "tf32" (faster, ~1e-3 relative LSE error).
    ``init`` = (f0, g0) warm-starts the potentials. Inputs of any float dtype
    are computed in float32. ``backend`` picks the kernel launcher
    ("triton_call", "callback", "auto"/None; see :mod:`.launch`).
    ``implicit``: :class:`ImplicitOptions` of the conjugate-gradient solve behind second
    derivatives and the derivatives of f, g, ``apply`` and ``marginal`` (None: defaults).
    Works inside ``jax.jit`` and under ``jax.vmap``; returns a :class:`SinkhornOutput` pytree.
    x (B, n, d), y (B, m, d), a (B, n), b (B, m): B problems, as ``jax.vmap`` of this call
    (:mod:`.leading_batch`; one packed loop), the outputs with a leading (B,) axis; with a label
    cost, labels (B, n), (B, m) and one ``label_cost`` (one solve per problem).
    ``multiscale``: a :class:`MultiscaleOptions` solves the same problem (d <= 3) with the
    multiscale backend instead, eagerly (not under jit / vmap), and returns a
    :class:`MultiscaleSinkhornOutput` (:mod:`.sinkhorn_multiscale`: conventions, derivatives); the
    loop options, ``init``, ``backend`` and ``implicit`` then raise.
    ``tau_a``, ``tau_b``: OTT's KL relaxation of the marginals of a, b (module docstring,
    "Unbalanced"), static Python floats in (0, 1] (1: strict); a traced value raises TypeError
    (under ``jax.jit`` pass them through ``static_argnames``); with ``multiscale`` too (first derivatives).
    ``label_x`` (n,), ``label_y`` (m,) integer classes and ``label_cost`` W (K_x, K_y): the
    label-augmented cost ``C_ij = s (|x_i - y_j|^2 + W[label_x_i, label_y_j])``, s = 1 / scale_cost
    (flash-sinkhorn's and OTDD's; rules in :mod:`ot_triton_jax.core.labels`). All three or none;
    shapes and dtypes are checked at trace time, label ranges and a finite W where concrete
    (under ``jax.jit``: NaN outputs and ``converged=False``). First derivatives of reg_ot_cost
    in x, y (envelope formula with the labelled plan), a, b, epsilon and scale_cost are exact;
    none flows to label_cost; derivatives of f, g, apply, marginal, second derivatives and
    ``multiscale`` raise NotImplementedError.
    """
    taus = check_taus(tau_a, tau_b)
    if is_batch(x, y):
        kw = dict(epsilon=epsilon, scale_cost=scale_cost, threshold=threshold, inner_iterations=inner_iterations,
                  min_iterations=min_iterations, max_iterations=max_iterations, precision=precision,
                  backend=backend, implicit=implicit, tau_a=tau_a, tau_b=tau_b)
        return over_batch(lambda x, y, a, b, lx, ly: sinkhorn(x, y, a, b, label_x=lx, label_y=ly,
                                                             label_cost=label_cost, **kw),
                          x, y, a, b, what="sinkhorn", rows={"label_x": (label_x, "x"), "label_y": (label_y, "y")},
                          init=init, multiscale=multiscale)
    labels = checked(label_x, label_y, label_cost, jnp.shape(x)[0], jnp.shape(y)[0])
    if multiscale is not None and labels is not None:
        raise NotImplementedError("the multiscale backend has no label cost: pass multiscale=None with label_cost")
    if multiscale is not None:
        mrules.reject_dense_options(inner_iterations=inner_iterations, min_iterations=min_iterations,
                                    max_iterations=max_iterations, init=init, backend=backend, implicit=implicit)
        for name, v in (("epsilon", epsilon), ("scale_cost", scale_cost), ("threshold", threshold)):
            multiscale_number(name, v)
        x, y, a, b = check_problem(x, y, a, b, epsilon, scale_cost, taus)
        return sinkhorn_multiscale(x, y, a, b, epsilon=epsilon, scale_cost=scale_cost, threshold=threshold,
                                   precision=LoopOptions(precision).precision, options=multiscale, taus=taus)
    x, y, a, b = check_problem(x, y, a, b, epsilon, scale_cost, taus)
    inner, lo, hi = check_iterations(threshold, inner_iterations, min_iterations, max_iterations)
    opts = LoopOptions(precision, inner, lo, hi)
    check_backend(backend)
    if init is not None:
        rules.init_shapes(init, x.shape[0], y.shape[0], jnp.shape)
        init = tuple(jnp.asarray(v) for v in init)
    return _sinkhorn_jit(x, y, a, b, epsilon, scale_cost, threshold, init, opts=opts, backend=backend,
                         implicit=implicit_options(implicit), taus=taus, labels=labels)
