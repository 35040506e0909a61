"""The sharded pieces behind :mod:`torch_api.distributed.samples_loss`: the softmin provider of
the anneal, the gradient rows of this rank's points, and the autograd Function joining them.

:class:`ShardedSoftmin` gives :func:`torch_api.samples_loss_anneal.anneal` the softmins it asks
for (``pair`` and ``own``, the interface of the single-device dense and packed providers) with
the potentials kept as full, replicated vectors: a softmin is the single-device kernel on (this
rank's rows, full other cloud) followed by one all-gather of the new pieces. ``pair`` gathers
its two sides in ONE all-gather (each rank's piece is [its rows of the first side, its rows of
the second side]), ``own`` in one. So every rank runs the same anneal on the same numbers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ot_triton_jax.core import pair_plans
from ot_triton_jax.core.sharding import ShardLayout

from .ops import Comm, Side, plan
from ..kernel_ops import Cloud, lse_update
from ..samples_loss_relaxed import mean, relaxed_row

F32 = torch.float32


class ShardedSoftmin:
    """The softmins of the anneal over sharded clouds. ``sides``: "x" and "y" (:class:`Side`:
    the full centred cloud, this rank's rows, the layout and gather index); the anneal's keys
    ("xy", "yx", "xx", "yy") name the source then the target side.

    softmin_i(g) = -eps LSE_j((g_j - C_ij)/eps + log w_j) for this rank's rows i of the source,
    j over the whole target: ``kernel_ops.lse_update`` on the local rows, with the fixed shift
    predicted from the old potential where the single-device kernels take one (``pair_plans``
    "fold" mode), the online max otherwise (same numbers to float32 rounding)."""

    def __init__(self, comm: Comm, sx: Side, sy: Side, precision: str):
        self.comm, self.sides, self.precision = comm, {"x": sx, "y": sy}, precision
        d = sx.local.d
        self.fold_pair = pair_plans.pair_mode(sx.layout.total, sy.layout.total, d, precision) == "fold"
        self.fold_self = pair_plans.self_mode(d, precision) == "fold"
        self._pairs: dict[str, tuple[ShardLayout, Tensor]] = {}

    def _softmin(self, s: Side, t: Side, pot: Tensor, lw: Tensor, prm: Tensor, old: Tensor, fold: bool) -> Tensor:
        if t.ring is not None:  # the old potential as the shards' shift (ring.RingPass.softmin)
            return t.ring.softmin(s.local, pot.contiguous(), prm, self.precision, pold=old[s.start:s.stop],
                                  logw_in=lw)[0]
        pold = old[s.start:s.stop].contiguous() if fold else None
        return lse_update(s.local, t.full, pot.contiguous(), prm, self.precision, logw_in=lw, pold=pold,
                          compute_err=False, fold=fold)[0]

    def _pair_gather(self, key: str) -> tuple[ShardLayout, Tensor]:
        """The layout of the pieces [source rows, target rows] of every rank and the index that
        reads the gathered buffer as [full source, full target]."""
        hit = self._pairs.get(key)
        if hit is None:
            ls, lt = self.sides[key[0]].layout, self.sides[key[1]].layout
            lay = ShardLayout(tuple(a + b for a, b in zip(ls.sizes, lt.sizes)))
            w = lay.width
            src = [r * w + torch.arange(n) for r, n in enumerate(ls.sizes)]
            tgt = [r * w + ls.sizes[r] + torch.arange(n) for r, n in enumerate(lt.sizes)]
            hit = self._pairs[key] = (lay, torch.cat(src + tgt).to(self.comm.device))
        return hit

    def pair(self, key: str, S: Cloud, T: Cloud, f: Tensor, g: Tensor, lw_s: Tensor, lw_t: Tensor, prm: Tensor):
        s, t = self.sides[key[0]], self.sides[key[1]]
        f_new = self._softmin(s, t, g, lw_t, prm, f, self.fold_pair)
        g_new = self._softmin(t, s, f, lw_s, prm, g, self.fold_pair)
        lay, index = self._pair_gather(key)
        both = self.comm.gather_rows(torch.cat((f_new, g_new)), lay, index)
        return both[:S.n], both[S.n:]

    def own(self, key: str, S: Cloud, f: Tensor, lw: Tensor, prm: Tensor) -> Tensor:
        s = self.sides[key[0]]
        return self.comm.gather_rows(self._softmin(s, s, f, lw, prm, f, self.fold_self), s.layout, s.index)


@dataclass(eq=False)
class Solved:
    """What the backward of a sharded SamplesLoss needs: the sides, the full potentials after
    (``new``) and entering (``old``) the last extrapolation (f_ba, g_ab, f_aa, g_bb; None
    without debias), the last eps (0-d) and its PARAMS [eps, S], the options, ``rho`` (None:
    balanced; both marginals relaxed alike otherwise) and ``terms`` (F, G are the per-point
    terms of the loss rather than the potentials)."""

    sx: Side
    sy: Side
    new: tuple
    old: tuple
    eps: Tensor
    prm: Tensor
    debias: bool
    precision: str
    rho: float | None
    terms: bool


def local_direction(sv: Solved, side: int) -> Tensor:
    """dF_i/dx_i (side 0) or dG_j/dy_j (side 1) for this rank's rows, float32 (n_r, d):
    ``torch_api.samples_loss_ops.direction`` with the source rows restricted to this rank's
    (the plans' rows of its points against the full other cloud and the full potentials, which
    every rank holds), so no collective runs."""
    f_ba, g_ab, f_aa, g_bb = sv.new
    of_ba, og_ab, of_aa, og_bb = sv.old
    if side == 0:
        s, t, f_st, g_st, f_ss, old_ss = sv.sx, sv.sy, f_ba, og_ab, f_aa, of_aa
    else:
        s, t, f_st, g_st, f_ss, old_ss = sv.sy, sv.sx, g_ab, of_ba, g_bb, og_bb
    eps, prm, Sc = sv.eps, sv.prm, s.local
    f_st = f_st[s.start:s.stop]
    # the weights are folded into the column potentials (eps log w: -inf on zero weights), so the
    # row-normalised plans below are GeomLoss's softmax weights
    p_t, r = plan(s, t, f_st, g_st + eps * t.logw_full, prm, sv.precision, with_points=True)
    mean_t = p_t / r[:, None]

    def mean_s(row_pot: Tensor, col_old: Tensor) -> Tensor:
        return mean(plan(s, s, row_pot, col_old + eps * s.logw_full, prm, sv.precision, with_points=True))

    own = None if f_ss is None else f_ss[s.start:s.stop]
    if sv.rho is not None:
        return relaxed_row(Sc, mean_t, mean_s, f_st, own, old_ss, sv.rho, sv.rho, sv.rho, eps, sv.debias, sv.terms)
    if not sv.debias:
        return Sc.x - mean_t
    return mean_s(own, old_ss) - mean_t


class ShardedPotentials(torch.autograd.Function):
    """``ShardedPotentials.apply(x, y, F, G, solved)``: the full (F, G) (float32, equal on every
    rank), differentiable in this rank's shards x and y by GeomLoss's rule (F_i depends on x_i
    only, G_j on y_j only): the VJP of (uF, uG) is uF_i dF_i/dx_i for the local rows i (and
    likewise in y). Entries of uF outside this rank's rows belong to other ranks' points and are
    not read; the backward runs no collective. Once differentiable."""

    @staticmethod
    def forward(ctx, x: Tensor, y: Tensor, F: Tensor, G: Tensor, solved: Solved):
        ctx.solved, ctx.dtypes = solved, (x.dtype, y.dtype)
        ctx.set_materialize_grads(False)
        return F.clone(), G.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, uF, uG):
        sv = ctx.solved
        out = [None, None]
        for k, (u, s) in enumerate(((uF, sv.sx), (uG, sv.sy))):
            if u is not None and ctx.needs_input_grad[k]:
                rows = local_direction(sv, k)
                out[k] = (u[s.start:s.stop].to(F32)[:, None] * rows).to(ctx.dtypes[k])
        return out[0], out[1], None, None, None
