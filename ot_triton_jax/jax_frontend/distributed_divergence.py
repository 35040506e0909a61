"""``ot_triton_jax.distributed.sinkhorn_divergence``: OTT's debiased Sinkhorn divergence with the
clouds sharded over a 1-D mesh.

The JAX twin of ``torch_api.distributed.sinkhorn_divergence`` and the sharded form of
:func:`ot_triton_jax.sinkhorn_divergence` (OTT-JAX's ``sinkhorn_divergence`` on ``PointCloud``
geometries), to float32 rounding::

    div = R(x, y) - 1/2 R(x, x) - 1/2 R(y, y) + 1/2 eps (sum a - sum b)^2

R = ``reg_ot_cost`` of :func:`ot_triton_jax.sinkhorn` (C = |x - y|^2 / scale_cost, absolute
epsilon shared by the three terms, P_ij = exp((f_i + g_j - C_ij)/eps)). x (n, d), y (m, d), a, b
are global arrays split by points over the devices of a 1-D ``Mesh``; each term is one
``shard_map`` under the caller's ``jax.jit``:

- (x, y): the sharded alternating solve of :func:`ot_triton_jax.distributed.sinkhorn` (clouds
  all-gathered once; per half-step the single-device kernel on the device's own rows against the
  full other cloud, then one ``all_gather`` of the new potential pieces; one ``psum`` per measured
  marginal error ||P^T 1 - b||_1).
- (x, x) and (y, y) with ``symmetric_sinkhorn=True`` (OTT's default): OTT's symmetric solve
  (``parallel_dual_updates=True``, momentum 0.5; f = g = h),

      h <- 0.5 h + 0.5 (eps log a - eps LSE_j((h_j - C_ij)/eps))

  (non-finite old entries count as 0), each device updating its rows of h against the full cloud
  (gathered once and centred alone, as the single-device self term centres it) followed by one
  ``all_gather`` of h per iteration; the error 2 ||P 1 - a||_1 is read off the next update and
  summed by one ``psum`` per measurement; sum P for R comes from one plan pass over the local rows
  (the unbiased row-mass pass with ``precision="float32"``) and one ``psum``.
- with ``symmetric_sinkhorn=False`` the self terms are sharded alternating solves of (x, x, a, a).

``static_b=True`` skips R(y, y) and uses ``offset_static_b`` (default 0) in its place. The same
``threshold`` / ``inner_iterations`` / ``min_iterations`` / ``max_iterations`` drive every solve.
Nothing n x m is communicated. n and m need not be multiples of the device count (zero-weight
padding, cut off the outputs).

Derivatives: the divergence is differentiable in x, y, a and b under ``jax.grad`` (envelope
theorem per term, potentials fixed: d R / d x_i = 2 s (r_i x_i - (P y)_i), r = P 1, s = 1 /
scale_cost, one sharded plan pass per side and term; d R / d a_i = f_i - eps log a_i - eps + eps
sum b where a_i > 0, eps sum b where a_i = 0, likewise in b, no collective; a symmetric self
term's gradients are twice its one side's; the mass term's eps (sum a - sum b) by JAX), and in
epsilon and scale_cost (each term's global derivative, the single-device formulas from the same
passes' partial sums and one ``psum``, ``distributed_shards.eps_scale_grads``). Derivatives of
the potentials, or second derivatives, raise NotImplementedError.
Scope: balanced problems (tau_a = tau_b = 1), no label cost, no second-order options.

Returns ``(divergence, SinkhornDivergenceOutput)`` as :func:`ot_triton_jax.sinkhorn_divergence`;
the potentials come back sharded along the mesh axis (when their length is a multiple of the
device count; placed by XLA otherwise). Values are checked when concrete; under ``jax.jit``
invalid values give NaN outputs and ``converged=False``.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.sharding import Mesh, PartitionSpec as P

from ..core import unbalanced
from ..core.options import LoopOptions
from .checks import check_backend, check_iterations, inputs_ok
from .derivatives import cost_value
from .distributed_shards import (Static, eps_scale_grads, eps_scale_partials, gatherer, mesh_axis, own_rows, pad,
                                 padded_size, placed, potentials_not_differentiable, scalar_cotangents,
                                 second_derivative_error, sharded_cost, weight_grad)
from .divergence import SinkhornDivergenceOutput
from .kernel_ops import F32, apply_plan, clouds, exact_row_mass, lse_update, masked_log
from .loops import ott_params, run_loop
from .sinkhorn_solver import as_f32, check_problem

__all__ = ["sinkhorn_divergence"]

_NAME = "sinkhorn_divergence"


def _symmetric_local(xl, al, prm, thr, ok, *, opts: LoopOptions, axis: str, backend):
    """OTT's symmetric solve (:func:`.loops.symmetric_solve`) on this device's rows of h, with an
    all-gather of h after each update. Returns local h, errors, n_iters and the psum'd sum P."""
    gather = gatherer(axis)
    (X,) = clouds(gather(xl), backend=backend)
    Xl = own_rows(X, xl.shape[0], axis)
    la = masked_log(al)
    kw = dict(precision=opts.precision, backend=backend)

    def update(h, with_err):
        u, err = lse_update(Xl, X, gather(h), prm, logw_out=la, pold=h, compute_err=with_err, **kw)
        return u, (2.0 * jax.lax.psum(jnp.sum(err), axis) if with_err else None)

    def iterate(it, st, with_err):
        h, u = st
        h = 0.5 * jnp.where(jnp.isfinite(h), h, 0.0) + 0.5 * u
        u, e = update(h, with_err)
        return (h, u), e

    h0 = jnp.where(al > 0, 0.0, -jnp.inf).astype(F32)
    (h, _), errors, n_iters = run_loop(iterate, (h0, update(h0, False)[0]), thr, ok, opts)
    h_full = gather(h)
    if opts.precision == "float32":
        row_mass = exact_row_mass(Xl, X, h, h_full, prm, backend=backend)
    else:
        row_mass = apply_plan(Xl, X, h, h_full, prm, **kw)[1]
    return h, errors, n_iters, jax.lax.psum(jnp.sum(row_mass), axis)


