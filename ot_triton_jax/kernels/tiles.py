"""Tile helpers shared by the streaming kernels.

Squared Euclidean cost with scale s: C_ij = s * (|x_i|^2 + |y_j|^2 - 2 <x_i, y_j>).
Every kernel needs the cross term <x_i, y_j> for a BLOCK_M x BLOCK_N tile:

* ``D_FMA > 0`` (small d, at most 8): exact float32 FMAs, one column at a time;
* otherwise ``tl.dot`` over chunks of ``BLOCK_K`` columns with ``PRECISION``
  ("tf32x3": three TF32 tensor-core products, float32-accurate; "tf32": one,
  ~1e-3 relative; "ieee": exact and slow). Tails are masked with zeros, so
  any n, m, d is valid.

Points are row-major float32 with row stride d.
"""

import triton
import triton.language as tl

LOG2E: tl.constexpr = 1.4426950408889634
LN2: tl.constexpr = 0.6931471805599453


@triton.jit
def load_rows(P, offs, mask, d, k0, BLOCK_K: tl.constexpr):
    """A (rows, BLOCK_K) tile of a row-major (*, d) array, columns k0..k0+BLOCK_K."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = P + offs[:, None] * d + offs_k[None, :]
    return tl.load(ptrs, mask=mask[:, None] & (offs_k[None, :] < d), other=0.0)


@triton.jit
def cross_tile_fma(X, Y, offs_m, offs_n, mask_m, mask_n,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, D_FMA: tl.constexpr):
    """<x_i, y_j> for a tile by exact FMAs (d == D_FMA, small)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.static_range(D_FMA):
        xk = tl.load(X + offs_m * D_FMA + k, mask=mask_m, other=0.0)
        yk = tl.load(Y + offs_n * D_FMA + k, mask=mask_n, other=0.0)
        acc += xk[:, None] * yk[None, :]
    return acc


@triton.jit
def cross_tile_dot(X, Y, offs_m, offs_n, mask_m, mask_n, d,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """<x_i, y_j> for a tile by tensor-core dots over d in chunks of BLOCK_K."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):
        xt = load_rows(X, offs_m, mask_m, d, k0, BLOCK_K)
        yt = load_rows(Y, offs_n, mask_n, d, k0, BLOCK_K)
        acc = tl.dot(xt, tl.trans(yt), acc, input_precision=PRECISION)
    return acc
