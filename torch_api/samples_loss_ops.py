"""The custom ops behind ``SamplesLoss`` (GeomLoss's annealed Sinkhorn and its gradient rule).

Two ``torch.library`` custom ops, so that ``torch.compile(..., fullgraph=True)`` traces
``SamplesLoss`` forward and backward as two opaque calls:

* ``ot_triton::samples_loss_solve``: the whole annealed solve of one problem or of a batch
  (the diameter, the eps-schedule and, under ``torch.compile``, the value checks run inside
  it: a host sync there, but no graph break, and a new schedule is no recompile). It returns
  (F, G) and, float32 (B, N) / (B, M), the new and old (entering the last extrapolation)
  f_ba, g_ab, f_aa, g_bb (0 columns without debias), and the last eps (0-d). Its autograd is
  GeomLoss's last-extrapolation rule (``samples_loss``): gradients in x and y, none in a, b.
* ``ot_triton::samples_loss_direction``: dF_i/dx_i (side 0) or dG_j/dy_j (side 1),
  one row per point, (B, N, D) float32. Its backward makes the loss twice
  differentiable in x, y: since dF_i/dx_i = (1/a_i) dS/dx_i, its VJP is the Hessian of
  the converged loss S at eps = blur^2 (``ot_triton::samples_loss_hvp``, streaming CG;
  the HVP of SamplesLoss is *defined* as that Hessian, evaluated at the final potentials).

KL-relaxed marginals (``rho_x``, ``rho_y``: None = strict; definitions in ``samples_loss``'s
module docstring, pieces in ``samples_loss_relaxed`` and ``core.unbalanced``): every softmin of a
first-side potential (f_ba, p) is multiplied by damping(eps, rho_x), of a second-side one (g_ab,
q) by damping(eps, rho_y). With rho_x != rho_y the self problems are split (f_aa = [p_a, q_a],
g_bb = [p_b, q_b], one ``lse_pair`` each); with one relaxed marginal every problem is translated
after each update (``unbalanced.semi_unbalanced_translate``). With ``terms`` the solve returns
the per-point dual terms of the loss (<a, F> + <b, G> in every case); the direction is their
derivative through the last extrapolation (``samples_loss_relaxed.relaxed_row``). Second
derivatives of the loss: the Jacobian of that gradient field at the fixed point, OTT's relaxed costs'
Hessians with per-side factors (``unbalanced.geomloss_hessian_sides``: c times the Hessian of OTT's
relaxed divergence with ``reach``; not symmetric with reach_x != reach_y, and the double backward
gives its transpose, as a VJP does); those of the potentials raise.

Label costs (``lx``, ``ly``, ``w``: the cost (|x_i - y_j|^2 + W[lx_i, ly_j]) / 2, W symmetric;
labels (N,), (M,), or (B, N), (B, M) for a batch, whose problems then run one by one): the solve
and the direction run on labelled clouds (the solve graphed as the unlabelled one, its labels and
table static inputs; the direction eager), the direction's formula unchanged; second derivatives raise.

Both accept points (N, D) or (B, N, D) with weights (N,) or (B, N), in any floating
dtype (computed in float32 on the clouds shifted by a common centre,
``kernel_ops.clouds``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ot_triton_jax.core.implicit_derivatives import debiased_hessian_apply
from ot_triton_jax.core.implicit_solve import ImplicitOptions
from ot_triton_jax.core.schedules import epsilon_schedule
from ot_triton_jax.core.unbalanced import (
    damping, geomloss_hessian_sides, self_problems_split,
)

from . import checks as check
from .implicit_ops import Passes, _info, _tensor_positions, required
from .host_copy import to_device
from .kernel_ops import apply_plan, apply_plan_blocksparse, clouds
from .label_inputs import message as label_message, pair_clouds
from .sinkhorn_loops import masked_log
from .samples_loss_anneal import PackedBatch, can_pack, graphed_anneal, packed_anneal
from .samples_loss_relaxed import mean, outputs, relaxed_row

S = 0.5  # cost scale: C = |x - y|^2 / 2 for p = 2


def diameter(x: Tensor, y: Tensor) -> float:
    """GeomLoss's default: diagonal of the joint bounding box of all points (whole batch)."""
    d = x.shape[-1]
    pts = torch.cat((x.detach().reshape(-1, d), y.detach().reshape(-1, d))).double()
    return float((pts.max(0).values - pts.min(0).values).norm())


