"""Sharded Sinkhorn on the GPUs of one host: ``torch_api.distributed.sinkhorn`` on P GPUs against
``torch_api.sinkhorn`` on one, same inputs, same process group.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=P bench/distributed.py [--sizes 20 22] [--dims 3 64]

Workload: x, y ~ randn(n, d) / sqrt(d) (y shifted by 0.3 / sqrt(d)), n = m = 2^k, uniform weights,
OTT's conventions, eps = 0.1, float32; ``10it``: 10 fixed iterations (min = max = 10), ``default``:
the default early-stopping call (threshold 1e-3; at n <= 2^20 only, where it takes seconds).
Every rank generates the same clouds on its GPU and keeps its ``core.sharding.split_sizes``
shard; rank 0 alone runs the single-device solve. Per row: the median wall time of a synchronous
call (3 repetitions after a warm-up; from n = 2^22 one call after a warm-up on 2^16 points), the scaling efficiency t_1 / (P t_P), the peak memory per
GPU, and per iteration the measured communication (two all-gathers of the potential pieces, timed
alone with the same sizes) against the rest (the kernels). Gate: the gathered f of the sharded
10-iteration solve against the single-device solve's, max |diff| / max |f| <= 1e-5 (float32
rounding; the single solve is itself gated against float64 by bench/areas/sinkhorn.py).
Writes bench/results/distributed/<device>-x<P>.json and .png on rank 0.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_api  # noqa: E402
from ot_triton_jax.core.sharding import ShardLayout  # noqa: E402
from torch_api import distributed  # noqa: E402

EPS, ITERS, REPS = 0.1, 10, 3  # REPS: 2 from n = 2^22 on (minutes of GPU time)
FIXED = dict(threshold=1e-3, inner_iterations=10, min_iterations=ITERS, max_iterations=ITERS)


def clouds(n: int, d: int, dev) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=dev).manual_seed(n + d)
    x = torch.randn(n, d, generator=gen, device=dev) / d ** 0.5
    y = (torch.randn(n, d, generator=gen, device=dev) + 0.3) / d ** 0.5
    return x, y


def timed(fn, reps: int = REPS, group: bool = True, warm=None) -> tuple[float, object]:
    """Median seconds of a synchronous fn() after one warm-up call (``warm``, default fn itself;
    all ranks start together)."""
    out, times = (warm or fn)(), []
    for _ in range(reps):
        if group:
            dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def comm_seconds(layout: ShardLayout, dev) -> float:
    """One iteration's communication: two all-gathers of pieces of ``layout.width`` floats."""
    piece = torch.zeros(layout.width, device=dev)
    out = torch.empty(layout.parts * layout.width, device=dev)

    def two():
        for _ in range(2):
            dist.all_gather_into_tensor(out, piece)
    t, _ = timed(lambda: [two() for _ in range(20)], reps=3)
    return t / 20


def rel(u: torch.Tensor, v: torch.Tensor) -> float:
    return float((u - v).abs().max() / v.abs().max())


