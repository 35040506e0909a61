"""Streaming plan application with a bilinear weight, the second-moment pass of the HVP.

    P_ij   = exp( (F_i + G_j - C_ij) / eps ),   C_ij = s |x_i - y_j|^2
    OUT_ik = sum_j P_ij <W_i, A_j> B_jk          (W: n x DA, A: m x DA, B: m x P)

The Hessian of the OT cost in x contains sum_j P_ij y_j y_j^T v_i, a d x d second
moment per row that must never be stored: with W = v, A = B = y this pass gives it in
one sweep (core/implicit.py). The weight tile <W_i, A_j> is one more product on the
tensor cores, float32-accurate for the float32-accurate precisions (tiles.dot_f32);
the weighted plan tile then multiplies B like ``apply_plan_kernel`` multiplies V.
Pᵀ-side passes swap the roles of (X, F) and (Y, G). PARAMS = [eps, s]; XSC, YSC as in apply.py.

Grid: (cdiv(n, BLOCK_M), cdiv(P, BLOCK_P)); DA is read in chunks of BLOCK_A columns.
LABELS: the label-augmented cost, LAB_X, LAB_Y, TT, k_src, k_tgt as in apply.py.
"""

import triton
import triton.language as tl

from .label_tiles import label_coef, label_cols, label_rows, label_tile
from .tiles import LOG2E, cross_coef2, dot_f32, load_resident, load_rows, plan_col_bias, plan_row_bias, plan_tile


@triton.jit(do_not_specialize=["n", "m", "k_src", "k_tgt"])
def apply_weighted_kernel(
    X, XLO, Y, YLO, XN, YN, F, G, W, A, B, PARAMS, XSC, YSC, LAB_X, LAB_Y, TT,
    n, m, k_src, k_tgt,
    OUT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_A: tl.constexpr,
    BLOCK_P: tl.constexpr, SINGLE_K: tl.constexpr, PRECISION: tl.constexpr, D: tl.constexpr,
    DA: tl.constexpr, P: tl.constexpr, N16: tl.constexpr = False, M16: tl.constexpr = False,
    LABELS: tl.constexpr = 0,
):
    if N16:
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
    for n0 in range(0, m, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < m
        col2 = plan_col_bias(G, YN, offs_n, mask_n, s, inv_eps)
        lab = None
        if LABELS:
            cols, cpois = label_cols(LAB_Y, TT, offs_n, mask_n, k_src, k_tgt, LABELS)
            col2 += cpois
            lab = label_tile(onehot, cols) * lcoef
        plan = plan_tile(X, XLO, Y, YLO, x_hi, x_lo, offs_m, offs_n, mask_m, mask_n, row2, col2, coef2, D,
                         BLOCK_M, BLOCK_N, BLOCK_K, SINGLE_K, PRECISION, LABELS, lab)
        wa = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for a0 in range(0, DA, BLOCK_A):
            wt = load_rows(W, offs_m, mask_m, DA, a0, BLOCK_A)
            at = load_rows(A, offs_n, mask_n, DA, a0, BLOCK_A)
            wa = dot_f32(wt, tl.trans(at), wa, PRECISION)
        bt = tl.load(B + offs_n[:, None] * P + offs_p[None, :], mask=mask_n[:, None] & mask_p[None, :], other=0.0)
        acc = dot_f32(plan * wa, bt, acc, PRECISION)
    tl.store(OUT + offs_m[:, None] * P + offs_p[None, :], acc, mask=mask_m[:, None] & mask_p[None, :])
