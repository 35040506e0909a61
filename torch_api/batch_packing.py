"""Packing a batch of OTT-convention problems for the block-sparse kernels, on the device.

``core.batch_layout`` says where each problem's rows sit in the packed clouds (row-block
boundaries, zero-weight padding). This module builds the device side of that plan once per
batch shape (:func:`layout`: the problem of every packed row, the packed row of every point,
the column ranges of every row block; cached, never written) and packs the points and weights
of one call:

* a dense batch, x (B, n, d), y (B, m, d), a (B, n), b (B, m) (:func:`pack_dense`): every
  problem has the same padded stride, so packing is a pad and a reshape and unpacking a view,
  with no work per problem on the host;
* a ragged batch, concatenated clouds and the problems' sizes (:func:`pack_concat`; OTT's
  segments, or a sequence of problems concatenated): one scatter into the packed rows.

Each problem is shifted by the mean of its own x and y (its cost |x - y|^2 is unchanged): a
centre shared by the batch would leave far-apart problems' points large and cost float32 digits
in |x|^2 + |y|^2 - 2 x.y. The means are float64 sums (a dense batch: one reduction along the
points; a ragged one: differences of prefix sums), deterministic, so that a CUDA-graph replay
of the solve repeats the eager call bit for bit.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from ot_triton_jax.core import batch_layout, multiscale_plans, runtime

from .batched_loop import segment_sum
from .sinkhorn_loops import _initial, masked_log

__all__ = ["Layout", "layout", "pack_dense", "pack_concat", "Packed"]


@dataclass(frozen=True)
class Layout:
    """The device side of a batch shape's packing (``core.batch_layout``). ``seg_x`` / ``seg_y``
    (rows,) int64: the problem of each packed row, -1 on padding; ``rows_x`` / ``rows_y`` the same
    clamped at 0 (a gather index); ``ix`` / ``iy`` (sum n_k,): the packed row of each point,
    problems in order; ``px`` / ``py`` (sum n_k,): the problem of each point; ``nx`` / ``ny`` (B,):
    the sizes; ``rx`` / ``ry``: the column ranges of each row block in the other cloud; ``bx`` / ``by``:
    the problem of each row block (``batch_layout.block_problems``)."""

    lx: batch_layout.CloudLayout
    ly: batch_layout.CloudLayout
    seg_x: Tensor
    seg_y: Tensor
    rows_x: Tensor
    rows_y: Tensor
    ix: Tensor
    iy: Tensor
    px: Tensor
    py: Tensor
    nx: Tensor
    ny: Tensor
    rx: Tensor
    ry: Tensor
    bx: Tensor
    by: Tensor

    @property
    def B(self) -> int:
        return len(self.lx.sizes)


@functools.lru_cache(maxsize=16)
def layout(sizes_x: tuple[int, ...], sizes_y: tuple[int, ...], d: int, precision: str,
           device: torch.device) -> Layout:
    """The :class:`Layout` of a batch shape, built on the host and copied to ``device`` once
    per shape (the tensors are shared by every call of that shape: nobody writes them)."""
    block = multiscale_plans.blocksparse_block_m(d, precision, runtime.on_gpu())
    lx, ly = batch_layout.cloud_layout(sizes_x, block), batch_layout.cloud_layout(sizes_y, block)
    seg_x, seg_y = (torch.as_tensor(lay.segment, device=device, dtype=torch.int64) for lay in (lx, ly))
    ix, iy = (torch.as_tensor(lay.index, device=device) for lay in (lx, ly))
    nx, ny = (torch.as_tensor(lay.sizes, device=device, dtype=torch.int64) for lay in (lx, ly))
    px, py = (torch.repeat_interleave(torch.arange(len(sizes_x), device=device), k) for k in (nx, ny))
    rx = torch.as_tensor(batch_layout.column_ranges(lx, ly), device=device)
    ry = torch.as_tensor(batch_layout.column_ranges(ly, lx), device=device)
    bx, by = (torch.as_tensor(batch_layout.block_problems(lay), device=device, dtype=torch.int64) for lay in (lx, ly))
    return Layout(lx, ly, seg_x, seg_y, seg_x.clamp_min(0), seg_y.clamp_min(0), ix, iy, px, py, nx, ny, rx, ry,
                  bx, by)


@dataclass
class Packed:
    """One call's packed batch: centred points ``x``, ``y`` (rows, d) float32 (0 on padding),
    weights ``a``, ``b`` (rows,) float32 (0 on padding), their logs ``la``, ``lb`` (-inf on zero
    weights and padding) and the loop's starting potentials ``f0``, ``g0`` (0, -inf where the
    weight is zero), its :class:`Layout`, whether both weights are the default uniform ones
    (equal masses by construction; then the weights' tensors are shared by the calls of the
    shape and never written) and whether the batch is dense (equal sizes)."""

    x: Tensor
    y: Tensor
    a: Tensor
    b: Tensor
    la: Tensor
    lb: Tensor
    f0: Tensor
    g0: Tensor
    lay: Layout
    uniform: bool
    dense: bool

    def sums(self, v: Tensor, side: int) -> Tensor:
        """(B,) sums per problem of packed rows ``v`` of side 0 (x) or 1 (y), zero on padding."""
        if self.dense:
            return v.view(self.lay.B, -1).sum(1)
        return segment_sum(v, self.lay.seg_x if side == 0 else self.lay.seg_y, self.lay.B)

    def unpack(self, v: Tensor, side: int) -> list[Tensor]:
        """Packed rows of side 0 (x) or 1 (y) -> the problems' pieces (views, in order)."""
        cl = self.lay.lx if side == 0 else self.lay.ly
        if self.dense:
            return list(v.view(self.lay.B, cl.rows // self.lay.B)[:, :cl.sizes[0]].unbind(0))
        return [v[o:o + s] for o, s in zip(cl.offsets, cl.sizes)]

    def gather(self, rows: Tensor, side: int, shape: torch.Size) -> Tensor:
        """Packed rows (rows, ...) -> the points' order, reshaped to the input's ``shape``."""
        return rows[self.lay.ix if side == 0 else self.lay.iy].reshape(shape)


def _strided(t: Tensor, stride: int) -> Tensor:
    """(B, n, ...) -> (B * stride, ...): each problem's rows, then zero rows up to ``stride``."""
    B, n = t.shape[:2]
    if n == stride:
        return t.reshape((B * n,) + tuple(t.shape[2:]))
    out = t.new_zeros((B, stride) + tuple(t.shape[2:]))
    out[:, :n] = t
    return out.reshape((B * stride,) + tuple(t.shape[2:]))


def _logs(a: Tensor, b: Tensor) -> tuple[Tensor, ...]:
    la, lb = masked_log(a), masked_log(b)
    return a, b, la, lb, _initial(la), _initial(lb)


@functools.lru_cache(maxsize=16)
def _uniform(B: int, n: int, m: int, sx: int, sy: int, device: torch.device) -> tuple[Tensor, ...]:
    """The packed default weights 1/n, 1/m of a dense batch shape with their logs and starting
    potentials (:func:`_logs`), made once per shape (nobody writes them)."""
    a, b = (_strided(torch.full((B, k), 1.0 / k, dtype=torch.float32, device=device), s)
            for k, s in ((n, sx), (m, sy)))
    return _logs(a, b)


def pack_dense(xs: Tensor, ys: Tensor, as_: Tensor | None, bs: Tensor | None, precision: str) -> Packed:
    """Pack x (B, n, d), y (B, m, d) and weights (B, n), (B, m) (None: uniform 1/n, 1/m)."""
    (B, n, d), m = xs.shape, ys.shape[1]
    lay = layout((n,) * B, (m,) * B, d, precision, xs.device)
    x32, y32 = (p.detach().to(torch.float32) for p in (xs, ys))
    c = ((x32.double().sum(1) + y32.double().sum(1)) / (n + m)).to(torch.float32)[:, None]
    sx, sy = lay.lx.rows // B, lay.ly.rows // B
    uniform = as_ is None and bs is None
    if uniform:
        weights = _uniform(B, n, m, sx, sy, xs.device)
    else:
        weights = _logs(*(_strided(torch.full((B, k), 1.0 / k, dtype=torch.float32, device=xs.device)
                                   if w is None else w.detach().to(torch.float32), s)
                          for w, k, s in ((as_, n, sx), (bs, m, sy))))
    return Packed(_strided(x32 - c, sx), _strided(y32 - c, sy), *weights, lay, uniform, True)


def _scatter(v: Tensor, rows: int, index: Tensor) -> Tensor:
    out = torch.zeros((rows,) + tuple(v.shape[1:]), dtype=torch.float32, device=index.device)
    out[index] = v.detach().to(torch.float32)
    return out


def pack_concat(x: Tensor, y: Tensor, a: Tensor | None, b: Tensor | None, sizes_x, sizes_y,
                precision: str) -> Packed:
    """Pack problems given as concatenated clouds x (sum n_k, d), y (sum m_k, d) with their
    sizes (OTT's segments, or a sequence of problems concatenated) and concatenated weights
    (None: uniform 1/n_k within each problem)."""
    d, dev = x.shape[1], x.device
    lay = layout(tuple(int(k) for k in sizes_x), tuple(int(k) for k in sizes_y), d, precision, dev)
    pts, sums = [], 0.0
    for p, k in ((x, lay.nx), (y, lay.ny)):
        cat = p.detach().to(torch.float32)
        # scanned along the inner axis of the (d, points) transpose: a scan along dim 0 of a tall
        # (points, d) tensor runs one sequential thread per column on CUDA (~1 us per point)
        scan = cat.double().t().cumsum(1)
        prefix = torch.cat((scan.new_zeros((scan.shape[0], 1)), scan), 1)
        ends = k.cumsum(0)
        sums = sums + (prefix[:, ends] - prefix[:, ends - k]).t()
        pts.append(cat)
    c = (sums / (lay.nx + lay.ny).double()[:, None]).to(torch.float32)
    wa, wb = ((1.0 / k.to(torch.float32))[seg] if w is None else w
              for w, k, seg in ((a, lay.nx, lay.px), (b, lay.ny, lay.py)))
    weights = _logs(_scatter(wa, lay.lx.rows, lay.ix), _scatter(wb, lay.ly.rows, lay.iy))
    return Packed(_scatter(pts[0] - c[lay.px], lay.lx.rows, lay.ix), _scatter(pts[1] - c[lay.py], lay.ly.rows, lay.iy),
                  *weights, lay, a is None and b is None, False)