def measure(n: int, d: int, rank: int, world: int, dev, with_default: bool) -> list[dict]:
    x, y = clouds(n, d, dev)
    lay = ShardLayout.even(n, world)
    lo, hi = lay.rows(rank)
    xr, yr = x[lo:hi].contiguous(), y[lo:hi].contiguous()
    rows = []
    for mode, opts in (("10it", FIXED), ("default", {})) if with_default else (("10it", FIXED),):
        torch.cuda.reset_peak_memory_stats(dev)
        # from 2^22 on one call is minutes: one timed call after a warm-up on 2^16 rows per rank
        reps, small = (REPS, None) if n < 2 ** 22 else (1, slice(0, 2 ** 16))
        warm_p = None if small is None else (lambda: distributed.sinkhorn(xr[small], yr[small], epsilon=EPS, **opts))
        t_p, out = timed(lambda: distributed.sinkhorn(xr, yr, epsilon=EPS, **opts), reps, warm=warm_p)
        mem_p = torch.cuda.max_memory_allocated(dev) / 2 ** 30
        f_parts = [torch.empty(lay.width, device=dev) for _ in range(world)]
        piece = torch.full((lay.width,), float("nan"), device=dev)
        piece[:out.f.shape[0]] = out.f.detach()
        dist.all_gather(f_parts, piece)
        comm = comm_seconds(lay, dev)
        mem = torch.tensor([mem_p], device=dev)
        dist.all_reduce(mem, op=dist.ReduceOp.MAX)
        if rank == 0:
            f_sharded = torch.cat([p[:s] for p, s in zip(f_parts, lay.sizes)])
            torch.cuda.reset_peak_memory_stats(dev)
            warm_1 = None if small is None else (lambda: torch_api.sinkhorn(x[small], y[small], epsilon=EPS, **opts))
            t_1, one = timed(lambda: torch_api.sinkhorn(x, y, epsilon=EPS, **opts), reps, group=False, warm=warm_1)
            mem_1 = torch.cuda.max_memory_allocated(dev) / 2 ** 30
            iters = int(out.n_iters)
            rows.append(dict(n=n, m=n, d=d, eps=EPS, mode=mode, gpus=world, n_iters=iters,
                             n_iters_single=int(one.n_iters), ms_single=1e3 * t_1, ms_sharded=1e3 * t_p,
                             efficiency=t_1 / (world * t_p), peak_gib_single=mem_1, peak_gib_per_gpu=float(mem),
                             comm_ms_per_iteration=1e3 * comm,
                             compute_ms_per_iteration=1e3 * (t_p / max(iters, 1) - comm),
                             f_error_vs_single=rel(f_sharded, one.f.detach()) if mode == "10it" else None))
            print(json.dumps(rows[-1]), flush=True)
        dist.barrier()
    del x, y, xr, yr
    torch.cuda.empty_cache()
    return rows


def plot(rows: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 3.5))
    labels = [f"2^{r['n'].bit_length() - 1}, d={r['d']}\n{r['mode']}" for r in rows]
    ax.bar(range(len(rows)), [100 * r["efficiency"] for r in rows], color="tab:blue")
    ax.axhline(100, color="gray", lw=0.8)
    ax.set_xticks(range(len(rows)), labels, fontsize=7)
    ax.set_ylabel(f"scaling efficiency on {rows[0]['gpus']} GPUs (%)")
    ax.set_title("t(1 GPU) / (P t(P GPUs)), torch_api.distributed.sinkhorn", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 22], help="log2 n")
    ap.add_argument("--dims", type=int, nargs="+", default=[3, 64])
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "distributed"))
    args = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dev = torch.device("cuda", torch.cuda.current_device())
    dist.init_process_group("nccl")
    rows = []
    try:
        for k in args.sizes:
            for d in args.dims:
                rows += measure(2 ** k, d, rank, world, dev, with_default=k <= 20)
                if rank == 0:  # written after every item: a run cut short keeps what it measured
                    write(rows, dev, world, args.out)
    finally:
        dist.destroy_process_group()
    return 0


def write(rows: list[dict], dev, world: int, out: str) -> None:
    name = torch.cuda.get_device_name(dev).lower().replace(" ", "-")
    os.makedirs(out, exist_ok=True)
    base = os.path.join(out, f"{name}-x{world}")
    env = dict(device=torch.cuda.get_device_name(dev), gpus=world, torch=torch.__version__,
               nccl=".".join(map(str, torch.cuda.nccl.version())), nvls=os.environ.get("NCCL_NVLS_ENABLE"))
    with open(base + ".json", "w") as fh:
        json.dump(dict(env=env, method=__doc__, rows=rows), fh, indent=1)
    plot(rows, base + ".png")
    print("wrote", base + ".json", flush=True)


if __name__ == "__main__":
    sys.exit(main())
