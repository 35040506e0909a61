"""The LSE half-step's kernel (the update, its loops and epilogue: kernels/lse.py).

``lse_update_kernel`` runs one row block per program (through ORDER with ORDERED). With the label
cost (LABELS) and per-label column biases (COL_BIAS: G holds k_src + 1 rows, ``column_bias_kernel``)
a block takes one of two ways (kernels/label_tiles.py):

* GROUPED (rows sorted by label, as the alternating loops' are; launch_plans.LABEL_GROUPED_MIN_D
  says where): the block runs the unlabelled loop once per label among its rows, on that label's
  row of biases, and keeps each pass's result for that label's rows; blocks of two labels or more
  go first (ORDERED). No one-hot product is compiled in: at d = 64 (one H200) the kernel holds
  179-255 registers with at most 4 spills, against 102 spills with the products.
* otherwise: a block of one label runs the unlabelled loop on its label's row, a mixed block the
  one-hot products per tile on the last row (any label order; ~3x a one-label block). At d = 3
  both ways cost ~1.24x the unlabelled half-step even on a cloud of one label (228 and 181
  registers against 125: two programs per SM instead of four), and this one is kept there.
"""

import triton
import triton.language as tl

from .label_tiles import label_coef, label_rows, label_uniform
from .lse import _block_lse, _write_potential
from .tiles import LOG2E, cross_coef2, load_resident


@triton.jit(do_not_specialize=["m", "k_src", "k_tgt"])
def _grouped_lse(X, XLO, Y, YLO, XN, YN, G, LOGW_IN, LOGW_OUT, POLD, PARAMS, LAB_X, x_hi, x_lo, offs_m, mask_m,
                 col_start, col_end, m, k_src, s, inv_eps, coef2, HAS_LOGW_IN: tl.constexpr,
                 HAS_LOGW_OUT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 SINGLE_K: tl.constexpr, PRECISION: tl.constexpr, D: tl.constexpr, FOLD: tl.constexpr,
                 PAIRED: tl.constexpr, RELAX_AT: tl.constexpr, LAB_Y, TT, k_tgt, lcoef):
    """(run_max, run_sum) of a labelled row block: one unlabelled pass per label l present, over the
    biases G + l m (row l: b_j + lcoef W[l, LAB_Y_j]), each kept for the rows of label l. A label
    outside [0, k_src) reads the plain biases (row k_src); the caller adds its NaN poison."""
    lab = tl.load(LAB_X + offs_m, mask=mask_m, other=0)
    key = tl.where((lab >= 0) & (lab < k_src), lab, k_src)
    done = k_src + 1
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    cur = tl.min(tl.where(mask_m, key, done), axis=0)
    while cur < done:
        rows = mask_m & (key == cur)
        mx, sm = _block_lse(X, XLO, Y, YLO, XN, YN, G + cur * m, LOGW_IN, LOGW_OUT, POLD, PARAMS, x_hi, x_lo,
                            offs_m, rows, col_start, col_end, s, inv_eps, coef2, HAS_LOGW_IN, HAS_LOGW_OUT, BLOCK_M,
                            BLOCK_N, BLOCK_K, SINGLE_K, PRECISION, D, FOLD, True, PAIRED, RELAX_AT, 0, run_sum,
                            LAB_Y, TT, k_src, k_tgt, lcoef)
        run_max = tl.where(rows, mx, run_max)
        run_sum = tl.where(rows, sm, run_sum)
        cur = tl.min(tl.where(mask_m & (key > cur), key, done), axis=0)
    return run_max, run_sum


