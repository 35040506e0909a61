"""The sharded pieces shared by :mod:`.distributed` (``sinkhorn``) and :mod:`.distributed_divergence`.

Everything here runs inside one ``shard_map`` over a 1-D mesh axis (or builds one): the clouds
are all-gathered once and prepared (centred, split) exactly as the single-device solve prepares
the full clouds, each device keeps its own rows of them, each half-step runs the single-device
kernel on (own rows, full other cloud) and all-gathers the new potential pieces, and each
measured marginal error is one ``psum``. n and m are padded to multiples of the device count
with zero-weight copies of the last point (absent from every sum; their potentials are -inf).

:func:`sharded_cost` is the alternating (x, y) solve with its ``reg_ot_cost`` as a
``custom_vjp`` whose backward is the envelope gradient in x, y, a and b (one sharded plan pass
per point side, no collective beyond gathering the clouds; the weights' from the local potentials
and the global masses kept from the forward, :func:`weight_grad`) and in epsilon and scale_cost
(the same passes' partial sums, one ``psum``: :func:`eps_scale_grads`). The gradient is a
``custom_jvp`` whose JVP raises: a second derivative raises NotImplementedError.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.custom_derivatives import SymbolicZero
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..core.options import LoopOptions
from .checks import inputs_ok
from .derivatives import cost_value
from .kernel_ops import F32, Cloud, apply_plan, clouds, exact_row_mass, lse_update, masked_log
from .loops import ott_params, run_loop


class Static(NamedTuple):
    """The static part of a sharded term: the mesh and its axis, the loop options, the launcher,
    the true sizes (n, m) before padding, and the public function's name (for error messages)."""

    mesh: Mesh
    axis: str
    opts: LoopOptions
    backend: str | None
    n: int
    m: int
    name: str


def mesh_axis(mesh: Mesh, axis: str | None) -> str:
    """``axis``, or the mesh's only axis when None; checked against the mesh."""
    if axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"mesh has axes {mesh.axis_names}: pass axis=, the one the points are split along")
        axis = mesh.axis_names[0]
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    return axis


def rows(c: Cloud, start, count: int) -> Cloud:
    """Rows [start, start + count) of a full prepared cloud (the scale stays the problem's)."""
    cut = lambda v: jax.lax.dynamic_slice_in_dim(v, start, count)  # noqa: E731
    return Cloud(cut(c.x), cut(c.sqnorm), cut(c.hi), cut(c.lo), c.scale)


def gatherer(axis: str):
    """The tiled all-gather of a local piece along ``axis`` (inside ``shard_map``)."""
    return functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)


def own_rows(full: Cloud, local_count: int, axis: str) -> Cloud:
    """This device's rows of a full prepared cloud (device k holds rows [k c, (k + 1) c))."""
    return rows(full, jax.lax.axis_index(axis) * local_count, local_count)


def prepared(xl, yl, axis: str, backend):
    """The full clouds (gathered, centred together, split) and this device's rows of them."""
    gather = gatherer(axis)
    X, Y = clouds(gather(xl), gather(yl), backend=backend)
    return X, Y, own_rows(X, xl.shape[0], axis), own_rows(Y, yl.shape[0], axis)


def placed(v, mesh: Mesh, axis: str):
    """``v`` sharded along ``axis`` where its length allows it (else as XLA places it)."""
    if v.shape[0] % mesh.shape[axis]:
        return v
    return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P(axis)))


def pad(v, count: int, fill):
    """``v`` extended to ``count`` rows with ``fill``."""
    extra = count - v.shape[0]
    return v if extra == 0 else jnp.concatenate([v, jnp.broadcast_to(fill, (extra,) + v.shape[1:]).astype(v.dtype)])


