"""Sinkhorn divergences in JAX: an OTT-JAX twin and a GeomLoss twin.

``sinkhorn_divergence`` follows ``ott.tools.sinkhorn_divergence.sinkhorn_divergence``
on ``PointCloud`` geometries (OTT 0.6.0)::

    div = R(x, y) - 1/2 R(x, x) - 1/2 R(y, y) + 1/2 eps (sum a - sum b)^2

with R = ``reg_ot_cost`` of ``ot_triton_jax.sinkhorn`` (C = |x - y|^2 / scale_cost,
absolute epsilon shared by the three terms). The (x, y) term is the alternating
solver; with ``symmetric_sinkhorn=True`` (OTT's default) the (x, x) and (y, y)
terms run OTT's symmetric solve (``parallel_dual_updates=True`` with momentum
0.5: h <- (h + T(h)) / 2, Feydy et al. 2019 eq. 25), whose marginal error is
||P 1 - a||_1 + ||P^T 1 - a||_1 and whose R uses an explicit plan-mass pass.
``static_b=True`` skips R(y, y) and uses ``offset_static_b`` (default 0) in its
place. The same ``threshold``/``inner_iterations``/``min_iterations``/
``max_iterations`` drive all solves (OTT's ``solve_kwargs``). Gradients in x, y,
a, b and epsilon: envelope theorem on each term (OTT's Danskin default), by the
``custom_vjp`` of :func:`ot_triton_jax.jax_frontend.sinkhorn_solver.reg_ot_cost`.
Returns ``(divergence, SinkhornDivergenceOutput)`` like OTT.

``samples_loss`` is the twin of ``torch_api.SamplesLoss`` / ``geomloss.SamplesLoss(
"sinkhorn", p=2)`` (see torch_api/samples_loss.py for the full statement):

* C = |x - y|^2 / 2, eps = blur^2, softmin_i = -eps log sum_j b_j exp((g_j - C_ij)/eps);
* eps-schedule ``schedules.epsilon_schedule(2, diameter, blur, scaling)``, the
  diameter defaulting to the diagonal of the joint bounding box of all points;
* initialisation at the first eps from zero potentials, symmetric averaged updates
  of f_ba, g_ab (and f_aa, g_bb with ``debias``) for every eps, then one last
  non-averaged extrapolation at blur^2;
* value <a, f_ba - f_aa> + <b, g_ab - g_bb> (debias) or <a, f_ba> + <b, g_ab>;
  ``potentials=True`` returns (F, G);
* gradients: GeomLoss's rule (only the last extrapolation is differentiated, its
  inputs detached): dF_i/dx_i = (Q x)_i - (P y)_i with the row-normalised plans
  of the last extrapolation (x_i - (P y)_i without debias), grad_a = F,
  grad_b = G; (F, G) themselves are differentiable in x, y (not a, b).

Argument order is (x, y, a, b) as everywhere in this package (GeomLoss's module
takes (a, x, b, y)). Points are (N, D) or (B, N, D) (a batch is solved one
problem after the other with one shared schedule, as GeomLoss does). ``backend``
is the kernel launcher ("triton_call", "callback", "auto"/None); GeomLoss's
names "tensorized" and "online" mean "auto" (one exact streaming solver);
"multiscale" is not implemented.

jit: blur, scaling, diameter, debias, potentials, precision and backend are
static. When the points are concrete (eager call) the eps-schedule is computed
in float64 on the host exactly as torch_api does; inside ``jax.jit`` with traced
points and ``diameter=None`` it is computed on the device in float32 (same
formula; its length is then a run-time loop bound, so new data never
retraces).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from . import kernel_ops as jax_ops
from .kernel_ops import F32, cloud, make_params, masked_log
from ..core.geomloss_options import reject_unsupported, schedule_numbers
from .interop import concrete_value
from .sinkhorn_solver import (
    _is_tracer, as_f32, check_backend, check_balanced, check_iterations, check_pair, check_points,
    check_positive, check_weights, inputs_ok, plan_mass, reg_ot_cost, solve_problem, symmetric_solve,
)
from ..core.launch_plans import check_precision
from ..core.schedules import epsilon_schedule

__all__ = ["sinkhorn_divergence", "SinkhornDivergenceOutput", "samples_loss"]


# ============================================================================= OTT twin


@functools.partial(
    jax.tree_util.register_dataclass,
    data_fields=["divergence", "a", "b", "potentials", "errors", "converged", "n_iters", "costs"],
    meta_fields=[],
)
@dataclasses.dataclass(frozen=True)
class SinkhornDivergenceOutput:
    """Details of :func:`sinkhorn_divergence` (a pytree), fields as OTT's.

    potentials, errors, converged, n_iters, costs: triples for the (x, y),
    (x, x) and (y, y) problems (the last entry is None with ``static_b``).
    ``costs`` are the three reg_ot_cost values.
    """

    divergence: jax.Array
    a: jax.Array
    b: jax.Array
    potentials: tuple
    errors: tuple
    converged: tuple
    n_iters: tuple
    costs: tuple


def _self_term(x32, a32, eps, scale, threshold, ok, cfg, symmetric: bool):
    """(reg_ot_cost, (f, g), errors, converged, n_iters) of the (x, x, a, a) problem."""
    precision, backend = cfg[0], cfg[1]
    if not symmetric:
        out = solve_problem(x32, x32, a32, a32, eps, scale, threshold, None, cfg)
        return out.reg_ot_cost, (out.f, out.g), out.errors, out.converged, out.n_iters
    sg = jax.lax.stop_gradient
    s = 1.0 / scale
    X = cloud(sg(x32), backend=backend)
    prm = make_params(sg(eps), sg(s))
    a_s = sg(a32)
    h0 = jnp.where(a_s > 0, 0.0, -jnp.inf).astype(F32)
    h, errors, n_iters = symmetric_solve(X, a_s, prm, sg(threshold), h0, ok, cfg)
    nan = jnp.float32(jnp.nan)
    h = jnp.where(ok, h, nan)
    errors = jnp.where(ok, errors, nan)
    n_iters = jnp.where(ok, n_iters, 0)
    converged = ok & ~jnp.any(jnp.isnan(errors)) & (errors[-1] < threshold)
    total = plan_mass(X, X, h, h, prm, precision, backend,
                      lambda: jnp.sum(jax_ops.apply_plan(X, X, h, h, prm, precision=precision, backend=backend)[1]))
    cost = reg_ot_cost((precision, backend), x32, x32, a32, a32, eps, s, h, h, total)
    return cost, (h, h), errors, converged, n_iters


@functools.partial(jax.jit, static_argnames=("cfg", "static_b", "symmetric"))
def _divergence_jit(x, y, a, b, eps, scale, threshold, offset, cfg, static_b, symmetric):
    x32, y32, a32, b32, eps, scale, threshold = as_f32(x, y, a, b, eps, scale, threshold)
    ok = inputs_ok(x32, y32, a32, b32, eps, scale, positive=(eps, scale), nonneg=(a32, b32))
    xy = solve_problem(x32, y32, a32, b32, eps, scale, threshold, None, cfg)
    xx = _self_term(x32, a32, eps, scale, threshold, ok, cfg, symmetric)
    if static_b:
        yy = (jnp.asarray(offset, F32), None, None, None, None)
    else:
        yy = _self_term(y32, b32, eps, scale, threshold, ok, cfg, symmetric)
    mass = 0.5 * jax.lax.stop_gradient(eps) * (jnp.sum(a32) - jnp.sum(b32)) ** 2
    div = xy.reg_ot_cost - 0.5 * (xx[0] + yy[0]) + mass
    out = SinkhornDivergenceOutput(
        divergence=div, a=a32, b=b32,
        potentials=((xy.f, xy.g), xx[1], yy[1]),
        errors=(xy.errors, xx[2], yy[2]),
        converged=(xy.converged, xx[3], yy[3]),
        n_iters=(xy.n_iters, xx[4], yy[4]),
        costs=(xy.reg_ot_cost, xx[0], yy[0]),
    )
    return div, out


def sinkhorn_divergence(
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
    static_b: bool = False,
    offset_static_b: Any = None,
    symmetric_sinkhorn: bool = True,
    backend: str | None = None,
) -> tuple[jax.Array, SinkhornDivergenceOutput]:
    """Sinkhorn divergence between point clouds, OTT-JAX conventions (module docstring).

    Equivalent to ``ott.tools.sinkhorn_divergence.sinkhorn_divergence(PointCloud, x, y,
    a=a, b=b, epsilon=epsilon, scale_cost=scale_cost, static_b=static_b,
    offset_static_b=offset_static_b, symmetric_sinkhorn=symmetric_sinkhorn,
    solve_kwargs=dict(threshold=..., inner_iterations=..., min_iterations=...,
    max_iterations=...))``. ``epsilon`` is required and absolute (OTT's default of
    5% of the mean cost is not reproduced). Differentiable in x, y, a, b, epsilon,
    scale_cost; works under ``jax.jit`` (epsilon etc. traced).
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
    if offset_static_b is not None and not static_b:
        raise ValueError("offset_static_b is only used with static_b=True; pass static_b=True or drop it")
    cfg = (precision, backend, int(inner_iterations), int(min_iterations), int(max_iterations))
    offset = 0.0 if offset_static_b is None else offset_static_b
    return _divergence_jit(x, y, a, b, epsilon, scale_cost, threshold, offset, cfg=cfg,
                           static_b=bool(static_b), symmetric=bool(symmetric_sinkhorn))


