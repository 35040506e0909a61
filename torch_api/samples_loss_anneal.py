"""GeomLoss's annealed symmetric Sinkhorn behind ``samples_loss_ops.solve``: one problem, or a
batch of equal-sized problems packed into one launch per softmin.

One problem (:func:`anneal` on its centred clouds, :func:`graphed_anneal` replaying it from a
CUDA graph): the four potentials f_ba, g_ab (the cross problem) and f_aa, g_bb (the debiasing self
problems) are swept together at every eps of the schedule, each sweep the symmetric averaged
update p <- (p + softmin(q)) / 2 with softmin_i(q) = -eps LSE_j((q_j - C_ij)/eps + log w_j), then
one last extrapolation at the final eps.

A batch of B problems x (B, N, D), y (B, M, D) with both marginals strict or both relaxed by the
same reach (:func:`packed_anneal`): the problems are packed as ``torch_api.sinkhorn_batch`` packs
them (``core.batch_layout``: each problem's rows on row-block boundaries, zero-weight padding)
and every softmin is one launch of the block-sparse LSE kernel in which problem k's row blocks
stream only problem k's columns, so a sweep is four launches for the whole batch instead of four
per problem (replayed from one CUDA graph from a batch shape's second call on); the schedule is
the batch's (GeomLoss computes one diameter for the batch). The numbers are each problem's single
solve to float32 rounding (each problem shifted by its own centre before packing).
:class:`PackedBatch` is that packing; ``samples_loss_ops.direction`` uses it too (the gradient's
plan products of a strict batch, one block-sparse pass per plan).
"""

from __future__ import annotations


import torch
from torch import Tensor

from ot_triton_jax.core.unbalanced import self_problems_split, semi_unbalanced_translate

from . import cuda_graphs
from .batch_packing import layout
from .kernel_ops import Cloud, clouds, lse_blocksparse, lse_pair, lse_self
from .label_inputs import pair_clouds
from .sinkhorn_loops import masked_log

__all__ = ["anneal", "graphed_anneal", "packed_anneal", "can_pack", "PackedBatch"]


def can_pack(B: int, rhos: tuple, labels) -> bool:
    """Whether a batch runs packed: more than one problem, no label cost, and both marginals
    strict or both relaxed alike (one relaxed marginal translates each problem by sums of its
    own, which the per-problem solves keep)."""
    rho_x, rho_y = rhos
    return B > 1 and labels is None and rho_x == rho_y


class _Packed:
    """The softmins of a packed batch: ``ranges[key]`` the column ranges of each row block of
    the source cloud in the target cloud (key "xy", "yx", "xx", "yy")."""

    def __init__(self, ranges: dict[str, Tensor], precision: str):
        self.ranges, self.precision = ranges, precision

    def pair(self, key: str, S: Cloud, T: Cloud, f, g, lw_s, lw_t, prm):
        back = key[::-1]
        return (lse_blocksparse(S, T, g, prm, self.ranges[key], self.precision, logw_in=lw_t)[0],
                lse_blocksparse(T, S, f, prm, self.ranges[back], self.precision, logw_in=lw_s)[0])

    def own(self, key: str, S: Cloud, f, lw, prm):
        return lse_blocksparse(S, S, f, prm, self.ranges[key], self.precision, logw_in=lw)[0]


class _Dense:
    def __init__(self, precision: str):
        self.precision = precision

    def pair(self, key, S, T, f, g, lw_s, lw_t, prm):
        return lse_pair(S, T, f, g, lw_s, lw_t, prm, self.precision)

    def own(self, key, S, f, lw, prm):
        return lse_self(S, f, lw, prm, self.precision)


