"""Host time of our launches, piece by piece (why n <= 8192 solves and small mHC calls are host-bound).

OT half-step (n = m = 8192, d = 3, tf32): microseconds of host time per call of torch.empty,
lse_plan, Triton's own launch, torch_api.launch, and the whole kernel_calls.lse_update
(calls queued without synchronizing; the GPU queue never fills).
mHC (n = 4, B = 4096): host timeline of forward + torch.autograd.grad, with the kernel launch
instants taken from Triton's launch hook, next to the same timeline for a trivial
autograd.Function (x * 2): the autograd engine's own cost on this machine.
Writes bench/results/probe_host_<device>.json.

    python bench/probe_host.py
"""

from __future__ import annotations

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402
import triton  # noqa: E402

from common import environment, write  # noqa: E402

import torch_api  # noqa: E402
from ot_triton_jax.core import launch_plans  # noqa: E402
from ot_triton_jax.core.kernels import lse_update_kernel  # noqa: E402
from torch_api import kernel_ops as kernel_calls, launch as fast_launch  # noqa: E402


def host_us(fn, reps=200):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        ts.append((time.perf_counter() - t0) / reps * 1e6)
        torch.cuda.synchronize()
    return statistics.median(ts)


def ot_half_step():
    n, d, prec = 8192, 3, "tf32"
    x, y = torch.randn(n, d, device="cuda"), torch.randn(n, d, device="cuda")
    X, Y = kernel_calls.clouds(x, y)
    prm = kernel_calls.params(0.1, 1.0, x.device)
    g = torch.zeros(n, device="cuda")
    la = torch.full((n,), -9.0, device="cuda")
    plan = launch_plans.lse_plan(n, n, d, prec, True)
    flags = launch_plans.lse_constexprs(plan, has_logw_in=False, has_logw_out=True, compute_err=False)
    split = plan.constexprs["SPLIT"]
    out = torch.empty(n, device="cuda")
    part = torch.empty(2 * split * n, device="cuda")
    args = (X.hi, X.lo, Y.hi, Y.lo, X.sqnorm, Y.sqnorm, g, prm, la, prm, prm, n, n, out, out, part)
    meta = {**plan.constexprs, **flags}
    rec = {"n": n, "d": d, "precision": prec, "split": split}
    rec["torch_empty_us"] = host_us(lambda: torch.empty(n, device="cuda"))
    rec["lse_plan_us"] = host_us(lambda: launch_plans.lse_plan(n, n, d, prec, True, fold=False))
    rec["triton_launch_us"] = host_us(lambda: lse_update_kernel[plan.grid](
        *args, num_warps=plan.num_warps, num_stages=plan.num_stages, **meta))
    rec["fast_launch_us"] = host_us(lambda: fast_launch.launch(
        lse_update_kernel, plan.grid, args, meta, num_warps=plan.num_warps, num_stages=plan.num_stages))
    rec["lse_update_us"] = host_us(lambda: kernel_calls.lse_update(X, Y, g, prm, prec, logw_out=la))
    rec["lse_update_fold_err_us"] = host_us(lambda: kernel_calls.lse_update(
        X, Y, g, prm, prec, logw_out=la, pold=g, fold=True))
    return rec


class _Twice(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, g):
        return g * 2


def mhc_timeline():
    stamps = []

    def hook(*_):
        stamps.append(time.perf_counter())

    rec = {}
    m = torch.randn(4096, 4, 4, device="cuda", requires_grad=True)
    w = torch.randn(4096, 4, 4, device="cuda")
    cases = {
        "mhc": lambda: torch_api.mhc_sinkhorn(m, 20, check_finite=False),
        "trivial_function": lambda: _Twice.apply(m),
    }
    for name, fwd in cases.items():
        rows = []
        for rep in range(30):
            torch.cuda.synchronize()
            stamps.clear()
            triton.knobs.runtime.launch_enter_hook = hook
            t0 = time.perf_counter()
            out = fwd()
            t1 = time.perf_counter()
            (gm,) = torch.autograd.grad(out, m, w)
            t2 = time.perf_counter()
            triton.knobs.runtime.launch_enter_hook = None
            torch.cuda.synchronize()
            if rep >= 5:
                row = {"forward_call_us": (t1 - t0) * 1e6, "grad_call_us": (t2 - t1) * 1e6}
                if len(stamps) == 2:
                    row["grad_start_to_bwd_launch_us"] = (stamps[1] - t1) * 1e6
                    row["bwd_launch_to_grad_return_us"] = (t2 - stamps[1]) * 1e6
                rows.append(row)
        rec[name] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    return rec


def main():
    rec = {"ot_half_step": ot_half_step(), "mhc_autograd": mhc_timeline()}
    print(rec, flush=True)
    write("probe_host", {"env": environment(), "results": rec})


if __name__ == "__main__":
    main()