def _batched(x, y, a, b):
    return (x, y, a, b) if x.ndim == 3 else (x[None], y[None], a[None], b[None])


def _problem_labels(labels: tuple | None, k: int) -> tuple | None:
    """Problem k's (label_x, label_y, W) of a batch's labels ((B, N), (B, M) rows, or one (N,), (M,)
    pair for an unbatched call)."""
    if labels is None:
        return None
    lx, ly, w = labels
    return (lx[k], ly[k], w) if lx.dim() == 2 else (lx, ly, w)


def _check_values(x, y, a, b, balanced: bool = True) -> None:
    """The value checks of ``SamplesLoss.forward``, run here when it is being compiled (equal
    masses only when both marginals are strict)."""
    check.values({"x": x, "y": y}, {"a": a, "b": b}, balanced_pair=("a", "b") if balanced else None)


def _empty_like_rows(t: Tensor) -> Tensor:
    return t.new_empty((t.shape[0], 0))


# ----------------------------------------------------------------------------- solve

_Solved = tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]


@torch.library.custom_op("ot_triton::samples_loss_solve", mutates_args=())
def solve(x: Tensor, y: Tensor, a: Tensor, b: Tensor, blur: float, scaling: float,
          diam: Optional[float], debias: bool, precision: str, check_values: bool,
          rho_x: Optional[float] = None, rho_y: Optional[float] = None, terms: bool = False,
          lx: Optional[Tensor] = None, ly: Optional[Tensor] = None, w: Optional[Tensor] = None) -> _Solved:
    """(F, G, f_ba, g_ab, f_aa, g_bb, old f_ba, old g_ab, old f_aa, old g_bb, eps); see the
    module docstring. ``diam`` None: GeomLoss's default diameter (0 -> blur: all points
    coincide, the schedule is [blur^2, blur^2]). ``check_values``: run the value checks
    (finite points, weights, equal masses when both marginals are strict) here. ``rho_x``,
    ``rho_y``: the relaxation of each marginal (None: strict); ``terms``: (F, G) are the loss's
    per-point dual terms rather than the potentials (module docstring). ``lx``, ``ly``, ``w``:
    a label cost (rows per problem for a batch)."""
    relax = (rho_x is not None, rho_y is not None)
    if check_values:
        _check_values(x, y, a, b, balanced=not any(relax))
    if diam is None:
        diam = diameter(x, y)
        if diam == 0.0:  # every point coincides: GeomLoss fails on log(0); anneal nothing
            diam = blur
    eps_list = epsilon_schedule(2, diam, blur, scaling)
    xs, ys, as_, bs = _batched(x, y, a, b)
    # one row of PARAMS [eps, S] per eps, padded to 16 bytes so that every row is aligned as a
    # lone PARAMS array is (Triton specializes pointers on it); one non-blocking copy
    rows = [[e, S, damping(e, rho_x), damping(e, rho_y)] if any(relax) else [e, S, 0.0, 0.0] for e in eps_list]
    prms = to_device(torch.tensor(rows, dtype=torch.float32), xs.device)
    labels = None if w is None else (lx, ly, w)
    if can_pack(xs.shape[0], (rho_x, rho_y), labels):  # one launch per softmin for the batch
        old, new = packed_anneal(xs, ys, as_, bs, prms, debias, precision, (rho_x, rho_y))
        F, G = outputs(new, debias, rho_x, rho_y, eps_list[-1], terms and any(relax))
        out = [F, G, *new, *old]
    else:
        rows = []
        for k in range(xs.shape[0]):
            la = masked_log(as_[k].detach().to(torch.float32))
            lb = masked_log(bs[k].detach().to(torch.float32))
            old, new = graphed_anneal(xs[k], ys[k], la, lb, prms, debias, precision, (rho_x, rho_y),
                                      _problem_labels(labels, k))
            F, G = outputs(new, debias, rho_x, rho_y, eps_list[-1], terms and any(relax))
            rows.append((F, G) + tuple(new) + tuple(old))
        out = [torch.stack(col) if col[0] is not None else None for col in zip(*rows)]
    for i in (4, 5, 8, 9):  # f_aa, g_bb without debias
        if out[i] is None:
            out[i] = _empty_like_rows(out[i - 2])
    eps = prms[-1, 0].clone()
    return tuple(out) + (eps,)


