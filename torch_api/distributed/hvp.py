"""``torch_api.distributed.hvp``: the Hessian-vector product of reg_ot_cost (or of OTT's Sinkhorn
divergence) in x or y, with the clouds sharded over a ``torch.distributed`` process group.

The numbers of :func:`torch_api.hvp` on the gathered problem, to float32 rounding, with the same
conventions (OTT-JAX: C = |x - y|^2 / scale_cost, absolute epsilon, P_ij = exp((f_i + g_j - C_ij)/eps),
f carrying eps log a) and the shards of :func:`torch_api.distributed.sinkhorn` (every rank holds
x_r, y_r, a_r, b_r; the global clouds are their concatenations in rank order).

The math (:mod:`ot_triton_jax.core.implicit_derivatives`, :mod:`ot_triton_jax.core.implicit_solve`).
The gradient of reg_ot_cost is the envelope gx_i = 2s (r_i x_i - (P y)_i) (s = 1 / scale_cost,
r = P 1, c = P^T 1), likewise gy. Its derivative along v moves the potentials by (df, dg) solving

    [[diag(r), P], [P^T, diag(c)]] [df; dg] = [2s e; 2s h],   e_i = sum_j P_ij dC_ij, h_j = sum_i P_ij dC_ij,

dC_ij = 2s <x_i - y_j, vx_i - vy_j>, solved by CG on the Schur complement of the larger side
(S = diag(c) - P^T diag(1/r) P for n >= m, its null vector 1 projected out); then
d gx_i = 2s sum_j [dP_ij (x_i - y_j) + P_ij (vx_i - vy_j)], dP_ij = P_ij (df_i + dg_j - dC_ij)/eps.
``loss="sinkhorn_divergence"``: H_xy(v) - 1/2 (H_xx(v, v)_x + H_xx(v, v)_y) for wrt="x" (the self
term's Hessian with both of its clouds moving; y likewise), as :func:`torch_api.hvp`.

Sharding. Vectors of length n or m (potentials, the direction, every CG vector) are replicated on
every rank; only the streaming plan passes are sharded (:class:`ShardedPasses`): a rank computes
its rows of P v (its x rows against the full y) or of P^T u (its y rows against the full x), and
one all-gather assembles the full result. Communication: the forward solve's
(:mod:`torch_api.distributed.solve`), one all-gather of v, then per pass one all-gather of the
rows it produced: a CG iteration is two passes, so two all-gathers of O(n) and O(m) numbers (P z
and P^T of the result, each with its row sums), plus one scalar all-reduce every
``implicit_ops.CHECK_EVERY`` iterations for the stop test; the passes around CG (right-hand side,
tangent assembly) gather O((n + m) d) numbers each. Nothing n x m is communicated.

Scope: balanced problems (tau_a = tau_b = 1), no label cost, precision "float32" or "tf32". The
clouds are gathered (no ``exchange``): the direction and the tangents are replicated (n, d) and
(m, d) arrays, the size of the clouds themselves, so keeping the clouds sharded would not bound
the memory.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ot_triton_jax.core import checks as rules
from ot_triton_jax.core.implicit_derivatives import hessian_apply
from ot_triton_jax.core.implicit_solve import PRECONDITIONERS, ImplicitOptions, implicit_options

from .ops import Comm, Side, alternating, symmetric
from .solve import _agreed_inputs, _gathered, _options, _Setup
from ..checks import READER
from ..hessian_vector import HVPInfo
from ..implicit_ops import CHECK_EVERY, Passes, _info
from ..kernel_ops import clouds, kernel_params

__all__ = ["hvp", "ShardedPasses", "HVPInfo", "ImplicitOptions"]

F32 = torch.float32
_CHOICES = ("wrt", "loss", "implicit.rtol", "implicit.atol", "implicit.max_iter", "implicit.preconditioner",
            "implicit.neumann_terms", "implicit.warn")


def _own(t: Tensor, side: Side) -> Tensor:
    """This rank's rows of a replicated vector, as a fresh tensor (aligned kernel input)."""
    return t[side.start:side.stop].clone()


