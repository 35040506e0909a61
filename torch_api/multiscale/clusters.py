"""Voxel clustering and block lists for the multiscale solve (torch; rules in
``ot_triton_jax.core.multiscale_rules``).

Everything stays on the clouds' device and nothing n x m is formed: the clusters are sorted
voxels (one argsort per cloud), the truncation mask is cluster x cluster (the coarse problem's
size, ``bounds``) and the block-sparse kernels get each row block's runs of kept
columns (``kept_ranges``, built by a kernel from the cluster mask; ``row_block_mask`` and
``column_ranges`` build the same in torch through a (cdiv(n, BLOCK_M), K_y) mask, for the HVP's
block-rectangle plans).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ot_triton_jax.core import multiscale_calls, multiscale_rules as rules, runtime

from ..kernel_ops import run


@dataclass(frozen=True)
class Clusters:
    """One cloud sorted by voxel.

    ``perm``: sorted position -> original index (points_sorted = points[perm]);
    ``label``: the cluster of each sorted point (non-decreasing, 0..K-1);
    ``start``: int32 (K + 1,), cluster k holds sorted points [start[k], start[k+1]);
    ``weight``: (K,) summed weights; ``centroid``: (K, d) weighted means (plain means where a
    cluster's weight is 0); ``radius``: (K,) the largest distance of a member to its centroid.
    """

    perm: torch.Tensor
    label: torch.Tensor
    start: torch.Tensor
    weight: torch.Tensor
    centroid: torch.Tensor
    radius: torch.Tensor

    @property
    def k(self) -> int:
        return self.weight.shape[0]


def voxel_ids(points: torch.Tensor, lower: torch.Tensor, cluster_scale: float, shape: tuple[int, ...]) -> torch.Tensor:
    """Linear voxel index of every point (row-major over ``shape``) on the grid anchored at ``lower``."""
    cells = torch.floor((points.double() - lower.double()) / cluster_scale).long()
    cells = torch.minimum(cells.clamp_min(0), torch.tensor(shape, device=points.device) - 1)
    ids = cells[:, 0]
    for axis in range(1, points.shape[1]):
        ids = ids * shape[axis] + cells[:, axis]
    return ids


def cluster(points: torch.Tensor, weights: torch.Tensor, lower: torch.Tensor, cluster_scale: float,
            shape: tuple[int, ...]) -> Clusters:
    """Sort one cloud by voxel and reduce each occupied voxel to a weighted centroid."""
    ids = voxel_ids(points, lower, cluster_scale, shape)
    ids_sorted, perm = torch.sort(ids, stable=True)
    _, label, counts = torch.unique_consecutive(ids_sorted, return_inverse=True, return_counts=True)
    k = counts.shape[0]
    start = torch.zeros(k + 1, dtype=torch.int32, device=points.device)
    start[1:] = torch.cumsum(counts, 0).to(torch.int32)
    pts, w = points[perm].double(), weights[perm].double()
    weight = torch.zeros(k, dtype=torch.float64, device=points.device).index_add_(0, label, w)
    wsum = torch.zeros_like(pts[:k]).index_add_(0, label, w[:, None] * pts)
    plain = torch.zeros_like(pts[:k]).index_add_(0, label, pts) / counts[:, None].double()
    centroid = torch.where(weight[:, None] > 0, wsum / weight.clamp_min(torch.finfo(torch.float64).tiny)[:, None],
                           plain)
    dist = (pts - centroid[label]).norm(dim=1)
    radius = torch.zeros(k, dtype=torch.float64, device=points.device).scatter_reduce_(
        0, label, dist, reduce="amax", include_self=True)
    dt = points.dtype
    return Clusters(perm=perm, label=label, start=start, weight=weight.to(dt), centroid=centroid.to(dt),
                    radius=radius.to(dt))


def cluster_pair(x: torch.Tensor, a: torch.Tensor, y: torch.Tensor, b: torch.Tensor,
                 cluster_scale: float) -> tuple[Clusters, Clusters]:
    """Both clouds on one grid of side ``cluster_scale`` over their joint bounding box (one host
    read: the box's extent, which sizes the grid)."""
    rules.check_dim(x.shape[1])
    both = torch.cat([x, y])
    lower, upper = both.min(0).values, both.max(0).values
    shape = rules.grid_shape((upper - lower).double().tolist(), cluster_scale)
    return cluster(x, a, lower, cluster_scale, shape), cluster(y, b, lower, cluster_scale, shape)


def occupied_cells(x: torch.Tensor, y: torch.Tensor, cluster_scale: float) -> float:
    """The larger of the two clouds' occupied voxel counts on :func:`cluster_pair`'s grid of side
    ``cluster_scale`` (one host read; +inf when the grid would be too fine to build)."""
    both = torch.cat([x.detach(), y.detach()])
    lower, upper = both.min(0).values, both.max(0).values
    try:
        shape = rules.grid_shape((upper - lower).double().tolist(), cluster_scale)
    except ValueError:
        return float("inf")
    counts = [torch.unique(voxel_ids(p.detach(), lower, cluster_scale, shape)).numel() for p in (x, y)]
    return float(max(counts))


def row_block_mask(keep: torch.Tensor, label: torch.Tensor, block_m: int) -> torch.Tensor:
    """int8 (cdiv(n, block_m), K_y): row block b keeps the union of the kept columns of the
    clusters its sorted rows belong to (contiguous, since rows are sorted by cluster): one
    gather of keep rows per cluster a block spans beyond its first (one host read: the span)."""
    n = label.shape[0]
    first = label[::block_m]
    last = label[torch.clamp(torch.arange(block_m - 1, n + block_m - 1, block_m, device=label.device), max=n - 1)]
    keep = keep.bool()
    mask = keep[first]
    for t in range(1, int((last - first).max()) + 1 if n else 1):
        mask |= keep[torch.minimum(first + t, last)]
    return mask.view(torch.int8)


def column_ranges(mask: torch.Tensor, col_start: torch.Tensor) -> torch.Tensor:
    """int32 (rows, R, 2) column runs of a (rows, K_y) cluster mask: each maximal run of
    consecutive kept clusters c0..c1 of a row becomes [col_start[c0], col_start[c1 + 1]), so the
    block-sparse kernels stream long contiguous ranges; rows with fewer than R runs are padded
    with empty ranges [0, 0). R >= 1 (one host read: the largest run count)."""
    keep = mask.bool()
    rows = keep.shape[0]
    off = torch.zeros(rows, 1, dtype=torch.bool, device=keep.device)
    first = keep & ~torch.cat([off, keep[:, :-1]], 1)
    last = keep & ~torch.cat([keep[:, 1:], off], 1)
    runs = first.sum(1)
    r = max(1, int(runs.max())) if rows else 1
    out = torch.zeros(rows, r, 2, dtype=torch.int32, device=keep.device)
    bf, cf = first.nonzero(as_tuple=True)
    bl, cl = last.nonzero(as_tuple=True)
    rank = torch.arange(bf.shape[0], device=keep.device) - (torch.cumsum(runs, 0) - runs)[bf]
    starts = col_start.to(torch.int32)
    out[bf, rank, 0] = starts[cf]
    out[bl, rank, 1] = starts[cl + 1]
    return out


def kept_ranges(keep: torch.Tensor, label: torch.Tensor, block_m: int, col_start: torch.Tensor) -> torch.Tensor:
    """:func:`column_ranges` of :func:`row_block_mask` (the same int32 (cdiv(n, block_m), R, 2)
    ranges) without forming the (row blocks, K_y) mask: kernels/block_ranges.py reads the keep
    rows of the clusters each row block spans, counts its runs, then (one host read: the largest
    count) writes them."""
    return kept_ranges_many([(keep, label, block_m, col_start)])[0]


def kept_ranges_many(masks: list) -> list:
    """:func:`kept_ranges` of several (keep, label, block_m, col_start), with one host read (their
    largest run counts) for all."""
    gpu, staged = runtime.on_gpu(), []
    for keep, label, block_m, col_start in masks:
        n, kc = label.shape[0], keep.shape[1]
        blocks = -(-n // block_m)
        ends = torch.clamp(torch.arange(block_m - 1, n + block_m - 1, block_m, device=label.device), max=n - 1)
        span = torch.stack([label[::block_m], label[ends]], 1).to(torch.int32).contiguous()
        arrays = {"keep": keep.contiguous().view(torch.int8), "span": span,
                  "col_start": col_start.to(torch.int32).contiguous()}
        (runs,) = run(multiscale_calls.block_run_counts(blocks, kc, gpu), arrays, keep.device)
        staged.append((blocks, kc, arrays, keep.device, runs.max() if blocks else runs.new_ones(())))
    tops = torch.stack([t[-1].reshape(()) for t in staged]).tolist() if staged else []
    out = []
    for (blocks, kc, arrays, dev, _), top in zip(staged, tops):
        (ranges,) = run(multiscale_calls.block_run_ranges(blocks, kc, max(1, int(top)), gpu), arrays, dev)
        out.append(ranges)
    return out


def mask_lists(keep: torch.Tensor, with_rows: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The k-major pair list of a (K_r, K_c) cluster mask (:func:`mask_lists_many` of one mask)."""
    return mask_lists_many([keep], [with_rows])[0]


def mask_lists_many(keeps: list, with_rows: list) -> list:
    """The k-major pair lists of several cluster masks (kernels/mask_lists.py: row counts, their
    prefix sums, then each row's kept columns in place; one host read for all of them, the
    offsets): per mask (``lptr`` int64 (K_r + 1,) on the device, ``lidx`` int32 (the kept columns of
    row k in ``lidx[lptr[k]:lptr[k + 1]]``, increasing), ``rows`` int32 (each pair's row, where
    ``with_rows`` says; else None), ``lptr_host`` (lptr on the CPU))."""
    gpu = runtime.on_gpu()
    lptrs, arrays = [], []
    for keep in keeps:
        kr, kc = keep.shape
        arr = {"keep": keep.contiguous().view(torch.int8)}
        (counts,) = run(multiscale_calls.mask_row_counts(kr, kc, gpu), arr, keep.device)
        lptr = torch.zeros(kr + 1, dtype=torch.int64, device=keep.device)
        torch.cumsum(counts, 0, out=lptr[1:])
        lptrs.append(lptr)
        arrays.append(arr)
    host = torch.cat(lptrs).cpu().split([lp.shape[0] for lp in lptrs]) if keeps else ()
    out = []
    for keep, rows, lptr, lptr_host, arr in zip(keeps, with_rows, lptrs, host, arrays):
        kr, kc = keep.shape
        pairs, dev = int(lptr_host[-1]), keep.device
        lidx = torch.empty(pairs, dtype=torch.int32, device=dev)
        rowid = torch.empty(pairs, dtype=torch.int32, device=dev) if rows else None
        # without rows, lidx stands in for them (not written; an int32 array, as the prewarm's stand-in)
        arr.update(lptr=lptr, lidx=lidx, rowid=lidx if rowid is None else rowid)
        run(multiscale_calls.mask_row_lists(kr, kc, gpu, rows), arr, dev)
        out.append((lptr, lidx, rowid, lptr_host))
    return out


def kept_lists(keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The k-major pair list of a (K_r, K_c) cluster mask: int32 offsets ``lptr`` (K_r + 1,) into
    int32 ``lidx``, the kept columns of row k in ``lidx[lptr[k]:lptr[k + 1]]`` (increasing)."""
    return kept_lists_many([keep])[0]


def kept_lists_many(keeps: list) -> list:
    """:func:`kept_lists` of several masks (None entries give None), with one host read."""
    real = [k for k in keeps if k is not None]
    lists = iter(mask_lists_many(real, [False] * len(real)))
    out = []
    for k in keeps:
        if k is None:
            out.append(None)
        else:
            lptr, lidx, _, _ = next(lists)
            out.append((lptr.to(torch.int32), lidx))
    return out


def block_starts(n: int, block_m: int, device) -> torch.Tensor:
    """int32 (cdiv(n, block_m) + 1,): the first sorted index of every row block, and n."""
    return torch.clamp(torch.arange(0, n + block_m, block_m, device=device), max=n)[: -(-n // block_m) + 1].to(torch.int32)


def block_pair_ranges(keep: torch.Tensor, label_x: torch.Tensor, label_y: torch.Tensor,
                      block_m: int, chunk: int = 4096) -> tuple[torch.Tensor, torch.Tensor]:
    """Column ranges of one pair set, for both directions: (x-block I, y-block J) is kept iff a
    kept cluster pair (keep (K_x, K_y)) has its x cluster in I and its y cluster in J. Returns
    (ranges of the x row blocks over y, ranges of the y row blocks over x): the kernels' P and
    P^T are then exact transposes (the HVP's CG needs a symmetric operator; the sweeps'
    ranges, each built from its own side's row blocks, are not). The block mask is formed
    ``chunk`` blocks at a time (at most chunk x cdiv(n or m, block_m) int8)."""
    n, m = label_x.shape[0], label_y.shape[0]
    per_x_block = row_block_mask(keep, label_x, block_m)  # (x blocks, K_y)
    per_y_block = row_block_mask(keep.t().contiguous(), label_y, block_m)  # (y blocks, K_x)
    sx, sy = block_starts(n, block_m, keep.device), block_starts(m, block_m, keep.device)

    def ranges(per_block, other_label, other_starts):
        # rows: blocks of one side; columns: the other side's blocks touching a kept cluster
        parts = [column_ranges(row_block_mask(per_block[i:i + chunk].t().contiguous(), other_label,
                                              block_m).t().contiguous(), other_starts)
                 for i in range(0, per_block.shape[0], chunk)]
        r = max(p.shape[1] for p in parts)
        return torch.cat([torch.nn.functional.pad(p, (0, 0, 0, r - p.shape[1])) for p in parts])

    return ranges(per_x_block, label_y, sy), ranges(per_y_block, label_x, sx)
