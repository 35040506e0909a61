"""The Taylor pass with the gradient's softmin mean against the direct fused pass (issue 15,
bench/NOTES.md 95): on the x -> y plan of the default call's last sweep (bench_multiscale.py's
uniform clouds, blur 0.05, scaling 0.5, loss + gradient in x), the time of
multiscale_taylor.lse with and without ``mean`` (the solve run with MODE "always" to capture its
arguments) and of multiscale_solve._update_and_mean (the direct pass that gives the update and the
mean, captured with MODE "never"), and the Taylor mean's largest difference from the direct one.
Sets multiscale_rules.TAYLOR_MEAN_MIN_POINTS. Writes bench/results/probe_taylor_mean_<device>.json.

    [TAYLOR_P=7] python3 bench/probe_taylor_mean.py [--sizes 1048576,4194304]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
from bench_multiscale import BLUR, SCALING, clouds  # noqa: E402
from common import cuda_median_ms, environment, write  # noqa: E402

import torch_api  # noqa: E402
from ot_triton_jax.core import multiscale_rules as rules  # noqa: E402
from torch_api import multiscale_solve, multiscale_taylor as taylor  # noqa: E402

# the expansion's order the passes are timed at (TAYLOR_P; the cheapest by default, as the default solve takes)
ORDER = int(os.environ.get("TAYLOR_P", rules.TAYLOR_ORDERS[0]))


def captured_call(x, y, mode, module, name, keep):
    """Run the default loss + gradient with Taylor MODE ``mode``; the arguments of the first call of
    module.name for which ``keep(args, kwargs)`` holds."""
    got, orig = [], getattr(module, name)

    def hook(*a, **k):
        if not got and keep(a, k):
            got.append((a, k))
        return orig(*a, **k)
    setattr(module, name, hook)
    taylor.MODE = mode
    try:
        loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale")
        xg = x.clone().requires_grad_(True)
        loss(xg, y).backward()
    finally:
        setattr(module, name, orig)
        taylor.MODE = "auto"
    return got[0], orig, loss.last_multiscale


def kernel_ms(fn) -> dict:
    """GPU time of one call of fn by kernel name (torch.profiler), ms."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    out: dict = {}
    for ev in prof.key_averages():
        if ev.device_time_total > 0 and "kernel" in ev.key:
            out[ev.key] = round(ev.device_time_total / 1e3, 3)
    return out


def row(n: int) -> dict:
    x, y = clouds(n, "uniform")
    (ta, tk), lse, res = captured_call(x, y, "always", taylor, "lse", lambda a, k: a[8] if len(a) > 8 else k.get("mean"))
    (da, dk), fused, _ = captured_call(x, y, "never", multiscale_solve, "_update_and_mean", lambda a, k: True)
    ta = list(ta)
    out = {"n": n, "order": ORDER, "points_per_cluster": [n / c for c in res.clusters]}
    out["taylor_mean_ms"], _ = cuda_median_ms(lambda: lse(*ta, p=ORDER), reps=5)
    out["taylor_mean_kernels_ms"] = kernel_ms(lambda: lse(*ta, p=ORDER))
    mean_t = lse(*ta, p=ORDER)[2]
    ta[8] = False
    out["taylor_plain_ms"], _ = cuda_median_ms(lambda: lse(*ta, p=ORDER), reps=5)
    out["taylor_plain_kernels_ms"] = kernel_ms(lambda: lse(*ta, p=ORDER))
    out["direct_fused_ms"], _ = cuda_median_ms(lambda: fused(*da, **dk), reps=5)
    mean_d = fused(*da, **dk)[1]
    out["direct_fused_kernels_ms"] = kernel_ms(lambda: fused(*da, **dk))
    # the two stream different supersets of the mask's pairs (cluster pairs against row-block unions)
    out["mean_max_abs_diff_vs_direct"] = float((mean_t - mean_d).abs().max())
    out["finite"] = bool(torch.isfinite(mean_t).all())
    out["taylor_mean_over_direct"] = out["taylor_mean_ms"] / out["direct_fused_ms"]
    print(json.dumps(out), flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="1048576,4194304")
    args = ap.parse_args()
    rows = [row(int(s)) for s in args.sizes.split(",")]
    write("probe_taylor_mean", {"env": environment(), "blur": BLUR, "scaling": SCALING, "rows": rows}, full_device_name=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