@solve.register_fake
def _(x, y, a, b, blur, scaling, diam, debias, precision, check_values, rho_x=None, rho_y=None, terms=False,
      lx=None, ly=None, w=None):
    B = x.shape[0] if x.ndim == 3 else 1
    n, m = x.shape[-2], y.shape[-2]
    f = dict(dtype=torch.float32, device=x.device)
    k = (2 if self_problems_split(rho_x, rho_y) else 1) if debias else 0
    nn, mm = k * n, k * m
    pots = (x.new_empty((B, n), **f), y.new_empty((B, m), **f), x.new_empty((B, nn), **f),
            y.new_empty((B, mm), **f))
    old = tuple(p.new_empty(p.shape) for p in pots)
    return (x.new_empty((B, n), **f), y.new_empty((B, m), **f)) + pots + old + (x.new_empty((), **f),)


def _setup_solve(ctx, inputs, output):
    x, y, a, b, _, _, _, debias, precision, _ = inputs[:10]
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(x, y, a, b, *output[2:])
    ctx.debias, ctx.precision = debias, precision
    ctx.relaxed = tuple(inputs[10:13]) if len(inputs) > 10 else (None, None, False)
    ctx.labels = tuple(inputs[13:16]) if len(inputs) > 13 else (None, None, None)


def _backward_solve(ctx, uF, uG, *_unused):
    x, y, a, b, *pots = ctx.saved_tensors
    gx = gy = None
    if ctx.needs_input_grad[0] and uF is not None:
        dx = direction(x, y, a, b, *pots, 0, ctx.debias, ctx.precision, *ctx.relaxed, *ctx.labels)
        gx = (uF.to(torch.float32)[..., None] * dx).to(x.dtype).reshape(x.shape)
    if ctx.needs_input_grad[1] and uG is not None:
        dy = direction(x, y, a, b, *pots, 1, ctx.debias, ctx.precision, *ctx.relaxed, *ctx.labels)
        gy = (uG.to(torch.float32)[..., None] * dy).to(y.dtype).reshape(y.shape)
    return (gx, gy) + (None,) * 14


solve.register_autograd(_backward_solve, setup_context=_setup_solve)


# ----------------------------------------------------------------------------- backward direction


