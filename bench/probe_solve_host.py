"""Where the time of one default torch_api.sinkhorn call goes (n = m = 8192, the Sinkhorn
benchmark's 10 fixed iterations), after the warm-up that captures the loop's CUDA graphs:
wall time per synchronized call; host time from the call to the graph launch (prologue) and
from the graph launch to the return (epilogue, including the wait for the GPU); the GPU
time of the replayed segment (CUDA events around it); the kernels' GPU time per call from
torch.profiler. Writes bench/results/probe_solve_host_<device>.json.

    python bench/probe_solve_host.py
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment, write  # noqa: E402

import torch_api  # noqa: E402
from torch_api import cuda_graphs  # noqa: E402

marks = {}
_run = cuda_graphs.GraphSet.run


def timed_run(self, kind, body):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    marks["replay"] = time.perf_counter()
    start.record()
    out = _run(self, kind, body)
    end.record()
    marks["events"] = (start, end)
    return out


cuda_graphs.GraphSet.run = timed_run

# host timestamps at the prologue's steps (module globals looked up at call time)
from torch_api import sinkhorn_loops, sinkhorn_ops  # noqa: E402

steps = {}


def stamp(mod, name):
    fn = getattr(mod, name)

    def wrapped(*args, **kwargs):
        steps[name + ">"] = time.perf_counter()
        out = fn(*args, **kwargs)
        steps[name + "<"] = time.perf_counter()
        return out

    setattr(mod, name, wrapped)


for mod, name in ((sinkhorn_ops, "_check_values"), (sinkhorn_ops, "clouds"), (sinkhorn_ops, "kernel_params"),
                  (sinkhorn_ops, "alternating_loop"), (sinkhorn_ops, "_loop_outputs"),
                  (sinkhorn_loops, "masked_log"), (sinkhorn_loops.cuda_graphs, "graph_set")):
    stamp(mod, name)
_load = cuda_graphs.GraphSet.load


def timed_load(self, values):
    steps["load>"] = time.perf_counter()
    _load(self, values)
    steps["load<"] = time.perf_counter()


cuda_graphs.GraphSet.load = timed_load
rows = []
for d in (3, 64):  # noqa: C901
    for prec in ("float32", "tf32"):
        x = torch.randn(8192, d, device="cuda")
        y = torch.randn(8192, d, device="cuda")

        def call():
            return torch_api.sinkhorn(x, y, epsilon=0.1, min_iterations=10, max_iterations=10, inner_iterations=10,
                                      precision=prec)

        for _ in range(3):
            call()
        torch.cuda.synchronize()
        wall, pro, epi, seg, trace = [], [], [], [], []
        for _ in range(30):
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            trace.append({k: (v - t0) * 1e3 for k, v in sorted(steps.items(), key=lambda kv: kv[1])})
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            wall.append((t2 - t0) * 1e3)
            pro.append((marks["replay"] - t0) * 1e3)
            epi.append((t1 - marks["replay"]) * 1e3)
            seg.append(marks["events"][0].elapsed_time(marks["events"][1]))
        mid = sorted(range(30), key=lambda i: wall[i])[15]
        print("host timeline of the median call (ms from the call):",
              {k: round(v, 3) for k, v in trace[mid].items()}, "replay", round(pro[mid], 3), "return",
              round(pro[mid] + epi[mid], 3), "synchronized", round(wall[mid], 3), flush=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                call()
            torch.cuda.synchronize()
        kernel_us = sum(e.device_time_total for e in prof.key_averages()) / 10
        row = {"n": 8192, "d": d, "precision": prec, "wall_ms": statistics.median(wall),
               "prologue_host_ms": statistics.median(pro), "after_launch_host_ms": statistics.median(epi),
               "segment_gpu_ms": statistics.median(seg), "kernels_gpu_ms_per_call": kernel_us / 1e3}
        print(row, flush=True)
        if d == 3 and prec == "float32":
            print(prof.key_averages().table(sort_by="device_time_total", row_limit=15))
        rows.append(row)
print("wrote", write("probe_solve_host", {"env": environment(), "rows": rows}))
