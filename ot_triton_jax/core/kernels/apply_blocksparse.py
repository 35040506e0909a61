"""Block-sparse ("multiscale") application of the transport plan: apply.py over kept columns only.

    P_ij     = exp( (F_i + G_j - C_ij) / eps ) if j is in a range of row block(i), else 0
    OUT_ik   = sum_j P_ij V_jk     (V: m x p, row-major)
    ROWSUM_i = sum_j P_ij          (written by the programs with pid_p == 0)

C_ij = s |x_i - y_j|^2, PARAMS = [eps, s]. The layout (RANGES (cdiv(n, BLOCK_M), R, 2):
the column runs [start, end) each row block of BLOCK_M rows streams) is lse_blocksparse.py's.
A row block whose ranges are all empty gets OUT = 0 and ROWSUM = 0.

Grid (cdiv(n, BLOCK_M), cdiv(p, BLOCK_P)), no column split. As in apply.py: for p <= 8
(``P_FMA = p``) the product with V uses exact float32 FMAs, otherwise ``tl.dot`` with
PRECISION ("tf32x3", "tf32", "fp16x3" or "fp16"; XSC, YSC as in apply.py); ``HAS_V = False``: ROWSUM only. Points as in apply.py.
"""

import triton
import triton.language as tl

from .lse_blocksparse import kept_range
from .tiles import LOG2E, cross_coef2, load_resident, plan_col_bias, plan_row_bias, plan_tile, plan_times_v


@triton.jit
def _apply_range(X, XLO, Y, YLO, YN, G, V, x_hi, x_lo, offs_m, mask_m, offs_p, mask_p, row2, col_start, col_end,
                 acc, rowsum, s, inv_eps, coef2, HAS_V: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, P_FMA: tl.constexpr, SINGLE_K: tl.constexpr,
                 PRECISION: tl.constexpr, D: tl.constexpr, P: tl.constexpr):
    """(acc, rowsum) carried on over the columns [col_start, col_end)."""
    for n0 in range(col_start, col_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < col_end
        col2 = plan_col_bias(G, YN, offs_n, mask_n, s, inv_eps)
        plan = plan_tile(X, XLO, Y, YLO, x_hi, x_lo, offs_m, offs_n, mask_m, mask_n, row2, col2, coef2, D,
                         BLOCK_M, BLOCK_N, BLOCK_K, SINGLE_K, PRECISION)
        rowsum += tl.sum(plan, axis=1)
        if HAS_V:
            acc = plan_times_v(plan, V, offs_n, mask_n, offs_p, mask_p, acc, BLOCK_P, P_FMA, PRECISION, P)
    return acc, rowsum


# R (runs per row block) is data-dependent: not specialized, so that one compile serves every R
# (and a prewarm, kernel_ops.prewarm, can compile it before the masks exist)
@triton.jit(do_not_specialize=["R"])
def apply_plan_blocksparse_kernel(
    X, XLO, Y, YLO, XN, YN, F, G, V, PARAMS, XSC, YSC, RANGES,
    n, m, R,
    OUT, ROWSUM,
    HAS_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    P_FMA: tl.constexpr, SINGLE_K: tl.constexpr, PRECISION: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    N16: tl.constexpr = False,
):
    """Grid (cdiv(n, BLOCK_M), cdiv(p, BLOCK_P)); RANGES must have been built for this
    BLOCK_M. ``m`` is not read (the ranges bound the columns). N16: n is a multiple of 16."""
    tl.static_assert(PRECISION != "fixed4" and PRECISION != "ieee", "tf32x3, tf32, fp16x3 or fp16 only")
    if N16:  # written so that the compiler knows it (lse_update_kernel)
        n = (n // 16) * 16
    pid = tl.program_id(0)
    pid_p = tl.program_id(1)
    eps = tl.load(PARAMS)
    s = tl.load(PARAMS + 1)
    inv_eps = 1.0 / eps
    coef2 = cross_coef2(2.0 * s * inv_eps * LOG2E, XSC, YSC, PRECISION)

    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n
    row2 = plan_row_bias(F, XN, offs_m, mask_m, s, inv_eps)
    x_hi = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    x_lo = x_hi
    if SINGLE_K:
        x_hi, x_lo = load_resident(X, XLO, offs_m, mask_m, D, BLOCK_K, PRECISION)
    range_row = RANGES + pid.to(tl.int64) * (2 * R)

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    rowsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for r in range(0, R):
        col_start, col_end = kept_range(range_row, r)
        acc, rowsum = _apply_range(X, XLO, Y, YLO, YN, G, V, x_hi, x_lo, offs_m, mask_m, offs_p, mask_p, row2,
                                   col_start, col_end, acc, rowsum, s, inv_eps, coef2, HAS_V, BLOCK_M, BLOCK_N,
                                   BLOCK_K, BLOCK_P, P_FMA, SINGLE_K, PRECISION, D, P)

    if HAS_V:
        tl.store(OUT + offs_m[:, None] * P + offs_p[None, :], acc, mask=mask_m[:, None] & mask_p[None, :])
    if pid_p == 0:
        tl.store(ROWSUM + offs_m, rowsum, mask=mask_m)
