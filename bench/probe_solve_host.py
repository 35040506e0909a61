"""Where the time of one torch_api.sinkhorn call goes at n = m = 8192 (issue 16, item 3: a
solve within 1.25x of the sum of its kernels' GPU time), after the warm-up that captures
the loop's CUDA graphs. Two solves per (d, precision): the Sinkhorn benchmark's 10 fixed
iterations, and the default call (threshold 1e-3, early stopping, up to 2000 iterations).

Per solve: the wall time of a synchronized call (no instrumentation; the solves take turns
in 5 rounds of 30 calls, the row keeps the median of the rounds' medians); the
kernels' GPU time per call (torch.profiler, every kernel and copy the call launches); their
ratio; then, with host timestamps patched in, the host timeline of the median call (to the
graph replay, to the return). Writes bench/results/probe_solve_host_<device>.json.

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
from torch_api import cuda_graphs, sinkhorn_loops, sinkhorn_ops  # noqa: E402


def wall_ms(call, reps=50):
    call()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def kernels_ms(call, reps=10):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / reps / 1e3, prof


class Timeline:
    """Host timestamps at the prologue's steps and the graph replays (patched in, then removed)."""

    def __init__(self):
        self.steps, self.saved = {}, []

    def _patch(self, owner, name):
        fn = getattr(owner, name, None)
        if fn is None:  # a step that an older checkout lacks
            return
        self.saved.append((owner, name, fn))
        steps = self.steps

        def wrapped(*args, **kwargs):
            steps[name + ">"] = time.perf_counter()
            out = fn(*args, **kwargs)
            steps[name + "<"] = time.perf_counter()
            return out

        setattr(owner, name, wrapped)

    def __enter__(self):
        for owner, name in ((sinkhorn_ops, "_check_values"), (sinkhorn_ops, "kernel_params"),
                            (sinkhorn_ops, "alternating_loop"), (sinkhorn_loops, "masked_log"),
                            (sinkhorn_loops.cuda_graphs, "graph_set"), (cuda_graphs.GraphSet, "load"),
                            (cuda_graphs.GraphSet, "run"), (sinkhorn_loops, "loop_record")):
            self._patch(owner, name)
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self.saved):
            setattr(owner, name, fn)

    def median_call(self, call, reps=30):
        traces = []
        for _ in range(reps):
            self.steps.clear()
            t0 = time.perf_counter()
            call()
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            trace = {k: round((v - t0) * 1e3, 3) for k, v in sorted(self.steps.items(), key=lambda kv: kv[1])}
            trace.update(returned=round((t1 - t0) * 1e3, 3), synchronized=round((t2 - t0) * 1e3, 3))
            traces.append(trace)
        return sorted(traces, key=lambda t: t["synchronized"])[reps // 2]


cases = []
for d in (3, 64):
    for prec in ("float32", "tf32"):
        torch.manual_seed(0)
        x = torch.randn(8192, d, device="cuda")
        y = torch.randn(8192, d, device="cuda")
        for solve, kw in (("10 iterations", dict(min_iterations=10, max_iterations=10)), ("default", {})):
            def call(x=x, y=y, prec=prec, kw=kw):
                return torch_api.sinkhorn(x, y, epsilon=0.1, precision=prec, **kw)

            for _ in range(3):
                out = call()
            cases.append(({"n": 8192, "d": d, "precision": prec, "solve": solve, "n_iters": int(out.n_iters)}, call))
# the host's speed drifts: the cases take turns, ROUNDS times, and each row keeps its rounds' medians
ROUNDS = 5
walls = [[] for _ in cases]
for _ in range(ROUNDS):
    for k, (_, call) in enumerate(cases):
        walls[k].append(wall_ms(call, reps=30))
rows = []
for (row, call), w in zip(cases, walls):
    kern, prof = kernels_ms(call)
    wall = statistics.median(w)
    with Timeline() as tl:
        trace = tl.median_call(call)
    row.update(wall_ms=wall, wall_ms_rounds=w, kernels_gpu_ms_per_call=kern, wall_over_kernels=wall / kern)
    print(row, flush=True)
    print("  host timeline of the median instrumented call (ms):", trace, flush=True)
    if row["d"] == 3 and row["precision"] == "float32" and row["solve"] == "10 iterations":
        print(prof.key_averages().table(sort_by="device_time_total", row_limit=20))
    rows.append(row)
print("wrote", write("probe_solve_host", {"env": environment(), "rounds": ROUNDS, "rows": rows}))
