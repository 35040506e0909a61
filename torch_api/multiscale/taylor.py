"""The multiscale solve's Taylor pass (torch host side of kernels/taylor_blocksparse.py).

One block-sparse LSE update f_i <- f_i - eps log r_i over the kept cluster pairs, with r_i the row
sums of the plan at the previous potential, computed through the Taylor expansion of exp(<u, v> /
eps) inside each kept pair (the kernels' docstring states the math and the error bound). It is
used in place of the direct pass (lse_blocksparse with FOLD) when ``MODE`` allows it:

* "auto" (the default): when both sides of the plan hold at least multiscale_rules.TAYLOR_MIN_POINTS
  points per cluster on average (TAYLOR_MEAN_MIN_POINTS where the pass gives the gradient's softmin
  mean too: where it is faster) and on the GPU;
* "always": whenever an order's bound allows it (tests); "never": not at all (A/B benchmarks).

The order: :func:`order`, the cheapest of multiscale_rules.TAYLOR_ORDERS whose worst-case relative
error per pair weight, taylor_bound(max r_k * max r_l / eps), is within multiscale_rules.taylor_limit
of the solve's tolerance (a quarter of it). Whatever the mode, the caller runs the direct pass when
no order qualifies, and the pass declines (returns None) when some r_i leaves [2^-60, 2^100] (an old
potential too far off for the unshifted sum; the direct pass then rescales).

With ``truncate=None`` (every block kept) the solve takes the direct pass: the pair lists of all
K_x K_y cluster pairs would take gigabytes.

What it streams: every point pair of every kept cluster pair (k, l) of the mask, exactly the
mask's plan; the direct kernels stream, per row block of sorted rows, the union of its clusters'
kept columns (a superset). Both are truncations of the same plan whose dropped mass the solve's
bound covers (multiscale_rules).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ot_triton_jax.core import multiscale_calls, multiscale_rules as rules, runtime

from ..kernel_ops import run
from .clusters import mask_lists_many

MODE = "auto"
# bytes of moments per chunk of kept cluster pairs (M's FP16 head and tail, 4 R bytes per pair): 2^21 pairs
# at R = 128, 2^22 at R = 64 (2^20 at order 5: 5 chunks instead of 10, the call 114.5 ms against 121.8
# on the H100)
CHUNK_BYTES = 1 << 30
_RANGE = (2.0 ** -60, 2.0 ** 100)


def box_centers(pts: Tensor, labels: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The expansion's centres of a sorted cloud's ``k`` clusters: the midpoints of their bounding
    boxes (float32 (k, d)), and the largest distance of a point from its centre (a float64 0-d
    device tensor). Any centre makes the series exact in the limit; the box's midpoint keeps every
    radius within half the box's diagonal (half a voxel's diagonal, whatever the points), where the
    mean leaves a lone far point of a cluster further out (t = r_k r_l / eps decides the order)."""
    d, lab = pts.shape[1], labels.long()
    p64, idx = pts.double(), labels.long()[:, None].expand(-1, pts.shape[1])
    lo = torch.full((k, d), float("inf"), dtype=torch.float64, device=pts.device).scatter_reduce_(0, idx, p64, "amin")
    hi = torch.full((k, d), float("-inf"), dtype=torch.float64, device=pts.device).scatter_reduce_(0, idx, p64, "amax")
    centers = torch.where(torch.isfinite(lo), 0.5 * (lo + hi), 0.0).float().contiguous()  # empty clusters: 0
    radius = (p64 - centers.double()[lab]).norm(dim=1).max() if pts.shape[0] else torch.zeros((), dtype=torch.float64)
    return centers, radius


