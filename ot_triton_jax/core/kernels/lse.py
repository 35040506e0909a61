"""Streaming log-sum-exp potential update (one Sinkhorn half-step): its loops and epilogue here,
the kernel in kernels/lse_update.py.

For every row i of X (the side being updated; the frontends swap X and Y to
update the other side), with the potential G and log-weights of the other side:

    L_i   = LSE_j( (G_j - C_ij) / eps + logw_in_j )                 (natural log)
    OUT_i = eps * logw_out_i - eps * L_i      (L_i replaced by 0 if not finite)

C_ij = s |x_i - y_j|^2, PARAMS = [eps, s]. With logw_in = 0 and logw_out = log a
this is OTT-JAX's update (f carries eps*log a, zero weights give -inf); with
logw_in = log b and no logw_out it is GeomLoss's softmin.

The cost is never formed: shifted potentials turn the exponent into one GEMM
tile plus a column bias (DESIGN.md), in log2 units

    t_ij = ((G_j - C_ij)/eps + logw_in_j) log2(e) + s|x_i|^2/eps log2(e)
         = c <x_i, y_j> + b_j,      c = 2 s log2(e) / eps,
                                    b_j = ((G_j - s|y_j|^2)/eps + logw_in_j) log2(e),

and the sum over j streams tiles of Y (b_j computed per tile, or once per half-step by
``column_bias_kernel`` when the plan says COL_BIAS). Two ways to keep exp2 in range:

* online max (FlashAttention style, always correct): a running row max m_i,
  per pair one FFMA (c xy + b), max, subtract, exp2 and add.
* fixed shift (FOLD, when the previous potential POLD of this side is given): m_i is
  predicted from POLD (m_i = (logw_out_i - POLD_i/eps + s|x_i|^2/eps) log2(e)); per pair one
  add, one exp2 and one add (no max, no rescale). A row whose sum of exp2 falls outside
  [2^-60, 2^100] (or is not finite) means m_i was off by more than ~60, and the whole row
  block is recomputed with the online max. Exact in either case up to float32 rounding.

Masked tails and -inf biases (zero weights) drop out without NaN.

If COMPUTE_ERR, ERR_i = |exp(POLD_i/eps + L_i) - w_out_i|: the marginal
error on this side of the plan built from the *previous* potential POLD
(exp(POLD_i/eps + L_i) = sum_j exp((POLD_i + G_j - C_ij)/eps)). This makes
OTT's marginal check free: it rides on the next update.

KL-relaxed marginal on this side (RELAX_AT > 0; core/unbalanced.py): PARAMS[RELAX_AT] = tau and
PARAMS[RELAX_AT + 1] = 1/rho, rho = eps tau / (1 - tau). The update is damped,
OUT_i = tau (eps logw_out_i - eps L_i) (OTT's tau_a / tau_b, GeomLoss's 1 / (1 + eps/rho)),
the error's target is the relaxed marginal w_out_i exp(-POLD_i / rho) (OTT's
``grad_of_marginal_fit``), and FOLD predicts the shift from POLD / tau.

Label cost (LABELS = KP > 0; kernels/label_tiles.py): C_ij = s (|x_i - y_j|^2 + W[LAB_X_i, LAB_Y_j])
with TT = W^T (k_tgt, k_src) row-major. With COL_BIAS a row block of one label reads its label's
row of column biases (W folded in) and runs the unlabelled loop; a mixed block adds one-hot
products on the tensor cores per tile (one FFMA per pair), or with GROUPED runs the unlabelled
loop once per label among its rows (kernels/lse_update.py). ORDERED: program i takes row block
ORDER[i] (mixed blocks first). Out-of-range labels give NaN outputs (their poison reaches the
sums). Without LABELS, LAB_X, LAB_Y, TT, ORDER, k_src, k_tgt are not read.

Points enter as X = x_hi and XLO = x_lo, their TF32 head and tail from
kernels/split.py (XLO only read for "tf32x3" and "fp16x3"; for "fp16p", d <= 5, X and YLO hold the
packed rows and columns layouts and Y, XLO are not read); XN = |x|^2 of the original points.
For "fp16x3" / "fp16" they are FP16 parts of the scaled clouds and XSC, YSC hold 1 / S
of each cloud (kernels/split.py); otherwise XSC and YSC are not read.
"""

import triton
import triton.language as tl

