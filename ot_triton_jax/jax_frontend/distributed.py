"""``ot_triton_jax.distributed.sinkhorn``: OTT-convention Sinkhorn with the clouds sharded over a 1-D mesh.

The JAX twin of ``torch_api.distributed.sinkhorn``, on ``jax.sharding``: x (n, d), y (m, d), a, b
are global arrays split by points over the devices of a 1-D ``Mesh`` (``NamedSharding(mesh,
P(axis))``; any placement is accepted and resharded) and the solve runs under ``jax.jit`` as a
``shard_map`` with the scheme of :mod:`ot_triton_jax.core.sharding`: every device all-gathers the
clouds once and centres and splits the full clouds as the single solve does, then each half-step
is the single-device kernel on (its own rows, the full other cloud) followed by one
``all_gather`` of the new potential pieces, and each measured marginal error is one ``psum``.
Nothing n x m is communicated. n and m need not be multiples of the number of devices: the clouds
are padded with zero-weight points (absent from every sum; their potentials are -inf and are cut
off the outputs).

Conventions and outputs are :func:`ot_triton_jax.sinkhorn`'s (OTT's alternating loop, g then f,
its stopping rule, ``errors`` / ``n_iters`` / ``converged``, ``reg_ot_cost``) for balanced problems
without labels; f and g come back as global arrays sharded along the mesh axis (when n, resp. m,
is a multiple of the number of devices; placed by XLA otherwise). Derivatives:
``reg_ot_cost`` is differentiable in x and y (envelope theorem, potentials fixed: d cost / d x_i =
2 s (r_i x_i - (P y)_i), r = P 1, s = 1 / scale_cost; one sharded plan pass per side, no
collective beyond gathering the clouds); a derivative in a, b, epsilon or scale_cost, or of f and
g, raises NotImplementedError. Values are checked when concrete (as :func:`ot_triton_jax.sinkhorn`);
under ``jax.jit`` invalid values give NaN outputs and ``converged=False``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.custom_derivatives import SymbolicZero
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from ..core.options import LoopOptions
from .checks import check_iterations, inputs_ok
from .derivatives import cost_value
from .kernel_ops import F32, Cloud, apply_plan, clouds, exact_row_mass, lse_update, masked_log
from .loops import ott_params, run_loop
from .sinkhorn_solver import check_problem

__all__ = ["sinkhorn", "ShardedSinkhornOutput"]


class ShardedSinkhornOutput(NamedTuple):
    """f (n,), g (m,) sharded by points like the inputs; reg_ot_cost (differentiable in x, y),
    errors, n_iters, converged as :class:`ot_triton_jax.SinkhornOutput`'s."""

    f: jax.Array
    g: jax.Array
    reg_ot_cost: jax.Array
    errors: jax.Array
    n_iters: jax.Array
    converged: jax.Array


def _rows(c: Cloud, start, count: int) -> Cloud:
    """Rows [start, start + count) of a full prepared cloud (the scale stays the problem's)."""
    cut = lambda v: jax.lax.dynamic_slice_in_dim(v, start, count)  # noqa: E731
    return Cloud(cut(c.x), cut(c.sqnorm), cut(c.hi), cut(c.lo), c.scale)


def _prepared(xl, yl, axis: str, backend):
    """The full clouds (gathered, centred, split) and this device's rows of them."""
    X, Y = clouds(jax.lax.all_gather(xl, axis, tiled=True), jax.lax.all_gather(yl, axis, tiled=True),
                  backend=backend)
    k = jax.lax.axis_index(axis)
    return X, Y, _rows(X, k * xl.shape[0], xl.shape[0]), _rows(Y, k * yl.shape[0], yl.shape[0])


def _solve_local(xl, yl, al, bl, prm, thr, ok, *, opts: LoopOptions, axis: str, backend):
    """OTT's alternating loop on this device's shards (:func:`.loops.alternating_solve` with a
    gather after each half-step). Returns local f, g, errors, n_iters and the psum'd sum P."""
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)
    X, Y, Xl, Yl = _prepared(xl, yl, axis, backend)
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
        rows = exact_row_mass(Xl, Y, f, gather(g), prm, backend=backend)
    else:
        rows = jnp.where(al > 0, al, 0.0)  # sum P = sum a right after an f-update
    return f, g, errors, n_iters, jax.lax.psum(jnp.sum(rows), axis)


def _grads_local(xl, yl, f, g, prm, *, precision: str, axis: str, backend):
    """The envelope gradient of reg_ot_cost in this device's x and y rows."""
    gather = functools.partial(jax.lax.all_gather, axis_name=axis, tiled=True)
    X, Y, Xl, Yl = _prepared(xl, yl, axis, backend)
    kw = dict(precision=precision, backend=backend)
    py, r = apply_plan(Xl, Y, f, gather(g), prm, v=Y.x, **kw)
    px, c = apply_plan(Yl, X, g, gather(f), prm, v=X.x, **kw)
    return 2.0 * prm[1] * (r[:, None] * Xl.x - py), 2.0 * prm[1] * (c[:, None] * Yl.x - px)


def _placed(v, mesh: Mesh, axis: str):
    """``v`` sharded along ``axis`` where its length allows it (else as XLA places it)."""
    if v.shape[0] % mesh.shape[axis]:
        return v
    return jax.lax.with_sharding_constraint(v, NamedSharding(mesh, P(axis)))


def _pad(v, rows: int, fill):
    extra = rows - v.shape[0]
    return v if extra == 0 else jnp.concatenate([v, jnp.broadcast_to(fill, (extra,) + v.shape[1:]).astype(v.dtype)])


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "opts", "backend"))
def _sharded(x, y, a, b, eps, scale, thr, mesh: Mesh, axis: str, opts: LoopOptions, backend):
    return _cost(x, y, a, b, eps, scale, thr, (mesh, axis, opts, backend, x.shape[0], y.shape[0]))


