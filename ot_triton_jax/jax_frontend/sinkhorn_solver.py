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
mode) through a ``jax.custom_vjp`` whose backward is the plain function
:func:`ot_triton_jax.jax_frontend.kernel_ops.cost_grads` (two streaming passes). ``f``, ``g``
and ``apply``/``marginal`` outputs carry no derivative (``f``/``g`` are
``stop_gradient``-ed).

jit: epsilon, scale_cost, threshold, the weights and ``init`` are traced
arguments, so new values never retrace or recompile; sizes, iteration counts,
``precision`` and ``backend`` are static.

Bad input: shapes, dtypes and static arguments are checked at trace time;
values (finite points, non-negative weights with equal mass, epsilon > 0) are
checked when they are concrete (eager calls), exactly as ``torch_api``. Under
``jax.jit`` values are tracers: if any of x, y, a, b, epsilon, scale_cost is not
finite, a weight is negative, or epsilon/scale_cost <= 0, the solver runs no
iteration and returns NaN f, g, reg_ot_cost and errors with ``converged=False``
and ``n_iters=0``; in every case the loop is bounded by ``max_iterations``.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import kernel_ops as jax_ops
from .launch import BACKENDS
from .kernel_ops import F32, Cloud, cloud, make_params, masked_log
from ..core.geomloss_options import positive_number
from ..core.launch_plans import check_precision

__all__ = ["sinkhorn", "SinkhornOutput"]


# ----------------------------------------------------------------------------- validation

_FLOAT_DTYPES = tuple(jnp.dtype(t) for t in ("float16", "bfloat16", "float32", "float64"))


from .interop import concrete_value  # noqa: E402


def _is_tracer(v) -> bool:
    """No concrete value behind ``v`` (it is traced by jit): value checks are skipped."""
    return concrete_value(v) is None


def _concrete_all(pred, v) -> bool:
    """bool(all(pred(v))) for a concrete v, evaluated eagerly even inside a trace."""
    with jax.ensure_compile_time_eval():
        return bool(jnp.all(pred(jnp.asarray(v))))


def _shape_dtype(name: str, v, what: str):
    if not hasattr(v, "shape") or not hasattr(v, "dtype"):
        if isinstance(v, (list, tuple, np.ndarray, float, int)):
            v = jnp.asarray(v)
        else:
            raise TypeError(f"{name} must be a jax.Array of shape {what}; got {type(v).__name__}")
    return v


def check_points(name: str, x):
    """(n, d) floating array, n, d >= 1; finite entries checked when concrete."""
    x = _shape_dtype(name, x, "(n, d)")
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape (n, d) (2 dimensions); got shape {tuple(x.shape)}. "
                         f"Use x[None] / x[:, None] to add a missing axis")
    if jnp.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64; got {x.dtype}. "
                        f"Cast it, e.g. {name}.astype(jnp.float32)")
    if x.shape[0] == 0:
        raise ValueError(f"{name} is empty (0 points): a point cloud needs at least one point")
    if x.shape[1] == 0:
        raise ValueError(f"{name} has dimension d = 0: points need at least one coordinate")
    xc = concrete_value(x)
    if xc is not None and not _concrete_all(jnp.isfinite, xc):
        raise ValueError(f"{name} contains NaN or Inf coordinates; clean the input")
    return x


def check_pair(x, y, names=("x", "y")):
    nx, ny = names
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"{nx} and {ny} must have the same dimension d; got {nx}: {tuple(x.shape)}, "
                         f"{ny}: {tuple(y.shape)}")


