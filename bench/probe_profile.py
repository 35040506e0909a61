"""Where a solve's GPU time goes, and the throughput its kernels reach (issue 16's profiler evidence).

torch.profiler (CUPTI kernel records) around torch_api.sinkhorn, 10 fixed-eps iterations (eps 0.1,
randn, the suite's default calls), and around SamplesLoss loss + gradient: device time per
kernel, and for the streaming kernels the throughput reached on the unit that bounds them,
from their known work:

* exponentials: one exp2 per pair and pass, against the measured 4.17e12 exp2/s (MUFU);
* tensor cores: 2 n m K flops per product (K: the operand stride padded to the tile's BLOCK_K,
  3 products for "float32", 1 for "tf32" and for packed operands at d <= 5), against the measured
  FP16 dense rate 686e12 flop/s.

Also says whether Nsight Compute (ncu) is on the machine. Writes bench/results/probe_profile_<device>.json.

    python bench/probe_profile.py
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))

EXP2_PER_S, FP16_FLOPS = 4.17e12, 686e12
CASES = ((65536, 64, "float32"), (65536, 64, "tf32"), (65536, 3, "float32"), (65536, 3, "tf32"),
         (262144, 3, "float32"))
STREAMING = ("lse_update_kernel", "lse_pair_kernel", "apply_plan_kernel")


def kernel_times(fn, reps: int = 3) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches per call, device ms per call)} over ``reps`` calls of fn."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    acc: dict = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.events():
        if ev.device_type.name == "CUDA" and ev.device_time_total > 0:
            acc[ev.name][0] += 1
            acc[ev.name][1] += ev.device_time_total / 1000.0
    return {k: (v[0] // reps, v[1] / reps) for k, v in acc.items()}


def main() -> int:
    import torch

    from common import environment, write
    from ot_triton_jax.core import launch_plans
    import torch_api
    rows = []
    for n, d, prec in CASES:
        gen = torch.Generator().manual_seed(n + d)
        x, y = torch.randn(n, d, generator=gen).cuda(), torch.randn(n, d, generator=gen).cuda()
        kw = {} if prec == "float32" else {"precision": prec}
        times = kernel_times(lambda: torch_api.sinkhorn(x, y, epsilon=0.1, min_iterations=10, max_iterations=10,
                                                         inner_iterations=10, **kw))
        total = sum(t for _, t in times.values())
        plan = launch_plans.lse_plan(n, n, d, prec, True, fold=True).constexprs
        k = plan["BLOCK_K"]
        # packed operands (d <= 5): the three products are one over BLOCK_K = 16
        products = 3 if prec == "float32" and not launch_plans.packed_operands(d) else 1
        for name, (launches, ms) in sorted(times.items(), key=lambda kv: -kv[1][1]):
            row = {"workload": "sinkhorn_10it", "n": n, "d": d, "precision": prec, "kernel": name,
                   "launches": launches, "device_ms": ms, "share": ms / total}
            if any(name.startswith(s) for s in STREAMING) and launches:
                pairs = float(n) * n * launches
                row["exp2_fraction"] = pairs / EXP2_PER_S / (ms / 1e3)
                row["tensor_fraction"] = 2.0 * pairs * k * products / FP16_FLOPS / (ms / 1e3)
                row["block_k"] = k
            rows.append(row)
            print(json.dumps(row), flush=True)
    for n, d, blur in ((8192, 3, 0.05), (16384, 16, 0.1)):
        gen = torch.Generator().manual_seed(n + d)
        x, y = torch.randn(n, d, generator=gen).cuda(), (torch.randn(n, d, generator=gen) + 0.5).cuda()
        loss = torch_api.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=0.5)

        def step():
            xg = x.detach().clone().requires_grad_(True)
            torch.autograd.grad(loss(xg, y), xg)

        times = kernel_times(step)
        total = sum(t for _, t in times.values())
        for name, (launches, ms) in sorted(times.items(), key=lambda kv: -kv[1][1])[:8]:
            rows.append({"workload": "samples_loss_grad", "n": n, "d": d, "precision": "float32", "kernel": name,
                         "launches": launches, "device_ms": ms, "share": ms / total})
            print(json.dumps(rows[-1]), flush=True)
    ncu = shutil.which("ncu") or next((p for p in ("/usr/local/cuda/bin/ncu", "/opt/nvidia/nsight-compute/ncu")
                                       if os.path.exists(p)), None)
    print("ncu:", ncu)
    path = write("probe_profile", {"env": environment(), "exp2_per_s": EXP2_PER_S, "fp16_flops": FP16_FLOPS,
                                   "ncu": ncu, "rows": rows})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
