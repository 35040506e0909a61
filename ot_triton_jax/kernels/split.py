"""Split float32 points into TF32 head and tail for the "tf32x3" cross term.

    HI = rn_tf32(x),  LO = rn_tf32(x - HI)       (elementwise, flat arrays of length numel)

rn_tf32 rounds to the nearest value with 10 mantissa bits (the low 13 bits
cleared after adding half an ulp), so the tensor cores read HI and LO exactly
and x - HI - LO is about 2^-22 |x|.
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
