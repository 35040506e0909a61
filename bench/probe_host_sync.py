"""Where the multiscale call's host time and synchronizations go (issue 15, bench/NOTES.md 111):
one warm loss + gradient at n = m (default 2^20; bench_multiscale's uniform clouds, blur 0.05,
scaling 0.5): the call's wall times, cProfile of one call (by own time and by cumulative time),
and every synchronization's call site (torch.cuda.set_sync_debug_mode, each one counted).

    python3 bench/probe_host_sync.py [n]
"""
import collections
import cProfile
import io
import os
import pstats
import sys
import time
import traceback
import warnings

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
from bench_multiscale import BLUR, SCALING, clouds  # noqa: E402

import torch_api  # noqa: E402


def main() -> int:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
    x, y = clouds(n, "uniform")
    loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale")

    def call():
        xg = x.detach().requires_grad_(True)
        v = loss(xg, y)
        return v, torch.autograd.grad(v, xg)[0]
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        call()
        torch.cuda.synchronize()
        times.append(round((time.perf_counter() - t0) * 1e3, 1))
    print("wall ms", times)
    prof = cProfile.Profile()
    prof.enable()
    call()
    torch.cuda.synchronize()
    prof.disable()
    for key, rows in (("tottime", 35), ("cumulative", 60)):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(rows)
        print(out.getvalue())
    sites = collections.Counter()

    def record(message, category, filename, lineno, file=None, line=None):
        ours = [f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in traceback.extract_stack()[:-2]
                if "torch_api" in f.filename or "ot_triton_jax" in f.filename]
        sites[" <- ".join(reversed(ours[-3:]))] += 1
    warnings.showwarning = record
    warnings.simplefilter("always")  # every synchronization, not the first per call site
    torch.cuda.set_sync_debug_mode("warn")
    call()
    torch.cuda.set_sync_debug_mode(0)
    for site, count in sites.most_common():
        print(count, site)
    print("total syncs", sum(sites.values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
