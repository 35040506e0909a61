"""Exponential throughput of the H100's special-function unit: float32 exp2 against FP16 exp2 on
packed pairs (bench/NOTES.md 93).

The block-sparse passes are bound by one MUFU.EX2 per point pair. PTX's ex2.approx.f16x2 takes two
FP16 exponents per register; on sm_90 ptxas lowers it to two MUFU.EX2.F16 instructions (cuobjdump of
the cubin), so it only helps if MUFU.EX2.F16 issues at twice MUFU.EX2's rate. This times long
dependent-free chains of each in registers (ITERS steps over a (BLOCK,) vector per program, every
step a fused multiply-add and an exponential, the result kept in range by the multiply) and reports
exponentials per second and per SM clock. Writes bench/results/probe_mufu_<device>.json.

    python3 bench/probe_mufu.py
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from common import cuda_median_ms, environment  # noqa: E402

BLOCK, ITERS, CHAINS = 1024, 4096, 4


@triton.jit
def exp2_f32_kernel(X, Y, BLOCK: tl.constexpr, ITERS: tl.constexpr, CHAINS: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    a = tl.load(X + offs)
    b = a + 0.25
    c = a + 0.5
    e = a + 0.75
    for _ in range(ITERS):
        a = tl.exp2(a * -0.75 + 0.1)
        b = tl.exp2(b * -0.75 + 0.1)
        c = tl.exp2(c * -0.75 + 0.1)
        e = tl.exp2(e * -0.75 + 0.1)
    tl.store(Y + offs, a + b + c + e)


@triton.jit
def _ex2_f16x2(x):
    return tl.inline_asm_elementwise("ex2.approx.f16x2 $0, $1;", "=r,r", [x], dtype=tl.float16,
                                     is_pure=True, pack=2)


@triton.jit
def exp2_f16x2_kernel(X, Y, BLOCK: tl.constexpr, ITERS: tl.constexpr, CHAINS: tl.constexpr):
    """Twice the elements per program of the float32 kernel's registers: 2 * BLOCK FP16 values."""
    offs = tl.program_id(0) * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    a = tl.load(X + offs).to(tl.float16)
    b = a + 0.25
    c = a + 0.5
    e = a + 0.75
    for _ in range(ITERS):
        a = _ex2_f16x2(a * -0.75 + 0.1)
        b = _ex2_f16x2(b * -0.75 + 0.1)
        c = _ex2_f16x2(c * -0.75 + 0.1)
        e = _ex2_f16x2(e * -0.75 + 0.1)
    tl.store(Y + offs, (a + b + c + e).to(tl.float32))


def main() -> int:
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    programs = sms * 16
    rows = {}
    for name, kern, per_prog in (("exp2_f32", exp2_f32_kernel, BLOCK), ("exp2_f16x2", exp2_f16x2_kernel, 2 * BLOCK)):
        x = torch.rand(programs * per_prog, device=dev)
        y = torch.empty_like(x)
        run = lambda: kern[(programs,)](x, y, BLOCK=BLOCK, ITERS=ITERS, CHAINS=CHAINS, num_warps=4)  # noqa: E731
        ms = statistics.median(cuda_median_ms(run, reps=7, warmup=2)[1])
        exps = programs * per_prog * ITERS * CHAINS
        clock_hz = 1.98e9  # H100 SXM boost; the per-clock figure is an upper-bound reading
        rows[name] = {"ms": ms, "exps": exps, "exps_per_s": exps / (ms * 1e-3),
                      "exps_per_sm_clock_at_1.98GHz": exps / (ms * 1e-3) / sms / clock_hz,
                      "finite": bool(torch.isfinite(y).all())}
        print(name, json.dumps(rows[name]), flush=True)
    rows["f16x2_over_f32"] = rows["exp2_f16x2"]["exps_per_s"] / rows["exp2_f32"]["exps_per_s"]
    out = {"env": environment(), "sms": sms, "block": BLOCK, "iters": ITERS, "chains": CHAINS, "rows": rows}
    print(json.dumps(out, indent=1))
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    with open(os.path.join(HERE, "results", f"probe_mufu_{name}.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
