"""The Hessian of reg_ot_cost applied to a direction for B problems at once: the CG of every problem
in one loop, one block-sparse launch per plan pass for the whole batch.

``torch_api.hvp`` on x (B, n, d), y (B, m, d) runs the forward solves as one packed loop
(:func:`torch_api.sinkhorn_batch`) and then :func:`ot_triton_jax.core.implicit_derivatives.hessian_apply`
on (B, ...) vectors with :class:`PackedPasses` as its plan passes. The core reduces over the last
axis only, so every problem keeps its own projections, CG inner products, iteration count and stop
(a stopped problem's iterate is frozen while the others run): each problem's HVP is that of its
single call, to float32 rounding. The problems are packed as ``core.batch_layout`` lays them out
(:class:`torch_api.samples_loss_anneal.PackedBatch`: each problem on row-block boundaries, centred
on its own centre, zero-weight padding), and a plan pass P z is one launch of the block-sparse apply
kernel whose row blocks of problem k stream problem k's columns only: no pair of two problems is
formed. A CG iteration is two such launches for the batch, with the stop test read on the host
every ``implicit_ops.CHECK_EVERY`` iterations.

The tangent assembly's weighted pass sum_j P_ij <w_i, A_j> B_j (once per HVP) is a plain plan pass
of the columns A_j (x) B_j (k p of them) contracted with w_i afterwards when k p <= ``OUTER_MAX``
(d <= 8 for an HVP in x or y), and the dense weighted kernel problem by problem otherwise.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .implicit_ops import Passes
from .kernel_ops import apply_plan_blocksparse, apply_weighted, clouds
from .samples_loss_anneal import PackedBatch

F32 = torch.float32
OUTER_MAX = 64  # columns of the outer-product form of a weighted pass


class PackedPasses:
    """The plan passes of B packed problems (the core's ``PlanPasses`` with (B, ...) vectors).

    ``pb``: the packed batch; ``f`` (B, n), ``g`` (B, m): the solved potentials (OTT convention);
    ``prm``: the kernels' [eps, s] shared by the batch; ``flip``: the passes of P^T (rows on y)."""

    xp = torch
    while_loop = staticmethod(Passes.while_loop)

    def __init__(self, pb: PackedBatch, f: Tensor, g: Tensor, prm: Tensor, precision: str, flip: bool = False):
        self.pb, self.prm, self.precision, self.flip = pb, prm, precision, flip
        self.f, self.g = f.detach().to(F32), g.detach().to(F32)
        self.rows, self.cols = (1, 0) if flip else (0, 1)  # PackedBatch sides: 0 = x, 1 = y
        clouds_ = (pb.X, pb.Y)
        self.S, self.T = clouds_[self.rows], clouds_[self.cols]
        self.key, self.key_t = ("yx", "xy") if flip else ("xy", "yx")
        self.fp, self.gp = self._packed_pot(self.f, self.rows), self._packed_pot(self.g, self.cols)
        self.x, self.y = pb.unpack(self.S.x, self.rows), pb.unpack(self.T.x, self.cols)
        self.n, self.m = self.x.shape[1], self.y.shape[1]
        self.eps, self.s = prm[0], prm[1]

    def _packed_pot(self, v: Tensor, side: int) -> Tensor:
        rows = (self.pb.X if side == 0 else self.pb.Y).n
        out = torch.full((rows,), float("-inf"), dtype=F32, device=v.device)  # padding: rows of P are 0
        out[self.pb.ix if side == 0 else self.pb.iy] = v.reshape(-1)
        return out

    def _pack(self, v: Tensor, side: int) -> Tensor:
        return self.pb.pack(v, side, (self.pb.X if side == 0 else self.pb.Y).n)

    def _pass(self, transpose: bool, v, prm=None):
        src, tgt, fs, ft, key = ((self.T, self.S, self.gp, self.fp, self.key_t) if transpose
                                 else (self.S, self.T, self.fp, self.gp, self.key))
        side_src, side_tgt = (self.cols, self.rows) if transpose else (self.rows, self.cols)
        pv, sums = apply_plan_blocksparse(src, tgt, fs, ft, self.prm if prm is None else prm, self.pb.ranges[key],
                                          self.precision, v=None if v is None else self._pack(v, side_tgt))
        return (None if pv is None else self.pb.unpack(pv, side_src)), self.pb.unpack(sums, side_src)

    def apply(self, v):
        return self._pass(False, v)

    def apply_t(self, u):
        return self._pass(True, u)

    def apply_t_sq(self, u):
        half = torch.stack([0.5 * self.prm[0], self.prm[1]])  # P_ij^2 is the plan at eps / 2
        return self._pass(True, u[..., None], half)[0][..., 0]

    def _weighted(self, transpose: bool, w, A, B):
        k, p = w.shape[-1], B.shape[-1]
        if k * p <= OUTER_MAX:  # sum_q w_iq (P (A_q B))_i: one packed pass
            outer = (A[..., :, None] * B[..., None, :]).reshape(A.shape[:-1] + (k * p,))
            pv, _ = self._pass(transpose, outer)
            return (w[..., :, None] * pv.reshape(pv.shape[:-1] + (k, p))).sum(-2)
        out = []
        for b in range(self.f.shape[0]):  # the dense kernel on problem b's own clouds
            x, y = (self.y[b], self.x[b]) if transpose else (self.x[b], self.y[b])
            fs, ft = (self.g[b], self.f[b]) if transpose else (self.f[b], self.g[b])
            S, T = clouds(x, y)
            out.append(apply_weighted(S, T, fs, ft, self.prm, self.precision, w[b], A[b], B[b]))
        return torch.stack(out)

    def weighted(self, w, A, B):
        return self._weighted(False, w, A, B)

    def weighted_t(self, w, A, B):
        return self._weighted(True, w, A, B)

    def transposed(self) -> "PackedPasses":
        return PackedPasses(self.pb, self.g, self.f, self.prm, self.precision, not self.flip)