# ============================================================================= GeomLoss twin

_S = 0.5  # cost scale: C = |x - y|^2 / 2 for p = 2
_GEOMLOSS_BACKENDS = ("tensorized", "online")


def _check_options(loss, p, blur, reach, diameter, scaling, cost, kernel, cluster_scale, backend, precision):
    reject_unsupported(loss, p, reach, cost, kernel, cluster_scale, backend)
    if backend in _GEOMLOSS_BACKENDS:
        backend = None
    check_backend(backend)
    for name, v in (("blur", blur), ("scaling", scaling)) + ((("diameter", diameter),) if diameter is not None else ()):
        if _is_tracer(v):
            raise TypeError(f"{name} must be a Python number (it shapes the eps-schedule, static under jit); "
                            f"got a traced value. Mark it static (jax.jit(..., static_argnames=...))")
    blur, scaling, diameter = schedule_numbers(blur, scaling, diameter)
    check_precision(precision)
    return blur, diameter, scaling, backend


def _geomloss_points(x, y):
    for name, v in (("x", x), ("y", y)):
        if not hasattr(v, "shape") or not hasattr(v, "dtype"):
            raise TypeError(f"{name} must be a jax.Array of shape (N, D) or (B, N, D); got {type(v).__name__}")
        if v.ndim not in (2, 3):
            raise ValueError(f"{name} must have shape (N, D) or (B, N, D) (batch); got shape {tuple(v.shape)}")
    if x.ndim != y.ndim:
        raise ValueError(f"x and y must both be unbatched (N, D) or both batched (B, N, D); got shapes "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if x.dtype != y.dtype:
        raise TypeError(f"x and y must have the same dtype; got {x.dtype} and {y.dtype}. Cast one of them")
    if x.ndim == 3:
        if x.shape[0] != y.shape[0]:
            raise ValueError(f"x and y must have the same batch size B; got x: {tuple(x.shape)}, "
                             f"y: {tuple(y.shape)}")
        if x.shape[0] == 0:
            raise ValueError("x and y have batch size B = 0: nothing to compute")
    # (B, N, D) is checked as one (B*N, D) cloud: same messages, one device reduction
    flat = (lambda v: v.reshape(-1, v.shape[-1])) if x.ndim == 3 else (lambda v: v)
    if x.shape[-2] == 0 or y.shape[-2] == 0:
        name = "x" if x.shape[-2] == 0 else "y"
        raise ValueError(f"{name} is empty (0 points): a point cloud needs at least one point")
    check_points("x", flat(x))
    check_points("y", flat(y))
    check_pair(flat(x), flat(y))


def _geomloss_weights(name, w, pts, pname):
    shape = tuple(pts.shape[:-1])
    if w is None:
        return jnp.full(shape, 1.0 / shape[-1], dtype=jnp.promote_types(pts.dtype, F32))
    if not hasattr(w, "shape"):
        raise TypeError(f"{name} must be a jax.Array; got {type(w).__name__}")
    ww = w[..., 0] if (w.ndim == len(shape) + 1 and w.shape[-1] == 1) else w
    if tuple(ww.shape) != shape:
        want = " or ".join(str(s) for s in (shape, shape + (1,)))
        raise ValueError(f"{name} must have shape {want} to match the points {pname} {tuple(pts.shape)}; "
                         f"got {tuple(w.shape)}")
    rows = ww if ww.ndim == 2 else ww[None]
    for k in range(rows.shape[0]):
        check_weights(name if ww.ndim == 1 else f"{name}[{k}]", rows[k], shape[-1])
    return ww


def _check_masses(a, b, rtol=1e-5):
    a, b = concrete_value(a), concrete_value(b)
    if a is None or b is None:
        return
    sa = np.asarray(a, np.float64).reshape(-1, a.shape[-1]).sum(-1)
    sb = np.asarray(b, np.float64).reshape(-1, b.shape[-1]).sum(-1)
    for k, (ma, mb) in enumerate(zip(sa, sb)):
        if abs(ma - mb) > rtol * max(ma, mb):
            where = "" if a.ndim == 1 else f" in batch {k}"
            raise ValueError(f"a and b must have the same total mass (balanced OT, reach=None){where}; got "
                             f"sum(a)={ma:.8g}, sum(b)={mb:.8g}. Normalize both, e.g. a / a.sum() and b / b.sum()")


def _host_schedule(x, y, blur, diameter, scaling):
    """torch_api's schedule, in float64 on the host (concrete points or given diameter)."""
    if diameter is None:
        d = x.shape[-1]
        pts = np.concatenate([np.asarray(x, np.float64).reshape(-1, d), np.asarray(y, np.float64).reshape(-1, d)])
        diameter = float(np.linalg.norm(pts.max(0) - pts.min(0)))
        if diameter == 0.0:
            diameter = blur
    return np.asarray(epsilon_schedule(2, diameter, blur, scaling), np.float32)


def _device_schedule(x, y, blur, scaling):
    """(eps_0, start, step, count, eps_last) of the same schedule, computed on the device."""
    d = x.shape[-1]
    pts = jnp.concatenate([x.reshape(-1, d), y.reshape(-1, d)]).astype(F32)
    diam = jnp.linalg.norm(jnp.max(pts, 0) - jnp.min(pts, 0))
    diam = jnp.where(diam > 0, diam, blur)
    start, stop, step = 2 * jnp.log(diam), 2 * math.log(blur), 2 * math.log(scaling)
    count = jnp.maximum(jnp.ceil((stop - start) / step), 0).astype(jnp.int32)
    return diam * diam, start, jnp.float32(step), count, jnp.float32(blur * blur)


def _eps_at(sched, k):
    if isinstance(sched, tuple):
        e0, start, step, count, elast = sched
        k = jnp.asarray(k, jnp.int32)
        mid = jnp.exp(start + (k - 1).astype(F32) * step)
        return jnp.where(k == 0, e0, jnp.where(k <= count, mid, elast)).astype(F32)
    return sched[k]


def _n_eps(sched):
    return sched[3] + 2 if isinstance(sched, tuple) else sched.shape[0]


def _last_eps(sched):
    return sched[4] if isinstance(sched, tuple) else sched[-1]


def _geomloss_solve(X, Y, la, lb, sched, debias, precision, backend):
    """The annealed symmetric loop; returns (old, new) potential quadruples (f_aa, g_bb None w/o debias)."""
    def softmin(src, tgt, pot, logw, prm):
        return jax_ops.lse_update(src, tgt, pot, prm, precision=precision, backend=backend, logw_in=logw)[0]

    def sweep(pots, prm):
        f_ba, g_ab, f_aa, g_bb = pots
        out = [softmin(X, Y, g_ab, lb, prm), softmin(Y, X, f_ba, la, prm), f_aa, g_bb]
        if debias:
            out[2], out[3] = softmin(X, X, f_aa, la, prm), softmin(Y, Y, g_bb, lb, prm)
        return tuple(out)

    zx, zy = jnp.zeros(X.n, F32), jnp.zeros(Y.n, F32)
    pots = sweep((zx, zy, zx, zy), make_params(_eps_at(sched, 0), _S))

    def body(k, pots):
        new = sweep(pots, make_params(_eps_at(sched, k), _S))
        return tuple(0.5 * (p + q) for p, q in zip(pots, new))

    pots = jax.lax.fori_loop(0, _n_eps(sched), body, pots)
    last = sweep(pots, make_params(_last_eps(sched), _S))
    return pots, last


def _side_direction(S, T, f, g_w, h, h_w, prm, debias, precision, backend):
    """dF_i/dx_i (rows of S): (Q s)_i - (P t)_i with row-normalised plans (s_i - (P t)_i w/o debias)."""
    pt, r = jax_ops.apply_plan(S, T, f, g_w, prm, precision=precision, backend=backend, v=T.x)
    mean_t = pt / r[:, None]
    if not debias:
        return S.x - mean_t
    qs, q = jax_ops.apply_plan(S, S, h, h_w, prm, precision=precision, backend=backend, v=S.x)
    return qs / q[:, None] - mean_t


def _centered(x, y, backend):
    pts = jnp.concatenate([x, y])
    center = 0.5 * (jnp.max(pts, 0) + jnp.min(pts, 0))
    return cloud(x - center, backend=backend), cloud(y - center, backend=backend)


def _forward(cfg, x, y, a, b, sched):
    debias, precision, backend = cfg
    sg = jax.lax.stop_gradient
    X, Y = _centered(sg(x), sg(y), backend)
    a, b, sched = sg(a), sg(b), sg(sched)
    la, lb = masked_log(a), masked_log(b)
    old, new = _geomloss_solve(X, Y, la, lb, sched, debias, precision, backend)
    F, G = (new[0] - new[2], new[1] - new[3]) if debias else (new[0], new[1])
    res = (X, Y, la, lb, old, new, _last_eps(sched))
    return (F, G), res


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def geomloss_potentials(cfg, x, y, a, b, sched):
    """(F, G) of one problem; derivative in x, y by GeomLoss's rule, none in a, b, sched."""
    return _forward(cfg, x, y, a, b, sched)[0]


def _potentials_fwd(cfg, x, y, a, b, sched):
    out, res = _forward(cfg, x, y, a, b, sched)
    return out, res


def _potentials_bwd(cfg, saved, cts):
    debias, precision, backend = cfg
    X, Y, la, lb, old, new, eps = saved
    uF, uG = cts
    f_ba, g_ab, f_aa, g_bb = new
    of_ba, og_ab, of_aa, og_bb = old
    prm = make_params(eps, _S)
    dx = _side_direction(X, Y, f_ba, og_ab + eps * lb, f_aa, of_aa + eps * la if debias else None,
                         prm, debias, precision, backend)
    dy = _side_direction(Y, X, g_ab, of_ba + eps * la, g_bb, og_bb + eps * lb if debias else None,
                         prm, debias, precision, backend)
    # GeomLoss detaches the weights and the schedule: no cotangent for them
    return (uF[:, None] * dx, uG[:, None] * dy, None, None, None)


geomloss_potentials.defvjp(_potentials_fwd, _potentials_bwd)


@functools.partial(jax.jit, static_argnames=("cfg", "potentials", "blur", "scaling", "out_dtype"))
def _samples_loss_jit(x, y, a, b, sched, cfg, potentials, blur, scaling, out_dtype):
    if sched is None:
        sched = _device_schedule(x, y, blur, scaling)
    batched = x.ndim == 3
    xs, ys, as_, bs = (x, y, a, b) if batched else (x[None], y[None], a[None], b[None])

    def one(args):
        xk, yk, ak, bk = args
        return geomloss_potentials(cfg, xk.astype(F32), yk.astype(F32), ak.astype(F32), bk.astype(F32), sched)

    if xs.shape[0] == 1:
        F, G = one((xs[0], ys[0], as_[0], bs[0]))
        F, G = F[None], G[None]
    else:
        F, G = jax.lax.map(one, (xs, ys, as_, bs))
    F, G = F.astype(out_dtype), G.astype(out_dtype)
    if potentials:
        return (F, G) if batched else (F[0], G[0])
    values = jnp.sum(as_.astype(out_dtype) * F, -1) + jnp.sum(bs.astype(out_dtype) * G, -1)
    return values if batched else values[0]


def samples_loss(
    x: jax.Array,
    y: jax.Array,
    a: jax.Array | None = None,
    b: jax.Array | None = None,
    *,
    loss: str = "sinkhorn",
    p: int = 2,
    blur: float = 0.05,
    reach: Any = None,
    diameter: float | None = None,
    scaling: float = 0.5,
    truncate: Any = 5,
    cost: Any = None,
    kernel: Any = None,
    cluster_scale: Any = None,
    debias: bool = True,
    potentials: bool = False,
    verbose: bool = False,
    backend: str | None = None,
    precision: str = "float32",
):
    """Debiased Sinkhorn divergence between sampled measures, GeomLoss conventions.

    The functional twin of ``torch_api.SamplesLoss(...)(a, x, b, y)`` (module
    docstring). Points (N, D) or (B, N, D); weights (N,) / (N, 1) or (B, N) /
    (B, N, 1), default uniform 1/N, non-negative with equal total masses.
    Returns a 0-d array (or (B,)), differentiable in x, y, a, b; with
    ``potentials=True`` the pair (F, G), differentiable in x, y. ``truncate``
    and ``verbose`` are accepted and ignored (as GeomLoss outside multiscale).
    """
    del truncate, verbose
    blur, diameter, scaling, backend = _check_options(loss, p, blur, reach, diameter, scaling, cost,
                                                      kernel, cluster_scale, backend, precision)
    _geomloss_points(x, y)
    a = _geomloss_weights("a", a, x, "x")
    b = _geomloss_weights("b", b, y, "y")
    if a.dtype != b.dtype:
        raise TypeError(f"a and b must have the same dtype; got {a.dtype} and {b.dtype}. Cast one of them")
    _check_masses(a, b)
    sched = None
    xc, yc = concrete_value(x), concrete_value(y)
    if diameter is not None or (xc is not None and yc is not None):
        sched = jnp.asarray(_host_schedule(xc, yc, blur, diameter, scaling))
    out_dtype = jnp.promote_types(jnp.promote_types(x.dtype, a.dtype), F32)
    cfg = (bool(debias), precision, backend)
    return _samples_loss_jit(x, y, a, b, sched, cfg=cfg, potentials=bool(potentials), blur=blur,
                             scaling=scaling, out_dtype=out_dtype)
