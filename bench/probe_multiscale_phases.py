"""Where one multiscale loss + gradient call spends its GPU time, by phase (issue 15).

    python3 bench/probe_multiscale_phases.py [--sizes 65536,1048576]

Wraps the helpers that torch_api.multiscale_solve calls (clustering, bound fits, keep masks,
row-block masks, column ranges, dropped-mass bound, dense LSE passes, block-sparse passes,
Anderson steps) in torch.profiler ranges, profiles one warm call (default options, uniform cube,
blur 0.05, scaling 0.5; bench_multiscale's workload), and reports per phase the GPU time of the
kernels it launched and its host time. Also reports the wall time of the unwrapped call (CUDA
events, median of 5), and per phase the peak of allocated device memory inside it (the phases
nest: anneal's peak holds its callees'), and how long the GPU idles between the call's kernels. Writes bench/results/probe_multiscale_phases_<device>.json.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
from common import RESULTS, cuda_median_ms, environment  # noqa: E402

import torch_api  # noqa: E402
from torch_api import multiscale_bounds, multiscale_solve, samples_loss_multiscale  # noqa: E402

BLUR, SCALING = 0.05, 0.5
PHASES = {
    multiscale_solve: [name for name in ("cluster_pair", "occupied_cells", "kept_ranges", "kept_ranges_many", "row_block_mask",
                                         "column_ranges") if hasattr(multiscale_solve, name)] + [
        "lse_update", "lse_blocksparse", "apply_plan_blocksparse", "_update_and_mean"],
    samples_loss_multiscale: ["anneal", "direction"],
    multiscale_bounds: ["geometry", "fit", "keep_pairs", "dropped_mass"],
}


MEMORY: dict = {}
STACK: list = []  # open phases' running peaks (the allocator keeps one global peak: shared across nesting)


def _flush():
    peak = torch.cuda.max_memory_allocated()
    for frame in STACK:
        frame[0] = max(frame[0], peak)
    torch.cuda.reset_peak_memory_stats()


def wrap(module, name):
    fn = getattr(module, name)

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        _flush()
        before = torch.cuda.memory_allocated()
        STACK.append([before])
        try:
            with torch.profiler.record_function("phase::" + name):
                return fn(*args, **kwargs)
        finally:
            _flush()
            peak = STACK.pop()[0]
            rec = MEMORY.setdefault(name, {"peak_mib": 0.0})
            if peak / 2**20 > rec["peak_mib"]:
                rec.update(peak_mib=peak / 2**20, held_before_mib=before / 2**20,
                           held_after_mib=torch.cuda.memory_allocated() / 2**20)
    setattr(module, name, inner)
    return fn


def clouds(n):
    g = torch.Generator().manual_seed(n)
    return torch.rand(n, 3, generator=g).cuda(), torch.rand(n, 3, generator=g).cuda()


def row(n: int) -> dict:
    x, y = clouds(n)
    loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale")

    def call():
        xg = x.detach().requires_grad_(True)
        return torch.autograd.grad(loss(xg, y), xg)

    call()
    ms, times = cuda_median_ms(call, reps=5)
    originals = [(m, nm, wrap(m, nm)) for m, names in PHASES.items() for nm in names]
    try:
        call()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                torch.profiler.ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
    finally:
        for m, nm, fn in originals:
            setattr(m, nm, fn)
    phases, kernels = {}, []
    for ev in prof.key_averages():
        dev_us = getattr(ev, "device_time_total", None)
        if dev_us is None:
            dev_us = ev.cuda_time_total
        if ev.key.startswith("phase::"):
            phases[ev.key[7:]] = {"calls": ev.count, "gpu_ms": dev_us / 1e3, "host_ms": ev.cpu_time_total / 1e3}
        elif getattr(ev, "self_device_time_total", getattr(ev, "self_cuda_time_total", 0)) > 0:
            kernels.append({"name": ev.key[:90], "calls": ev.count,
                            "gpu_ms": getattr(ev, "self_device_time_total", getattr(ev, "self_cuda_time_total", 0)) / 1e3})
    kernels.sort(key=lambda k: -k["gpu_ms"])
    total_gpu = sum(k["gpu_ms"] for k in kernels)
    syncs = sum(ev.count for ev in prof.key_averages() if ev.key == "cudaStreamSynchronize")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40, max_name_column_width=60), flush=True)
    res = loss.last_multiscale
    gaps = idle_gaps(prof)
    memory = {k: dict(v) for k, v in MEMORY.items()}
    MEMORY.clear()
    return {"n": n, "ms": ms, "memory_by_phase": memory, "times_ms": times, "gpu_ms_profiled": total_gpu, "syncs": syncs,
            "phases": phases, "kernels": kernels[:40], "kept": res.kept, "clusters": list(res.clusters),
            "sweeps": res.sweeps, "coarse_finish_sweeps": res.coarse_finish_sweeps, "idle": gaps}


def idle_gaps(prof, top: int = 15) -> dict:
    """How much of the profiled call the GPU idles: the union of kernel intervals against the span
    from the first kernel's start to the last one's end, and the largest gaps (with the kernel that
    ends each). GPU-side copies of host ranges (record_function, autograd functions) are not
    kernels: dropped by their names. The profiler's own host overhead widens the gaps."""
    evs = prof.events()
    cpu_names = {e.name for e in evs if e.device_type == torch.autograd.DeviceType.CPU}
    kern = sorted((e for e in evs if e.device_type == torch.autograd.DeviceType.CUDA and e.name not in cpu_names),
                  key=lambda e: e.time_range.start)
    if not kern:
        return {}
    busy, gaps, end = 0.0, [], kern[0].time_range.start
    for e in kern:
        s, t = e.time_range.start, e.time_range.end
        if s > end:
            gaps.append((s - end, e.name))
        busy += max(0.0, t - max(s, end))
        end = max(end, t)
    span = end - kern[0].time_range.start
    gaps.sort(reverse=True)
    return {"span_ms": span / 1e3, "busy_ms": busy / 1e3, "idle_ms": (span - busy) / 1e3,
            "gaps_over_20us": sum(1 for g in gaps if g[0] >= 20.0),
            "largest": [{"gap_us": round(g, 1), "next_kernel": nxt[:60]} for g, nxt in gaps[:top]]}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="65536,1048576")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    env = environment()
    rows = []
    for n in [int(s) for s in args.sizes.split(",") if s]:
        rows.append(row(n))
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "kernels"}), flush=True)
        torch.cuda.empty_cache()
    dev = env["device"].lower().replace(" ", "-")
    path = os.path.join(RESULTS, f"probe_multiscale_phases{args.tag}_{dev}.json")
    with open(path, "w") as fh:
        json.dump({"env": env, "rows": rows}, fh, indent=1)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
