"""Centre float32 point clouds and split them into TF32 heads and tails for the cross term.

``center_kernel`` (one program): the common centre of two clouds X (n, D) and Y (m, D),

    c = (mean_S(X) + mean_S(Y)) / 2,

the means over at most SAMPLE rows of each cloud, evenly strided (every row when
n <= SAMPLE). The cost |x - y|^2 is invariant under a common shift, so any c gives the
same transport problem; c only has to lie near the data. It matters for float32: the
kernels expand |x - y|^2 = |x|^2 + |y|^2 - 2<x, y>, whose rounding grows with |x|^2 and
|y|^2, so clouds far from the origin would lose accuracy (and the marginal error the
solvers stop on would be misread) without it.

``split_centered_kernel`` ("tf32x3", every solver pass), per row of an (n, D) array:

    XC = x - c (rounded once),  HI = rn_tf32(XC),  LO = rn_tf32(XC - HI),  SQ = |XC|^2

rn_tf32 rounds to the nearest value with 10 mantissa bits (the low 13 bits
cleared after adding half an ulp), so the tensor cores read HI and LO exactly
and XC - HI - LO is about 2^-22 |XC|.

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


@triton.jit
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
def split_centered_kernel(X, CENTER, n, XC, HI, LO, SQ, D: tl.constexpr, BLOCK_R: tl.constexpr,
                          BLOCK_D: tl.constexpr):
    """Rows [pid * BLOCK_R, ...) of the (n, D) row-major X; D in chunks of BLOCK_D."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    rmask = rows < n
    sq = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_D):
        cols = k0 + tl.arange(0, BLOCK_D)
        cmask = cols < D
        mask = rmask[:, None] & cmask[None, :]
        offs = rows[:, None].to(tl.int64) * D + cols[None, :]
        c = tl.load(CENTER + cols, mask=cmask, other=0.0)
        xc = tl.load(X + offs, mask=mask, other=0.0) - c[None, :]
        hi = rn_tf32(xc)
        tl.store(XC + offs, xc, mask=mask)
        tl.store(HI + offs, hi, mask=mask)
        tl.store(LO + offs, rn_tf32(xc - hi), mask=mask)
        sq += tl.sum(xc * xc, axis=1)
    tl.store(SQ + rows, sq, mask=rmask)


@triton.jit
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