@functools.partial(jax.custom_vjp, nondiff_argnums=(7,))
def _cost(x, y, a, b, eps, scale, thr, static):
    return _forward(x, y, a, b, eps, scale, thr, static)[0]


def _forward(x, y, a, b, eps, scale, thr, static):
    mesh, axis, opts, backend, n, m = static
    parts = mesh.shape[axis]
    npad, mpad = -(-n // parts) * parts, -(-m // parts) * parts
    sg = jax.lax.stop_gradient
    x32, y32, a32, b32 = (sg(v).astype(F32) for v in (x, y, a, b))
    eps, scale, thr = (sg(jnp.asarray(v, F32)) for v in (eps, scale, thr))
    ok = inputs_ok(x32, y32, a32, b32, eps, scale, thr, positive=(eps, scale, thr), nonneg=(a32, b32),
                   balanced=((a32, b32),))
    xp, yp = _pad(x32, npad, x32[-1]), _pad(y32, mpad, y32[-1])  # padding: copies of a point, zero weight
    ap, bp = _pad(a32, npad, 0.0), _pad(b32, mpad, 0.0)
    prm = ott_params(eps, 1.0 / scale)
    solve = jax.shard_map(functools.partial(_solve_local, opts=opts, axis=axis, backend=backend), mesh=mesh,
                          in_specs=(P(axis), P(axis), P(axis), P(axis), P(), P(), P()),
                          out_specs=(P(axis), P(axis), P(), P(), P()), check_vma=False)
    f, g, errors, n_iters, total = solve(xp, yp, ap, bp, prm, thr, ok)
    cost = cost_value(ap, bp, eps, f, g, total)
    nan = jnp.float32(jnp.nan)
    f_out, g_out = _placed(jnp.where(ok, f[:n], nan), mesh, axis), _placed(jnp.where(ok, g[:m], nan), mesh, axis)
    out = (jnp.where(ok, cost, nan), f_out, g_out, jnp.where(ok, errors, nan), jnp.where(ok, n_iters, 0))
    return out, (xp, yp, f, g, prm)


def _cost_fwd(x, y, a, b, eps, scale, thr, static):
    for name, v in (("a", a), ("b", b), ("epsilon", eps), ("scale_cost", scale)):
        if v.perturbed:
            raise NotImplementedError(f"derivatives of ot_triton_jax.distributed.sinkhorn in {name} are not "
                                      "implemented (those of reg_ot_cost in x and y are)")
    out, res = _forward(x.value, y.value, a.value, b.value, eps.value, scale.value, thr.value, static)
    return out, res


def _cost_bwd(static, res, cts):
    mesh, axis, opts, backend, n, m = static
    xp, yp, f, g, prm = res
    ct_cost, ct_f, ct_g = cts[:3]
    if not (isinstance(ct_f, SymbolicZero) and isinstance(ct_g, SymbolicZero)):
        raise NotImplementedError("derivatives of ot_triton_jax.distributed.sinkhorn's f, g are not implemented; "
                                  "reg_ot_cost is differentiable in x and y")
    if isinstance(ct_cost, SymbolicZero):
        return (None,) * 7
    grads = jax.shard_map(functools.partial(_grads_local, precision=opts.precision, axis=axis, backend=backend),
                          mesh=mesh, in_specs=(P(axis),) * 4 + (P(),), out_specs=(P(axis), P(axis)),
                          check_vma=False)
    gx, gy = grads(xp, yp, f, g, prm)
    return ct_cost * gx[:n], ct_cost * gy[:m], None, None, None, None, None


_cost.defvjp(_cost_fwd, _cost_bwd, symbolic_zeros=True)


def sinkhorn(
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
    backend: str | None = None,
) -> ShardedSinkhornOutput:
    """:func:`ot_triton_jax.sinkhorn` with x (n, d), y (m, d), a (n,), b (m,) split by points over
    the devices of ``mesh`` along ``axis`` (default: its only axis), as one ``shard_map`` under
    ``jax.jit`` (module docstring: the communication, the padding, the derivatives). Returns a
    :class:`ShardedSinkhornOutput` whose f and g are sharded along ``axis``."""
    if axis is None:
        if len(mesh.axis_names) != 1:
            raise ValueError(f"mesh has axes {mesh.axis_names}: pass axis=, the one the points are split along")
        axis = mesh.axis_names[0]
    if axis not in mesh.axis_names:
        raise ValueError(f"axis {axis!r} is not an axis of the mesh {mesh.axis_names}")
    x, y, a, b = check_problem(x, y, a, b, epsilon, scale_cost)
    inner, lo, hi = check_iterations(threshold, inner_iterations, min_iterations, max_iterations)
    opts = LoopOptions(precision, inner, lo, hi)
    cost, f, g, errors, n_iters = _sharded_outputs(x, y, a, b, epsilon, scale_cost, threshold, mesh, axis, opts,
                                                   backend)
    converged = ~jnp.any(jnp.isnan(errors)) & (errors[-1] < threshold)
    return ShardedSinkhornOutput(f, g, cost, errors, n_iters, converged)


def _sharded_outputs(x, y, a, b, eps, scale, thr, mesh, axis, opts, backend):
    return _sharded(x, y, a, b, jnp.asarray(eps, F32), jnp.asarray(scale, F32), jnp.asarray(thr, F32),
                    mesh=mesh, axis=axis, opts=opts, backend=backend)