from .label_tiles import label_coef, label_logits
from .tiles import LN2, LOG2E, cross_tile_dot, cross_tile_resident, online_lse_step

# accepted sum of exp2(t - shift) with a fixed shift: below FOLD_LO terms under
# 2^-126 (flushed to zero) could matter for m up to 2^30, above FOLD_HI a term may have overflowed
FOLD_LO = tl.constexpr(2.0 ** -60)
FOLD_HI = tl.constexpr(2.0 ** 100)


@triton.jit
def _write_potential(run_max, run_sum, offs_m, mask_m, XN, LOGW_OUT, POLD, OUT, ERR, eps, s,
                     HAS_LOGW_OUT: tl.constexpr, COMPUTE_ERR: tl.constexpr, BLOCK_M: tl.constexpr,
                     PARAMS, RELAX_AT: tl.constexpr, LABELS: tl.constexpr = 0):
    """Epilogue: from the online (max, sum of exp2) of each row to OUT (and ERR).

    In float64, rounded once: run_max and s|x|^2/eps are each ~|x|^2/eps (hundreds at
    eps = 0.1) and cancel to ~f/eps, so float32 here leaves an error of a few float32 ulps
    of |x|^2/eps in every potential, at every half-step; that would be the largest error of
    the float32 solve (docs/performance.md). 1/eps is the float32 value the exponents used."""
    inv_eps = (1.0 / eps).to(tl.float64)
    eps64 = eps.to(tl.float64)
    xn = tl.load(XN + offs_m, mask=mask_m, other=0.0).to(tl.float64)
    lse = (run_max.to(tl.float64) + tl.log2(run_sum).to(tl.float64)) * LN2 - s.to(tl.float64) * xn * inv_eps
    lse_finite = (lse == lse) & (tl.abs(lse) < float("inf"))
    out = -eps64 * tl.where(lse_finite, lse, 0.0)
    if HAS_LOGW_OUT:
        logw = tl.load(LOGW_OUT + offs_m, mask=mask_m, other=0.0)
        out += eps64 * logw.to(tl.float64)
    if RELAX_AT > 0:
        out = tl.load(PARAMS + RELAX_AT).to(tl.float64) * out
    if LABELS:  # an out-of-range label's NaN poison, not an empty row's 0
        out = tl.where(run_sum == run_sum, out, float("nan"))
    tl.store(OUT + offs_m, out.to(tl.float32), mask=mask_m)
    if COMPUTE_ERR:
        pold = tl.load(POLD + offs_m, mask=mask_m, other=0.0).to(tl.float64)
        marg = tl.where(lse_finite, tl.exp((pold * inv_eps + lse).to(tl.float32)), 0.0)
        if HAS_LOGW_OUT:
            w = tl.exp(logw)
        else:
            w = tl.full((BLOCK_M,), 1.0, dtype=tl.float32)
        if RELAX_AT > 0:  # the relaxed marginal w exp(-pold / rho); zero weights stay 0 (pold = -inf there)
            inv_rho = tl.load(PARAMS + RELAX_AT + 1)
            w = tl.where(w > 0, w * tl.exp(-pold.to(tl.float32) * inv_rho), 0.0)
        err = tl.abs(marg - w)
        if LABELS:
            err = tl.where(run_sum == run_sum, err, float("nan"))
        tl.store(ERR + offs_m, err, mask=mask_m)


@triton.jit
def column_bias(G, YN, LOGW_IN, offs_n, mask_n, s, inv_eps, HAS_LOGW_IN: tl.constexpr):
    """b_j = ((G_j - s YN_j) / eps + LOGW_IN_j) log2(e) of a column tile; -inf on masked columns."""
    g = tl.load(G + offs_n, mask=mask_n, other=0.0)
    yn = tl.load(YN + offs_n, mask=mask_n, other=0.0)
    bias = (g - s * yn) * inv_eps
    if HAS_LOGW_IN:
        bias += tl.load(LOGW_IN + offs_n, mask=mask_n, other=0.0)
    return tl.where(mask_n, bias * LOG2E, float("-inf"))


@triton.jit
def _column_bias(G, YN, LOGW_IN, offs_n, mask_n, s, inv_eps, HAS_LOGW_IN: tl.constexpr, COL_BIAS: tl.constexpr):
    """b_j of a column tile: computed here, or (COL_BIAS) read from G, which then holds
    column_bias_kernel's output (YN and LOGW_IN unused)."""
    if COL_BIAS:
        return tl.load(G + offs_n, mask=mask_n, other=float("-inf"))
    else:
        return column_bias(G, YN, LOGW_IN, offs_n, mask_n, s, inv_eps, HAS_LOGW_IN)


