"""Tile helpers shared by the streaming kernels.

Squared Euclidean cost with scale s: C_ij = s * (|x_i|^2 + |y_j|^2 - 2 <x_i, y_j>).
Every kernel needs the cross term <x_i, y_j> for a BLOCK_M x BLOCK_N tile, computed
with tensor-core dots over chunks of BLOCK_K columns (d is zero-padded to BLOCK_K,
at least 16, so tiny d costs almost nothing on the tensor cores). PRECISION:

* "tf32x3" (float32-accurate): each operand is split once into a TF32 head and
  a float32 tail, x = x_hi + x_lo, and <x, y> ~ <x_lo, y_hi> + <x_hi, y_lo> +
  <x_hi, y_hi> (the x_lo y_lo term is below float32 rounding). Splitting by hand
  lets the kernels split the resident x block once instead of at every tile.
* "tf32": one TF32 product (~1e-3 relative error in the LSE at eps = 0.1).
* "ieee": exact float32 FMAs (slow; not used by the launch plans).

Tails in n, m and d are masked with zeros. Points are row-major float32 with row stride d.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def load_rows(P, offs, mask, d, k0, BLOCK_K: tl.constexpr):
    """A (rows, BLOCK_K) tile of a row-major (*, d) array, columns k0..k0+BLOCK_K."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = P + offs[:, None] * d + offs_k[None, :]
    return tl.load(ptrs, mask=mask[:, None] & (offs_k[None, :] < d), other=0.0)


@triton.jit
def tf32_head(v):
    """v rounded toward zero to TF32 (10 mantissa bits): v - tf32_head(v) is exact."""
    return (v.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)


@triton.jit
def dot_x3(x_hi, x_lo, yt, acc):
    """acc + x yt^T with float32 accuracy from three TF32 products (x pre-split)."""
    y_hi = tf32_head(yt)
    y_lo = yt - y_hi
    acc = tl.dot(x_lo, tl.trans(y_hi), acc, input_precision="tf32")
    acc = tl.dot(x_hi, tl.trans(y_lo), acc, input_precision="tf32")
    return tl.dot(x_hi, tl.trans(y_hi), acc, input_precision="tf32")


@triton.jit
def cross_tile_dot(X, Y, offs_m, offs_n, mask_m, mask_n, d,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """<x_i, y_j> for a tile, looping over d in chunks of BLOCK_K (x not resident)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):
        xt = load_rows(X, offs_m, mask_m, d, k0, BLOCK_K)
        yt = load_rows(Y, offs_n, mask_n, d, k0, BLOCK_K)
        if PRECISION == "tf32x3":
            x_hi = tf32_head(xt)
            acc = dot_x3(x_hi, xt - x_hi, yt, acc)
        else:
            acc = tl.dot(xt, tl.trans(yt), acc, input_precision=PRECISION)
    return acc


@triton.jit
def cross_tile_resident(x_hi, x_lo, Y, offs_n, mask_n, d,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    """<x_i, y_j> when d <= BLOCK_K and the x block (split into x_hi + x_lo for
    "tf32x3"; x_hi = x otherwise) stays in registers across column tiles."""
    yt = load_rows(Y, offs_n, mask_n, d, 0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PRECISION == "tf32x3":
        return dot_x3(x_hi, x_lo, yt, acc)
    return tl.dot(x_hi, tl.trans(yt), acc, input_precision=PRECISION)


@triton.jit
def load_resident(X, offs_m, mask_m, d, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """The x block for cross_tile_resident: (x_hi, x_lo)."""
    xt = load_rows(X, offs_m, mask_m, d, 0, BLOCK_K)
    if PRECISION == "tf32x3":
        x_hi = tf32_head(xt)
        return x_hi, xt - x_hi
    return xt, xt