@triton.jit(do_not_specialize=["n", "m", "k_src", "k_tgt"])
def lse_update_kernel(
    X, XLO, Y, YLO, XN, YN, G, LOGW_IN, LOGW_OUT, POLD, PARAMS, XSC, YSC, LAB_X, LAB_Y, TT, ORDER,
    n, m, k_src, k_tgt,
    OUT, ERR, PART,
    HAS_LOGW_IN: tl.constexpr, HAS_LOGW_OUT: tl.constexpr, COMPUTE_ERR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SINGLE_K: tl.constexpr, PRECISION: tl.constexpr, SPLIT: tl.constexpr, D: tl.constexpr,
    FOLD: tl.constexpr = False, N16: tl.constexpr = False, M16: tl.constexpr = False,
    COL_BIAS: tl.constexpr = False, PAIRED: tl.constexpr = False, RELAX_AT: tl.constexpr = 0,
    LABELS: tl.constexpr = 0, ORDERED: tl.constexpr = False, GROUPED: tl.constexpr = False,
):
    """Grid (cdiv(n, BLOCK_M), SPLIT). With SPLIT == 1 each program finishes its rows;
    otherwise program (i, k) reduces the k-th of SPLIT column ranges and stores its
    partial (max, sum) in PART[k*n + row] and PART[(SPLIT + k)*n + row], and
    ``lse_combine_kernel`` finishes (small n: more programs than row blocks).
    FOLD (needs SINGLE_K and POLD, the previous potential of this side): the fixed shift.
    N16 / M16: n / m are multiples of 16 (from the plan, see launch_plans.size_hints).
    COL_BIAS: G holds the column biases from ``column_bias_kernel`` (YN, LOGW_IN unused).
    PAIRED (FOLD only): two column tiles per loop step (``_lse_folded``).
    RELAX_AT: 0 (balanced) or the index in PARAMS of this side's (tau, 1/rho) (module docstring).
    LABELS, ORDERED, GROUPED: the label cost, the row-block order and the label-run loop (module
    docstring)."""
    if N16:  # (n // 16) * 16 == n, written so that the compiler knows it (vector loads)
        n = (n // 16) * 16
    if M16:
        m = (m // 16) * 16
    pid = tl.program_id(0)
    if ORDERED:
        pid = tl.load(ORDER + pid)
    pid_s = tl.program_id(1)
    eps = tl.load(PARAMS)
    s = tl.load(PARAMS + 1)
    inv_eps = 1.0 / eps
    coef2 = cross_coef2(2.0 * s * inv_eps * LOG2E, XSC, YSC, PRECISION)

    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n
    x_hi = tl.zeros((BLOCK_M, BLOCK_K), dtype=tl.float32)
    x_lo = x_hi
    if SINGLE_K:
        x_hi, x_lo = load_resident(X, XLO, offs_m, mask_m, D, BLOCK_K, PRECISION)

    span = tl.cdiv(tl.cdiv(m, BLOCK_N), SPLIT) * BLOCK_N
    col_start = pid_s * span
    col_end = tl.minimum(m, col_start + span)
    no_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    onehot = no_sum
    rpois = no_sum
    lcoef = s
    if LABELS:
        onehot, rpois = label_rows(LAB_X, offs_m, mask_m, k_src, LABELS)
        lcoef = label_coef(s, inv_eps)
    if LABELS and COL_BIAS and GROUPED:
        run_max, run_sum = _grouped_lse(X, XLO, Y, YLO, XN, YN, G, LOGW_IN, LOGW_OUT, POLD, PARAMS, LAB_X, x_hi, x_lo,
            offs_m, mask_m, col_start, col_end, m, k_src, s, inv_eps, coef2, HAS_LOGW_IN, HAS_LOGW_OUT, BLOCK_M,
            BLOCK_N, BLOCK_K, SINGLE_K, PRECISION, D, FOLD, PAIRED, RELAX_AT, LAB_Y, TT, k_tgt, lcoef)
    elif LABELS and COL_BIAS:
        # G holds k_src + 1 rows of column biases (column_bias_kernel): a block of one label runs the
        # unlabelled loop on its label's row, a mixed block the one-hot products on the last row
        lrow = label_uniform(LAB_X, offs_m, mask_m, k_src)
        if lrow >= 0:
            run_max, run_sum = _block_lse(X, XLO, Y, YLO, XN, YN, G + lrow * m, LOGW_IN, LOGW_OUT, POLD, PARAMS, x_hi, x_lo,
                offs_m, mask_m, col_start, col_end, s, inv_eps, coef2, HAS_LOGW_IN, HAS_LOGW_OUT, BLOCK_M, BLOCK_N,
                BLOCK_K, SINGLE_K, PRECISION, D, FOLD, COL_BIAS, PAIRED, RELAX_AT, 0, onehot, LAB_Y, TT,
                k_src, k_tgt, lcoef)
        else:
            run_max, run_sum = _block_lse(X, XLO, Y, YLO, XN, YN, G + k_src * m, LOGW_IN, LOGW_OUT, POLD, PARAMS, x_hi, x_lo,
                offs_m, mask_m, col_start, col_end, s, inv_eps, coef2, HAS_LOGW_IN, HAS_LOGW_OUT, BLOCK_M, BLOCK_N,
                BLOCK_K, SINGLE_K, PRECISION, D, FOLD, COL_BIAS, PAIRED, RELAX_AT, LABELS, onehot, LAB_Y, TT,
                k_src, k_tgt, lcoef)
    else:
        run_max, run_sum = _block_lse(X, XLO, Y, YLO, XN, YN, G, LOGW_IN, LOGW_OUT, POLD, PARAMS, x_hi, x_lo,
                offs_m, mask_m, col_start, col_end, s, inv_eps, coef2, HAS_LOGW_IN, HAS_LOGW_OUT, BLOCK_M, BLOCK_N,
                BLOCK_K, SINGLE_K, PRECISION, D, FOLD, COL_BIAS, PAIRED, RELAX_AT, LABELS, onehot, LAB_Y, TT,
                k_src, k_tgt, lcoef)
    if LABELS:  # NaN for the rows of an out-of-range label
        run_sum += rpois

    if SPLIT == 1:
        _write_potential(run_max, run_sum, offs_m, mask_m, XN, LOGW_OUT, POLD, OUT, ERR, eps, s,
                         HAS_LOGW_OUT, COMPUTE_ERR, BLOCK_M, PARAMS, RELAX_AT, LABELS)
    else:
        tl.store(PART + pid_s * n + offs_m, run_max, mask=mask_m)
        tl.store(PART + (SPLIT + pid_s) * n + offs_m, run_sum, mask=mask_m)
