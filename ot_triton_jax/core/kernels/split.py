"""Centre float32 point clouds and split them into TF32 or FP16 heads and tails for the cross term.

``center_kernel`` (one program): the common centre of two clouds X (n, D) and Y (m, D),

    c = (mean_S(X) + mean_S(Y)) / 2,

the means over at most SAMPLE rows of each cloud, evenly strided (every row when
n <= SAMPLE). The cost |x - y|^2 is invariant under a common shift, so any c gives the
same transport problem; c only has to lie near the data. It matters for float32: the
kernels expand |x - y|^2 = |x|^2 + |y|^2 - 2<x, y>, whose rounding grows with |x|^2 and
|y|^2, so clouds far from the origin would lose accuracy (and the marginal error the
solvers stop on would be misread) without it.

``split_centered_kernel`` ("tf32x3"; TF32 parts, the baseline the FP16 parts are timed
against when launch_plans.FP16_MIN_D is raised), per row of an (n, D) array:

    XC = x - c (rounded once),  HI = rn_tf32(XC),  LO = rn_tf32(XC - HI),  SQ = |XC|^2

rn_tf32 rounds to the nearest value with 10 mantissa bits (the low 13 bits
cleared after adding half an ulp), so the tensor cores read HI and LO exactly
and XC - HI - LO is about 2^-22 |XC|.

``absmax_kernel`` and ``split_scaled_kernel`` ("fp16x3" and "fp16", every solver pass; launch_plans.fp16_operands):
the FP16 tensor cores run at twice the TF32 rate with the same 11-bit significand, but FP16
has 5 exponent bits, so the clouds are first brought to a known range by one power of two
per problem. ``absmax_kernel`` writes per-program maxima of |x - c| over both clouds (AMAX,
no atomics: the split kernels reduce the few partials themselves); with 2^E <= max |x - c| <
2^(E + 1) (E clamped to [-50, 63]),

    S = 2^(14 - E),   XS = (x - c) S   (exact: a power of two; |XS| < 2^15 < 65504),
    HI = rn_fp16(XS),   LO = rn_fp16(XS - HI),   SC = 1 / S,   SQ = |x - c|^2 (not scaled)

HI and LO are stored with row stride DP = launch_plans.operand_stride(d) (a multiple of 8,
at least 16; zeros after column d) so that the kernels' tile loads are aligned vector copies.
For d <= 5 (PACKED, launch_plans.packed_operands) the same parts are stored packed, HI =
[LO, HI, HI, 0...] and LO = [HI, LO, HI, 0..., 1] in one row of 16, for the one-product cross
term "fp16p" (the 1 meets a 0 of the rows layout; kernels/apply_blocksparse.py's TGT_MEAN reads it).

and every cross-term kernel multiplies its <HI + LO, ...> by SC_x SC_y. XS - HI is exact in
float32 and |LO| <= 2^-11 |XS|; LO keeps 11 bits down to |LO| = 2^-14 (FP16's smallest
normal) and 2^-24 absolute below, i.e. the three products hi.hi + hi.lo + lo.hi carry an
absolute error of about 2^-22 |XS| on every coordinate with |XS| >= 2^-3, and 2^-25 below:
the largest coordinate sits at 2^14, so that is a relative 2^-39 of the largest one, far
under float32's own rounding of |x|^2. The same S for both clouds of a problem (one AMAX).
Without a device read of the scale: no host synchronization.

``split_fixed_kernel`` ("fixed4", reg_ot_cost's mass pass), per row of an (n, D) array:

    q_i  = 2^(E_i + 1 - P_BITS),   2^E_i <= max_k |x_ik| < 2^(E_i + 1)
    HI   = q_i * round(x / q_i)    (|HI| <= 2^P_BITS q_i: at most 11 significant bits, TF32-exact)
    LO   = rn_tf32(x - HI)         (|x - HI| <= q_i / 2)

A product of two heads is an integer multiple of q_i q_j below 2^(2 P_BITS) q_i q_j, so
with 2 P_BITS + log2(D) <= 24 every partial sum of sum_k HI_ik HI_jk is an integer below
2^24 units: exactly representable in float32, whatever the tensor cores' internal
rounding (they truncate toward zero, which biases ordinary float32 sums). The round to
the grid is (x + M) - M with M = 1.5 * 2^23 * q_i (round to nearest even). Rows with
max |x| >= 2^(103 + P_BITS) get a finer grid (their squared norms overflow float32 anyway).
"""

import triton
import triton.language as tl


@triton.jit
def rn_tf32(v):
    bits = v.to(tl.int32, bitcast=True)
    return ((bits + 4096) & -8192).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["n", "m"])
