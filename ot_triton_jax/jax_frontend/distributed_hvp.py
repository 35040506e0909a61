"""``ot_triton_jax.distributed.hvp``: the Hessian-vector product of reg_ot_cost (or of OTT's Sinkhorn
divergence) in x or y, with the clouds sharded over a 1-D ``jax.sharding.Mesh``.

The JAX twin of ``torch_api.distributed.hvp`` and the sharded form of :func:`ot_triton_jax.hvp`:
its numbers on the same problem, to float32 rounding, with its conventions (OTT-JAX: C = |x - y|^2
/ scale_cost, absolute epsilon, P_ij = exp((f_i + g_j - C_ij)/eps), f carrying eps log a).

The math (:mod:`ot_triton_jax.core.implicit_derivatives`, :mod:`ot_triton_jax.core.implicit_solve`,
run unchanged). The gradient of reg_ot_cost is the envelope gx_i = 2s (r_i x_i - (P y)_i) (s = 1 /
scale_cost, r = P 1, c = P^T 1), likewise gy. Its derivative along v moves the potentials by
(df, dg) solving

    [[diag(r), P], [P^T, diag(c)]] [df; dg] = [2s e; 2s h],   e_i = sum_j P_ij dC_ij, h_j = sum_i P_ij dC_ij,

dC_ij = 2s <x_i - y_j, vx_i - vy_j>, solved by CG on the Schur complement of the larger side
(S = diag(c) - P^T diag(1/r) P for n >= m, its null vector 1 projected out); then
d gx_i = 2s sum_j [dP_ij (x_i - y_j) + P_ij (vx_i - vy_j)], dP_ij = P_ij (df_i + dg_j - dC_ij)/eps.
``loss="sinkhorn_divergence"`` (symmetric self terms, OTT's default): H_xy(v) - 1/2 (H_xx(v, v)_x +
H_xx(v, v)_y) for wrt="x" (the self term's Hessian with both of its clouds moving; y likewise).

Sharding. Everything runs in one ``shard_map`` under ``jax.jit``: the forward solve is the sharded
alternating loop of :func:`ot_triton_jax.distributed.sinkhorn` (:mod:`.distributed_shards`; the
divergence's self term of ``wrt`` the sharded symmetric solve of
:func:`ot_triton_jax.distributed.sinkhorn_divergence`), then the core's ``hessian_apply`` runs on
every device with :class:`ShardedPasses` as its ``PlanPasses``. Vectors of length n or m
(potentials, the direction, every CG vector) are replicated; only the streaming plan passes are
sharded: a device computes its rows of P v (its x rows against the full y) or of P^T u (its y rows
against the full x) with the single-device kernel, and one ``all_gather`` assembles the full result,
so every device runs the identical CG on identical vectors.

Communicated: the forward solve's (clouds gathered once; one all-gather of a potential per
half-step; one ``psum`` per measured error), one all-gather of v, then per plan pass one all-gather
of the rows it produced: a CG iteration is two passes (P z, P^T of the result, each with its row
sums: O(n) and O(m) numbers) plus one scalar ``pmax`` of the stop test (so that no device can leave
the loop alone); the passes around CG (right-hand side, tangent assembly) gather O((n + m) d)
numbers each. Nothing n x m is communicated. n and m need not be multiples of the device count: the
clouds are padded with zero-weight points (potentials -inf, rows of P zero, masked out of CG; the
Schur side is chosen from the true sizes, as on one device).

Scope: balanced problems (tau_a = tau_b = 1), no label cost; other taus raise NotImplementedError.
No autodiff through the result (it is a value, as :func:`ot_triton_jax.hvp`'s).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from ..core import checks as rules
from ..core.implicit_derivatives import hessian_apply
from ..core.implicit_solve import ImplicitOptions, implicit_options
from ..core.options import LoopOptions
from .checks import READER, check_backend, check_iterations, inputs_ok
from .distributed_divergence import _symmetric_local
from .distributed_shards import _solve_local, gatherer, mesh_axis, pad, padded_size, placed, prepared
from .hessian_vector import HVPInfo
from .implicit import ImplicitConfig, warn_unconverged
from .kernel_ops import F32, apply_plan, apply_weighted, make_params
from .loops import ott_params
from .sinkhorn_solver import as_f32, check_problem

__all__ = ["hvp", "ShardedPasses", "HVPInfo", "ImplicitOptions"]


def _own(v, count: int, axis: str):
    """This device's ``count`` rows of a replicated array (device k: rows [k count, (k + 1) count))."""
    return jax.lax.dynamic_slice_in_dim(v, jax.lax.axis_index(axis) * count, count)