def _symmetric_grad_local(xl, h, prm, *, precision: str, axis: str, backend):
    """The envelope gradient of a symmetric self term's R in this device's rows: both sides of
    the (x, x) cost move with x, each giving 2 s (r_i x_i - (P x)_i), hence 4 s (...); and the
    all-reduced partial sums of its epsilon and scale derivatives (both sides these rows)."""
    gather = gatherer(axis)
    (X,) = clouds(gather(xl), backend=backend)
    Xl = own_rows(X, xl.shape[0], axis)
    px, r = apply_plan(Xl, X, h, gather(h), prm, v=X.x, precision=precision, backend=backend)
    return 4.0 * prm[1] * (r[:, None] * Xl.x - px), eps_scale_partials(Xl, Xl, r, r, px, h, h, axis)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _self_grads(static: Static, x, a, eps, scale, saved):
    """(dR/dx, dR/da, dR/deps, dR/ds) of a symmetric self term at the saved solve: both sides of
    (x, x, a, a) move, so each is twice one side's, 4 s (r_i x_i - (P x)_i) and 2 (h_i - eps log
    a_i - eps + eps sum a) (2 eps sum a where a_i = 0; sum a global, from the forward); eps and s
    as :func:`eps_scale_grads` with a on both sides. The primal inputs only carry tangents, so
    that a second derivative reaches the JVP rule below, which raises."""
    mesh, axis, opts, backend, n = static[:5]
    xp, h, prm, ap, mass = jax.tree.map(jax.lax.stop_gradient, saved)
    grad = jax.shard_map(functools.partial(_symmetric_grad_local, precision=opts.precision, axis=axis,
                                           backend=backend),
                         mesh=mesh, in_specs=(P(axis), P(axis), P()), out_specs=(P(axis), P()), check_vma=False)
    gx, parts = grad(xp, h, prm)
    return (gx[:n], 2.0 * weight_grad(ap, h, prm[0], mass)[:n]) + eps_scale_grads(parts, ap, ap, prm,
                                                                                    (mass, mass))