def anneal(X: Cloud, Y: Cloud, la, lb, prms: Tensor, debias: bool, precision: str,
           rhos: tuple = (None, None), packed: _Packed | None = None):
    """(old, new): the four potentials entering the last extrapolation and after it.
    ``prms``: (L, 4) float32, row k the PARAMS [eps_k, S] of the schedule's k-th eps, padded with
    the dampings (damp_x, damp_y) at eps_k, applied to the x (resp. y) potentials where ``rhos``
    (rho_x, rho_y) relaxes that marginal (the kernels read only [eps, S]). With rho_x != rho_y the
    self problems are split: f_aa = [p_a, q_a], g_bb = [p_b, q_b] (module docstring); with exactly
    one relaxed marginal every problem is translated after each update
    (``unbalanced.semi_unbalanced_translate``). No host read: on the GPU the whole anneal is one
    CUDA graph (``solve``). ``packed``: the softmins of a packed batch (:func:`packed_anneal`)."""
    rho_x, rho_y = rhos
    soft = packed or _Dense(precision)
    split = debias and self_problems_split(rho_x, rho_y)

    def damp(t, side, prm):
        return t if rhos[side] is None else prm[2 + side] * t

    def self_split(key, Sc, pq, lw, prm):  # p <- softmin(q) damped with rho_x, q <- softmin(p) with rho_y
        p, q = soft.pair(key, Sc, Sc, pq[:Sc.n], pq[Sc.n:], lw, lw, prm)
        return torch.cat((damp(p, 0, prm), damp(q, 1, prm)))

    def sweep(pots, prm):
        f_ba, g_ab, f_aa, g_bb = pots
        f, g = soft.pair("xy", X, Y, f_ba, g_ab, la, lb, prm)
        out = [damp(f, 0, prm), damp(g, 1, prm), None, None]
        if split:
            out[2], out[3] = self_split("xx", X, f_aa, la, prm), self_split("yy", Y, g_bb, lb, prm)
        elif debias:
            out[2] = damp(soft.own("xx", X, f_aa, la, prm), 0, prm)
            out[3] = damp(soft.own("yy", Y, g_bb, lb, prm), 1, prm)
        return tuple(out)

    def translate(pots):
        if (rho_x is None) == (rho_y is None):
            return pots
        f_ba, g_ab, f_aa, g_bb = pots
        out = list(semi_unbalanced_translate(torch, f_ba, g_ab, la, lb, rho_x, rho_y))
        for Sc, pq, lw in ((X, f_aa, la), (Y, g_bb, lb)) if debias else ():
            out.append(torch.cat(semi_unbalanced_translate(torch, pq[:Sc.n], pq[Sc.n:], lw, lw, rho_x, rho_y)))
        return tuple(out) if debias else tuple(out) + (None, None)

    dev = X.x.device
    k = 2 if split else 1
    zx, zy = (torch.zeros(c.n, dtype=torch.float32, device=dev) for c in (X, Y))
    zsx, zsy = (torch.zeros(k * c.n, dtype=torch.float32, device=dev) for c in (X, Y))
    pots = translate(sweep((zx, zy, zsx, zsy), prms[0]))
    for i in range(prms.shape[0]):
        new = sweep(pots, prms[i])
        pots = translate(tuple(None if p is None else 0.5 * (p + q) for p, q in zip(pots, new)))
    return pots, translate(sweep(pots, prms[-1]))


def graphed_anneal(x: Tensor, y: Tensor, la, lb, prms: Tensor, debias: bool, precision: str,
                    rhos: tuple = (None, None), labels: tuple | None = None):
    """:func:`anneal` on the points x, y (centred here, ``kernel_ops.clouds``), replayed
    from one CUDA graph per (shapes, schedule length) from the second solve on
    (``torch_api.cuda_graphs``; eager otherwise). The potentials returned by a replay are
    rewritten by the next one: the caller copies them out. ``labels`` (lx, ly, W): labelled
    clouds (the labels and the table static inputs of the graph, as the points)."""
    x, y = (p.detach().to(torch.float32).contiguous() for p in (x, y))
    statics = {"x": x, "y": y, "la": la, "lb": lb, "prms": prms}
    key = ("samples_loss", x.shape[0], y.shape[0], x.shape[1], prms.shape[0], debias, precision) + tuple(rhos)
    if labels is not None:
        statics.update(zip(("lx", "ly", "lw"), (v.detach() for v in labels)))
        key += ("labels", tuple(labels[2].shape), labels[2].dtype, labels[0].dtype, labels[1].dtype)
    graphs = cuda_graphs.graph_set(key, x.device, x.shape[0] * y.shape[0], statics)

    def body(s):
        X, Y = pair_clouds(s["x"], s["y"], *((s["lx"], s["ly"], s["lw"]) if labels is not None else (None,) * 3))
        return anneal(X, Y, s["la"], s["lb"], s["prms"], debias, precision, rhos)

    if graphs is None:
        return body(statics)
    graphs.load(statics)

    return graphs.run("anneal", body)




