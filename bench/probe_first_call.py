"""Where the first call's time goes (issue 15's first-call target): a cold Triton cache, one
SamplesLoss(backend="multiscale") loss + gradient, every Triton compile timed (kernel name,
seconds), then the same call warm. Writes bench/results/probe_first_call_<device>.json.

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
from bench_multiscale import clouds  # noqa: E402

COMPILES: list = []
_do_compile = JITFunction._do_compile


def _timed(self, *args, **kwargs):
    t0 = time.perf_counter()
    out = _do_compile(self, *args, **kwargs)
    COMPILES.append((self.fn.__name__, time.perf_counter() - t0))
    return out


JITFunction._do_compile = _timed


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 20)
    args = ap.parse_args()
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
    for name, sec in COMPILES:
        k = per_kernel.setdefault(name, {"compiles": 0, "s": 0.0})
        k["compiles"] += 1
        k["s"] += sec
    out = {"env": environment(), "n": args.n, "cold_s": cold, "warm_s": warm, "compiles": len(COMPILES),
           "compile_s": sum(s for _, s in COMPILES), "per_kernel": per_kernel}
    print(json.dumps(out, indent=1))
    dev = torch.cuda.get_device_name().lower().replace(" ", "-")
    with open(os.path.join(HERE, "results", f"probe_first_call_{dev}.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