class ShardedPasses:
    """The streaming passes of one plan P (n x m) sharded over the ranks, satisfying the core's
    ``PlanPasses`` protocol with replicated full vectors in and out.

    Two single-device :class:`torch_api.implicit_ops.Passes` of this rank: ``rows`` on (its x rows,
    full y, its f, full g) for the x-side results (``apply``, ``weighted``), ``cols`` on (full x,
    its y rows, full f, its g) for the y-side ones (``apply_t``, ``apply_t_sq``, ``weighted_t``);
    each pass computes its rows, then one all-gather (``Comm.gather_rows``) gives every rank the
    full result. ``transposed()`` swaps the roles of the two sides.

    Determinism: an all-gather hands every rank the same bytes, so every rank runs the core's CG on
    identical full vectors and computes identical inner products, step sizes and stop tests. In
    exact arithmetic that is CG with inner products all-reduced from the ranks' partial sums
    (<u, w> = sum_r <u_r, w_r>); here each rank forms the whole sum itself in one order, so no rank
    can see another value. The stop test is all-reduced nevertheless (the loop runs while any rank
    would continue; the CG body is a no-op once converged), so that ranks on dissimilar devices can
    never leave the loop at different iterations and strand the others in a collective.
    """

    xp = torch

    def __init__(self, comm: Comm, sx: Side, sy: Side, f_full: Tensor, g_full: Tensor, prm: Tensor,
                 precision: str):
        self.comm, self.sx, self.sy, self.prm, self.precision = comm, sx, sy, prm, precision
        self.f_full, self.g_full = f_full, g_full
        self.rows = Passes(sx.local, sy.full, _own(f_full, sx), g_full, prm, precision)
        self.cols = Passes(sx.full, sy.local, f_full, _own(g_full, sy), prm, precision)
        self.x, self.y, self.n, self.m = sx.full.x, sy.full.x, sx.full.n, sy.full.n
        self.eps, self.s = prm[0], prm[1]

    def _gather_pair(self, pv: Tensor | None, sums: Tensor, side: Side) -> tuple[Tensor | None, Tensor]:
        # one all-gather for the product and its row sums together
        if pv is None:
            return None, self.comm.gather_rows(sums, side.layout, side.index)
        full = self.comm.gather_rows(torch.cat([pv, sums[:, None]], dim=1), side.layout, side.index)
        return full[:, :-1], full[:, -1].contiguous()

    def apply(self, v):
        return self._gather_pair(*self.rows.apply(v), self.sx)

    def apply_t(self, u):
        return self._gather_pair(*self.cols.apply_t(u), self.sy)

    def apply_t_sq(self, u):
        return self.comm.gather_rows(self.cols.apply_t_sq(u), self.sy.layout, self.sy.index)

    def weighted(self, w, A, B):
        return self.comm.gather_rows(self.rows.weighted(_own(w, self.sx), A, B), self.sx.layout, self.sx.index)

    def weighted_t(self, w, A, B):
        return self.comm.gather_rows(self.cols.weighted_t(_own(w, self.sy), A, B), self.sy.layout, self.sy.index)

    def transposed(self) -> "ShardedPasses":
        return ShardedPasses(self.comm, self.sy, self.sx, self.g_full, self.f_full, self.prm, self.precision)

    def while_loop(self, cond, body, state):
        while self._anyone(bool(cond(state))):
            for _ in range(CHECK_EVERY):
                state = body(state)
        return state

    def _anyone(self, flag: bool) -> bool:
        return bool(self.comm.sum(torch.tensor(float(flag), device=self.comm.device)) > 0)


def _choices(wrt, loss, implicit) -> tuple[ImplicitOptions, dict]:
    """The checked HVP choices and their row of the agreement table (:data:`_CHOICES`)."""
    rules.hvp_args(wrt, loss)
    o = implicit_options(implicit)
    vals = (("x", "y").index(wrt), rules.HVP_LOSSES.index(loss), o.rtol, o.atol, o.max_iter,
            PRECONDITIONERS.index(o.preconditioner), o.neumann_terms, int(o.warn))
    return o, dict(zip(_CHOICES, vals))


def _sides(st: _Setup, pts: tuple, layouts: tuple, w: tuple) -> tuple[Side, ...]:
    """The clouds of one problem centred together (``kernel_ops.clouds``, as the single solve) and
    this rank's rows of each."""
    return tuple(Side.make(C, lay, st.comm.rank, ws) for C, lay, ws in zip(clouds(*pts), layouts, w))


def _hessian(st: _Setup, sx: Side, sy: Side, f_full: Tensor, g_full: Tensor, prm: Tensor, v: tuple,
             want: tuple, iopts: ImplicitOptions, symmetric: bool = False):
    """``symmetric``: a self term moved as one cloud (the single-device solve's symmetric system)."""
    ops = ShardedPasses(st.comm, sx, sy, f_full, g_full, prm, st.opts.precision)
    (tx, ty, _, _), info = hessian_apply(ops, ops.f_full, ops.g_full, sx.w, sy.w, (*v, None, None),
                                         (*want, False, False), iopts, symmetric=symmetric)
    return tx, ty, _info(info, "HVP of reg_ot_cost (torch_api.distributed.hvp)", iopts.warn)


