"""Where the first call's time goes (issue 15's first-call target): a cold Triton cache, one
SamplesLoss(backend="multiscale") loss + gradient, every Triton compile timed (kernel name,
seconds; inside the parallel prewarm, torch_api.launch.prewarm, worker processes compile into
the cache and the in-process step loads, so per-kernel seconds there are loads and the
prewarm's and its workers' wall times are reported instead), then the same call warm. ``--no-prewarm``: the one-by-one compiles at first launch, for comparison.
Writes bench/results/probe_first_call_<device>.json.

    python3 bench/probe_first_call.py [--n 1048576]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="cold_triton_")  # before triton is imported

import torch  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
from common import environment  # noqa: E402

import torch_api  # noqa: E402
from torch_api import kernel_ops, launch  # noqa: E402
from bench_multiscale import clouds  # noqa: E402

COMPILES: list = []
PREWARM: list = []
_do_compile = JITFunction._do_compile
_in_prewarm = [False]


def _timed(self, *args, **kwargs):
    t0 = time.perf_counter()
    out = _do_compile(self, *args, **kwargs)
    if out is not None:  # None: the prewarm only read the specialization for its worker processes
        COMPILES.append((self.fn.__name__, time.perf_counter() - t0, _in_prewarm[0]))
    return out


JITFunction._do_compile = _timed
_prewarm = launch.prewarm
_workers = launch._compile_in_processes
WORKERS: list = []


def _timed_workers(*args, **kwargs):
    t0 = time.perf_counter()
    sent = _workers(*args, **kwargs)
    WORKERS.append({"jobs": sent, "s": time.perf_counter() - t0})
    return sent


launch._compile_in_processes = _timed_workers


def _timed_prewarm(items, workers=None):
    _in_prewarm[0] = True
    t0 = time.perf_counter()
    try:
        ran = _prewarm(items, workers)
    finally:
        _in_prewarm[0] = False
    PREWARM.append({"kernels": len(items), "compiled": ran, "s": time.perf_counter() - t0})
    return ran


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--no-prewarm", action="store_true")
    args = ap.parse_args()
    if not args.no_prewarm:
        kernel_ops.launch_prewarm = _timed_prewarm
    else:
        kernel_ops.launch_prewarm = lambda items, workers=None: 0
    # bench_multiscale's uniform clouds (seed n; the committed JSON of this script used seed 0)
    x, y = clouds(args.n, "uniform")
    torch.cuda.synchronize()
    loss = torch_api.SamplesLoss("sinkhorn", blur=0.05, scaling=0.5, backend="multiscale")

    def call():
        xg = x.clone().requires_grad_(True)
        (gx,) = torch.autograd.grad(loss(xg, y), xg)
        torch.cuda.synchronize()
        return gx

    t0 = time.perf_counter()
    call()
    cold = time.perf_counter() - t0
    t0 = time.perf_counter()
    call()
    warm = time.perf_counter() - t0
    per_kernel: dict = {}
    for name, sec, pre in COMPILES:
        k = per_kernel.setdefault(name, {"compiles": 0, "s": 0.0, "in_prewarm": 0})
        k["compiles"] += 1
        k["s"] += sec
        k["in_prewarm"] += int(pre)
    out = {"env": environment(), "n": args.n, "prewarm": not args.no_prewarm, "cpus": os.cpu_count(),
           "cold_s": cold, "warm_s": warm, "compiles": len(COMPILES),
           "compiles_at_first_launch": sum(1 for *_, pre in COMPILES if not pre),
           "compile_s_at_first_launch": sum(s for _, s, pre in COMPILES if not pre),
           "prewarm_calls": PREWARM, "worker_steps": WORKERS, "per_kernel": per_kernel}
    print(json.dumps(out, indent=1))
    dev = torch.cuda.get_device_name().lower().replace(" ", "-")
    tag = "_no_prewarm" if args.no_prewarm else ""
    with open(os.path.join(HERE, "results", f"probe_first_call{tag}_{dev}.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
