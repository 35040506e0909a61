"""Split float32 points into TF32 heads and tails for the tensor-core cross term.

``split_tf32_kernel`` ("tf32x3", every solver pass), elementwise over flat arrays:

    HI = rn_tf32(x),  LO = rn_tf32(x - HI)

rn_tf32 rounds to the nearest value with 10 mantissa bits (the low 13 bits
cleared after adding half an ulp), so the tensor cores read HI and LO exactly
and x - HI - LO is about 2^-22 |x|.

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
def split_tf32_kernel(X, numel, HI, LO, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(X + offs, mask=mask, other=0.0)
    hi = rn_tf32(x)
    tl.store(HI + offs, hi, mask=mask)
    tl.store(LO + offs, rn_tf32(x - hi), mask=mask)


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