def center_kernel(X, Y, n, m, C, D: tl.constexpr, SAMPLE: tl.constexpr, BLOCK_D: tl.constexpr):
    """C = (mean of the sampled rows of X + mean of the sampled rows of Y) / 2, in chunks of BLOCK_D columns."""
    k = tl.arange(0, SAMPLE)
    cnt_x = tl.minimum(n, SAMPLE)
    cnt_y = tl.minimum(m, SAMPLE)
    rows_x = (k.to(tl.int64) * n) // cnt_x
    rows_y = (k.to(tl.int64) * m) // cnt_y
    for k0 in range(0, D, BLOCK_D):
        cols = k0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        x = tl.load(X + rows_x[:, None] * D + cols[None, :], mask=(k < cnt_x)[:, None] & cmask[None, :], other=0.0)
        y = tl.load(Y + rows_y[:, None] * D + cols[None, :], mask=(k < cnt_y)[:, None] & cmask[None, :], other=0.0)
        c = 0.5 * (tl.sum(x, axis=0) / cnt_x.to(tl.float32) + tl.sum(y, axis=0) / cnt_y.to(tl.float32))
        tl.store(C + cols, c, mask=cmask)


@triton.jit
def _centered_chunk(X, CENTER, rows, rmask, k0, D: tl.constexpr, BLOCK_D: tl.constexpr):
    """(x - c for the columns k0..k0+BLOCK_D of ``rows``, zero outside the array; its offsets
    in the (n, D) layout; its mask; the column indices)."""
    cols = k0 + tl.arange(0, BLOCK_D)
    cmask = cols < D
    mask = rmask[:, None] & cmask[None, :]
    offs = rows[:, None].to(tl.int64) * D + cols[None, :]
    c = tl.load(CENTER + cols, mask=cmask, other=0.0)
    return tl.where(mask, tl.load(X + offs, mask=mask, other=0.0) - c[None, :], 0.0), offs, mask, cols


@triton.jit(do_not_specialize=["n"])
def split_centered_kernel(X, CENTER, n, XC, HI, LO, SQ, D: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Rows [pid * BLOCK_R, ...) of the (n, D) row-major X; D in chunks of BLOCK_D."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n
    sq = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_D):
        xc, offs, mask, _ = _centered_chunk(X, CENTER, rows, rmask, k0, D, BLOCK_D)
        hi = rn_tf32(xc)
        tl.store(XC + offs, xc, mask=mask)
        tl.store(HI + offs, hi, mask=mask)
        tl.store(LO + offs, rn_tf32(xc - hi), mask=mask)
        sq += tl.sum(xc * xc, axis=1)
    tl.store(SQ + rows, sq, mask=rmask)