@_self_grads.defjvp
def _self_grads_jvp(static: Static, primals, tangents):
    raise second_derivative_error(static.name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _self_cost(x, a, eps, scale, thr, static: Static):
    """(R, h, errors, n_iters) of the symmetric sharded solve of (x, x, a, a) (float32 global
    arrays); differentiable once in x, a, eps and scale."""
    return _self_forward(x, a, eps, scale, thr, static)[0]


def _self_forward(x, a, eps, scale, thr, static: Static):
    mesh, axis, opts, backend, n = static[:5]
    npad = padded_size(n, mesh, axis)
    sg = jax.lax.stop_gradient
    x32, a32 = sg(x).astype(F32), sg(a).astype(F32)
    eps, scale, thr = (sg(jnp.asarray(v, F32)) for v in (eps, scale, thr))
    ok = inputs_ok(x32, a32, eps, scale, thr, positive=(eps, scale, thr), nonneg=(a32,))
    xp, ap = pad(x32, npad, x32[-1]), pad(a32, npad, 0.0)
    prm = ott_params(eps, 1.0 / scale)
    solve = jax.shard_map(functools.partial(_symmetric_local, opts=opts, axis=axis, backend=backend), mesh=mesh,
                          in_specs=(P(axis), P(axis), P(), P(), P()), out_specs=(P(axis), P(), P(), P()),
                          check_vma=False)
    h, errors, n_iters, total = solve(xp, ap, prm, thr, ok)
    nan = jnp.float32(jnp.nan)
    cost = cost_value(ap, ap, eps, h, h, total)
    out = (jnp.where(ok, cost, nan), placed(jnp.where(ok, h[:n], nan), mesh, axis), jnp.where(ok, errors, nan),
           jnp.where(ok, n_iters, 0))
    return out, (xp, h, prm, ap, jnp.sum(a32))


def _self_fwd(x, a, eps, scale, thr, static: Static):
    out, saved = _self_forward(x.value, a.value, eps.value, scale.value, thr.value, static)
    return out, ((x.value, a.value, jnp.asarray(eps.value), jnp.asarray(scale.value)), saved)


def _self_bwd(static: Static, res, cts):
    primals, saved = res
    potentials_not_differentiable(static.name, cts[1:2])
    if isinstance(cts[0], SymbolicZero):
        return (None,) * 5
    gx, ga, geps, gs = _self_grads(static, *primals, saved)
    return (((cts[0] * gx).astype(primals[0].dtype), (cts[0] * ga).astype(primals[1].dtype))
            + scalar_cotangents(cts[0], geps, gs, *primals[2:]) + (None,))


_self_cost.defvjp(_self_fwd, _self_bwd, symbolic_zeros=True)


def _self_term(p, w, eps, scale, thr, static: Static, symmetric: bool):
    """(R, (f, g), errors, converged, n_iters) of the (p, p, w, w) problem, sharded."""
    if symmetric:
        cost, h, errors, n_iters = _self_cost(p, w, eps, scale, thr, static)
        pots = (h, h)
    else:
        cost, f, g, errors, n_iters = sharded_cost(p, p, w, w, eps, scale, thr, static)
        pots = (f, g)
    converged = ~jnp.any(jnp.isnan(errors)) & (errors[-1] < thr)
    return cost, pots, errors, converged, n_iters


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "opts", "backend", "static_b", "symmetric"))
def _divergence_jit(x, y, a, b, eps, scale, thr, offset, mesh: Mesh, axis: str, opts: LoopOptions, backend,
                    static_b: bool, symmetric: bool):
    x32, y32, a32, b32, eps, scale, thr = as_f32(x, y, a, b, eps, scale, thr)
    n, m = x32.shape[0], y32.shape[0]
    ok = inputs_ok(x32, y32, a32, b32, eps, scale, thr, positive=(eps, scale, thr), nonneg=(a32, b32),
                   balanced=((a32, b32),))
    xy_cost, f, g, xy_err, xy_it = sharded_cost(x32, y32, a32, b32, eps, scale, thr,
                                                Static(mesh, axis, opts, backend, n, m, _NAME))
    xy = (xy_cost, (f, g), xy_err, ~jnp.any(jnp.isnan(xy_err)) & (xy_err[-1] < thr), xy_it)
    xx = _self_term(x32, a32, eps, scale, thr, Static(mesh, axis, opts, backend, n, n, _NAME), symmetric)
    if static_b:
        yy = (jnp.asarray(offset, F32), None, None, None, None)
    else:
        yy = _self_term(y32, b32, eps, scale, thr, Static(mesh, axis, opts, backend, m, m, _NAME), symmetric)
    mass = unbalanced.divergence_mass_term(jnp.sum(a32), jnp.sum(b32), jax.lax.stop_gradient(eps))
    nan = jnp.float32(jnp.nan)
    div = jnp.where(ok, xy[0] - 0.5 * (xx[0] + yy[0]) + mass, nan)
    terms = (xy, xx, yy)
    out = SinkhornDivergenceOutput(
        divergence=div, a=placed(a32, mesh, axis), b=placed(b32, mesh, axis),
        potentials=tuple(t[1] for t in terms),
        errors=tuple(t[2] for t in terms),
        converged=tuple(None if t[3] is None else ok & t[3] for t in terms),
        n_iters=tuple(t[4] for t in terms),
        costs=tuple(t[0] for t in terms),
    )
    return div, out


