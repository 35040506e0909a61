"""Block-sparse ("multiscale") streaming LSE update: lse.py's half-step over kept clusters only.

Layout. A multiscale solve (d <= 3) sorts both clouds by cluster (a voxel grid), so that
every cluster's points are contiguous and the columns a row block keeps are a few runs of
consecutive columns. The rows of X go in row blocks of BLOCK_M rows (b = i // BLOCK_M;
BLOCK_M is the launch plan's, ``launch_plans.blocksparse_block_m``, which the caller
queries before building the ranges). RANGES (int32, (cdiv(n, BLOCK_M), R, 2), row-major):
row block b streams the columns [RANGES[b, r, 0], RANGES[b, r, 1]) for r < R (an empty
range, start >= end, streams nothing: the padding of blocks with fewer than R runs; the
ranges of one block must not overlap). With S_b the union of the ranges of b, for a row i
of block b:

    L_i   = LSE_{j in S_b} ( (G_j - C_ij) / eps + logw_in_j )
    OUT_i = eps * logw_out_i - eps * L_i      (L_i replaced by 0 if not finite)

that is lse.py's update with every dropped column absent (its term zero, as with a bias of
-inf). C_ij = s |x_i - y_j|^2 and PARAMS = [eps, s], as in lse.py.

Empty rows: a row block whose ranges are all empty has L = -inf, so by the
epilogue's rule OUT_i = eps * logw_out_i (0 without logw_out) and, with COMPUTE_ERR,
ERR_i = w_out_i. The frontend avoids it: every row keeps at least its own best cluster.

COMPUTE_ERR and FOLD as in lse.py, over S_b: ERR_i = |exp(POLD_i/eps + L_i) - w_out_i|;
FOLD sums exp2(t - shift) over all kept ranges with the shift predicted from POLD, checks
the whole row block once, and redoes it with the online max over all kept ranges when a
row's sum is out of range.

Grid (cdiv(n, BLOCK_M),): one program per row block, no column split (SPLIT of lse.py).
Points as in lse.py: X = x_hi, XLO = x_lo (kernels/split.py), XN = |x|^2.
"""

import triton
import triton.language as tl

from .lse import _fold_rejected, _fold_shift, _lse_folded, _lse_online, _write_potential
from .tiles import LOG2E, cross_coef2, load_resident


@triton.jit
def kept_range(RANGE_ROW, r):
    """Columns [start, end) of the row block's r-th range (RANGE_ROW: its (R, 2) ranges)."""
    start = tl.load(RANGE_ROW + 2 * r)
    end = tl.load(RANGE_ROW + 2 * r + 1)
    return start, tl.maximum(start, end)


@triton.jit
def _lse_kept_online(X, XLO, Y, YLO, YN, G, LOGW_IN, RANGE_ROW, R, x_hi, x_lo, offs_m, mask_m,
                     s, inv_eps, coef2, HAS_LOGW_IN: tl.constexpr, BLOCK_M: tl.constexpr,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_K: tl.constexpr,
                     PRECISION: tl.constexpr, D: tl.constexpr):
    """lse.py's online (max, sum of exp2) of each row, carried across the kept ranges."""
    run_max = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for r in range(0, R):
        col_start, col_end = kept_range(RANGE_ROW, r)
        run_max, run_sum = _lse_online(X, XLO, Y, YLO, YN, G, LOGW_IN, x_hi, x_lo, offs_m, mask_m,
                                       col_start, col_end, run_max, run_sum, s, inv_eps, coef2, HAS_LOGW_IN,
                                       BLOCK_M, BLOCK_N, BLOCK_K, SINGLE_K, PRECISION, D)
    return run_max, run_sum


# R (runs per row block) is data-dependent: not specialized, so that one compile serves every R
# (and a prewarm, kernel_ops.prewarm, can compile it before the masks exist)
@triton.jit(do_not_specialize=["R", "n", "m"])
def lse_blocksparse_kernel(
    X, XLO, Y, YLO, XN, YN, G, LOGW_IN, LOGW_OUT, POLD, PARAMS, XSC, YSC, RANGES,
    n, m, R,
    OUT, ERR,
    HAS_LOGW_IN: tl.constexpr, HAS_LOGW_OUT: tl.constexpr, COMPUTE_ERR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SINGLE_K: tl.constexpr, PRECISION: tl.constexpr, D: tl.constexpr,
    FOLD: tl.constexpr = False, N16: tl.constexpr = False, RELAX_AT: tl.constexpr = 0,
):
    """Grid (cdiv(n, BLOCK_M),); RANGES must have been built for this BLOCK_M. ``m`` is not
    read (the ranges bound the columns). FOLD needs SINGLE_K and POLD (lse.py).
    N16: n is a multiple of 16 (launch_plans.size_hints)."""
    if N16:  # written so that the compiler knows it (lse_update_kernel)
        n = (n // 16) * 16
    pid = tl.program_id(0)
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
    range_row = RANGES + pid.to(tl.int64) * (2 * R)

    if FOLD:
        tl.static_assert(SINGLE_K, "FOLD needs the resident x block (d <= 64)")
        shift, logw = _fold_shift(XN, LOGW_OUT, POLD, offs_m, mask_m, s, inv_eps, HAS_LOGW_OUT, BLOCK_M,
                                  PARAMS, RELAX_AT)
        run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for r in range(0, R):
            col_start, col_end = kept_range(range_row, r)
            run_sum += _lse_folded(Y, YLO, YN, G, LOGW_IN, x_hi, x_lo, shift, col_start, col_end, s,
                                   inv_eps, coef2, HAS_LOGW_IN, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, D)
        run_max = shift
        # a block that keeps no column sums to 0 and is "redone" over no column: same result
        if _fold_rejected(run_sum, logw, mask_m):
            run_max, run_sum = _lse_kept_online(X, XLO, Y, YLO, YN, G, LOGW_IN, range_row, R,
                                                x_hi, x_lo, offs_m, mask_m, s, inv_eps, coef2, HAS_LOGW_IN,
                                                BLOCK_M, BLOCK_N, BLOCK_K, SINGLE_K, PRECISION, D)
    else:
        run_max, run_sum = _lse_kept_online(X, XLO, Y, YLO, YN, G, LOGW_IN, range_row, R,
                                            x_hi, x_lo, offs_m, mask_m, s, inv_eps, coef2, HAS_LOGW_IN,
                                            BLOCK_M, BLOCK_N, BLOCK_K, SINGLE_K, PRECISION, D)

    _write_potential(run_max, run_sum, offs_m, mask_m, XN, LOGW_OUT, POLD, OUT, ERR, eps, s,
                     HAS_LOGW_OUT, COMPUTE_ERR, BLOCK_M, PARAMS, RELAX_AT)