@torch.library.custom_op("ot_triton::samples_loss_direction", mutates_args=())
def direction(x: Tensor, y: Tensor, a: Tensor, b: Tensor, f_ba: Tensor, g_ab: Tensor, f_aa: Tensor,
              g_bb: Tensor, of_ba: Tensor, og_ab: Tensor, of_aa: Tensor, og_bb: Tensor, eps: Tensor,
              side: int, debias: bool, precision: str, rho_x: Optional[float] = None,
              rho_y: Optional[float] = None, terms: bool = False, lx: Optional[Tensor] = None, ly: Optional[Tensor] = None, w: Optional[Tensor] = None) -> Tensor:
    """dF_i/dx_i (side 0) or dG_j/dy_j (side 1), (B, N, D) float32; see the module docstring
    of ``samples_loss`` (and this module's for relaxed marginals). Potentials as returned by
    :func:`solve`; no host synchronization."""
    rho_ = rho_x if side == 0 else rho_y
    relaxed = rho_x is not None or rho_y is not None
    xs, ys, as_, bs = _batched(x, y, a, b)
    prm = torch.full((2,), S, dtype=torch.float32, device=xs.device)
    prm[0] = eps
    labels = None if w is None else (lx, ly, w)
    if not relaxed and can_pack(xs.shape[0], (None, None), labels):
        return _packed_direction(xs, ys, as_, bs, (f_ba, g_ab, f_aa, g_bb), (of_ba, og_ab, of_aa, og_bb), eps, prm,
                                 side, debias, precision)
    rows = []
    for k in range(xs.shape[0]):
        X, Y = pair_clouds(xs[k], ys[k], *(_problem_labels(labels, k) or (None, None, None)))
        la = masked_log(as_[k].detach().to(torch.float32))
        lb = masked_log(bs[k].detach().to(torch.float32))
        # Source cloud S, other cloud T; the plans' weights are folded into the potentials
        # (eps log w: -inf on zero weights), so P and Q below are GeomLoss's softmax weights.
        if side == 0:
            Sc, T, f_st, g_st, f_ss, old_ss, lw_s, lw_t = X, Y, f_ba[k], og_ab[k], f_aa[k], of_aa[k], la, lb
        else:
            Sc, T, f_st, g_st, f_ss, old_ss, lw_s, lw_t = Y, X, g_ab[k], of_ba[k], g_bb[k], og_bb[k], lb, la
        p_t, r = apply_plan(Sc, T, f_st, g_st + eps * lw_t, prm, precision, T.x)   # (P y, P 1)
        mean_t = p_t / r[:, None]
        if relaxed:
            mean_s = lambda row_pot, col_old: mean(apply_plan(Sc, Sc, row_pot, col_old + eps * lw_s, prm,
                                                               precision, Sc.x))
            rows.append(relaxed_row(Sc, mean_t, mean_s, f_st, f_ss, old_ss, rho_, rho_x, rho_y, eps, debias, terms))
            continue
        if not debias:
            rows.append(Sc.x - mean_t)
            continue
        q_s, q = apply_plan(Sc, Sc, f_ss, old_ss + eps * lw_s, prm, precision, Sc.x)  # (Q x, Q 1)
        rows.append(q_s / q[:, None] - mean_t)
    return torch.stack(rows)


def _packed_direction(xs, ys, as_, bs, new, old, eps, prm, side: int, debias: bool, precision: str) -> Tensor:
    """:func:`direction` of a strict batch in one block-sparse pass per plan for all problems."""
    pb = PackedBatch(xs, ys, as_, bs, precision)
    f_ba, g_ab, f_aa, g_bb, of_ba, og_ab, of_aa, og_bb = (  # (B, 0) self potentials without debias
        None if p.numel() == 0 else pb.packed_pot(p, s) for p, s in zip(new + old, (0, 1, 0, 1) * 2))
    if side == 0:
        Sc, T, f_st, g_st, f_ss, old_ss, lw_s, lw_t, key = pb.X, pb.Y, f_ba, og_ab, f_aa, of_aa, pb.la, pb.lb, "xy"
    else:
        Sc, T, f_st, g_st, f_ss, old_ss, lw_s, lw_t, key = pb.Y, pb.X, g_ab, of_ba, g_bb, og_bb, pb.lb, pb.la, "yx"
    p_t, r = apply_plan_blocksparse(Sc, T, f_st, g_st + eps * lw_t, prm, pb.ranges[key], precision, T.x)
    rows = -(p_t / r[:, None])
    if debias:
        own = key[0] * 2
        q_s, q = apply_plan_blocksparse(Sc, Sc, f_ss, old_ss + eps * lw_s, prm, pb.ranges[own], precision, Sc.x)
        rows = rows + q_s / q[:, None]
    else:
        rows = rows + Sc.x
    return pb.unpack(rows, side)