@triton.jit(do_not_specialize=["n"])
def split_fixed_kernel(X, n, HI, LO, D: tl.constexpr, P_BITS: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """Rows [pid * BLOCK_R, ...) of the (n, D) row-major X; D in chunks of BLOCK_D."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_D):
        cols = k0 + tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (cols[None, :] < D)
        x = tl.load(X + rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x), axis=1))
    # biased exponent of M = 1.5 * 2^23 * q: (E + 127) + 24 - P_BITS, kept a normal number
    e = (amax.to(tl.int32, bitcast=True) >> 23) & 255
    e_magic = tl.minimum(tl.maximum(e + 24 - P_BITS, 1), 254)
    magic = ((e_magic << 23) | 0x400000).to(tl.float32, bitcast=True)
    for k0 in range(0, D, BLOCK_D):
        cols = k0 + tl.arange(0, BLOCK_D)
        mask = rmask[:, None] & (cols[None, :] < D)
        offs = rows[:, None] * D + cols[None, :]
        x = tl.load(X + offs, mask=mask, other=0.0)
        hi = (x + magic[:, None]) - magic[:, None]
        tl.store(HI + offs, hi, mask=mask)
        tl.store(LO + offs, rn_tf32(x - hi), mask=mask)


@triton.jit(do_not_specialize=["n", "m"])
def absmax_kernel(X, Y, CENTER, n, m, AMAX, D: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """AMAX[pid] = max |x - c| over the rows of X (n, D) and Y (m, D) that program pid visits:
    blocks of BLOCK_R rows, every num_programs-th block."""
    step = tl.num_programs(0) * BLOCK_R
    amax = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for r0 in range(tl.program_id(0) * BLOCK_R, tl.maximum(n, m), step):
        rows = r0 + tl.arange(0, BLOCK_R)
        for k0 in range(0, D, BLOCK_D):
            cols = k0 + tl.arange(0, BLOCK_D)
            cmask = cols < D
            c = tl.load(CENTER + cols, mask=cmask, other=0.0)
            offs = rows[:, None].to(tl.int64) * D + cols[None, :]
            xmask = (rows < n)[:, None] & cmask[None, :]
            ymask = (rows < m)[:, None] & cmask[None, :]
            x = tl.where(xmask, tl.abs(tl.load(X + offs, mask=xmask, other=0.0) - c[None, :]), 0.0)
            y = tl.where(ymask, tl.abs(tl.load(Y + offs, mask=ymask, other=0.0) - c[None, :]), 0.0)
            amax = tl.maximum(amax, tl.maximum(tl.max(x, axis=1), tl.max(y, axis=1)))
    tl.store(AMAX + tl.program_id(0), tl.max(amax, axis=0))


@triton.jit(do_not_specialize=["n", "n_amax"])
def split_scaled_kernel(X, CENTER, AMAX, n, n_amax, XC, HI, LO, SQ, SC, D: tl.constexpr, DP: tl.constexpr,
                        BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_A: tl.constexpr,
                        PACKED: tl.constexpr = False):
    """Rows [pid * BLOCK_R, ...) of the (n, D) row-major X: XC (stride D), FP16 HI and LO of
    (x - c) S (stride DP >= D, zero columns after D), SQ = |x - c|^2; program 0 writes
    SC = 1 / S. S from the n_amax partial maxima AMAX.
    PACKED (3 D < DP <= BLOCK_D; launch_plans.packed_operands): HI = [lo, hi, hi, 0...] (the
    rows layout) and LO = [hi, lo, hi, 0..., 1] (the columns layout) of the same parts, for the
    one-product "fp16p" cross term (kernels/tiles.py; the 1 meets a 0 of the rows layout)."""
    amax = tl.zeros((BLOCK_A,), dtype=tl.float32)
    for a0 in range(0, n_amax, BLOCK_A):
        k = a0 + tl.arange(0, BLOCK_A)
        amax = tl.maximum(amax, tl.load(AMAX + k, mask=k < n_amax, other=0.0))
    big = tl.max(amax, axis=0)
    e = ((big.to(tl.int32, bitcast=True) >> 23) & 255) - 127  # floor(log2 big) for a normal big
    e = tl.minimum(tl.maximum(e, -50), 63)
    scale = ((127 + 14 - e) << 23).to(tl.float32, bitcast=True)
    if tl.program_id(0) == 0:
        tl.store(SC, ((127 - 14 + e) << 23).to(tl.float32, bitcast=True))
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n
    if PACKED:
        tl.static_assert(3 * D < DP and DP <= BLOCK_D, "PACKED: one chunk holds the three parts and a ones column")
        xc, offs, mask, cols = _centered_chunk(X, CENTER, rows, rmask, 0, D, BLOCK_D)
        xs = xc * scale
        hi = xs.to(tl.float16)
        lo = (xs - hi.to(tl.float32)).to(tl.float16)
        tl.store(XC + offs, xc, mask=mask)
        base = rows[:, None].to(tl.int64) * DP + cols[None, :]
        tl.store(HI + base, lo, mask=mask)
        tl.store(HI + base + D, hi, mask=mask)
        tl.store(HI + base + 2 * D, hi, mask=mask)
        tl.store(LO + base, hi, mask=mask)
        tl.store(LO + base + D, lo, mask=mask)
        tl.store(LO + base + 2 * D, hi, mask=mask)
        pad = rmask[:, None] & (cols >= 3 * D)[None, :] & (cols < DP)[None, :]
        zero = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float16)
        tl.store(HI + base, zero, mask=pad)
        # the columns layout's last column is 1 (the rows layout's is 0, so the cross term does
        # not see it): the plan times this tile also gives the plan's row sum (apply_blocksparse.py,
        # TGT_MEAN)
        tl.store(LO + base, tl.where((cols == DP - 1)[None, :], 1.0, zero.to(tl.float32)).to(tl.float16), mask=pad)
        sq = tl.sum(xc * xc, axis=1)
    else:
        sq = tl.zeros((BLOCK_R,), dtype=tl.float32)
        for k0 in range(0, DP, BLOCK_D):
            xc, offs, mask, cols = _centered_chunk(X, CENTER, rows, rmask, k0, D, BLOCK_D)
            xs = xc * scale
            hi = xs.to(tl.float16)
            tl.store(XC + offs, xc, mask=mask)
            offs_p = rows[:, None].to(tl.int64) * DP + cols[None, :]
            pmask = rmask[:, None] & (cols < DP)[None, :]
            tl.store(HI + offs_p, hi, mask=pmask)
            tl.store(LO + offs_p, (xs - hi.to(tl.float32)).to(tl.float16), mask=pmask)
            sq += tl.sum(xc * xc, axis=1)
    tl.store(SQ + rows, sq, mask=rmask)
