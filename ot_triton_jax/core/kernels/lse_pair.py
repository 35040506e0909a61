"""Both half-steps of a symmetric Sinkhorn update from one sweep of the exponentials.

GeomLoss's symmetric update (and every solver that updates both sides from the same
potentials) needs, for the same (F, G),

    f_i <- -eps LSE_j( (G_j - C_ij)/eps + log b_j )     (rows: lse.py with X, Y)
    g_j <- -eps LSE_i( (F_i - C_ij)/eps + log a_i )     (columns: lse.py with Y, X)

Both are lse.py's fixed-shift (FOLD) update with the shift predicted from the potential
being replaced, and both shifts are the potentials of this very pair: in log2 units

    shift_i  = (s|x_i|^2 - F_i)/eps log2(e),    shift'_j = (s|y_j|^2 - G_j)/eps log2(e),
    E_ij     = exp2( c <x_i, y_j> - shift_i - shift'_j ) = exp((F_i + G_j - C_ij)/eps),

so one exponential per pair gives FOLD's row sum sum_j b_j E_ij and its column sum
sum_i a_i E_ij (lse.py computes each with its own sweep). The weights multiply the terms
(one FFMA each) instead of entering the exponent, so zero weights need no special case.

:func:`lse_pair_kernel` sweeps the pairs on a grid of (row groups, column groups): program
(g, k) streams the column tiles of group k past each row block of group g (x block
resident), and writes partial sums: ROWPART[k, i] (the row sums over group k's columns)
and COLPART[g, j] (the column sums over group g's rows; the program adds its row blocks
one after the other into its own slots), both in one scratch PART (K n + G m floats, G, K ~ 16
on the GPU). Partials keep the result deterministic (no atomics).

A cloud against itself (GeomLoss's debiasing terms, SELF): E is symmetric, so the sweep takes
the pairs j >= i only, each counted for row i and (j > i) for row j through the column sums:
half the exponentials of lse.py's update of the same side.

:func:`lse_pair_finish_kernel` finishes one side exactly as lse.py's FOLD does: the sum of
its partials is the fixed-shift sum; a row block with a sum outside [FOLD_LO, FOLD_HI] (or
not finite) is redone with the online max (lse.py), and the float64 epilogue writes the
potential. The result equals two FOLD half-steps up to float32 rounding.

Points as in lse.py (X = x_hi, XLO = x_lo, XN = |x|^2, XSC = 1 / S for FP16 parts).
"""

import triton
import triton.language as tl

from .lse import _fold_rejected, _lse_online, _write_potential
from .tiles import LOG2E, cross_coef2, cross_tile_resident, load_resident