@direction.register_fake
def _(x, y, a, b, f_ba, g_ab, f_aa, g_bb, of_ba, og_ab, of_aa, og_bb, eps, side, debias, precision, rho_x=None,
      rho_y=None, terms=False, lx=None, ly=None, w=None):
    pts = x if side == 0 else y
    B = pts.shape[0] if pts.ndim == 3 else 1
    return pts.new_empty((B, pts.shape[-2], pts.shape[-1]), dtype=torch.float32)


# ----------------------------------------------------------------------------- second order


@torch.library.custom_op("ot_triton::samples_loss_hvp", mutates_args=())
def hvp(x: Tensor, y: Tensor, a: Tensor, b: Tensor, f_ba: Tensor, g_ab: Tensor, f_aa: Tensor, g_bb: Tensor,
        eps: Tensor, vx: Optional[Tensor], vy: Optional[Tensor], debias: bool, precision: str,
        rho_x: Optional[float] = None, rho_y: Optional[float] = None, transpose: bool = False) -> tuple[Tensor, Tensor]:
    """The Jacobian in (x, y) of the loss's gradient field at eps (the last of the schedule) applied
    to (vx, vy) (``transpose``: its transpose): with strict marginals the Hessian of
    S = OT(a, b) - 1/2 OT(a, a) - 1/2 OT(b, b) (debias) or OT(a, b), OT = OTT's reg_ot_cost with
    C = |x - y|^2 / 2, evaluated at the solve's final potentials (OTT's f = f_ba + eps log a, ...);
    with ``rho_x`` / ``rho_y`` (GeomLoss's reach^2 per marginal) OTT's relaxed costs and the per-side
    factors of ``unbalanced.geomloss_hessian_sides`` (core.implicit_derivatives.debiased_hessian_apply;
    split self potentials [p, q] with rho_x != rho_y). (B, N, D) and (B, M, D) float32; default CG
    options (core.implicit_solve.ImplicitOptions)."""
    opts = ImplicitOptions()
    taus, scales = (1.0, 1.0), (1.0, 1.0)
    if rho_x is not None or rho_y is not None:
        taus, scales = geomloss_hessian_sides(rho_x, rho_y, eps, True)
    split = self_problems_split(rho_x, rho_y)
    xs, ys, as_, bs = _batched(x, y, a, b)
    B = xs.shape[0]
    vxs = None if vx is None else vx.reshape(B, xs.shape[1], -1).to(torch.float32)
    vys = None if vy is None else vy.reshape(B, ys.shape[1], -1).to(torch.float32)
    prm = torch.full((2,), S, dtype=torch.float32, device=xs.device)
    prm[0] = eps
    outs_x, outs_y = [], []
    for k in range(B):
        X, Y = clouds(xs[k], ys[k])
        ak, bk = as_[k].detach().to(torch.float32), bs[k].detach().to(torch.float32)
        la, lb = masked_log(ak), masked_log(bk)
        f, g = f_ba[k] + eps * la, g_ab[k] + eps * lb
        own = [None, None]
        if debias:
            for i, (h, lw) in enumerate(((f_aa[k], la), (g_bb[k], lb))):
                n = lw.shape[0]
                own[i] = (h[:n] + eps * lw, h[n:] + eps * lw) if split else h + eps * lw
        pair = lambda h: h if isinstance(h, tuple) else (h, h)
        ops_xy = Passes(X, Y, f, g, prm, precision)
        ops_xx = Passes(X, X, *pair(own[0]), prm, precision) if debias else None
        ops_yy = Passes(Y, Y, *pair(own[1]), prm, precision) if debias else None
        (tx, ty), infos = debiased_hessian_apply(ops_xy, ops_xx, ops_yy, (f, g, *own), ak, bk,
                                                 None if vxs is None else vxs[k], None if vys is None else vys[k],
                                                 opts, taus, scales, transpose)
        for info in infos:
            _info(info, "HVP of SamplesLoss", opts.warn)
        outs_x.append(tx)
        outs_y.append(ty)
    return torch.stack(outs_x).reshape(x.shape), torch.stack(outs_y).reshape(y.shape)