class TaylorSide:
    """One sorted cloud as the Taylor pass reads it: float32 points ``pts`` (the solve's centred
    cloud), int32 ``labels`` and ``start``, float32 cluster centres ``centers`` (K, d; box_centers),
    the largest distance of a point from its cluster's centre ``max_radius``, and the monomials per
    (eps, order)."""

    def __init__(self, pts: Tensor, labels: Tensor, start: Tensor):
        self.pts, self.start = pts.contiguous(), start.to(torch.int32).contiguous()
        self.labels = labels.to(torch.int32).contiguous()
        k = self.start.numel() - 1
        # the radius around the float32 centre the kernels subtract, and the cluster offsets (read on
        # the host at first use: settle_radii reads several sides' at once)
        self.centers, radius = box_centers(self.pts, labels, k)
        self._radius = radius if pts.shape[0] else None
        self._max_radius: float | None = None if pts.shape[0] else 0.0
        self._start_host: Tensor | None = None if pts.shape[0] else torch.zeros(k + 1, dtype=torch.int64)
        self.points_per_cluster = pts.shape[0] / max(k, 1)
        self._phi: dict = {}

    @property
    def max_radius(self) -> float:
        if self._max_radius is None:
            settle_radii(self)
        return self._max_radius

    @property
    def start_host(self) -> Tensor:
        """``start`` on the host, int64 (the mean's monomials are made per chunk of row clusters)."""
        if self._start_host is None:
            settle_radii(self)
        return self._start_host

    @property
    def k(self) -> int:
        return self.start.numel() - 1

    def monomials(self, prm: Tensor, eps: float, p: int) -> tuple[Tensor, Tensor]:
        """phi of order ``p`` at ``eps`` (FP16 heads and tails), kept for the next pass at the same pair."""
        if (eps, p) not in self._phi:
            self._phi.clear()  # one (eps, order) at a time (the solve's sweeps go down the schedule)
            d = self.pts.shape[1]
            alpha = _table("alpha", d, p, self.pts.device)
            self._phi[eps, p] = run(multiscale_calls.taylor_monomials(self.pts.shape[0], d, runtime.on_gpu(), p),
                                    {"pts": self.pts, "centers": self.centers, "labels": self.labels,
                                     "taylor_alpha": alpha, "params": prm}, self.pts.device)
        return self._phi[eps, p]

    def monomials_with_derivatives(self, prm: Tensor, row0: int, rows: int, p: int) -> tuple[Tensor, Tensor]:
        """Rows row0 .. row0 + rows of phi and its derivatives psi^c (multiscale_rules.taylor_mean_groups
        groups per row, FP16 heads and tails) of order ``p``, for one chunk of the pass with the mean."""
        d = self.pts.shape[1]
        return run(multiscale_calls.taylor_monomials(rows, d, runtime.on_gpu(), p, True, row0),
                   {"pts": self.pts, "centers": self.centers, "labels": self.labels,
                    "taylor_alpha": _table("derivative", d, p, self.pts.device), "params": prm}, self.pts.device)


def wanted(points_per_src_cluster: float, points_per_tgt_cluster: float, mean: bool = False) -> bool:
    """Whether ``MODE`` asks for the Taylor pass on a plan with these mean cluster sizes (``mean``:
    with the gradient's softmin mean)."""
    if MODE not in ("auto", "always", "never"):
        raise ValueError(f"torch_api.multiscale.taylor.MODE must be 'auto', 'always' or 'never', got {MODE!r}")
    if MODE == "never":
        return False
    if MODE == "always":
        return True
    return runtime.on_gpu() and rules.taylor_worthwhile(points_per_src_cluster, points_per_tgt_cluster, mean)


def order(src: TaylorSide, tgt: TaylorSide, eps: float, tol: float | None, mean: bool = False) -> int | None:
    """The expansion's order for this pair of sides at ``eps`` (multiscale_rules.taylor_order at
    t = max r_k * max r_l / eps, for the solve's ``tol``; ``mean``: with the softmin mean), or None."""
    return rules.taylor_order(src.max_radius * tgt.max_radius / eps, tol, mean)


@dataclass(frozen=True)
class PairOrder:
    """The kept cluster pairs of one plan as the kernels read them (rows: the source's clusters k,
    columns: the target's l): k-major ``lptr`` (K_src + 1,) int64 offsets into ``lidx`` (int32 l);
    l-major ``kidx`` (int32 k), ``key`` = l K_src + k (int64, increasing along the l-major list) and
    ``slot`` (int32, the k-major position of each l-major pair); ``lptr_host`` lptr on the CPU (the
    chunks are planned on the host without reading the device)."""

    lptr: Tensor
    lidx: Tensor
    kidx: Tensor
    key: Tensor
    slot: Tensor
    lptr_host: Tensor

    @property
    def pairs(self) -> int:
        return self.lidx.numel()


def pair_orders(keep: Tensor, keep_t: Tensor, both: bool = True) -> tuple[PairOrder, PairOrder | None]:
    """The pair lists of a mask ``keep`` (K_r, K_c) and of its transposed plan, from keep's and
    ``keep_t``'s (its transpose; ``keep`` itself when symmetric) kept pairs (clusters.mask_lists): the k-major list of one
    orientation is the l-major list of the other, and their slots are inverse permutations (one
    stable sort gives both). ``both=False``: the transposed plan's is None (not built)."""
    return pair_orders_many([(keep, keep_t, both)])[0]


