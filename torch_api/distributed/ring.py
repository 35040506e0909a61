"""The ring exchange of :mod:`torch_api.distributed`: clouds that stay sharded.

With ``exchange="gather"`` every rank holds both full clouds ((n + m) d numbers); with
``exchange="ring"`` it holds only its own rows, and every pass over the other side (a softmin,
a plan application, the cost's plan mass) streams that side's shards around the ring of ranks:
at step k = 0, ..., P - 1 rank r computes on the shard of rank (r - k) mod P while it sends the
shard it holds to rank r + 1 and receives the next from rank r - 1 (one ``batch_isend_irecv``
per step, overlapped with the kernels). Per pass each rank sends and receives the other cloud
once (its FP16 parts and squared norms, the points too when the pass needs them) and keeps at
most two shards of it, so a rank's memory is O((n_r + max_r m_r) d) and the traffic per
half-step O(m d) instead of the gathered scheme's O(m).

The shards' pieces combine exactly as one pass over the full cloud would sum them:

* softmin: each shard's kernel gives L_k,i = LSE_{j in k}((g_j - C_ij)/eps) (as pold_i - eps
  L_k,i, rounded once: :meth:`RingPass.softmin` says why); L_i = logsumexp_k L_k,i in float64,
  then the potential eps logw_i - eps L_i and the marginal error |exp(pold_i/eps + L_i) - w_i|
  as the kernel's epilogue computes them (kernels/lse.py). A shard whose weights are all 0
  contributes nothing; it is skipped (the kernel writes 0, not -inf, for an empty row);
* plan applications and row masses are sums over j: the shards' results add.

The clouds are centred and split as :func:`torch_api.kernel_ops.clouds` does on the gathered
problem, from the same numbers: the centre is ``center_kernel`` on its SAMPLE sampled rows of
each cloud (the rows are assembled by one all-reduce in which each row has one nonzero
contributor, hence exactly), and the FP16 parts' scale from one all-reduce (MAX) of the
ranks' largest |x - c|. A rank's kernel inputs are therefore its rows of the gathered clouds.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from ot_triton_jax.core import cloud_plans, kernel_calls, launch_plans, runtime
from ot_triton_jax.core.sharding import ShardLayout

from .. import checks as check
from ..kernel_ops import Cloud, apply_plan, exact_row_mass, lse_update, run

EXCHANGES = ("auto", "gather", "ring")


def check_exchange(exchange) -> None:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {EXCHANGES}; got {exchange!r}")


def use_ring(comm, exchange: str, points: int, d: int) -> bool:
    """``exchange`` resolved on every rank alike (``comm``: ``ops.Comm``): "auto" takes the ring
    when, on some rank, the gathered scheme's clouds (about 32 (n + m)(d + 1) bytes at their
    peak, ``points`` = n + m: the float64 gather and the float32 and FP16 copies) would exceed
    half of the GPU memory free now; on CPUs "auto" gathers."""
    if exchange != "auto":
        return exchange == "ring"
    need = 0.0
    if comm.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(comm.device)
        need = float(32 * points * (d + 1) > free // 2)
    return bool(comm.sum(torch.tensor(need, device=comm.device)).item() > 0)


def _sampled_rows(group, rank: int, local: Tensor, layout: ShardLayout) -> Tensor:
    """The rows of the global cloud that ``center_kernel`` reads ((k n) // min(n, SAMPLE)),
    assembled on every rank by one exact all-reduce."""
    n, d = layout.total, local.shape[1]
    sample = cloud_plans.center_plan(d, runtime.on_gpu()).constexprs["SAMPLE"]
    cnt = min(n, sample)
    rows = (torch.arange(cnt, dtype=torch.int64) * n) // cnt
    start, stop = layout.rows(rank)
    mine = ((rows >= start) & (rows < stop)).to(local.device)
    buf = local.new_zeros((cnt, d))
    buf[mine] = local.index_select(0, (rows.to(local.device) - start).clamp(0, max(stop - start - 1, 0))[mine])
    dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
    return buf


def local_clouds(group, rank: int, pts: tuple[Tensor, ...], layouts: tuple[ShardLayout, ...]) -> tuple[Cloud, ...]:
    """This rank's rows of ``kernel_ops.clouds(*full_clouds)``, from its shards ``pts`` (float32,
    one or two clouds) and their layouts, without gathering the clouds (module docstring)."""
    on_gpu, dev, d = runtime.on_gpu(), pts[0].device, pts[0].shape[1]
    sx, sy = (_sampled_rows(group, rank, p, lay) for p, lay in (zip(pts, layouts) if len(pts) == 2 else
                                                                  [(pts[0], layouts[0])] * 2))
    (c,) = run(kernel_calls.center(sx.shape[0], sy.shape[0], d, on_gpu), {"x": sx, "y": sy}, dev)
    amax = None
    if launch_plans.fp16_operands(d):
        x, y = pts[0], pts[-1]
        part = run(kernel_calls.absmax(x.shape[0], y.shape[0], d, on_gpu), {"x": x, "y": y, "center": c}, dev)[0]
        amax = part.max().reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    n_amax = 0 if amax is None else 1
    return tuple(Cloud(*run(kernel_calls.split_centered(p.shape[0], d, on_gpu, n_amax),
                            {"x": p, "center": c, "amax": amax}, dev)) for p in pts)


def sharded_problem(comm, lx: ShardLayout, ly: ShardLayout, x: Tensor, y: Tensor, a, b, balanced: bool,
                    numbers: dict) -> tuple:
    """The ring exchange's inputs: this rank's float32 shards, the gathered float64 weights (O(n + m)
    numbers; None: the uniform 1/n) and the single solve's value checks, the points' finiteness by
    one all-reduce (``comm``: ``ops.Comm``; ``numbers``: more values that must be > 0)."""
    x32, y32 = x.detach().to(torch.float32).contiguous(), y.detach().to(torch.float32).contiguous()
    bad = comm.sum(torch.stack([(~torch.isfinite(x32)).any(), (~torch.isfinite(y32)).any()]).double())
    for name, v in zip("xy", bad.tolist()):
        if v:
            raise ValueError(f"{name} contains non-finite values (NaN or inf) on {int(v)} rank(s); pass finite points")
    ws = [check.uniform_weights(lay.total, comm.device) if w is None else
          comm.gather_rows(w.detach().double()[:, None], lay)[:, 0].contiguous() for lay, w in ((lx, a), (ly, b))]
    default = a is None and b is None
    check.DeferredValues({}, {} if default else {"a": ws[0], "b": ws[1]},
                         balanced_pair=("a", "b") if balanced and not default else None, numbers=numbers).finish()
    return x32, y32, ws[0], ws[1]


def bounding_box_diameter(comm, x: Tensor, y: Tensor) -> float:
    """``samples_loss_ops.diameter`` of the global clouds from the shards: the per-coordinate
    maxima and minus minima by one MAX all-reduce (the same float64 numbers)."""
    pts = torch.cat((x.detach(), y.detach())).double()
    ext = torch.cat((pts.max(0).values, -pts.min(0).values))
    dist.all_reduce(ext, op=dist.ReduceOp.MAX, group=comm.group)
    d = x.shape[1]
    return float((ext[:d] + ext[d:]).norm())


def shape_only(n: int, d: int, device) -> Cloud:
    """A Cloud that carries only its size (n, d) and device, no data: what the anneal reads of the
    clouds whose softmins a ring provider computes."""
    return Cloud(torch.empty((1, 1), device=device).expand(n, d), None, None, None)


def _global_rank(group, r: int) -> int:
    return r if group is None else dist.get_global_rank(group, r)


class RingPass:
    """Streams one sharded cloud around the ring of ``group``'s ranks (module docstring).
    ``empty``: per rank, whether its shard's weights are all 0 (such shards are not used in
    a softmin)."""

    def __init__(self, group, rank: int, world: int, layout: ShardLayout, local: Cloud, w_full: Tensor):
        self.group, self.rank, self.world, self.layout, self.local = group, rank, world, layout, local
        self.next, self.prev = _global_rank(group, (rank + 1) % world), _global_rank(group, (rank - 1) % world)
        self.empty = tuple(bool(v) for v in torch.stack(
            [(w_full[s:e] <= 0).all() for s, e in (layout.rows(k) for k in range(world))]).tolist())

    def blocks(self, with_points: bool):
        """Yield (start, stop, Cloud) for every rank's shard, this rank's first; the next shard's
        transfer runs while the caller computes on the current one."""
        c = self.local
        cur = [c.hi, c.lo, c.sqnorm] + ([c.x] if with_points else [])
        for k in range(self.world):
            owner = (self.rank - k) % self.world
            reqs, nxt = [], None
            if k < self.world - 1:
                size = self.layout.sizes[(owner - 1) % self.world]
                nxt = [t.new_empty((size,) + tuple(t.shape[1:])) for t in cur]
                reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, t, self.next, self.group) for t in cur]
                                              + [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in nxt])
            start, stop = self.layout.rows(owner)
            x = cur[3] if with_points else c.x.new_empty((1, 1)).expand(stop - start, c.d)
            yield owner, start, stop, Cloud(x, cur[0], cur[1], cur[2], c.scale)
            for q in reqs:
                q.wait()
            cur = nxt

    def softmin(self, src: Cloud, pot_full: Tensor, prm: Tensor, precision: str, logw_out: Tensor | None = None,
                w_out: Tensor | None = None, pold: Tensor | None = None, compute_err: bool = False,
                logw_in: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        """(eps logw_out - eps L, the marginal error at ``pold`` or None) for the ``src`` rows
        against this cloud with potential ``pot_full`` (and target log weights ``logw_in``,
        both full vectors; module docstring). Each shard's kernel runs with the log weight
        pold/eps, so that it returns pold - eps L_k, of the size of eps log(marginal), not of the
        potentials: its float32 rounding then costs what the single kernel's own rounding of
        pold/eps + L does."""
        eps = prm[0].double()
        n = src.n
        shift = src.sqnorm.new_zeros(n) if pold is None else torch.where(torch.isfinite(pold), pold, 0.0)
        lw = (shift.double() / eps).float()
        base = eps * lw.double()
        total = None
        for owner, start, stop, blk in self.blocks(False):
            if self.empty[owner]:
                continue
            li = None if logw_in is None else logw_in[start:stop].contiguous()
            out, _ = lse_update(src, blk, pot_full[start:stop].contiguous(), prm, precision, logw_in=li, logw_out=lw)
            part = (base - out.double()) / eps
            total = part if total is None else torch.logaddexp(total, part)
        finite = torch.isfinite(total)
        lse = torch.where(finite, total, 0.0)
        new = (eps * ((0.0 if logw_out is None else logw_out.double()) - lse)).float()
        if not compute_err:
            return new, None
        marg = torch.where(finite, torch.exp(pold.double() / eps + lse), 0.0).float()
        return new, (marg - w_out).abs()

    def plan(self, src: Cloud, f: Tensor, pot_full: Tensor, prm: Tensor, precision: str,
             with_points: bool) -> tuple[Tensor | None, Tensor]:
        """(P y or None, P 1) for the ``src`` rows, P_ij = exp((f_i + g_j - C_ij)/eps), summed
        over this cloud's shards."""
        pv = rows = None
        for _, start, stop, blk in self.blocks(with_points):
            p, r = apply_plan(src, blk, f, pot_full[start:stop].contiguous(), prm, precision,
                              blk.x if with_points else None)
            rows = r if rows is None else rows + r
            if with_points:
                pv = p if pv is None else pv + p
        return pv, rows

    def row_mass(self, src: Cloud, f: Tensor, pot_full: Tensor, prm: Tensor) -> Tensor:
        """P 1 with the unbiased "fixed4" cross term (``kernel_ops.exact_row_mass``), summed
        over this cloud's shards."""
        rows = None
        for _, start, stop, blk in self.blocks(True):
            r = exact_row_mass(src, blk, f, pot_full[start:stop].contiguous(), prm)
            rows = r if rows is None else rows + r
        return rows