@triton.jit(do_not_specialize=["m", "k_src", "k_tgt"])
def column_bias_kernel(G, YN, LOGW_IN, PARAMS, LAB_Y, TT, m, k_src, k_tgt, B, HAS_LOGW_IN: tl.constexpr,
                       BLOCK: tl.constexpr, LABELS: tl.constexpr = 0):
    """B = the column biases b_j of a half-step (module docstring; -inf for zero weights), once
    per half-step instead of in every row block's tiles: each thread of a tile holds a few rows
    of 16 columns, so recomputing the biases there (two loads, FFMA, FMUL, FMUL, FSEL per column
    and thread) costs ~24% of the FOLD loop's instructions at d = 3 (docs/performance.md).
    LABELS (grid (., k_src + 1)): row l < k_src of B holds b_j + lcoef W[l, LAB_Y_j] (the biases
    of a row block of label l), row k_src b_j; each with the column poison (kernels/label_tiles.py)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < m
    eps = tl.load(PARAMS)
    s = tl.load(PARAMS + 1)
    bias = column_bias(G, YN, LOGW_IN, offs, mask, s, 1.0 / eps, HAS_LOGW_IN)
    if LABELS:
        row = tl.program_id(1)
        lab = tl.load(LAB_Y + offs, mask=mask, other=0)
        ok = (lab >= 0) & (lab < k_tgt)
        lab = tl.minimum(tl.maximum(lab, 0), k_tgt - 1)
        w = tl.load(TT + lab * k_src + row, mask=mask & (row < k_src), other=0.0)
        bias += tl.where(ok, label_coef(s, 1.0 / eps) * w, float("nan"))
        B += row * m
    tl.store(B + offs, bias, mask=mask)


@triton.jit
def _lse_online(X, XLO, Y, YLO, YN, G, LOGW_IN, x_hi, x_lo, offs_m, mask_m, col_start, col_end,
                run_max, run_sum, s, inv_eps, coef2, HAS_LOGW_IN: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_K: tl.constexpr,
                PRECISION: tl.constexpr, D: tl.constexpr, COL_BIAS: tl.constexpr = False,
                LABELS: tl.constexpr = 0, onehot=None, LAB_Y=None, TT=None, k_src=None, k_tgt=None,
                lcoef=None):
    """(running max, sum of exp2(t - max)) of each row: the state (run_max, run_sum) carried on
    over columns [col_start, col_end). Start from (-inf, 0); a state from another column range
    continues it (the block-sparse kernel chains its kept clusters). LABELS: the label cost
    (``onehot``, ``lcoef`` from kernels/label_tiles.py, the column labels LAB_Y, the table TT)."""
    for n0 in range(col_start, col_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < col_end
        bias2 = _column_bias(G, YN, LOGW_IN, offs_n, mask_n, s, inv_eps, HAS_LOGW_IN, COL_BIAS)
        if SINGLE_K:
            xy = cross_tile_resident(x_hi, x_lo, Y, YLO, offs_n, mask_n, D, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        else:
            xy = cross_tile_dot(X, XLO, Y, YLO, offs_m, offs_n, mask_m, mask_n, D,
                                BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
        if LABELS:
            t = label_logits(xy, coef2, bias2, bias2, onehot, LAB_Y, TT, offs_n, mask_n, k_src, k_tgt, lcoef,
                             LABELS, False)
        else:
            t = xy * coef2 + bias2[None, :]
        run_max, run_sum = online_lse_step(run_max, run_sum, t)
    return run_max, run_sum


@triton.jit
def _fold_shift(XN, LOGW_OUT, POLD, offs_m, mask_m, s, inv_eps, HAS_LOGW_OUT: tl.constexpr, BLOCK_M: tl.constexpr,
                PARAMS, RELAX_AT: tl.constexpr):
    """FOLD's fixed shift m_i predicted from POLD (module docstring; 0 where not finite) and
    logw_out of the rows (0 without it); a relaxed side's POLD is tau times the undamped update."""
    pold = tl.load(POLD + offs_m, mask=mask_m, other=0.0)
    if RELAX_AT > 0:
        pold = pold / tl.load(PARAMS + RELAX_AT)
    xn = tl.load(XN + offs_m, mask=mask_m, other=0.0)
    shift = (s * xn - pold) * inv_eps
    logw = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if HAS_LOGW_OUT:
        logw = tl.load(LOGW_OUT + offs_m, mask=mask_m, other=0.0)
        shift += logw
    shift = shift * LOG2E
    return tl.where((shift == shift) & (tl.abs(shift) < 1e30), shift, 0.0), logw