def check_weights(name: str, w, n: int):
    """Non-negative finite weights (n,), not all zero (when concrete); None means uniform 1/n."""
    if w is None:
        return jnp.full((n,), 1.0 / n, dtype=F32)
    w = _shape_dtype(name, w, f"({n},)")
    if w.ndim != 1 or w.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) to match the points; got {tuple(w.shape)}")
    if jnp.dtype(w.dtype) not in _FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating array; got {w.dtype}. Cast it with .astype(jnp.float32)")
    wc = concrete_value(w)
    if wc is not None:
        if not _concrete_all(jnp.isfinite, wc):
            raise ValueError(f"{name} contains NaN or Inf; weights must be finite")
        if not _concrete_all(lambda v: v >= 0, wc):
            raise ValueError(f"{name} has negative entries; weights must be >= 0")
        if _concrete_all(lambda v: v <= 0, wc):
            raise ValueError(f"{name} is all zeros; at least one weight must be positive")
    return w


def check_balanced(a, b, rtol: float = 1e-5):
    a, b = concrete_value(a), concrete_value(b)
    if a is None or b is None:
        return
    sa, sb = float(np.sum(np.asarray(a, np.float64))), float(np.sum(np.asarray(b, np.float64)))
    if abs(sa - sb) > rtol * max(sa, sb):
        raise ValueError(f"a and b must have the same total mass for balanced OT; got sum(a)={sa:.8g}, "
                         f"sum(b)={sb:.8g}. Normalize both, e.g. a / a.sum() and b / b.sum()")


def check_positive(name: str, v):
    """A positive finite scalar; a traced scalar is checked at run time (NaN output)."""
    if hasattr(v, "shape") and jnp.ndim(v) != 0:
        raise ValueError(f"{name} must be a scalar; got shape {tuple(jnp.shape(v))}")
    vc = concrete_value(v)
    if vc is not None:
        positive_number(name, vc)
    return v


