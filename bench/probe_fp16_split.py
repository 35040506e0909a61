"""Issue 16's FP16 split, measured before it is built: is the d = 64 cross term faster with FP16
operands (2x the TF32 tensor rate) at the accuracy of today's 3xTF32?

One LSE half-step at n = m = 65536, d = 64, eps = 0.1, randn clouds (the issue's workload):
f_i = s|x_i|^2 - eps ln sum_j exp((g_j - s|y_j|^2 + 2 s <x_i, y_j>) / eps), s = 1/2, written
as an experimental online-LSE kernel in this file (not the product's kernel) with the cross
term from hi/lo operand pairs:

* ``fp16x3``: x S = hi + lo, both FP16 (S a power of two putting max |x| at <= 1, so nothing
  overflows and the lo parts keep ~2^-24 absolute resolution), three FP16 products
  hi.hi + lo.hi + hi.lo into one float32 accumulator, scaled back by 1 / S^2 in the exponent's
  coefficient;
* ``tf32x3``: the same with float32 hi/lo (hi rounded to TF32) and TF32 products: what the
  product's float32 path does;
* ``fp16x1`` / ``tf32x1``: the head product alone (the ``precision="tf32"`` accuracy class).

Every variant is timed (CUDA events, medians) beside the product's own kernel on the same
inputs (``torch_api.kernel_ops.lse_update``, float32 and tf32, its online loop: no FOLD) and its f compared with a
float64 evaluation on 512 sampled rows. Prediction (bench/NOTES.md 62-63): 3xTF32 at the measured
369 TFLOP/s is 4.5 ms of tensor work per half-step, 3xFP16 at 686 TFLOP/s 2.4 ms, the exps 1.0 ms.
Writes bench/results/probe_fp16_split_<device>.json.

    python3 bench/probe_fp16_split.py [--n 65536] [--d 64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
from common import cuda_median_ms, environment  # noqa: E402

from ot_triton_jax.core import kernel_calls, launch_plans  # noqa: E402
from torch_api import kernel_ops  # noqa: E402

LOG2E = 1.4426950408889634
S_COST = 0.5
EPS = 0.1
TILES = [(128, 64, 4, 3), (128, 128, 8, 3), (64, 128, 4, 3), (256, 64, 8, 3)]


@triton.jit
def lse_split_kernel(XH, XL, YH, YL, BIAS, OUT, m, coef2,
                     D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     FP16: tl.constexpr, PRODUCTS: tl.constexpr, MASKED: tl.constexpr = False):
    """OUT_i = log2 sum_j exp2(coef2 <xh_i + xl_i, yh_j + yl_j> + BIAS_j) (n, m multiples of the tiles).
    MASKED: the column masks and -inf guards the product's loop carries (mask_n = cols < m on every
    load, -inf bias on masked columns, a guarded max), to price them."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    kk = tl.arange(0, D)
    xh = tl.load(XH + rows[:, None] * D + kk[None, :])
    xl = tl.load(XL + rows[:, None] * D + kk[None, :])
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in range(0, m, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        mask_n = cols < m
        ymask = mask_n[:, None] & (kk[None, :] < D)
        if not MASKED:  # a constant-true mask: Triton drops it
            mask_n = tl.full((BLOCK_N,), 1, tl.int1)
            ymask = tl.full((BLOCK_N, D), 1, tl.int1)
        yh = tl.load(YH + cols[:, None] * D + kk[None, :], mask=ymask, other=0.0)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if FP16:
            acc = tl.dot(xh, tl.trans(yh), acc)
            if PRODUCTS == 3:
                yl = tl.load(YL + cols[:, None] * D + kk[None, :], mask=ymask, other=0.0)
                acc = tl.dot(xl, tl.trans(yh), acc)
                acc = tl.dot(xh, tl.trans(yl), acc)
        else:
            acc = tl.dot(xh, tl.trans(yh), acc, input_precision="tf32")
            if PRODUCTS == 3:
                yl = tl.load(YL + cols[:, None] * D + kk[None, :], mask=ymask, other=0.0)
                acc = tl.dot(xl, tl.trans(yh), acc, input_precision="tf32")
                acc = tl.dot(xh, tl.trans(yl), acc, input_precision="tf32")
        bias = tl.where(mask_n, tl.load(BIAS + cols, mask=mask_n, other=0.0), float("-inf"))
        t = acc * coef2 + bias[None, :]
        new_max = tl.maximum(run_max, tl.max(t, axis=1))
        if MASKED:
            safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        else:
            safe = new_max
        run_sum = run_sum * tl.exp2(run_max - safe) + tl.sum(tl.exp2(t - safe[:, None]), axis=1)
        run_max = new_max
    tl.store(OUT + rows, run_max + tl.log2(run_sum))


def split(p: torch.Tensor, fp16: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) with hi + lo = p * scale: FP16 parts, or a TF32-rounded float32 head and its tail."""
    ps = p * scale
    if fp16:
        hi = ps.half()
        return hi.contiguous(), (ps - hi.float()).half().contiguous()
    hi = (ps.view(torch.int32) + 0x1000 & ~0x1FFF).view(torch.float32)  # round to 10 mantissa bits
    return hi.contiguous(), (ps - hi).contiguous()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=65536)
    ap.add_argument("--d", type=int, default=64)
    args = ap.parse_args()
    n = m = args.n
    gen = torch.Generator().manual_seed(16)
    x = torch.randn(n, args.d, generator=gen).cuda()
    y = torch.randn(m, args.d, generator=gen).cuda()
    g = (0.1 * torch.randn(m, generator=gen)).cuda()
    # a power of two putting every coordinate at <= 1 (one scale for both clouds)
    scale = 2.0 ** -math.ceil(math.log2(float(torch.maximum(x.abs().max(), y.abs().max()))))
    bias = ((g - S_COST * (y * y).sum(1)) / EPS * LOG2E).float().contiguous()
    coef2 = 2.0 * S_COST / EPS * LOG2E / scale ** 2
    xn = (x.double() * x.double()).sum(1)

    rows = torch.randperm(n, generator=gen)[:512].cuda()
    xd, yd = x.double()[rows], y.double()
    cost = S_COST * ((xd * xd).sum(1)[:, None] + (yd * yd).sum(1)[None, :] - 2.0 * xd @ yd.T)
    f_ref = -EPS * torch.logsumexp((g.double()[None, :] - cost) / EPS, dim=1)

    def rel_err(f):
        return float(((f[rows].double() - f_ref).abs().max() / f_ref.abs().max()))

    out = {"env": environment(), "n": n, "d": args.d, "eps": EPS, "scale": scale, "rows": []}
    X, Y = kernel_ops.clouds(x, y)
    prm = kernel_ops.params(EPS, S_COST, x.device)
    f_prev = kernel_ops.lse_update(X, Y, g, prm, "float32")[0]  # a previous potential for FOLD: this one
    table = launch_plans.GPU_LSE
    saved = {k: dict(v) for k, v in table.items()}
    for precision, fold, tile in (("float32", False, None), ("float32", True, None), ("tf32", False, None),
                                  ("float32", False, (256, 64, 8, 3)), ("float32", True, (256, 64, 8, 3))):
        if tile is not None:
            for key in (("resident", precision), ("resident", precision, "fold")):
                table[key] = dict(BLOCK_M=tile[0], BLOCK_N=tile[1], num_warps=tile[2], num_stages=tile[3])
        launch_plans.lse_plan.cache_clear()
        kernel_calls.lse_update.cache_clear()
        kw = dict(pold=f_prev, fold=True, compute_err=False) if fold else {}
        run = lambda: kernel_ops.lse_update(X, Y, g, prm, precision, **kw)[0]  # noqa: E731
        f = run()
        ms = statistics.median(cuda_median_ms(run, reps=7)[1])
        row = {"kernel": f"product lse_update ({precision}{', FOLD' if fold else ''})",
               "tile": list(tile) if tile else "plan", "ms": ms, "f_rel_err": rel_err(f),
               "finite": bool(torch.isfinite(f).all())}
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
        table.clear()
        table.update(saved)
    launch_plans.lse_plan.cache_clear()
    kernel_calls.lse_update.cache_clear()
    lse2 = torch.empty(n, device=x.device, dtype=torch.float32)
    variants = [(name, fp16, products, tile, False) for name, fp16, products in
                (("fp16x3", True, 3), ("tf32x3", False, 3), ("fp16x1", True, 1), ("tf32x1", False, 1)) for tile in TILES]
    variants += [("fp16x3", True, 3, (256, 64, 8, 3), True), ("tf32x3", False, 3, (256, 64, 8, 3), True)]
    for name, fp16, products, (bm, bn, warps, stages), masked in variants:
        xh, xl = split(x, fp16, scale)
        yh, yl = split(y, fp16, scale)
        row = {"kernel": name, "BLOCK_M": bm, "BLOCK_N": bn, "num_warps": warps, "num_stages": stages,
               "masked": masked}
        try:
            def call():
                lse_split_kernel[(n // bm,)](xh, xl, yh, yl, bias, lse2, m, coef2, D=args.d, BLOCK_M=bm,
                                             BLOCK_N=bn, FP16=fp16, PRODUCTS=products, MASKED=masked,
                                             num_warps=warps, num_stages=stages)
            call()
            f = (S_COST * xn - EPS * math.log(2.0) * lse2.double())
            row.update(ms=statistics.median(cuda_median_ms(call, reps=7)[1]), f_rel_err=rel_err(f),
                       finite=bool(torch.isfinite(lse2).all()))
        except Exception as exc:  # a tile that does not compile or fit: recorded
            row["failure"] = repr(exc)[:300]
        out["rows"].append(row)
        print(json.dumps(row), flush=True)
    dev = torch.cuda.get_device_name().lower().replace(" ", "-")
    with open(os.path.join(HERE, "results", f"probe_fp16_split_{dev}.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
