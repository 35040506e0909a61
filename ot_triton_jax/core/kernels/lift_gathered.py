"""Coarse-to-fine extrapolation of the multiscale solve over kept cluster pairs only (d <= 3).

The lift of a fine potential from the other cloud's clusters (centroids c_l, weights B_l, coarse
potential G_l) is, for every point x_i of a sorted cloud,

    OUT_i = -eps LSE_{l in kept(k_i)} ( (G_l - |x_i - c_l|^2 / 2) / eps + LOGW_l ),

with k_i the cluster of x_i and kept(k) the columns of row k of a cluster keep mask, given as a
k-major pair list: LPTR (K + 1,) offsets into LIDX (int32 l). The dense lift sums over every l;
the terms of a dropped pair (k, l) are those the mask's truncation bound puts below
exp(-truncate) (multiscale_rules; the solve's dropped-mass bound covers the fine plans, and the
lift is only where the fine sweep starts from). Every row of the mask keeps at least one pair; a
point whose kept terms are all zero (zero-weight clusters) gets 0, as lse_blocksparse.py's rule
for a non-finite LSE.

Grid (K,): program k takes the points START[k] .. START[k + 1] of cluster k in chunks of BLOCK_I
and the gathered columns LIDX[LPTR[k] .. LPTR[k + 1]) in steps of BLOCK_L (the centroids, G and
LOGW are small: L2 hits). SHIFT_i predicts OUT_i (the solve passes an upper bound of the untruncated
lift, multiscale.bounds.lifted_fit, so every term is below exp(SHIFT_i - OUT_i) ~ 1): the terms
exp((SHIFT_i - ...)/eps) are summed into a tile without a running max and reduced once per chunk of
rows; a chunk where some row's sum leaves [2^-60, 2^60] is redone with a running max. The cost is the squared
distance itself (d subtractions and FMAs per pair on centred float32 points; C = |x - y|^2 / 2),
one exp2 per kept (point, cluster) pair.
"""

import triton
import triton.language as tl

from .tiles import LOG2E, coordinate, online_lse_step


@triton.jit
def _online(X0, X1, X2, C, G, LOGW, LIDX, p0, p1, eps, scale, BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr,
            D: tl.constexpr):
    """(max, sum of exp2) of each row's exponents in base 2, with a running max (the fallback)."""
    run_max = tl.full((BLOCK_I,), float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros((BLOCK_I,), dtype=tl.float32)
    for pb in range(p0, p1, BLOCK_L):
        offs_p = pb + tl.arange(0, BLOCK_L)
        mask_p = offs_p < p1
        z = _exponent(X0, X1, X2, C, G, LOGW, LIDX, offs_p, mask_p, eps, scale, D)
        run_max, run_sum = online_lse_step(run_max, run_sum, z)
    return run_max, run_sum


@triton.jit
def _exponent(x0, x1, x2, C, G, LOGW, LIDX, offs_p, mask_p, eps, scale, D: tl.constexpr):
    """(G_l + eps LOGW_l - |x_i - c_l|^2 / 2) / eps in base 2 for the gathered columns offs_p."""
    l = tl.load(LIDX + offs_p, mask=mask_p, other=0)
    t0 = x0[:, None] - coordinate(C, l, mask_p, 0, D)[None, :]
    t1 = x1[:, None] - coordinate(C, l, mask_p, 1, D)[None, :]
    t2 = x2[:, None] - coordinate(C, l, mask_p, 2, D)[None, :]
    col = tl.load(G + l, mask=mask_p, other=0.0) + eps * tl.load(LOGW + l, mask=mask_p, other=0.0)
    z = (col[None, :] - 0.5 * (t0 * t0 + t1 * t1 + t2 * t2)) * scale
    return tl.where(mask_p[None, :], z, float("-inf"))


@triton.jit
def lift_gathered_kernel(X, START, LPTR, LIDX, C, G, LOGW, SHIFT, PARAMS, OUT,
                         BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr, D: tl.constexpr):
    """X (n, D) sorted points, START (K + 1,) int32 cluster starts, LPTR (K + 1,) int32, LIDX int32,
    C (K_c, D) centroids, G, LOGW (K_c,), SHIFT (n,) a prediction of OUT, PARAMS [eps, s]; OUT (n,).
    The module docstring."""
    k = tl.program_id(0)
    i0 = tl.load(START + k)
    i1 = tl.load(START + k + 1)
    p0 = tl.load(LPTR + k)
    p1 = tl.load(LPTR + k + 1)
    eps = tl.load(PARAMS)
    scale = LOG2E / eps  # exponents in base 2
    for ic in range(i0, i1, BLOCK_I):
        offs_i = ic + tl.arange(0, BLOCK_I)
        mask_i = offs_i < i1
        x0 = coordinate(X, offs_i, mask_i, 0, D)
        x1 = coordinate(X, offs_i, mask_i, 1, D)
        x2 = coordinate(X, offs_i, mask_i, 2, D)
        shift = tl.load(SHIFT + offs_i, mask=mask_i, other=0.0) * scale
        acc = tl.zeros((BLOCK_I, BLOCK_L), dtype=tl.float32)
        for pb in range(p0, p1, BLOCK_L):  # the sum at the predicted shift, reduced once per chunk
            offs_p = pb + tl.arange(0, BLOCK_L)
            mask_p = offs_p < p1
            acc += tl.exp2(_exponent(x0, x1, x2, C, G, LOGW, LIDX, offs_p, mask_p, eps, scale, D) + shift[:, None])
        run_sum = tl.sum(acc, axis=1)
        run_max = -shift
        rejected = mask_i & ~((run_sum > 8.673617379884035e-19) & (run_sum < 1.152921504606847e18))  # 2^-60, 2^60
        if tl.sum(rejected.to(tl.int32), axis=0) > 0:  # a prediction far off: redo the chunk with a running max
            run_max, run_sum = _online(x0, x1, x2, C, G, LOGW, LIDX, p0, p1, eps, scale, BLOCK_I, BLOCK_L, D)
        lse2 = run_max + tl.log2(tl.maximum(run_sum, 1e-30))  # run_sum is >= 1 where run_max is finite
        out = tl.where(tl.abs(lse2) < float("inf"), -eps * lse2 / LOG2E, 0.0)  # NaN and +-inf: 0
        tl.store(OUT + offs_i, out, mask=mask_i)
