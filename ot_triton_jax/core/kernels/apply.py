"""Streaming application of the transport plan, P V and P 1, never forming P.

    P_ij   = exp( (F_i + G_j - C_ij) / eps ),   C_ij = s |x_i - y_j|^2
    OUT_ik = sum_j P_ij V_jk     (V: m x p, row-major)
    ROWSUM_i = sum_j P_ij        (written by the programs with pid_p == 0)

PARAMS = [eps, s]. Pᵀ U is the same kernel with the roles of (X, F) and
(Y, G) swapped. Weights that GeomLoss keeps outside the exponent are folded
into F and G by the caller (F + eps log a); zero weights give -inf and drop out.

Grid: (cdiv(n, BLOCK_M), cdiv(p, BLOCK_P)). For p <= 8 (``P_FMA = p``) the
product with V uses exact float32 FMAs; otherwise ``tl.dot`` with PRECISION
(the plan tile P is in [0, 1]; float32-accurate precisions use Triton's built-in 3xTF32
there, tiles.dot_f32).
With ``HAS_V = False`` only ROWSUM is computed (marginals).

LABELS = KP > 0: the label-augmented cost C_ij = s (|x_i - y_j|^2 + W[LAB_X_i, LAB_Y_j]), TT = W^T
(k_tgt, k_src) row-major (kernels/label_tiles.py; out-of-range labels give NaN rows / columns).
Without LABELS, LAB_X, LAB_Y, TT, k_src and k_tgt are not read.

Points enter as X = x_hi and XLO = x_lo, their TF32 head and tail from
kernels/split.py (XLO only read for "tf32x3", "fp16x3" and "fixed4", whose heads and tails
come from split_fixed_kernel); XN = |x|^2 of the original points. XSC, YSC: 1 / S of
each cloud for the FP16 precisions (kernels/split.py), not read otherwise.
"""

import triton
import triton.language as tl

from .label_tiles import label_coef, label_cols, label_rows, label_tile
from .tiles import LOG2E, cross_coef2, cross_tile_fixed4, load_resident, plan_col_bias, plan_row_bias, plan_tile, plan_times_v


@triton.jit(do_not_specialize=["n", "m", "k_src", "k_tgt"])
def apply_plan_kernel(
    X, XLO, Y, YLO, XN, YN, F, G, V, PARAMS, XSC, YSC, LAB_X, LAB_Y, TT,
    n, m, k_src, k_tgt,
    OUT, ROWSUM,
    HAS_V: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr,
    P_FMA: tl.constexpr, SINGLE_K: tl.constexpr, PRECISION: tl.constexpr, D: tl.constexpr, P: tl.constexpr,
    N16: tl.constexpr = False, M16: tl.constexpr = False, SPLIT: tl.constexpr = 1,
    LABELS: tl.constexpr = 0,
):
    """SPLIT > 1 (row sums only): grid (cdiv(n, BLOCK_M), SPLIT), program (i, k) sums the k-th of
    SPLIT column ranges into ROWSUM[k * n + row]; the caller adds the SPLIT partial sums."""
    if N16:  # n is a multiple of 16, written so that the compiler knows it (lse_update_kernel)
        n = (n // 16) * 16
    if M16:
        m = (m // 16) * 16
    pid = tl.program_id(0)
    pid_p = tl.program_id(1)
    eps = tl.load(PARAMS)
    s = tl.load(PARAMS + 1)
    inv_eps = 1.0 / eps
    coef2 = cross_coef2(2.0 * s * inv_eps * LOG2E, XSC, YSC, PRECISION)

    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n
    row2 = plan_row_bias(F, XN, offs_m, mask_m, s, inv_eps)
    onehot = row2
    lcoef = s
    if LABELS:
        onehot, rpois = label_rows(LAB_X, offs_m, mask_m, k_src, LABELS)
        row2 += rpois
        lcoef = label_coef(s, inv_eps)
    x_hi = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    x_lo = x_hi
    if SINGLE_K:
        x_hi, x_lo = load_resident(X, XLO, offs_m, mask_m, D, BLOCK_K, PRECISION)

    offs_p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    mask_p = offs_p < P
    acc = tl.zeros((BLOCK_M, BLOCK_P), dtype=tl.float32)
    rowsum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    col_start = 0
    col_end = m
    if SPLIT > 1:
        tl.static_assert(not HAS_V, "the column split is for row sums only")
        span = tl.cdiv(tl.cdiv(m, BLOCK_N), SPLIT) * BLOCK_N
        col_start = pid_p * span
        col_end = tl.minimum(m, col_start + span)
    for n0 in range(col_start, col_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < col_end
        col2 = plan_col_bias(G, YN, offs_n, mask_n, s, inv_eps)
        lab = None
        if LABELS:
            cols, cpois = label_cols(LAB_Y, TT, offs_n, mask_n, k_src, k_tgt, LABELS)
            col2 += cpois
            lab = label_tile(onehot, cols) * lcoef

        if PRECISION == "fixed4":
            hh, tails = cross_tile_fixed4(X, XLO, Y, YLO, x_hi, x_lo, offs_m, offs_n, mask_m, mask_n, D,
                                          BLOCK_M, BLOCK_N, BLOCK_K, SINGLE_K)
            if LABELS:
                plan = tl.exp2(hh * coef2 + (tails * coef2 + (row2[:, None] + col2[None, :] + lab)))
            else:
                plan = tl.exp2(hh * coef2 + (tails * coef2 + (row2[:, None] + col2[None, :])))
        else:
            plan = plan_tile(X, XLO, Y, YLO, x_hi, x_lo, offs_m, offs_n, mask_m, mask_n, row2, col2, coef2, D,
                             BLOCK_M, BLOCK_N, BLOCK_K, SINGLE_K, PRECISION, LABELS, lab)
        rowsum += tl.sum(plan, axis=1)

        if HAS_V:
            acc = plan_times_v(plan, V, offs_n, mask_n, offs_p, mask_p, acc, BLOCK_P, P_FMA, PRECISION, P)

    if HAS_V:
        tl.store(OUT + offs_m[:, None] * P + offs_p[None, :], acc,
                 mask=mask_m[:, None] & mask_p[None, :])
    if SPLIT > 1:
        tl.store(ROWSUM + pid_p * n + offs_m, rowsum, mask=mask_m)
    elif pid_p == 0:
        tl.store(ROWSUM + offs_m, rowsum, mask=mask_m)