class ShardedPasses:
    """The streaming passes of one plan P (padded n x m) sharded over the mesh axis, satisfying
    the core's ``PlanPasses`` protocol with replicated full vectors in and out (inside
    ``shard_map``).

    X, Y: the full prepared clouds (gathered and centred together); Xl, Yl: this device's rows of
    them; f, g: the full (replicated) potentials. The x-side results (``apply``, ``weighted``) are
    the single-device kernel on (Xl, Y, own f, g), the y-side ones (``apply_t``, ``apply_t_sq``,
    ``weighted_t``) on (Yl, X, own g, f); each pass is followed by one tiled ``all_gather``
    (a product and its row sums gathered together). ``n``, ``m`` are the true sizes (the padded
    ones are ``x.shape[0]``, ``y.shape[0]``), so :func:`schur_solve` picks the side the
    single-device HVP picks. ``transposed()`` swaps the roles of the two sides.

    Determinism: an all-gather hands every device the same values, so every device runs the
    core's CG on identical vectors; the stop test is ``pmax``'d nevertheless (the CG body is a
    no-op once converged), so no device can leave the loop while another continues.
    """

    xp = jnp

    def __init__(self, X, Y, Xl, Yl, f, g, prm, n: int, m: int, precision: str, backend, axis: str):
        self.X, self.Y, self.Xl, self.Yl, self.f, self.g, self.prm = X, Y, Xl, Yl, f, g, prm
        self.n, self.m, self.precision, self.backend, self.axis = n, m, precision, backend, axis
        self.x, self.y = X.x, Y.x
        self.eps, self.s = prm[0], prm[1]
        self.fl, self.gl = _own(f, Xl.n, axis), _own(g, Yl.n, axis)
        self._gather = gatherer(axis)

    def _kw(self):
        return dict(precision=self.precision, backend=self.backend)

    def _pair(self, pv, sums):
        # one all-gather for the product and its row sums together
        if pv is None:
            return None, self._gather(sums)
        full = self._gather(jnp.concatenate([pv, sums[:, None]], axis=1))
        return full[:, :-1], full[:, -1]

    def apply(self, v):
        return self._pair(*apply_plan(self.Xl, self.Y, self.fl, self.g, self.prm, v=v, **self._kw()))

    def apply_t(self, u):
        return self._pair(*apply_plan(self.Yl, self.X, self.gl, self.f, self.prm, v=u, **self._kw()))

    def apply_t_sq(self, u):
        half = make_params(0.5 * self.eps, self.s)  # P_ij^2 is the plan at eps / 2
        return self._gather(apply_plan(self.Yl, self.X, self.gl, self.f, half, v=u[:, None], **self._kw())[0][:, 0])

    def weighted(self, w, A, B):
        own = _own(w, self.Xl.n, self.axis)
        return self._gather(apply_weighted(self.Xl, self.Y, self.fl, self.g, self.prm, own, A, B, **self._kw()))

    def weighted_t(self, w, A, B):
        own = _own(w, self.Yl.n, self.axis)
        return self._gather(apply_weighted(self.Yl, self.X, self.gl, self.f, self.prm, own, A, B, **self._kw()))

    def transposed(self) -> "ShardedPasses":
        return ShardedPasses(self.Y, self.X, self.Yl, self.Xl, self.g, self.f, self.prm, self.m, self.n,
                             self.precision, self.backend, self.axis)

    def while_loop(self, cond, body, state):
        anyone = lambda st: jax.lax.pmax(cond(st).astype(jnp.int32), self.axis) > 0  # noqa: E731
        return jax.lax.while_loop(anyone, body, state)