def pair_orders_many(requests: list) -> list:
    """:func:`pair_orders` of several (keep, keep_t, both), with one host read for all (the masks'
    offsets): a sweep builds its Taylor plans' lists before it launches any pass, so that no read
    waits on a pass in flight."""
    masks, rows, index = [], [], []
    for keep, keep_t, both in requests:
        sym = keep_t is keep
        # (row, col) = (k, l) k-major, and (l, k) l-major from the transpose
        own = [(keep, True)] if sym else [(keep, both), (keep_t, True)]
        index.append(list(range(len(masks), len(masks) + len(own))))
        masks += [m for m, _ in own]
        rows += [r for _, r in own]
    lists = mask_lists_many(masks, rows)
    return [_orders(keep, keep_t, both, lists[idx[0]], lists[idx[-1]]) for (keep, keep_t, both), idx in zip(requests, index)]


def _orders(keep: Tensor, keep_t: Tensor, both: bool, lists, lists_t) -> tuple[PairOrder, PairOrder | None]:
    """pair_orders from keep's and keep_t's lists (mask_lists_many)."""
    kr, kc = keep.shape
    sym = keep_t is keep
    lptr, col, row, host = lists
    lptr_t, colt, rowt, host_t = lists_t
    key = rowt.long() * kr + colt.long()
    key_t = key if sym or not both else row.long() * kc + col.long()
    dev = keep.device
    del row, rowt
    pairs = col.numel()
    # a stable sort of the l-major list by row cluster keeps l ascending: it lists the k-major order
    perm = torch.sort(colt, stable=True)[1]
    slot = torch.empty(pairs, dtype=torch.int32, device=dev)
    slot[perm] = torch.arange(pairs, dtype=torch.int32, device=dev)
    order = PairOrder(lptr=lptr, lidx=col, kidx=colt, key=key, slot=slot, lptr_host=host)
    if sym:
        return order, order
    if not both:
        return order, None
    return order, PairOrder(lptr=lptr_t, lidx=colt, kidx=col, key=key_t, slot=perm.to(torch.int32), lptr_host=host_t)


_TABLES: dict = {}


def _table(name: str, d: int, p: int, dev) -> Tensor:
    """multiscale_rules' monomial ("alpha") or monomial-and-derivative ("derivative") table for d and
    order p as a float32 device array, made once per process and device (a host-to-device copy waits
    for the stream)."""
    key = (name, d, p, str(dev))
    if key not in _TABLES:
        rows = rules.taylor_alpha_table(d, p) if name == "alpha" else rules.taylor_derivative_table(d, p)
        _TABLES[key] = torch.tensor(rows, dtype=torch.float32, device=dev).contiguous()
    return _TABLES[key]


def settle_radii(*sides: TaylorSide) -> None:
    """Read the sides' largest radii and cluster offsets to the host in one read."""
    todo = [s for s in sides if s._max_radius is None or s._start_host is None]
    if todo:
        parts = [t for s in todo for t in (s._radius.double().reshape(1), s.start.double())]
        # a CPU tensor, not a list: converting K + 1 offsets to Python ints costs ~4 ms of host time at
        # 2^20 while the GPU waits (measured on the H100)
        host = torch.cat(parts).cpu()
        for s in todo:
            s._max_radius = float(host[0])
            s._start_host = host[1:s.k + 2].long()
            host = host[s.k + 2:]