def padded_size(n: int, mesh: Mesh, axis: str) -> int:
    parts = mesh.shape[axis]
    return -(-n // parts) * parts


def potentials_not_differentiable(name: str, cts) -> None:
    if not all(isinstance(c, SymbolicZero) for c in cts):
        raise NotImplementedError(f"derivatives of ot_triton_jax.distributed.{name}'s f, g are not implemented; "
                                  "reg_ot_cost is differentiable in x, y, a, b, epsilon and scale_cost")


def second_derivative_error(name: str) -> NotImplementedError:
    return NotImplementedError(f"second derivatives of ot_triton_jax.distributed.{name} are not implemented (its "
                               "gradient in x, y, a, b, epsilon and scale_cost is); ot_triton_jax.distributed.hvp "
                               "gives HVPs in x or y")


def eps_scale_partials(Xl: Cloud, Yl: Cloud, r, c, py, f, g, axis: str):
    """The all-reduced partial sums [sum r|x|^2 + sum c|y|^2 - 2 sum <x_i, (P y)_i>, <r, f> + <c, g>,
    sum P] of this device's rows (r = P 1 over its x rows, c = P^T 1 over its y rows, py = P y), for
    :func:`eps_scale_grads`."""
    raw = jnp.sum(r * Xl.sqnorm) + jnp.sum(c * Yl.sqnorm) - 2.0 * jnp.sum(Xl.x * py)
    rfcg = jnp.sum(jnp.where(r > 0, r * f, 0.0)) + jnp.sum(jnp.where(c > 0, c * g, 0.0))
    return jax.lax.psum(jnp.stack([raw, rfcg, jnp.sum(r)]), axis)


def eps_scale_grads(parts, a, b, prm, masses):
    """(dR/deps, dR/ds) of the global reg_ot_cost at fixed potentials, s = 1 / scale_cost (the
    single-device formulas, :func:`.envelope_grads.cost_grads`): -sum a log a - sum b log b + sum a
    sum b - sum P + (<r, f> + <c, g> - <P, C>) / eps and <P, C> / s, <P, C> = s * parts[0]. A
    symmetric self term passes its one side twice (a as b, r as c): every piece counts twice but
    sum P, as in its cost."""
    raw, rfcg, total = parts
    eps, s = prm[0], prm[1]
    ent = sum(jnp.sum(jnp.where(w > 0, w * masked_log(w), 0.0)) for w in (a, b))
    pc = s * raw
    return -ent + masses[0] * masses[1] - total + (rfcg - pc) / eps, pc / s


def scalar_cotangents(ct, geps, gs, eps, scale):
    """The cotangents of epsilon and scale_cost (their dtypes) from dR/deps, dR/ds: s = 1 / scale_cost,
    so dR/dscale = -dR/ds / scale^2."""
    return (ct * geps).astype(eps.dtype), (-ct * gs / (scale * scale)).astype(scale.dtype)


def weight_grad(w, pot, eps, other_mass):
    """d reg_ot_cost / d w_i for one side's weights w (OTT's balanced envelope derivative,
    :func:`.envelope_grads.cost_grads`): pot_i - eps log w_i - eps + eps M where w_i > 0, eps M
    where w_i = 0; ``pot`` that side's potential, M the GLOBAL mass of the other side (kept from
    the forward). Elementwise: sharded like ``w``, no collective."""
    return jnp.where(w > 0, pot - eps * masked_log(w) - eps + eps * other_mass, eps * other_mass)


def _solve_local(xl, yl, al, bl, prm, thr, ok, *, opts: LoopOptions, axis: str, backend):
    """OTT's alternating loop on this device's shards (:func:`.loops.alternating_solve` with a
    gather after each half-step). Returns local f, g, errors, n_iters and the psum'd sum P."""
    gather = gatherer(axis)
    X, Y, Xl, Yl = prepared(xl, yl, axis, backend)
    la, lb = masked_log(al), masked_log(bl)
    kw = dict(precision=opts.precision, backend=backend)
    f0 = jnp.where(al > 0, 0.0, -jnp.inf).astype(F32)
    g0 = jnp.where(bl > 0, 0.0, -jnp.inf).astype(F32)

    def iterate(it, st, with_err):
        f, g, g_next, g_next_full = st
        f = lse_update(Xl, Y, g_next_full, prm, logw_out=la, pold=f, compute_err=False, fold=True, **kw)[0]
        g_new, err = lse_update(Yl, X, gather(f), prm, logw_out=lb, pold=g_next, compute_err=with_err, fold=True,
                                **kw)
        return (f, g_next, g_new, gather(g_new)), (jax.lax.psum(jnp.sum(err), axis) if with_err else None)

    g_next = lse_update(Yl, X, gather(f0), prm, logw_out=lb, **kw)[0]
    (f, g, _, _), errors, n_iters = run_loop(iterate, (f0, g0, g_next, gather(g_next)), thr, ok, opts)
    if opts.precision == "float32":
        row_mass = exact_row_mass(Xl, Y, f, gather(g), prm, backend=backend)
    else:
        row_mass = jnp.where(al > 0, al, 0.0)  # sum P = sum a right after an f-update
    return f, g, errors, n_iters, jax.lax.psum(jnp.sum(row_mass), axis)


def _grads_local(xl, yl, f, g, prm, *, precision: str, axis: str, backend):
    """The envelope gradient of reg_ot_cost in this device's x and y rows, and the all-reduced
    partial sums of its epsilon and scale derivatives (:func:`eps_scale_partials`)."""
    gather = gatherer(axis)
    X, Y, Xl, Yl = prepared(xl, yl, axis, backend)
    kw = dict(precision=precision, backend=backend)
    py, r = apply_plan(Xl, Y, f, gather(g), prm, v=Y.x, **kw)
    px, c = apply_plan(Yl, X, g, gather(f), prm, v=X.x, **kw)
    return (2.0 * prm[1] * (r[:, None] * Xl.x - py), 2.0 * prm[1] * (c[:, None] * Yl.x - px),
            eps_scale_partials(Xl, Yl, r, c, py, f, g, axis))


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def _envelope_grads(static: Static, x, y, a, b, eps, scale, saved):
    """(dR/dx, dR/dy, dR/da, dR/db, dR/deps, dR/ds) at the saved sharded solve (:func:`cost_grads
    <.envelope_grads.cost_grads>`' formulas, masses and sums global): the primal inputs only carry
    tangents, so that a second derivative reaches the JVP rule below, which raises."""
    mesh, axis, opts, backend, n, m = static[:6]
    xp, yp, f, g, prm, ap, bp, masses = jax.tree.map(jax.lax.stop_gradient, saved)
    grads = jax.shard_map(functools.partial(_grads_local, precision=opts.precision, axis=axis, backend=backend),
                          mesh=mesh, in_specs=(P(axis),) * 4 + (P(),), out_specs=(P(axis), P(axis), P()),
                          check_vma=False)
    gx, gy, parts = grads(xp, yp, f, g, prm)
    ga, gb = weight_grad(ap, f, prm[0], masses[1]), weight_grad(bp, g, prm[0], masses[0])
    return (gx[:n], gy[:m], ga[:n], gb[:m]) + eps_scale_grads(parts, ap, bp, prm, masses)


@_envelope_grads.defjvp
def _envelope_grads_jvp(static: Static, primals, tangents):
    raise second_derivative_error(static.name)


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def sharded_cost(x, y, a, b, eps, scale, thr, static: Static):
    """(reg_ot_cost, f, g, errors, n_iters) of the alternating sharded solve of (x, y, a, b) on
    float32 global arrays (f, g cut to n, m and sharded along the axis; NaN / 0 iterations when
    the values are invalid). Differentiable once in x, y, a, b, eps and scale (envelope gradient);
    through f, g or a second time it raises NotImplementedError."""
    return _forward(x, y, a, b, eps, scale, thr, static)[0]


def _forward(x, y, a, b, eps, scale, thr, static: Static):
    mesh, axis, opts, backend, n, m = static[:6]
    npad, mpad = padded_size(n, mesh, axis), padded_size(m, mesh, axis)
    sg = jax.lax.stop_gradient
    x32, y32, a32, b32 = (sg(v).astype(F32) for v in (x, y, a, b))
    eps, scale, thr = (sg(jnp.asarray(v, F32)) for v in (eps, scale, thr))
    ok = inputs_ok(x32, y32, a32, b32, eps, scale, thr, positive=(eps, scale, thr), nonneg=(a32, b32),
                   balanced=((a32, b32),))
    xp, yp = pad(x32, npad, x32[-1]), pad(y32, mpad, y32[-1])  # padding: copies of a point, zero weight
    ap, bp = pad(a32, npad, 0.0), pad(b32, mpad, 0.0)
    prm = ott_params(eps, 1.0 / scale)
    solve = jax.shard_map(functools.partial(_solve_local, opts=opts, axis=axis, backend=backend), mesh=mesh,
                          in_specs=(P(axis), P(axis), P(axis), P(axis), P(), P(), P()),
                          out_specs=(P(axis), P(axis), P(), P(), P()), check_vma=False)
    f, g, errors, n_iters, total = solve(xp, yp, ap, bp, prm, thr, ok)
    cost = cost_value(ap, bp, eps, f, g, total)
    masses = jnp.stack([jnp.sum(a32), jnp.sum(b32)])
    nan = jnp.float32(jnp.nan)
    f_out, g_out = placed(jnp.where(ok, f[:n], nan), mesh, axis), placed(jnp.where(ok, g[:m], nan), mesh, axis)
    out = (jnp.where(ok, cost, nan), f_out, g_out, jnp.where(ok, errors, nan), jnp.where(ok, n_iters, 0))
    return out, (xp, yp, f, g, prm, ap, bp, masses)


def _cost_fwd(x, y, a, b, eps, scale, thr, static: Static):
    out, saved = _forward(x.value, y.value, a.value, b.value, eps.value, scale.value, thr.value, static)
    return out, ((x.value, y.value, a.value, b.value, jnp.asarray(eps.value), jnp.asarray(scale.value)), saved)


def _cost_bwd(static: Static, res, cts):
    primals, saved = res
    potentials_not_differentiable(static.name, cts[1:3])
    if isinstance(cts[0], SymbolicZero):
        return (None,) * 7
    grads = _envelope_grads(static, *primals, saved)
    points = tuple((cts[0] * g).astype(p.dtype) for g, p in zip(grads[:4], primals[:4]))
    return points + scalar_cotangents(cts[0], *grads[4:], *primals[4:]) + (None,)


sharded_cost.defvjp(_cost_fwd, _cost_bwd, symbolic_zeros=True)
