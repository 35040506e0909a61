"""Sharded Sinkhorn on the GPUs of one host: ``torch_api.distributed.sinkhorn`` on P GPUs against
``torch_api.sinkhorn`` on one, same inputs, one launch for every P.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=4 bench/distributed.py [--sizes 20 22] [--dims 3 64]
        [--gpus 2 4] [--iters 10] [--default-up-to 20] [--loss | --exchange ring]

Workload: x, y ~ randn(n, d) / sqrt(d) (y shifted by 0.3 / sqrt(d)), n = m = 2^k, uniform weights,
OTT's conventions, eps = 0.1, float32. ``fixed``: ``--iters`` fixed iterations (min = max; one
iteration is a g- and an f-update, and the call ends with one more g-update that measures the
final marginal error); ``default``: the default early-stopping call (threshold 1e-3), for
n <= 2^``--default-up-to``; with ``--loss`` instead the default ``torch_api.samples_loss`` call
(``SamplesLoss()``: GeomLoss's blur 0.05, scaling 0.5, debiased: its eps-schedule runs a fixed number of
updates), its value the gate (relative difference to the single-device loss <= 1e-5). Every rank generates the same clouds on its GPU; for each P of
``--gpus`` the first P ranks form a process group and solve with their ``core.sharding.split_sizes``
shards (``--gpus 1`` times the sharded code path on one GPU); rank 0 alone runs the single-device
solve once per workload, its ``reg_ot_cost`` read (the sharded call computes the cost, one pass
over the plan, before it returns; the single-device output computes it when first read, and
that pass is worth about 2.4 half-steps of the loop). Per row: the wall time of a synchronous call (the median of 3 after a
warm-up below 2^20 points; from 2^20 on one timed call after a warm-up on 2^16 points per rank,
the calls being seconds to minutes long), the scaling efficiency t_1 / (P t_P), the peak memory
per GPU, and per iteration the measured communication (two all-gathers of the potential pieces,
timed alone with the same sizes) against the rest (the kernels). Gate: the gathered f of the
sharded fixed-iteration solve against the single-device solve's, max |diff| / max |f| <= 1e-5
(float32 rounding; the single solve is itself gated against float64 by bench/areas/sinkhorn.py).
``--exchange ring``: the sharded calls keep their clouds sharded and stream the other side around
the ring of ranks (``torch_api.distributed.ring``); those rows are the ``torch_ring`` frontend.
Writes the ``torch`` (or ``torch_ring``) rows of bench/results/distributed/<device>-x<world>.json
(the other frontends' rows are kept) and its plot, after every workload.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_api  # noqa: E402
from bench.distributed_report import merge_rows  # noqa: E402
from ot_triton_jax.core.sharding import ShardLayout  # noqa: E402
from torch_api import distributed  # noqa: E402

EPS, REPS, GATE = 0.1, 3, 1e-5


def clouds(n: int, d: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=dev).manual_seed(n + d)
    x = torch.randn(n, d, generator=gen, device=dev) / d ** 0.5
    y = (torch.randn(n, d, generator=gen, device=dev) + 0.3) / d ** 0.5
    return x, y


def timed(fn, reps: int, group=None, warm=None) -> tuple[float, object]:
    """Median seconds of a synchronous fn() after one warm-up call (``warm``, default fn itself;
    with ``group`` its ranks start together)."""
    out, times = (warm or fn)(), []
    for _ in range(reps):
        if group is not None:
            dist.barrier(group=group)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def comm_seconds(layout: ShardLayout, dev, group) -> float:
    """One iteration's communication: two all-gathers of pieces of ``layout.width`` floats."""
    piece = torch.zeros(layout.width, device=dev)
    out = torch.empty(layout.parts * layout.width, device=dev)

    def two():
        for _ in range(2):
            dist.all_gather_into_tensor(out, piece, group=group)
    t, _ = timed(lambda: [two() for _ in range(20)], 3, group)
    return t / 20


def rel(u: torch.Tensor, v: torch.Tensor) -> float:
    return float((u - v).abs().max() / v.abs().max())


EXCHANGE = ["gather"]  # the sharded calls' exchange (--exchange)


def frontend() -> str:
    """The rows' frontend: "torch", or "torch_ring" for the ring exchange's runs."""
    return "torch" if EXCHANGE[0] == "gather" else "torch_" + EXCHANGE[0]


def modes(n: int, iters: int, default_up_to: int, loss: bool) -> list[tuple[str, dict]]:
    if loss:
        return [("samples_loss", {})]
    fixed = dict(threshold=1e-3, inner_iterations=10, min_iterations=iters, max_iterations=iters)
    out = [(f"{iters}it", fixed)]
    return out + [("default", {})] if n <= 2 ** default_up_to else out


class LossOut:
    """A samples_loss value in the shape of a solve's output (``f``: the loss, one 'iteration')."""

    def __init__(self, value: torch.Tensor):
        self.f, self.n_iters = value.reshape(1), 1


def solved(x, y, mode, opts):
    """The single-device solve with its reg_ot_cost read: the sharded call returns the cost (one
    pass over the plan at the end), the single-device output computes it when first read."""
    if mode == "samples_loss":
        return LossOut(torch_api.SamplesLoss()(x, y))
    out = torch_api.sinkhorn(x, y, epsilon=EPS, **opts)
    out.reg_ot_cost
    return out


