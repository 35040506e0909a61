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

TGT_MEAN (PRECISION "fp16p", V not read, P = the points' dimension): OUT = the softmin mean of
the target points times ROWSUM, i.e. OUT_i / ROWSUM_i = sum_j P_ij t_j / sum_j P_ij with t_j the
centred target points, the multiscale solve's gradient term. The products run on the tensor
cores: the plan tile, scaled by 2^MEAN_SHIFT, in FP16 times the target's packed columns
[t_hi, t_lo, t_hi, 0..., 1] (kernels/split.py; the tile the cross term reads), so the numerator
and the denominator of the mean see the same FP16-rounded P_ij (rounding to nearest: relative
2^-12 per entry, unbiased; the ratio is exact for a constant t). ROWSUM stays the float32 sum.
Entries must stay below 2^16 / 2^MEAN_SHIFT (4 for MEAN_SHIFT = 14; P_ij <= ROWSUM_i, so the
caller checks ROWSUM < 4) and those below 2^-(24 + MEAN_SHIFT) are dropped from the mean.
Replaces ~6 instructions per pair (3 products and 3 row reductions on the FMA units) by half a
conversion and a share of one HGMMA (docs/performance.md).
"""

import triton
import triton.language as tl

from .lse_blocksparse import kept_range
from .tiles import (LOG2E, cross_coef2, dot_one, load_resident, load_rows, plan_col_bias, plan_row_bias, plan_tile,
                    plan_times_v)

# TGT_MEAN: the plan tile times 2^14 before FP16 (P_ij <= ROWSUM_i < 4 fits under 2^16), and back
MEAN_SHIFT = tl.constexpr(14.0)
MEAN_UNSHIFT = tl.constexpr(2.0 ** -14)


@triton.jit
def _apply_range(X, XLO, Y, YLO, YN, G, V, x_hi, x_lo, offs_m, mask_m, offs_p, mask_p, row2, col_start, col_end,
                 acc, acc16, rowsum, s, inv_eps, coef2, ysc, HAS_V: tl.constexpr, TGT_MEAN: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr, P_FMA: tl.constexpr, SINGLE_K: tl.constexpr,
                 PRECISION: tl.constexpr, D: tl.constexpr, P: tl.constexpr):
    """(acc, acc16, rowsum) carried on over the columns [col_start, col_end)."""
    for n0 in range(col_start, col_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < col_end
        col2 = plan_col_bias(G, YN, offs_n, mask_n, s, inv_eps)
        if TGT_MEAN:
            # the packed columns [t_hi, t_lo, t_hi, 0..., 1] serve both products (one shared tile)
            yt = load_rows(YLO, offs_n, mask_n, D, 0, BLOCK_K)
            plan = tl.exp2(dot_one(x_hi, yt, tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32), PRECISION) * coef2
                           + row2[:, None] + col2[None, :])
        else:
            plan = plan_tile(X, XLO, Y, YLO, x_hi, x_lo, offs_m, offs_n, mask_m, mask_n, row2, col2, coef2, D,
                             BLOCK_M, BLOCK_N, BLOCK_K, SINGLE_K, PRECISION)
        rowsum += tl.sum(plan, axis=1)
        if TGT_MEAN:
            # one tile's product, then added in float32: the tensor cores truncate while they
            # accumulate, and ~6000 accumulations per row (2^20 points) bias the mean by ~1e-4 of
            # |t| (measured on the H100). The factor ysc (a power of two, cancelled by the ones
            # column) keeps Triton from folding the addition back into the product's accumulator.
            acc16 += tl.dot(plan.to(tl.float16), yt) * ysc
        elif HAS_V:
            acc = plan_times_v(plan, V, offs_n, mask_n, offs_p, mask_p, acc, BLOCK_P, P_FMA, PRECISION, P)
    return acc, acc16, rowsum


# R (runs per row block) is data-dependent: not specialized, so that one compile serves every R
# (and a prewarm, kernel_ops.prewarm, can compile it before the masks exist)
@triton.jit(do_not_specialize=["R", "n", "m"])
def apply_plan_blocksparse_kernel(
    X, XLO, Y, YLO, XN, YN, F, G, V, PARAMS, XSC, YSC, RANGES,
    n, m, R,
    OUT, ROWSUM,
    HAS_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    P_FMA: tl.constexpr, SINGLE_K: tl.constexpr, PRECISION: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    N16: tl.constexpr = False, TGT_MEAN: tl.constexpr = False,
):
    """Grid (cdiv(n, BLOCK_M), cdiv(p, BLOCK_P)); RANGES must have been built for this
    BLOCK_M. ``m`` is not read (the ranges bound the columns). N16: n is a multiple of 16."""
    tl.static_assert(PRECISION != "fixed4" and PRECISION != "ieee", "tf32x3, tf32, fp16x3 or fp16 only")
    tl.static_assert(not TGT_MEAN or (PRECISION == "fp16p" and SINGLE_K and 3 * P < BLOCK_K and HAS_V),
                     "TGT_MEAN: packed parts")
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
    ysc = 1.0
    if TGT_MEAN:
        row2 += MEAN_SHIFT
        ysc = tl.load(YSC)
    x_hi = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    x_lo = x_hi
    if SINGLE_K:
        x_hi, x_lo = load_resident(X, XLO, offs_m, mask_m, D, BLOCK_K, PRECISION)
    range_row = RANGES + pid.to(tl.int64) * (2 * R)

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    acc16 = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    rowsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for r in range(0, R):
        col_start, col_end = kept_range(range_row, r)
        acc, acc16, rowsum = _apply_range(X, XLO, Y, YLO, YN, G, V, x_hi, x_lo, offs_m, mask_m, offs_p, mask_p, row2,
                                          col_start, col_end, acc, acc16, rowsum, s, inv_eps, coef2, ysc, HAS_V,
                                          TGT_MEAN,
                                          BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_P, P_FMA, SINGLE_K, PRECISION, D, P)
    if TGT_MEAN:
        rowsum = rowsum * MEAN_UNSHIFT
        kk = tl.arange(0, BLOCK_K)
        ones = tl.sum(tl.where(kk[None, :] == BLOCK_K - 1, acc16, 0.0), axis=1)
        # OUT / ROWSUM = (sum P (t_hi + t_lo) / sum P) / S (ysc = 1 / S): the FP16 sums' ratio
        scale = tl.where(ones > 0.0, rowsum * ysc / tl.where(ones > 0.0, ones, 1.0), 0.0)
        for k in tl.static_range(P):
            sel = (kk[None, :] == k) | (kk[None, :] == k + P)
            pv = tl.sum(tl.where(sel, acc16, 0.0), axis=1)
            acc += tl.where(offs_p[None, :] == k, (pv * scale)[:, None], 0.0)

    if HAS_V:
        tl.store(OUT + offs_m[:, None] * P + offs_p[None, :], acc, mask=mask_m[:, None] & mask_p[None, :])
    if pid_p == 0:
        tl.store(ROWSUM + offs_m, rowsum, mask=mask_m)