class _Static(NamedTuple):
    """The static part of one sharded HVP: mesh axis, loop and CG options, launcher, true sizes
    (n, m) before padding, wrt and loss."""

    axis: str
    opts: LoopOptions
    backend: str | None
    implicit: ImplicitOptions
    n: int
    m: int
    wrt: str
    loss: str


def _hessian(st: _Static, prm, pts, w, pots, sizes, tangents, want, symmetric=False):
    """(tx, ty, info) of the core's hessian_apply on one problem, with sharded passes. ``pts``:
    this device's rows of the two clouds; ``w``, ``pots``: full (replicated) weights, potentials;
    ``symmetric``: a self term moved as one cloud (the single-device solve's symmetric system)."""
    X, Y, Xl, Yl = prepared(*pts, st.axis, st.backend)
    ops = ShardedPasses(X, Y, Xl, Yl, *pots, prm, *sizes, st.opts.precision, st.backend, st.axis)
    (tx, ty, _, _), info = hessian_apply(ops, *pots, *w, (*tangents, None, None), (*want, False, False),
                                         st.implicit, symmetric=symmetric)
    return tx, ty, info


def _converged(errors, thr):
    return ~jnp.any(jnp.isnan(errors)) & (errors[-1] < thr)


def _hvp_local(xl, yl, al, bl, vl, prm, thr, ok, *, st: _Static):
    """This device's rows of the HVP, the CG records (k, rel, ok) stacked, and whether the forward
    solves converged (everything but the rows replicated)."""
    gather = gatherer(st.axis)
    kw = dict(opts=st.opts, axis=st.axis, backend=st.backend)
    f, g, errors, _, _ = _solve_local(xl, yl, al, bl, prm, thr, ok, **kw)
    v = gather(vl)
    on_x = st.wrt == "x"
    tangents, want = ((v, None), (True, False)) if on_x else ((None, v), (False, True))
    tx, ty, info = _hessian(st, prm, (xl, yl), (gather(al), gather(bl)), (gather(f), gather(g)), (st.n, st.m),
                            tangents, want)
    res, infos, solved = (tx if on_x else ty), [info], _converged(errors, thr)
    if st.loss == "sinkhorn_divergence":
        zl, wl, k = (xl, al, st.n) if on_x else (yl, bl, st.m)
        h, self_errors, _, _ = _symmetric_local(zl, wl, prm, thr, ok, **kw)
        h, w = gather(h), gather(wl)
        s1, s2, info_self = _hessian(st, prm, (zl, zl), (w, w), (h, h), (k, k), (v, v), (True, True),
                                     symmetric=True)
        res, solved = res - 0.5 * (s1 + s2), solved & _converged(self_errors, thr)
        infos.append(info_self)
    record = jnp.stack([jnp.stack([jnp.asarray(i, F32) for i in info]) for info in infos])
    return _own(res, vl.shape[0], st.axis), record, solved