@triton.jit
def _fold_rejected(run_sum, logw, rows):
    """True when the fixed-shift sum of one of ``rows`` left [FOLD_LO, FOLD_HI] (or is not
    finite): the block is then redone with the online max. Rows of zero weight (logw = -inf)
    come out -inf whatever the sum: not checked."""
    in_range = (run_sum >= FOLD_LO) & (run_sum <= FOLD_HI)
    bad = rows & (logw > float("-inf")) & ~in_range
    return tl.max(bad.to(tl.int32), axis=0) > 0


@triton.jit
def _folded_sum(xy, bias, shift, offs_n, mask_n, coef2, LABELS: tl.constexpr, onehot, LAB_Y, TT, k_src, k_tgt,
                lcoef):
    """sum_j exp2(t_ij - shift_i) over one column tile, from its product ``xy`` and biases."""
    if LABELS:
        t = label_logits(xy, coef2, bias, shift, onehot, LAB_Y, TT, offs_n, mask_n, k_src, k_tgt, lcoef,
                         LABELS, True)
    else:
        t = xy * coef2 + (bias[None, :] - shift[:, None])
    return tl.sum(tl.exp2(t), axis=1)


@triton.jit
def _lse_folded(Y, YLO, YN, G, LOGW_IN, x_hi, x_lo, shift, col_start, col_end, s, inv_eps, coef2,
                HAS_LOGW_IN: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, D: tl.constexpr, COL_BIAS: tl.constexpr = False,
                PAIRED: tl.constexpr = False, LABELS: tl.constexpr = 0, onehot=None, LAB_Y=None, TT=None,
                k_src=None, k_tgt=None, lcoef=None):
    """sum_j exp2(t_ij - shift_i) for a fixed shift (no running max, no rescaling):
    t - shift = c xy + (b_j - shift_i), one FADD and one FFMA per pair. The product
    starts from zero: seeding the tensor-core accumulator with b_j - shift_i (one
    instruction less) measured 3-5x larger errors in f on the H200, and the FFMA keeps
    exactly the rounding of the online loop. LABELS: the label cost, as in :func:`_lse_online`."""
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if PAIRED:
        # two column tiles per step, both products issued before either tile's exponentials: the
        # second product's tensor-core work can overlap the first tile's exp2s (docs/performance.md)
        for n0 in range(col_start, col_end, 2 * BLOCK_N):
            offs_a = n0 + tl.arange(0, BLOCK_N)
            offs_b = offs_a + BLOCK_N
            mask_a = offs_a < col_end
            mask_b = offs_b < col_end
            xy_a = cross_tile_resident(x_hi, x_lo, Y, YLO, offs_a, mask_a, D, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
            xy_b = cross_tile_resident(x_hi, x_lo, Y, YLO, offs_b, mask_b, D, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
            bias_a = _column_bias(G, YN, LOGW_IN, offs_a, mask_a, s, inv_eps, HAS_LOGW_IN, COL_BIAS)
            run_sum += _folded_sum(xy_a, bias_a, shift, offs_a, mask_a, coef2, LABELS, onehot, LAB_Y, TT, k_src, k_tgt, lcoef)
            bias_b = _column_bias(G, YN, LOGW_IN, offs_b, mask_b, s, inv_eps, HAS_LOGW_IN, COL_BIAS)
            run_sum += _folded_sum(xy_b, bias_b, shift, offs_b, mask_b, coef2, LABELS, onehot, LAB_Y, TT, k_src, k_tgt, lcoef)
    else:
        for n0 in range(col_start, col_end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < col_end
            bias2 = _column_bias(G, YN, LOGW_IN, offs_n, mask_n, s, inv_eps, HAS_LOGW_IN, COL_BIAS)
            xy = cross_tile_resident(x_hi, x_lo, Y, YLO, offs_n, mask_n, D, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
            run_sum += _folded_sum(xy, bias2, shift, offs_n, mask_n, coef2, LABELS, onehot, LAB_Y, TT, k_src, k_tgt, lcoef)
    return run_sum


@triton.jit
def _block_lse(X, XLO, Y, YLO, XN, YN, G, LOGW_IN, LOGW_OUT, POLD, PARAMS, x_hi, x_lo, offs_m, mask_m, col_start,
               col_end, s, inv_eps, coef2, HAS_LOGW_IN: tl.constexpr, HAS_LOGW_OUT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_K: tl.constexpr,
               PRECISION: tl.constexpr, D: tl.constexpr, FOLD: tl.constexpr, COL_BIAS: tl.constexpr,
               PAIRED: tl.constexpr, RELAX_AT: tl.constexpr, LABELS: tl.constexpr, onehot, LAB_Y, TT, k_src, k_tgt,
               lcoef):
    """(run_max, run_sum) of a row block over columns [col_start, col_end): the fixed-shift loop
    (FOLD) with its online fallback, or the online loop."""
    no_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    no_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    if FOLD:
        tl.static_assert(SINGLE_K, "FOLD needs the resident x block (d <= 64)")
        shift, logw = _fold_shift(XN, LOGW_OUT, POLD, offs_m, mask_m, s, inv_eps, HAS_LOGW_OUT, BLOCK_M,
                                  PARAMS, RELAX_AT)
        run_sum = _lse_folded(Y, YLO, YN, G, LOGW_IN, x_hi, x_lo, shift, col_start, col_end, s,
                              inv_eps, coef2, HAS_LOGW_IN, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, D, COL_BIAS, PAIRED,
                              LABELS, onehot, LAB_Y, TT, k_src, k_tgt, lcoef)
        run_max = shift
        if _fold_rejected(run_sum, logw, mask_m & (col_start < col_end)):
            run_max, run_sum = _lse_online(X, XLO, Y, YLO, YN, G, LOGW_IN, x_hi, x_lo, offs_m, mask_m,
                                           col_start, col_end, no_max, no_sum, s, inv_eps, coef2, HAS_LOGW_IN,
                                           BLOCK_M, BLOCK_N, BLOCK_K, SINGLE_K, PRECISION, D, COL_BIAS,
                                           LABELS, onehot, LAB_Y, TT, k_src, k_tgt, lcoef)
    else:
        run_max, run_sum = _lse_online(X, XLO, Y, YLO, YN, G, LOGW_IN, x_hi, x_lo, offs_m, mask_m,
                                       col_start, col_end, no_max, no_sum, s, inv_eps, coef2, HAS_LOGW_IN,
                                       BLOCK_M, BLOCK_N, BLOCK_K, SINGLE_K, PRECISION, D, COL_BIAS,
                                       LABELS, onehot, LAB_Y, TT, k_src, k_tgt, lcoef)
    return run_max, run_sum


@triton.jit(do_not_specialize=["n"])
def lse_combine_kernel(
    PART, XN, LOGW_OUT, POLD, PARAMS, n,
    OUT, ERR,
    HAS_LOGW_OUT: tl.constexpr, COMPUTE_ERR: tl.constexpr, SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
    N16: tl.constexpr = False, RELAX_AT: tl.constexpr = 0, LABELS: tl.constexpr = 0,
):
    """Finish a split LSE update: merge the SPLIT partial (max, sum) pairs of each row
    (LABELS: a NaN partial sum, an out-of-range label's, gives a NaN potential)."""
    if N16:
        n = (n // 16) * 16
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n
    eps = tl.load(PARAMS)
    s = tl.load(PARAMS + 1)
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    for k in tl.static_range(SPLIT):
        run_max = tl.maximum(run_max, tl.load(PART + k * n + offs_m, mask=mask_m, other=float("-inf")))
    safe_max = tl.where(run_max == float("-inf"), 0.0, run_max)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in tl.static_range(SPLIT):
        mk = tl.load(PART + k * n + offs_m, mask=mask_m, other=float("-inf"))
        sk = tl.load(PART + (SPLIT + k) * n + offs_m, mask=mask_m, other=0.0)
        run_sum += sk * tl.exp2(mk - safe_max)
    _write_potential(run_max, run_sum, offs_m, mask_m, XN, LOGW_OUT, POLD, OUT, ERR, eps, s,
                     HAS_LOGW_OUT, COMPUTE_ERR, BLOCK_M, PARAMS, RELAX_AT, LABELS)