def lse(src: TaylorSide, tgt: TaylorSide, pot: Tensor, logw: Tensor, pold: Tensor, prm: Tensor,
        pairs: PairOrder, check: bool, mean: bool = False, eps: float | None = None,
        deferred: bool = False, p: int = rules.TAYLOR_ORDERS[-1]) -> tuple | None:
    """(f, err) with f_i = pold_i - eps log r_i over the kept cluster pairs ``pairs`` (pair_orders)
    and err_i = |r_i - 1| (when ``check``), or None when it declines (module docstring). ``pot``,
    ``logw``: the target side's potential and log-weights; ``pold`` the source side's previous
    potential (sorted orders). The cost must be |x - y|^2 / 2. ``mean``: (f, err, mean) with mean_i
    = sum_j P_ij y_j / r_i, the softmin mean of the target's points (n, d) (the kernels' docstring
    states its order). ``eps``: prm's eps as a number (read from prm, a host read, when None).
    ``deferred``: the range check is the caller's: never None, the last element a 0-d bool device
    tensor, whether the pass stands (False: discard it, as when it declines). ``p``: the expansion's
    order (:func:`order`; the caller checks it against its tolerance).

    The moments go to k-major slots. Chunks of row clusters bound M's memory (CHUNK_BYTES): each
    chunk's pairs are one k-major range, and the l-major list's part of a chunk is, per column
    cluster, one contiguous run (binary searches of the increasing keys). Host reads: the range
    check unless ``deferred`` (the chunks are planned from ``pairs.lptr_host``)."""
    eps = float(prm[0]) if eps is None else eps
    dev, d = src.pts.device, src.pts.shape[1]
    kr, kc = src.k, tgt.k
    lptr = pairs.lptr
    # chunks of consecutive row clusters, at most CHUNK_BYTES of moments each (a row cluster's pairs stay
    # together), planned on the host from the offsets' copy there
    host = pairs.lptr_host
    chunk_of_k = torch.div(host[:-1], max(1, CHUNK_BYTES // (4 * rules.taylor_rank(d, p))), rounding_mode="floor")
    first_k = torch.searchsorted(chunk_of_k, torch.arange(int(chunk_of_k[-1]) + 2)).clamp_max(kr)
    first_k[-1] = kr
    bounds = [first_k.tolist(), host[first_k].tolist()]
    chunks = len(bounds[0]) - 1
    first_k_dev = first_k.to(torch.int32)
    if dev.type == "cuda":  # pinned, so that the copy does not wait for the stream
        first_k_dev = first_k_dev.pin_memory().to(dev, non_blocking=True)
    phi = None if mean else src.monomials(prm, eps, p)
    psi = tgt.monomials(prm, eps, p)
    acc = torch.zeros(src.pts.shape[0], dtype=torch.float32, device=dev)
    mean_out = torch.empty(src.pts.shape[0], d, dtype=torch.float32, device=dev) if mean else acc
    arrays = {"y": tgt.pts, "cy": tgt.centers, "g": pot.contiguous(), "logw": logw.contiguous(), "start_y": tgt.start,
              "kidx": pairs.kidx, "slot": pairs.slot, "cx": src.centers, "psi_hi": psi[0], "psi_lo": psi[1], "params": prm,
              "x": src.pts, "f": pold.contiguous(), "start_x": src.start, "acc": acc,
              "lptr": lptr.to(torch.int32), "lidx": pairs.lidx, "first_k": first_k_dev, "mean_out": mean_out}
    if phi is not None:
        arrays["phi_hi"], arrays["phi_lo"] = phi
    cols = torch.arange(kc, device=dev) * kr
    on_gpu = runtime.on_gpu()
    for c in range(chunks):
        (k0, k1), (b0, b1) = bounds[0][c:c + 2], bounds[1][c:c + 2]
        if k1 == k0:
            continue
        # each column cluster's run of this chunk's row clusters in the l-major list
        arrays["klo"] = torch.searchsorted(pairs.key, cols + k0).to(torch.int32)
        arrays["khi"] = torch.searchsorted(pairs.key, cols + k1).to(torch.int32)
        for name in ("m_hi", "m_lo", "sig"):  # the previous chunk's moments go before the next's come
            arrays.pop(name, None)
        row0 = 0
        if mean:  # the chunk's rows' monomials and their derivatives (G groups per row)
            row0 = int(src.start_host[k0])
            arrays.pop("phi_hi", None), arrays.pop("phi_lo", None)
            arrays["phi_hi"], arrays["phi_lo"] = src.monomials_with_derivatives(prm, row0, int(src.start_host[k1]) - row0, p)
        run(multiscale_calls.taylor_moments(b1 - b0, kc, c, d, on_gpu, p), arrays, dev)
        run(multiscale_calls.taylor_evaluate(k1 - k0, c, d, on_gpu, p, mean, row0), arrays, dev)
    r = acc
    ok = ((r >= _RANGE[0]) & (r <= _RANGE[1])).all()
    if not deferred and not bool(ok):
        return None
    out = (pold - eps * torch.log(r), (r - 1.0).abs() if check else None) + ((mean_out,) if mean else ())
    return out + (ok,) if deferred else out