def hvp(
    x: Tensor,
    y: Tensor,
    v: Tensor,
    *,
    wrt: str = "x",
    a: Tensor | None = None,
    b: Tensor | None = None,
    epsilon: float | Tensor,
    scale_cost: float | Tensor = 1.0,
    loss: str = "reg_ot_cost",
    threshold: float | Tensor = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    implicit: ImplicitOptions | None = None,
    tau_a: float = 1.0,
    tau_b: float = 1.0,
    group=None,
) -> tuple[Tensor, HVPInfo]:
    """Hessian of ``loss`` in ``wrt`` applied to v, on clouds sharded over the ranks of ``group``
    (module docstring); :func:`torch_api.hvp`'s numbers on the gathered problem.

    Called by every rank of ``group`` (default: the default process group) with its shards ``x``
    (n_r, d), ``y`` (m_r, d), their weights ``a`` (n_r,), ``b`` (m_r,) (None: the uniform 1/n, 1/m
    of the global sizes, None on every rank) and ``v``, this rank's rows of the direction: the
    shape of its shard of the cloud ``wrt``. ``wrt``, ``loss``, ``epsilon``, ``scale_cost``, the
    forward options, ``precision`` and ``implicit`` (CG options, :class:`ImplicitOptions`) are
    :func:`torch_api.hvp`'s and must be equal on every rank (checked: every rank raises the same
    error, or one naming the rank whose own checks failed). ``tau_a``, ``tau_b`` must be 1.

    Returns (this rank's rows of the HVP, float32 with v's shape; :class:`HVPInfo`, equal on every
    rank). ``solve_converged`` covers the forward solves the HVP uses: the (x, y) solve, and with
    the divergence the self term of ``wrt`` (the other self term does not enter the HVP and is not
    solved). A ``RuntimeWarning`` is issued when CG stops unconverged (unless ``implicit.warn`` is
    False). No autograd: the result is detached.
    """
    try:
        iopts, extra, choice_error = *_choices(wrt, loss, implicit), None
    except (ValueError, TypeError) as err:  # raised after the agreement gather (no rank left waiting)
        iopts, extra, choice_error = None, dict.fromkeys(_CHOICES, math.nan), err

    def precheck():
        if choice_error is not None:
            raise choice_error
        if tau_a != 1.0 or tau_b != 1.0:
            raise NotImplementedError(f"torch_api.distributed.hvp solves balanced problems only (tau_a = tau_b = 1); "
                                      f"got tau_a={tau_a!r}, tau_b={tau_b!r}: use torch_api.hvp on one device for "
                                      "KL-relaxed marginals")
        like = x if wrt == "x" else y
        rules.hvp_direction(READER, v, like, wrt)
        if not v.is_floating_point() or v.device != like.device:
            raise ValueError(f"v must be a floating tensor on {wrt}'s device {like.device}; got {v.dtype} on "
                             f"{v.device}")

    detach = lambda t: t.detach() if isinstance(t, Tensor) else t
    x, y, v, a, b = (detach(t) for t in (x, y, v, a, b))
    opts = _options(detach(epsilon), detach(scale_cost), detach(threshold), inner_iterations, min_iterations,
                    max_iterations, precision)
    st = _agreed_inputs("hvp", group, x, y, a, b, opts, {}, extra, precheck)
    x_full, y_full, a_full, b_full = _gathered(st, x, y, a, b)
    prm = kernel_params(st.eps, st.scale, st.comm.device)
    on_x = wrt == "x"
    sx, sy = _sides(st, (x_full, y_full), (st.lx, st.ly), (a_full, b_full))
    own = sx if on_x else sy
    v_full = st.comm.gather_rows(v.to(F32), own.layout, own.index)
    _, _, f_full, g_full, _, _, solved = alternating(st.comm, sx, sy, prm, st.thr32, st.opts)
    vv, want = ((v_full, None), (True, False)) if on_x else ((None, v_full), (False, True))
    tx, ty, info = _hessian(st, sx, sy, f_full, g_full, prm, vv, want, iopts)
    res, infos = (tx if on_x else ty), [info]
    if loss == "sinkhorn_divergence":
        pts, lay, w = (x_full, st.lx, a_full) if on_x else (y_full, st.ly, b_full)
        (alone,) = _sides(st, (pts,), (lay,), (w,))  # the symmetric solve centres the cloud alone
        _, h_full, _, _, self_solved = symmetric(st.comm, alone, prm, st.thr32, st.opts)
        s1, s2 = _sides(st, (pts, pts), (lay, lay), (w, w))
        t1, t2, info_self = _hessian(st, s1, s2, h_full, h_full, prm, (v_full, v_full), (True, True), iopts,
                                      symmetric=True)
        res, solved = res - 0.5 * (t1 + t2), solved & self_solved
        infos.append(info_self)
    stack = torch.stack(infos)
    record = HVPInfo(cg_iterations=stack[:, 0].max().to(torch.int32), cg_residual=stack[:, 1].max(),
                     cg_converged=stack[:, 2].min() > 0, solve_converged=solved)
    return res[own.start:own.stop].clone(), record