class PackedBatch:
    """B equal-sized problems x (B, N, D), y (B, M, D), a (B, N), b (B, M) packed as
    ``core.batch_layout`` lays them out: the packed centred clouds ``X``, ``Y``, log weights
    ``la``, ``lb`` (-inf on zero weights and padding), the packed rows of each problem's points
    (``ix``, ``iy``) and the block-sparse column ranges ``ranges[key]`` (key "xy", "yx", "xx", "yy":
    source then target cloud)."""

    def __init__(self, xs: Tensor, ys: Tensor, as_: Tensor, bs: Tensor, precision: str):
        self.B, self.n, d = xs.shape
        self.m = ys.shape[1]
        self.ix, self.iy, rows_x, rows_y, self.ranges = _layout(self.B, self.n, self.m, d, precision, xs.device)
        # each problem shifted by its own centre (its cost is unchanged): a shared centre would
        # leave far-apart problems' points large and cost float32 digits in |x|^2 + |y|^2 - 2 x.y
        xs, ys = (p.detach().to(torch.float32) for p in (xs, ys))
        c = torch.cat((xs, ys), 1).mean(1, keepdim=True)
        self.X, self.Y = clouds(self.pack(xs - c, 0, rows_x), self.pack(ys - c, 1, rows_y))
        self.la, self.lb = masked_log(self.pack(as_, 0, rows_x)), masked_log(self.pack(bs, 1, rows_y))

    def pack(self, v: Tensor, side: int, rows: int) -> Tensor:
        out = torch.zeros((rows,) + tuple(v.shape[2:]), dtype=torch.float32, device=v.device)
        out[self.ix if side == 0 else self.iy] = v.detach().to(torch.float32).reshape((-1,) + tuple(v.shape[2:]))
        return out

    def unpack(self, v: Tensor, side: int) -> Tensor:
        """Packed rows of side 0 (x) or 1 (y) -> (B, N, ...) / (B, M, ...)."""
        index, size = (self.ix, self.n) if side == 0 else (self.iy, self.m)
        return v[index].view((self.B, size) + tuple(v.shape[1:]))

    def packed_pot(self, v: Tensor, side: int) -> Tensor:
        """Stacked potentials (B, N) or (B, M) -> packed rows (padding: 0, weightless)."""
        return self.pack(v, side, (self.X if side == 0 else self.Y).n)


def packed_anneal(xs: Tensor, ys: Tensor, as_: Tensor, bs: Tensor, prms: Tensor, debias: bool, precision: str,
                  rhos: tuple = (None, None)) -> tuple[tuple, tuple]:
    """:func:`anneal` of the B problems (xs[k], ys[k], as_[k], bs[k]) at once (module docstring;
    :func:`can_pack` says when): (old, new), each the four potentials stacked per problem, f_ba
    and f_aa (B, N), g_ab and g_bb (B, M) (None without debias). Four launches per sweep for the
    batch; from a batch shape's second call on, the packing and the whole anneal replay from one
    CUDA graph (``torch_api.cuda_graphs``, as :func:`graphed_anneal`), eager otherwise."""
    (B, n, d), m = xs.shape, ys.shape[1]
    statics = {k: v.detach().to(torch.float32).contiguous()
               for k, v in (("x", xs), ("y", ys), ("a", as_), ("b", bs), ("prms", prms))}
    ix, iy = _layout(B, n, m, d, precision, xs.device)[:2]  # its host work and copies: never in a capture
    graphs = cuda_graphs.graph_set(("samples_loss_packed", B, n, m, d, prms.shape[0], debias, precision) + tuple(rhos),
                                   xs.device, B * n * m, statics)

    def body(s):
        pb = PackedBatch(s["x"], s["y"], s["a"], s["b"], precision)
        old, new = anneal(pb.X, pb.Y, pb.la, pb.lb, s["prms"], debias, precision, rhos, _Packed(pb.ranges, precision))
        return tuple(old) + tuple(new)

    if graphs is None:
        pots = body(statics)
    else:
        graphs.load(statics)
        pots = graphs.run("packed_anneal", body)  # graph outputs: the gathers below copy them out

    def unpack(p, side: int):
        return None if p is None else p[ix if side == 0 else iy].view(B, n if side == 0 else m)
    pots = tuple(unpack(p, side) for p, side in zip(pots, (0, 1, 0, 1) * 2))
    return pots[:4], pots[4:]


def _layout(B: int, n: int, m: int, d: int, precision: str, device: torch.device) -> tuple:
    """(ix, iy, rows of packed x, rows of packed y, ranges) of a batch shape (``PackedBatch``), from
    the cached layouts of ``torch_api.batch_packing`` (the cross pair's and the self pairs')."""
    cross = layout((n,) * B, (m,) * B, d, precision, device)
    xx, yy = (layout((k,) * B, (k,) * B, d, precision, device) for k in (n, m))
    ranges = {"xy": cross.rx, "yx": cross.ry, "xx": xx.rx, "yy": yy.rx}
    return cross.ix, cross.iy, cross.lx.rows, cross.ly.rows, ranges