def sharded(x, y, mode, opts, group):
    if mode == "samples_loss":
        return LossOut(distributed.samples_loss(x, y, group=group))
    return distributed.sinkhorn(x, y, epsilon=EPS, group=group, exchange=EXCHANGE[0], **opts)


def sharded_row(n, d, mode, opts, P, group, rank, dev, x, y, reps, small) -> dict | None:
    """The sharded solve on the group of ranks [0, P) (None on the other ranks)."""
    if group is None:
        return None
    lay = ShardLayout.even(n, P)
    lo, hi = lay.rows(rank)
    xr, yr = x[lo:hi].contiguous(), y[lo:hi].contiguous()
    torch.cuda.reset_peak_memory_stats(dev)
    warm = None if small is None else (lambda: sharded(xr[small], yr[small], mode, opts, group))
    t_p, out = timed(lambda: sharded(xr, yr, mode, opts, group), reps, group, warm)
    mem = torch.tensor([torch.cuda.max_memory_allocated(dev) / 2 ** 30], device=dev)
    dist.all_reduce(mem, op=dist.ReduceOp.MAX, group=group)
    if mode == "samples_loss":  # the loss is equal on every rank: rank 0's is the result
        lay, parts = ShardLayout.even(1, 1), [out.f.detach()]
    else:
        parts = [torch.empty(lay.width, device=dev) for _ in range(P)]
        piece = torch.full((lay.width,), float("nan"), device=dev)
        piece[:out.f.shape[0]] = out.f.detach()
        dist.all_gather(parts, piece, group=group)
    comm = comm_seconds(lay, dev, group) if P > 1 and mode != "samples_loss" else 0.0
    iters = int(out.n_iters)
    return dict(frontend=frontend(), n=n, m=n, d=d, eps=EPS, mode=mode, gpus=P, n_iters=iters,
                ms=1e3 * t_p, peak_gib_per_gpu=float(mem),
                **({} if mode == "samples_loss" else dict(comm_ms_per_iteration=1e3 * comm,
                                                          compute_ms_per_iteration=1e3 * (t_p / max(iters, 1) - comm))),
                f_gathered=torch.cat([p[:s] for p, s in zip(parts, lay.sizes)]))


def measure(n, d, rank, dev, groups, args) -> list[dict]:
    x, y = clouds(n, d, dev)
    rows = []
    for mode, opts in modes(n, args.iters, args.default_up_to, args.loss):
        reps, small = (REPS, None) if n < 2 ** 20 else (1, slice(0, 2 ** 16))
        single = None
        if rank == 0:
            torch.cuda.reset_peak_memory_stats(dev)
            warm = None if small is None else (lambda: solved(x[small], y[small], mode, opts))
            t_1, one = timed(lambda: solved(x, y, mode, opts), reps, None, warm)
            single = dict(frontend=frontend(), n=n, m=n, d=d, eps=EPS, mode=mode, gpus=1, sharded=False,
                          n_iters=int(one.n_iters), ms=1e3 * t_1,
                          peak_gib_per_gpu=torch.cuda.max_memory_allocated(dev) / 2 ** 30)
            rows.append(single)
            print(single, flush=True)
        dist.barrier()
        for P, group in groups:
            row = sharded_row(n, d, mode, opts, P, group, rank, dev, x, y, reps, small)
            if rank == 0:
                f_sharded = row.pop("f_gathered")
                row.update(sharded=True, efficiency=single["ms"] / (P * row["ms"]), ms_single=single["ms"],
                           f_error_vs_single=rel(f_sharded, one.f.detach()) if mode != "default" else None,
                           same_iterations=row["n_iters"] == single["n_iters"])
                rows.append(row)
                print(row, flush=True)
            dist.barrier()
    del x, y
    torch.cuda.empty_cache()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 22], help="log2 n")
    ap.add_argument("--dims", type=int, nargs="+", default=[3, 64])
    ap.add_argument("--gpus", type=int, nargs="+", default=None, help="group sizes P (default: 2, 4, ... world)")
    ap.add_argument("--iters", type=int, default=10, help="fixed iterations of the 'fixed' mode")
    ap.add_argument("--default-up-to", type=int, default=20, help="log2 n up to which the default call is timed")
    ap.add_argument("--loss", action="store_true", help="time the default samples_loss call instead of sinkhorn")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "distributed"))
    ap.add_argument("--exchange", choices=("gather", "ring"), default="gather",
                    help="the sharded sinkhorn's exchange (rows of the ring runs: frontend torch_ring)")
    args = ap.parse_args()
    if args.loss and args.exchange != "gather":
        ap.error("--loss runs samples_loss, which gathers its clouds: drop --exchange")
    EXCHANGE[0] = args.exchange
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl", device_id=dev)
    sizes = args.gpus or [p for p in (2, 4, 8, 16) if p <= world]
    groups = []
    for P in sizes:  # every rank creates every group, in the same order
        g = dist.new_group(list(range(P)))
        groups.append((P, g if rank < P else None))
    rows = []
    try:
        for k in args.sizes:
            for d in args.dims:
                rows += measure(2 ** k, d, rank, dev, groups, args)
                if rank == 0:  # written after every workload: a run cut short keeps what it measured
                    env = dict(device=torch.cuda.get_device_name(dev), gpus=world, torch=torch.__version__,
                               nccl=".".join(map(str, torch.cuda.nccl.version())),
                               nvls=os.environ.get("NCCL_NVLS_ENABLE"))
                    merge_rows(args.out, env, frontend(), __doc__, rows)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