@hvp.register_fake
def _(x, y, a, b, f_ba, g_ab, f_aa, g_bb, eps, vx, vy, debias, precision, rho_x=None, rho_y=None, transpose=False):
    return x.new_empty(x.shape, dtype=torch.float32), y.new_empty(y.shape, dtype=torch.float32)


def _setup_hvp(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:9])
    ctx.debias, ctx.precision = inputs[11], inputs[12]
    ctx.rhos = tuple(inputs[i] if len(inputs) > i else None for i in (13, 14))
    ctx.transpose = len(inputs) > 15 and inputs[15]
    _tensor_positions(ctx, inputs)
    ctx.set_materialize_grads(False)


def _backward_hvp(ctx, ux, uy):
    """Linear in (vx, vy): its VJP there is the transposed map (the same one when the Jacobian is a
    Hessian); third derivatives raise."""
    if any(required(ctx, i) for i in range(9)):
        raise NotImplementedError("third derivatives of SamplesLoss are not implemented (its HVP is linear in "
                                  "the direction only)")
    x, y, a, b, *pots = ctx.saved_tensors
    tx, ty = hvp(x, y, a, b, *pots, ux, uy, ctx.debias, ctx.precision, *ctx.rhos, not ctx.transpose)
    return (None,) * 9 + (tx if ctx.needs_input_grad[9] else None, ty if ctx.needs_input_grad[10] else None,
                          None, None, None, None, None)


hvp.register_autograd(_backward_hvp, setup_context=_setup_hvp)


def _setup_direction(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:8], inputs[12])
    ctx.side, ctx.debias, ctx.precision = inputs[13], inputs[14], inputs[15]
    ctx.rhos = (inputs[16], inputs[17]) if len(inputs) > 17 else (None, None)
    ctx.terms = len(inputs) > 18 and inputs[18]
    ctx.labelled = len(inputs) > 21 and inputs[21] is not None
    ctx.set_materialize_grads(False)


def _backward_direction(ctx, u):
    """dF_i/dx_i = (1/a_i) G_x,i (GeomLoss's gradient field, p = 2; G = grad S with strict marginals), so
    its VJP is the transposed Jacobian of G (:func:`hvp`, the Hessian of S when strict) applied to
    (u / a, 0) (side 0) or (0, u / b) (side 1)."""
    if u is None or not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        return (None,) * 22
    if ctx.labelled:
        raise NotImplementedError(label_message("a second derivative (HVP) of SamplesLoss"))
    x, y, a, b, f_ba, g_ab, f_aa, g_bb, eps = ctx.saved_tensors
    if ctx.rhos != (None, None):
        geomloss_hessian_sides(*ctx.rhos, 1.0, ctx.terms)  # raises where not implemented
    w = a if ctx.side == 0 else b
    pts = x if ctx.side == 0 else y
    w = w.detach().to(torch.float32).reshape(pts.shape[:-1])
    v = torch.where(w[..., None] > 0, u.reshape(pts.shape).to(torch.float32) / torch.where(w > 0, w, 1.0)[..., None],
                    0.0)
    vx, vy = (v, None) if ctx.side == 0 else (None, v)
    tx, ty = hvp(x, y, a, b, f_ba, g_ab, f_aa, g_bb, eps, vx, vy, ctx.debias, ctx.precision, *ctx.rhos, True)
    return ((tx.to(x.dtype) if ctx.needs_input_grad[0] else None, ty.to(y.dtype) if ctx.needs_input_grad[1] else None)
            + (None,) * 20)


direction.register_autograd(_backward_direction, setup_context=_setup_direction)