@triton.jit
def _prologue(n, m, PARAMS, N16: tl.constexpr, M16: tl.constexpr):
    """(n, m, eps, s, 1 / eps): the sizes restated as multiples of 16 where the plan says they are
    (launch_plans.size_hints), and PARAMS = [eps, s]."""
    if N16:
        n = (n // 16) * 16
    if M16:
        m = (m // 16) * 16
    eps = tl.load(PARAMS)
    return n, m, eps, tl.load(PARAMS + 1), 1.0 / eps


@triton.jit
def _side(XN, P, LOGW, PARAMS, offs, mask, U, W):
    """U = -shift = (P - s|x|^2)/eps log2(e) and W = exp(LOGW) of one cloud's entries."""
    eps = tl.load(PARAMS)
    s = tl.load(PARAMS + 1)
    p = tl.load(P + offs, mask=mask, other=0.0)
    xn = tl.load(XN + offs, mask=mask, other=0.0)
    tl.store(U + offs, ((p - s * xn) * (1.0 / eps)) * LOG2E, mask=mask)
    tl.store(W + offs, tl.exp(tl.load(LOGW + offs, mask=mask, other=0.0)), mask=mask)


@triton.jit(do_not_specialize=["n", "m"])
def pair_prep_kernel(XN, F, LOGW_X, YN, G, LOGW_Y, PARAMS, n, m, UX, WX, UY, WY, BLOCK: tl.constexpr,
                     TWO: tl.constexpr = True):
    """Per point of both clouds (of the first only, and UY, WY not written, unless TWO):
    U = -shift (FOLD's shift, the sweep's and the finishing kernel's, so both use the same
    float32 value) and the weight W = exp(logw). Not guarded: a non-finite potential makes the
    sums non-finite, and the finishing kernel then redoes the block with the online max.
    Grid (cdiv(max(n, m), BLOCK),)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    _side(XN, F, LOGW_X, PARAMS, offs, offs < n, UX, WX)
    if TWO:
        _side(YN, G, LOGW_Y, PARAMS, offs, offs < m, UY, WY)


@triton.jit
def _pair_tile(x_hi, x_lo, Y, YLO, UY, WY, u_row, w_row, offs_m, n0, col_end, col_part, r, row_acc, coef2,
               DIAG: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PRECISION: tl.constexpr, D: tl.constexpr):
    """One tile of the sweep: E of the resident rows and the columns n0.., added to the row sums
    (``row_acc``, returned) and to this program's column sums in ``col_part`` (stored; added to
    what its earlier row blocks stored when r > 0). DIAG (SELF, a tile on the diagonal): only the
    pairs j >= i, and j == i to the row sum only."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    mask_n = offs_n < col_end
    u_col = tl.load(UY + offs_n, mask=mask_n, other=float("-inf"))
    w_col = tl.load(WY + offs_n, mask=mask_n, other=0.0)
    xy = cross_tile_resident(x_hi, x_lo, Y, YLO, offs_n, mask_n, D, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    e = tl.exp2(xy * coef2 + (u_row[:, None] + u_col[None, :]))
    e_col = e
    if DIAG:
        above = offs_n[None, :] - offs_m[:, None]
        e = tl.where(above >= 0, e, 0.0)
        e_col = tl.where(above > 0, e, 0.0)
    row_acc += e * w_col[None, :]
    col_sum = tl.sum(e_col * w_row[:, None], axis=0)
    if r > 0:  # this program's earlier row blocks (its own slots, stored before the barrier)
        col_sum += tl.load(col_part + offs_n, mask=mask_n, other=0.0)
    tl.store(col_part + offs_n, col_sum, mask=mask_n)
    return row_acc


@triton.jit
def _zero_unswept(PART, n, n_k, g, GROUP_ROWS: tl.constexpr, BLOCK_M: tl.constexpr):
    """SELF: zeros in the partial slots of row group g that no program writes: its row partials
    from column groups k < g and its column partials from row groups after g."""
    for r in range(0, GROUP_ROWS):
        offs = (g * GROUP_ROWS + r) * BLOCK_M + tl.arange(0, BLOCK_M)
        zero = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k in range(0, g):
            tl.store(PART + k * n + offs, zero, mask=offs < n)
        for h in range(g + 1, n_k):
            tl.store(PART + (n_k + h) * n + offs, zero, mask=offs < n)


@triton.jit(do_not_specialize=["n", "m"])
def lse_pair_kernel(
    X, XLO, Y, YLO, UX, WX, UY, WY, PARAMS, XSC, YSC,
    n, m,
    PART,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, D: tl.constexpr, GROUP_ROWS: tl.constexpr, SELF: tl.constexpr = False,
    N16: tl.constexpr = False, M16: tl.constexpr = False,
):
    """Grid (G, K): program (g, k) takes the row blocks [g GROUP_ROWS, (g + 1) GROUP_ROWS)
    and the k-th of K column ranges. PART (K n + G m): the row partials PART[k n + i], then the
    column partials PART[K n + g m + j] (module docstring). Needs the resident x block
    (d <= BLOCK_K <= 64).

    SELF (Y is X, UY / WY are UX / WX, m = n; BLOCK_M a multiple of BLOCK_N): the update of a
    cloud against itself. E is symmetric, so only the pairs j >= i are swept: each adds to
    the row sum of i and, for j > i, to the column sum of j (the pair's other half). The
    column groups are the row groups (K = G), and the grid (G (G + 1) / 2, 1) holds only the
    block pairs g <= k, so every program has work (a full grid's lower half would idle). The
    diagonal program (g, g) also zeroes the slots no program writes (row partials k < g, column
    partials of row groups after g), so the partials of a point are all of PART[., i]."""
    n, m, eps, s, inv_eps = _prologue(n, m, PARAMS, N16, M16)
    coef2 = cross_coef2(2.0 * s * inv_eps * LOG2E, XSC, YSC, PRECISION)

    if SELF:  # program p -> the p-th block pair (g, k), g <= k, row by row
        n_k = tl.cdiv(tl.cdiv(n, BLOCK_M), GROUP_ROWS)
        pid_k = tl.program_id(0)
        pid_g = pid_k * 0
        while pid_k >= n_k - pid_g:
            pid_k -= n_k - pid_g
            pid_g += 1
        pid_k += pid_g
        span = GROUP_ROWS * BLOCK_M
        if pid_k == pid_g:
            _zero_unswept(PART, n, n_k, pid_g, GROUP_ROWS, BLOCK_M)
    else:
        pid_g = tl.program_id(0)
        pid_k = tl.program_id(1)
        n_k = tl.num_programs(1)
        span = tl.cdiv(tl.cdiv(m, BLOCK_N), n_k) * BLOCK_N
    col_start = pid_k * span
    col_end = tl.minimum(m, col_start + span)
    col_part = PART + n_k * n + pid_g * m
    for r in range(0, GROUP_ROWS):
        r0 = (pid_g * GROUP_ROWS + r) * BLOCK_M
        offs_m = r0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < n
        x_hi, x_lo = load_resident(X, XLO, offs_m, mask_m, D, BLOCK_K, PRECISION)
        u_row = tl.load(UX + offs_m, mask=mask_m, other=float("-inf"))
        w_row = tl.load(WX + offs_m, mask=mask_m, other=0.0)
        lo = col_start
        if SELF:  # tiles wholly below the diagonal: skipped; their column slots zeroed once
            lo = tl.maximum(col_start, tl.minimum(r0, col_end))
            if r == 0:
                for z0 in range(col_start, lo, BLOCK_N):
                    offs_z = z0 + tl.arange(0, BLOCK_N)
                    tl.store(col_part + offs_z, tl.zeros((BLOCK_N,), dtype=tl.float32), mask=offs_z < lo)
        # the row sums stay a tile until the row block ends (one FFMA per pair, no shuffles per tile)
        row_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        if SELF:  # the diagonal's tiles in a loop of their own: the masks cost nothing elsewhere
            diag_end = tl.minimum(r0 + BLOCK_M, col_end)
            for n0 in range(lo, diag_end, BLOCK_N):
                row_acc = _pair_tile(x_hi, x_lo, Y, YLO, UY, WY, u_row, w_row, offs_m, n0, col_end, col_part, r,
                                     row_acc, coef2, True, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, D)
            lo = tl.maximum(lo, diag_end)
        for n0 in range(lo, col_end, BLOCK_N):
            row_acc = _pair_tile(x_hi, x_lo, Y, YLO, UY, WY, u_row, w_row, offs_m, n0, col_end, col_part, r,
                                 row_acc, coef2, False, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, D)
        tl.store(PART + pid_k * n + offs_m, tl.sum(row_acc, axis=1), mask=mask_m)
        tl.debug_barrier()  # the next row block reads this one's column sums, stored by any thread


@triton.jit(do_not_specialize=["n", "m", "part_start", "parts"])
def lse_pair_finish_kernel(
    X, XLO, Y, YLO, XN, YN, G, LOGW_IN, U, PARAMS, XSC, YSC, PART,
    n, m, part_start, parts,
    OUT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, D: tl.constexpr,
    N16: tl.constexpr = False, M16: tl.constexpr = False,
):
    """OUT_i = -eps LSE_j((G_j - C_ij)/eps + LOGW_IN_j) for the rows of X (lse.py without
    logw_out), from the fixed-shift partial sums PART[part_start + k n + i], k < parts, of
    :func:`lse_pair_kernel`, taken with the shift -U (:func:`pair_prep_kernel`); grid
    (cdiv(n, BLOCK_M),)."""
    n, m, eps, s, inv_eps = _prologue(n, m, PARAMS, N16, M16)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < n
    run_sum = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k in range(0, parts):
        run_sum += tl.load(PART + part_start + k * n + offs_m, mask=mask_m, other=0.0)
    run_max = -tl.load(U + offs_m, mask=mask_m, other=0.0)
    if _fold_rejected(run_sum, tl.zeros((BLOCK_M,), dtype=tl.float32), mask_m):
        coef2 = cross_coef2(2.0 * s * inv_eps * LOG2E, XSC, YSC, PRECISION)
        x_hi, x_lo = load_resident(X, XLO, offs_m, mask_m, D, BLOCK_K, PRECISION)
        run_max, run_sum = _lse_online(X, XLO, Y, YLO, YN, G, LOGW_IN, x_hi, x_lo, offs_m, mask_m, 0, m,
                                       tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32),
                                       tl.zeros((BLOCK_M,), dtype=tl.float32), s, inv_eps, coef2, True,
                                       BLOCK_M, BLOCK_N, BLOCK_K, True, PRECISION, D)
    _write_potential(run_max, run_sum, offs_m, mask_m, XN, U, U, OUT, OUT, eps, s, False, False, BLOCK_M,
                     PARAMS, 0)
