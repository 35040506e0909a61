"""Wall time per segment of the multiscale loss + gradient (issue 15, bench/NOTES.md 112): the
segments start at the first call of a marker function of multiscale_solve (clustering, geometry,
coarse sweeps, lifted fits, lift, Taylor sides, pair lists, the fine passes, the bounds), each
boundary synchronized (``--nosync``: host timestamps only), medians of 7 warm calls; to compare with
the segments' kernel sums (bench/probe_multiscale_phases.py).

    python3 bench/probe_multiscale_segments.py [n] [--nosync]
"""
import json
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
from bench_multiscale import BLUR, SCALING, clouds  # noqa: E402

import torch_api  # noqa: E402
from torch_api import multiscale_solve as ms  # noqa: E402
n = int(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else 1 << 20
SYNC = "--nosync" not in sys.argv
x, y = clouds(n, "uniform")
loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale")
marks = []
def mark(name):
    if SYNC:
        torch.cuda.synchronize()
    marks.append((name, time.perf_counter()))
def first(mod, attr, name):
    orig = getattr(mod, attr)
    def w(*a, **k):
        if not any(m[0] == name for m in marks):
            mark(name)
        return orig(*a, **k)
    setattr(mod, attr, w)
first(ms, "cluster_pair", "1 cluster_pair")
first(ms.mb, "geometry", "2 geometry")
first(ms._CoarsePhase, "anneal", "3 coarse")
first(ms, "apply_plan", "4 lifted_fits")
first(ms, "kept_lists_many", "5 lift")
first(ms.taylor, "TaylorSide", "6 fine: taylor sides")
first(ms.taylor, "pair_orders_many", "7 fine: orders")
first(ms, "_update_and_mean", "8 fine: passes")
first(ms.mb, "dropped_mass", "9 bounds")
def call():
    marks.clear()
    mark("0 start")
    xg = x.detach().requires_grad_(True)
    v = loss(xg, y)
    mark("A forward done")
    g = torch.autograd.grad(v, xg)[0]
    mark("B backward done")
    torch.cuda.synchronize()
    marks.append(("C end", time.perf_counter()))
    return list(marks)
for _ in range(3):
    call()
runs = [call() for _ in range(7)]
names = [m[0] for m in runs[0]]
rows = {}
for r in runs:
    for (a, ta), (b, tb) in zip(r[:-1], r[1:]):
        rows.setdefault(f"{a} -> {b}", []).append((tb - ta) * 1e3)
tot = statistics.median((r[-1][1] - r[0][1]) * 1e3 for r in runs)
print(json.dumps({"n": n, "sync": SYNC, "total_ms": round(tot, 2)}))
for k, v in rows.items():
    print(f"{statistics.median(v):8.2f} ms  {k}")