_UNSUPPORTED = ("ot_triton_jax.distributed.sinkhorn_divergence solves balanced problems (tau_a = tau_b = 1) "
                "without label cost or second-order options")


def sinkhorn_divergence(
    x: jax.Array,
    y: jax.Array,
    a: jax.Array | None = None,
    b: jax.Array | None = None,
    *,
    mesh: Mesh,
    axis: str | None = None,
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
    implicit: Any = None,
    tau_a: float = 1.0,
    tau_b: float = 1.0,
    label_x: jax.Array | None = None,
    label_y: jax.Array | None = None,
    label_cost: jax.Array | None = None,
) -> tuple[jax.Array, SinkhornDivergenceOutput]:
    """:func:`ot_triton_jax.sinkhorn_divergence` with x (n, d), y (m, d), a (n,), b (m,) split by
    points over the devices of ``mesh`` along ``axis`` (default: its only axis); module docstring
    for the math, the communication and the derivatives.

    Options as :func:`ot_triton_jax.sinkhorn_divergence` (``epsilon`` required and absolute;
    ``static_b``, ``offset_static_b``, ``symmetric_sinkhorn``; the loop options shared by the three
    solves). ``tau_a`` / ``tau_b`` other than 1, labels (``label_x``, ``label_y``, ``label_cost``)
    and ``implicit`` (second-order options) raise NotImplementedError. Returns ``(divergence,
    SinkhornDivergenceOutput)``; the divergence is differentiable in x, y, a, b, epsilon and scale_cost.
    """
    given = {"tau_a": tau_a != 1.0, "tau_b": tau_b != 1.0, "label_x": label_x is not None,
             "label_y": label_y is not None, "label_cost": label_cost is not None, "implicit": implicit is not None}
    for name, used in given.items():
        if used:
            raise NotImplementedError(f"{_UNSUPPORTED}: {name} is not supported (use "
                                      "ot_triton_jax.sinkhorn_divergence on one device for it)")
    axis = mesh_axis(mesh, axis)
    x, y, a, b = check_problem(x, y, a, b, epsilon, scale_cost)
    inner, lo, hi = check_iterations(threshold, inner_iterations, min_iterations, max_iterations)
    opts = LoopOptions(precision, inner, lo, hi)
    check_backend(backend)
    if offset_static_b is not None and not static_b:
        raise ValueError("offset_static_b is only used with static_b=True; pass static_b=True or drop it")
    offset = 0.0 if offset_static_b is None else offset_static_b
    return _divergence_jit(x, y, a, b, jnp.asarray(epsilon, F32), jnp.asarray(scale_cost, F32),
                           jnp.asarray(threshold, F32), jnp.asarray(offset, F32), mesh=mesh, axis=axis, opts=opts,
                           backend=backend, static_b=bool(static_b), symmetric=bool(symmetric_sinkhorn))