@functools.partial(jax.jit, static_argnames=("mesh", "st"))
def _hvp_jit(x, y, a, b, v, eps, scale, thr, mesh: Mesh, st: _Static):
    x32, y32, a32, b32, v32, eps, scale, thr = as_f32(x, y, a, b, v, eps, scale, thr)
    n, m = st.n, st.m
    npad, mpad = padded_size(n, mesh, st.axis), padded_size(m, mesh, st.axis)
    ok = inputs_ok(x32, y32, a32, b32, v32, eps, scale, thr, positive=(eps, scale, thr), nonneg=(a32, b32),
                   balanced=((a32, b32),))
    xp, yp = pad(x32, npad, x32[-1]), pad(y32, mpad, y32[-1])  # padding: copies of a point, zero weight
    ap, bp = pad(a32, npad, 0.0), pad(b32, mpad, 0.0)
    vp = pad(v32, npad if st.wrt == "x" else mpad, 0.0)
    prm = ott_params(eps, 1.0 / scale)
    ax = P(st.axis)
    run = jax.shard_map(functools.partial(_hvp_local, st=st), mesh=mesh,
                        in_specs=(ax, ax, ax, ax, ax, P(), P(), P()), out_specs=(ax, P(), P()), check_vma=False)
    res, record, solved = run(xp, yp, ap, bp, vp, prm, thr, ok)
    cg_info = (jnp.max(record[:, 0]), jnp.max(record[:, 1]), jnp.all(record[:, 2] > 0))
    warn_unconverged(cg_info, ImplicitConfig(st.opts.precision, st.backend, st.implicit),
                     "HVP of reg_ot_cost (ot_triton_jax.distributed.hvp)")
    out = placed(jnp.where(ok, res[:v32.shape[0]], jnp.nan), mesh, st.axis)
    info = HVPInfo(cg_iterations=cg_info[0].astype(jnp.int32), cg_residual=cg_info[1], cg_converged=cg_info[2],
                   solve_converged=ok & solved)
    return out, info


def hvp(
    x: jax.Array,
    y: jax.Array,
    v: jax.Array,
    a: jax.Array | None = None,
    b: jax.Array | None = None,
    *,
    mesh: Mesh,
    axis: str | None = None,
    epsilon: Any,
    wrt: str = "x",
    loss: str = "reg_ot_cost",
    scale_cost: Any = 1.0,
    threshold: Any = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    implicit: ImplicitOptions | None = None,
    backend: str | None = None,
    tau_a: float = 1.0,
    tau_b: float = 1.0,
) -> tuple[jax.Array, HVPInfo]:
    """:func:`ot_triton_jax.hvp` with x (n, d), y (m, d), a (n,), b (m,) and the direction v (the
    shape of the cloud ``wrt``) split by points over the devices of ``mesh`` along ``axis``
    (default: its only axis); module docstring for the math and the communication.

    Options as :func:`ot_triton_jax.hvp` (``epsilon`` required and absolute; ``wrt``, ``loss``,
    the forward loop options, ``precision``, ``implicit``: CG options, :class:`ImplicitOptions`).
    ``tau_a`` / ``tau_b`` other than 1 raise NotImplementedError. Returns (the HVP, float32 with
    v's shape, sharded like v's cloud when its length is a multiple of the device count;
    :class:`HVPInfo`). ``solve_converged`` covers the forward solves the HVP uses: (x, y), and with
    the divergence the self term of ``wrt`` (the other self term does not enter and is not
    solved). A ``RuntimeWarning`` is issued when CG stops unconverged (unless ``implicit.warn``
    is False). Values are checked when concrete; under ``jax.jit`` invalid values give NaN.
    """
    if tau_a != 1.0 or tau_b != 1.0:
        raise NotImplementedError(f"ot_triton_jax.distributed.hvp solves balanced problems only (tau_a = tau_b = 1); "
                                  f"got tau_a={tau_a!r}, tau_b={tau_b!r}: use ot_triton_jax.hvp on one device for "
                                  "KL-relaxed marginals")
    rules.hvp_args(wrt, loss)
    axis = mesh_axis(mesh, axis)
    x, y, a, b = check_problem(x, y, a, b, epsilon, scale_cost)
    v = jnp.asarray(v)
    rules.hvp_direction(READER, v, x if wrt == "x" else y, wrt)
    inner, lo, hi = check_iterations(threshold, inner_iterations, min_iterations, max_iterations)
    check_backend(backend)
    st = _Static(axis, LoopOptions(precision, inner, lo, hi), backend, implicit_options(implicit), x.shape[0],
                 y.shape[0], wrt, loss)
    return _hvp_jit(x, y, a, b, v, jnp.asarray(epsilon, F32), jnp.asarray(scale_cost, F32),
                    jnp.asarray(threshold, F32), mesh=mesh, st=st)