def check_iterations(threshold, inner_iterations, min_iterations, max_iterations):
    for name, v in (("inner_iterations", inner_iterations), ("max_iterations", max_iterations)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a Python int >= 1 (it is static under jit); got {v!r}")
    if (isinstance(min_iterations, bool) or not isinstance(min_iterations, (int, np.integer))
            or not 0 <= min_iterations <= max_iterations):
        raise ValueError(f"min_iterations must be an int in [0, max_iterations={max_iterations}]; "
                         f"got {min_iterations!r}")
    check_positive("threshold", threshold)


def check_backend(backend):
    if backend is not None and backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'auto' or one of {BACKENDS}; got {backend!r}")
    return backend


def inputs_ok(*arrays, positive=(), nonneg=()) -> jax.Array:
    """Run-time validity flag: all finite, ``positive`` scalars > 0, ``nonneg`` arrays >= 0."""
    ok = jnp.array(True)
    for v in arrays:
        ok &= jnp.all(jnp.isfinite(v))
    for v in positive:
        ok &= v > 0
    for v in nonneg:
        ok &= jnp.all(v >= 0)
    return ok


# ----------------------------------------------------------------------------- output


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["f", "g", "reg_ot_cost", "errors", "converged", "n_iters",
                 "x", "y", "a", "b", "epsilon", "scale_cost", "threshold"],
    meta_fields=["inner_iterations", "precision", "backend"],
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

    @property
    def potentials(self) -> tuple[jax.Array, jax.Array]:
        return self.f, self.g

    def _params(self):
        return make_params(self.epsilon, 1.0 / self.scale_cost)

    def apply(self, v: jax.Array, axis: int = 0) -> jax.Array:
        """Matrix-free transport of ``v`` (OTT's and torch_api's axis convention).

        axis=0: ``v`` is indexed by the x points, shape (n,) or (n, k); returns P^T v.
        axis=1: ``v`` is indexed by the y points, shape (m,) or (m, k); returns P v.
        Not differentiable.
        """
        if axis not in (0, 1):
            raise ValueError(f"axis must be 0 (returns P^T v) or 1 (returns P v); got {axis!r}")
        n, m = self.x.shape[0], self.y.shape[0]
        k = n if axis == 0 else m
        if not hasattr(v, "shape") or jnp.ndim(v) not in (1, 2) or v.shape[0] != k:
            shape = tuple(v.shape) if hasattr(v, "shape") else type(v).__name__
            raise ValueError(f"v must have shape ({k},) or ({k}, p) for axis={axis}; got {shape}")
        X, Y = cloud(self.x, backend=self.backend), cloud(self.y, backend=self.backend)
        f, g, v = jax.lax.stop_gradient((self.f, self.g, v))
        src, tgt, fs, gt = (Y, X, g, f) if axis == 0 else (X, Y, f, g)
        return jax_ops.transport(src, tgt, fs, gt, jax.lax.stop_gradient(self._params()), v,
                                 precision=self.precision, backend=self.backend)

    def marginal(self, axis: int) -> jax.Array:
        """OTT's ``marginal(axis)``: axis=0 gives P^T 1 (size m), axis=1 gives P 1 (size n)."""
        if axis not in (0, 1):
            raise ValueError(f"axis must be 0 (P^T 1, size m) or 1 (P 1, size n); got {axis!r}")
        X, Y = cloud(self.x, backend=self.backend), cloud(self.y, backend=self.backend)
        f, g = jax.lax.stop_gradient((self.f, self.g))
        prm = jax.lax.stop_gradient(self._params())
        if axis == 1:
            return jax_ops.apply_plan(X, Y, f, g, prm, precision=self.precision, backend=self.backend)[1]
        return jax_ops.apply_plan(Y, X, g, f, prm, precision=self.precision, backend=self.backend)[1]

    def marginals(self) -> tuple[jax.Array, jax.Array]:
        """(P 1, P^T 1): row (size n) and column (size m) marginals, as torch_api."""
        return self.marginal(1), self.marginal(0)

    @property
    def transport_mass(self) -> jax.Array:
        return jnp.sum(self.marginal(1))


# ----------------------------------------------------------------------------- solver


def run_loop(iterate, state, threshold, ok, inner: int, min_it: int, max_it: int):
    """OTT's fixed-point loop around ``iterate(it, state, with_err) -> (state, err)``.

    ``err`` is the marginal error of the state *returned* by iteration ``it``
    (None when ``with_err`` is False). Iterations run in blocks of ``inner``
    (aligned on multiples of ``inner``); only the last iteration of a block can
    be measured (``it == max_it - 1`` or ``it % inner == inner - 1 and it >=
    min_it``), so it alone asks for the error and records it at
    ``errors[it // inner]`` (+inf when not measured). Blocks run in a
    ``lax.while_loop`` that stops after a measured block whose error is below
    ``threshold`` or not finite (or at once if ``ok`` is False); with
    ``min_it == max_it`` a fixed-length ``lax.scan``. A last partial block keeps
    ``max_it`` a hard cap. Returns (state, errors, n_iters).
    """
    n_blocks, rem = divmod(max_it, inner)
    errors = jnp.full((-(-max_it // inner),), -1.0, F32)

    def block(it0, carry, length):
        st, errs = carry
        if length <= 16:  # unrolled: no per-iteration loop bookkeeping
            for t in range(length - 1):
                st, _ = iterate(it0 + t, st, False)
        else:
            st = jax.lax.fori_loop(0, length - 1, lambda t, s: iterate(it0 + t, s, False)[0], st, unroll=8)
        it = it0 + length - 1
        st, e = iterate(it, st, True)
        measured = (it == max_it - 1) | ((it % inner == inner - 1) & (it >= min_it))
        return st, errs.at[it // inner].set(jnp.where(measured, e, jnp.inf))

    carry = (state, errors)
    if min_it == max_it:  # fixed number of iterations: a scan, no stopping test
        carry, _ = jax.lax.scan(lambda c, k: (block(k * inner, c, inner), None), carry,
                                jnp.arange(n_blocks, dtype=jnp.int32))
        if rem:
            carry = block(n_blocks * inner, carry, rem)
        return carry[0], carry[1], jnp.int32(max_it)

    def stop_after(it_end, errs):
        # the block ending at it_end (exclusive) was measured iff it_end - 1 >= min_it
        e = errs[(it_end - 1) // inner]
        return (it_end - 1 >= min_it) & ((~jnp.isfinite(e)) | (e < threshold))

    def cond(loop):
        k, stop, _ = loop
        return (k < n_blocks) & ~stop

    def body(loop):
        k, _, c = loop
        c = block(k * inner, c, inner)
        return k + 1, stop_after((k + 1) * inner, c[1]), c

    k, stop, carry = jax.lax.while_loop(cond, body, (jnp.int32(0), ~ok, carry))
    n_iters = k * inner
    if rem:
        carry = jax.lax.cond(stop, lambda c: c, lambda c: block(n_blocks * inner, c, rem), carry)
        n_iters = jnp.where(stop, n_iters, max_it)
    return carry[0], carry[1], n_iters.astype(jnp.int32)


def alternating_solve(X: Cloud, Y: Cloud, a, b, prm, threshold, f0, g0, ok, cfg):
    """OTT's alternating Sinkhorn (g then f). Returns (f, g, errors, n_iters).

    State (f, g, g_next): g_next is the next iteration's g-update, computed
    speculatively at the end of each iteration; its error output is the column
    marginal error of the new (f, g), so measuring costs nothing.
    """
    precision, backend, inner, min_it, max_it = cfg
    la, lb = masked_log(a), masked_log(b)

    def iterate(it, st, with_err):
        f, g, g_next = st
        g = g_next
        # the previous potentials predict the LSE shifts (kernels/lse.py, FOLD; verified there)
        f, _ = jax_ops.lse_update(X, Y, g, prm, precision=precision, backend=backend, logw_out=la,
                                  pold=f, compute_err=False, fold=True)
        g_next, err = jax_ops.lse_update(Y, X, f, prm, precision=precision, backend=backend,
                                         logw_out=lb, pold=g, compute_err=with_err, fold=True)
        return (f, g, g_next), (jnp.sum(err) if with_err else None)

    g_next, _ = jax_ops.lse_update(Y, X, f0, prm, precision=precision, backend=backend, logw_out=lb)
    (f, g, _), errors, n_iters = run_loop(iterate, (f0, g0, g_next), threshold, ok, inner, min_it, max_it)
    return f, g, errors, n_iters


def symmetric_solve(X: Cloud, a, prm, threshold, h0, ok, cfg):
    """OTT's symmetric solve of the (x, x, a, a) problem as ``sinkhorn_divergence`` runs it
    (``parallel_dual_updates=True``, momentum 0.5, Feydy et al. eq. 25): f = g = h and

        h <- 0.5 h + 0.5 (eps log a - eps LSE_j((h_j - C_ij)/eps))

    (non-finite old entries count as 0, as OTT's momentum). The error of a state is
    ||P 1 - a||_1 + ||P^T 1 - a||_1 = 2 ||P 1 - a||_1, read off the next update.
    Returns (h, errors, n_iters).
    """
    precision, backend, inner, min_it, max_it = cfg
    la = masked_log(a)

    def update(h, with_err):
        u, err = jax_ops.lse_update(X, X, h, prm, precision=precision, backend=backend,
                                    logw_out=la, pold=h, compute_err=with_err)
        return u, (2.0 * jnp.sum(err) if with_err else None)

    def iterate(it, st, with_err):
        h, u = st
        h = 0.5 * jnp.where(jnp.isfinite(h), h, 0.0) + 0.5 * u
        u, e = update(h, with_err)
        return (h, u), e

    u0, _ = update(h0, False)
    (h, _), errors, n_iters = run_loop(iterate, (h0, u0), threshold, ok, inner, min_it, max_it)
    return h, errors, n_iters


def _cost_value(a, b, eps, f, g, total):
    fa = jnp.sum(jnp.where(a > 0, a * (f - eps * masked_log(a)), 0.0))
    gb = jnp.sum(jnp.where(b > 0, b * (g - eps * masked_log(b)), 0.0))
    return fa + gb + eps * (jnp.sum(a) * jnp.sum(b) - total)


def plan_mass(X: Cloud, Y: Cloud, f, g, prm, precision: str, backend, tf32_total) -> jax.Array:
    """sum P for the mass term of reg_ot_cost (stop-gradient): with "float32" one row-sum
    pass with the unbiased "fixed4" cross term (the dual objective is stationary in (f, g),
    so the unbiased cost removes the tensor cores' truncation bias to first order); with
    "tf32" ``tf32_total()``."""
    if precision == "float32":
        total = jnp.sum(jax_ops.exact_row_mass(X, Y, f, g, prm, backend=backend))
    else:
        total = tf32_total()
    return jax.lax.stop_gradient(total)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def reg_ot_cost(cfg, x, y, a, b, eps, s, f, g, total):
    """OTT's reg_ot_cost at potentials (f, g) that solve the problem; envelope derivative.

    R = sum_{a>0} a (f - eps log a) + sum_{b>0} b (g - eps log b) + eps (sum a sum b - total)
    with ``total`` = sum P (sum a right after an f-update, else a row-sum pass).
    ``cfg`` = (precision, backend). Differentiable in x, y, a, b, eps, s by the
    envelope theorem: f, g (and total) are held fixed, their cotangents are zero;
    the backward is the plain function :func:`jax_ops.cost_grads`.
    """
    return _cost_value(a, b, eps, f, g, total)


def _reg_ot_cost_fwd(cfg, x, y, a, b, eps, s, f, g, total):
    return _cost_value(a, b, eps, f, g, total), (x, y, a, b, eps, s, f, g, total)


def envelope_grads(x, y, a, b, eps, s, f, g, *, precision: str, backend: str | None = None):
    """Gradient of reg_ot_cost in (x, y, a, b, eps, s) at fixed potentials (f, g).

    A plain function of arrays (cloud preparation included, no custom rule), the
    whole gradient path of :func:`reg_ot_cost`: the HVP issue can wrap it in
    ``jax.custom_jvp`` and forward-over-reverse (``jax.jvp(jax.grad(...))``,
    ``jax.hessian``) goes through the ``custom_vjp`` above into it.
    """
    X, Y = cloud(x, backend=backend), cloud(y, backend=backend)
    return jax_ops.cost_grads(X, Y, a, b, eps, s, f, g, precision=precision, backend=backend)


def _reg_ot_cost_bwd(cfg, res, ct):
    x, y, a, b, eps, s, f, g, total = res
    precision, backend = cfg
    gr = envelope_grads(x, y, a, b, eps, s, f, g, precision=precision, backend=backend)
    return (ct * gr.x, ct * gr.y, ct * gr.a, ct * gr.b, ct * gr.eps, ct * gr.s,
            jnp.zeros_like(f), jnp.zeros_like(g), jnp.zeros_like(total))


reg_ot_cost.defvjp(_reg_ot_cost_fwd, _reg_ot_cost_bwd)


def solve_problem(x32, y32, a32, b32, eps, scale, threshold, init, cfg) -> SinkhornOutput:
    """The traced body of :func:`sinkhorn` on float32 inputs (eps, scale, threshold: 0-d float32)."""
    precision, backend, inner, min_it, max_it = cfg
    s = 1.0 / scale
    ok = inputs_ok(x32, y32, a32, b32, eps, scale, positive=(eps, scale), nonneg=(a32, b32))

    sg = jax.lax.stop_gradient
    X, Y = cloud(sg(x32), backend=backend), cloud(sg(y32), backend=backend)
    a_s, b_s, prm = sg(a32), sg(b32), make_params(sg(eps), sg(s))
    if init is None:
        f0 = jnp.where(a_s > 0, 0.0, -jnp.inf).astype(F32)
        g0 = jnp.where(b_s > 0, 0.0, -jnp.inf).astype(F32)
    else:
        f0, g0 = (sg(v).astype(F32) for v in init)
    f, g, errors, n_iters = alternating_solve(X, Y, a_s, b_s, prm, sg(threshold), f0, g0, ok, cfg)

    nan = jnp.float32(jnp.nan)
    f = jnp.where(ok, f, nan)
    g = jnp.where(ok, g, nan)
    errors = jnp.where(ok, errors, nan)
    n_iters = jnp.where(ok, n_iters, 0)
    converged = ok & ~jnp.any(jnp.isnan(errors)) & (errors[-1] < threshold)
    cost = reg_ot_cost((precision, backend), x32, y32, a32, b32, eps, s, f, g,
                       plan_mass(X, Y, f, g, prm, precision, backend, lambda: jnp.sum(a32)))
    return SinkhornOutput(
        f=f, g=g, reg_ot_cost=cost, errors=errors, converged=converged, n_iters=n_iters,
        x=x32, y=y32, a=a32, b=b32, epsilon=eps, scale_cost=scale, threshold=threshold,
        inner_iterations=inner, precision=precision, backend=backend)


def as_f32(*vals):
    return tuple(jnp.asarray(v).astype(F32) for v in vals)


@functools.partial(jax.jit, static_argnames=("cfg",))
def _sinkhorn_jit(x, y, a, b, eps, scale, threshold, init, cfg):
    x32, y32, a32, b32, eps, scale, threshold = as_f32(x, y, a, b, eps, scale, threshold)
    return solve_problem(x32, y32, a32, b32, eps, scale, threshold, init, cfg)


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
) -> SinkhornOutput:
    """Entropic OT between point clouds x (n, d) and y (m, d) with OTT-JAX conventions.

    See the module docstring for the exact conventions, derivatives and the
    behaviour on bad input. ``a``/``b`` default to uniform weights 1/n, 1/m and
    must have equal total mass. ``epsilon``, ``scale_cost`` and ``threshold`` may
    be traced (changing them never recompiles). ``precision`` is "float32"
    (float32-accurate) or "tf32" (faster, ~1e-3 relative LSE error).
    ``init`` = (f0, g0) warm-starts the potentials. Inputs of any float dtype
    are computed in float32. ``backend`` picks the kernel launcher
    ("triton_call", "callback", "auto"/None; see :mod:`ot_triton_jax.jax_frontend.launch`).
    Works inside ``jax.jit``; returns a :class:`SinkhornOutput` pytree.
    """
    x = check_points("x", x)
    y = check_points("y", y)
    check_pair(x, y)
    a = check_weights("a", a, x.shape[0])
    b = check_weights("b", b, y.shape[0])
    check_balanced(a, b)
    check_positive("epsilon", epsilon)
    check_positive("scale_cost", scale_cost)
    check_iterations(threshold, inner_iterations, min_iterations, max_iterations)
    check_precision(precision)
    check_backend(backend)
    if init is not None:
        if not (isinstance(init, (tuple, list)) and len(init) == 2):
            raise TypeError("init must be a pair (f0, g0) of arrays of shapes (n,), (m,)")
        f0, g0 = (jnp.asarray(v) for v in init)
        if tuple(f0.shape) != (x.shape[0],) or tuple(g0.shape) != (y.shape[0],):
            raise ValueError(f"init must have shapes ({x.shape[0]},), ({y.shape[0]},); "
                             f"got {tuple(f0.shape)}, {tuple(g0.shape)}")
        init = (f0, g0)
    cfg = (precision, backend, int(inner_iterations), int(min_iterations), int(max_iterations))
    return _sinkhorn_jit(x, y, a, b, epsilon, scale_cost, threshold, init, cfg=cfg)
