"""Multiscale SamplesLoss on the GPU (issue 15): ours (loss + gradient, default multiscale options)
against flash-sinkhorn 0.4.1's multiscale mode (forward only: it has no gradients), and our dense
streaming solve at the same eps for the value.

    python3 bench/bench_multiscale.py [--sizes 65536,262144,1048576] [--big 4194304]

Workload: x ~ N(0, I_3), y ~ N(0.5, I_3) (fixed CPU seeds), uniform weights, blur 0.05,
scaling 0.5, debias. Per size: median ms over repetitions after two warm-ups (CUDA events), the
first call's wall time, peak memory, the kept fraction of cluster pairs, the dropped-mass bound,
the final (x, y) plan's marginal error ||P 1 - a||_1 on the kept blocks, and (n <= 2^18) the
relative difference of the value from our dense solve. Writes bench/results/multiscale_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:  # torch_api without PYTHONPATH
    sys.path.append(os.path.dirname(HERE))
from common import cuda_median_ms, environment  # noqa: E402

import torch_api  # noqa: E402
from torch_api import kernel_ops  # noqa: E402

BLUR, SCALING, REPS = 0.05, 0.5, 5


def clouds(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(n)
    return torch.randn(n, 3, generator=g).cuda(), (torch.randn(n, 3, generator=g) + 0.5).cuda()


def cuda_ms(fn, reps: int = REPS) -> list[float]:
    return cuda_median_ms(fn, reps=reps, warmup=0)[1]


def marginal_error(res, a: torch.Tensor) -> float:
    """||P 1 - a||_1 of the final (x, y) plan on the kept blocks (GeomLoss's plan a_i b_j exp(...))."""
    X, Y, la, lb, masks, cx, cy, new, old, prm = res.state
    eps = prm[0]
    _, rows = kernel_ops.apply_plan_blocksparse(X, Y, new[0] + eps * la, new[1] + eps * lb, prm, masks[0],
                                                cy.start, "float32")
    return float((rows - a[cx.perm]).abs().sum())


def ours(x: torch.Tensor, y: torch.Tensor) -> dict:
    loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale")

    def call():
        xg = x.detach().requires_grad_(True)
        value = loss(xg, y)
        (g,) = torch.autograd.grad(value, xg)
        return value, g

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    value, g = call()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    call()
    torch.cuda.reset_peak_memory_stats()
    times = cuda_ms(call)
    value, g = call()
    res = loss.last_multiscale
    a = torch.full((x.shape[0],), 1.0 / x.shape[0], device="cuda")
    return {"ms": statistics.median(times), "times_ms": times, "first_call_s": first,
            "peak_mib": torch.cuda.max_memory_allocated() / 2**20, "value": float(value),
            "grad_finite": bool(torch.isfinite(g).all()), "kept": res.kept, "clusters": list(res.clusters),
            "jump": res.jump, "schedule_len": len(res.eps), "dropped_mass_bound": res.dropped_mass_bound,
            "marginal_error_xy": marginal_error(res, a)}


def flash(x: torch.Tensor, y: torch.Tensor) -> dict:
    try:
        from flash_sinkhorn.samples_loss import SamplesLoss as FlashLoss
        loss = FlashLoss("sinkhorn", p=2, blur=BLUR, scaling=SCALING, debias=True, half_cost=True,
                         backend="multiscale")
        t0 = time.perf_counter()
        loss(x, y)
        torch.cuda.synchronize()
        first = time.perf_counter() - t0
        times = cuda_ms(lambda: loss(x, y))
        return {"ms": statistics.median(times), "times_ms": times, "first_call_s": first,
                "value": float(loss(x, y)), "call": "flash_sinkhorn.samples_loss.SamplesLoss('sinkhorn', p=2, "
                f"blur={BLUR}, scaling={SCALING}, debias=True, half_cost=True, backend='multiscale') (forward only)"}
    except Exception as exc:  # absent or failing: the row says so
        return {"ms": None, "failure": repr(exc)[:400]}


def dense_value(x: torch.Tensor, y: torch.Tensor) -> float:
    return float(torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING)(x, y))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="65536,262144,1048576")
    ap.add_argument("--big", type=int, default=1 << 22, help="one run at this size (0: none)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("bench_multiscale.py needs a CUDA device", file=sys.stderr)
        return 2
    rows = []
    for n in [int(s) for s in args.sizes.split(",")] + ([args.big] if args.big else []):
        x, y = clouds(n)
        row = {"n": n, "m": n, "d": 3, "blur": BLUR, "scaling": SCALING, "ours": ours(x, y)}
        if n != args.big:
            row["flash_multiscale"] = flash(x, y)
            fm = row["flash_multiscale"].get("ms")
            row["speedup_vs_flash_forward"] = fm / row["ours"]["ms"] if fm else None
        if n <= 1 << 18:
            dv = dense_value(x, y)
            row["dense_value"] = dv
            row["value_rel_diff_vs_dense"] = abs(row["ours"]["value"] - dv) / abs(dv)
        rows.append(row)
        print(json.dumps(row), flush=True)
        torch.cuda.empty_cache()
    dev = torch.cuda.get_device_name().lower().replace(" ", "-")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", f"multiscale_{dev}.json")
    with open(path, "w") as fh:
        json.dump({"env": environment(), "rows": rows}, fh, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
