"""Cluster-pair truncation bound of the multiscale solve (d <= 3), tile by tile.

For clusters k of X (centre c_k, radius r_k, summed weight W_k) and l of Y, and per-cluster
affine fits of the two potentials (f_i = alpha_k + <beta_k, x_i - c_k> + rho_i, |rho_i| <= h_k;
``multiscale_rules`` states the rule, ``torch_api.multiscale.bounds`` the fits):

    U_kl = alpha_k + alpha_l - |D|^2 / 2 + min(A r_k + B r_l, q(A) + S r_l, q(B) + S r_k) + h_k + h_l,
    D = c_k - c_l, A = |beta_k - D|, B = |beta_l + D|, S = |beta_k + beta_l|, R = r_k + r_l,
    q(a) = a^2 / 2 if a <= R else a R - R^2 / 2,

an upper bound of f_i + g_j - |x_i - y_j|^2 / 2 over the pair's points (torch_api.multiscale.bounds derives
the three forms; the last two keep the -|u - v|^2 / 2 of the cost, about R^2 / 2 tighter). Computed in float32
and raised by 2^-18 (|alpha_k| + |alpha_l| + |D|^2 / 2 + 1), far above the rounding of those
few operations, so it stays an upper bound.

Kernels over (BLOCK_K x BLOCK_L) tiles, grid (cdiv(Kx, BLOCK_K), cdiv(Ky, BLOCK_L)):

* ``pair_keep_kernel``: KEEP[k, l] = U > THR (int8; THR = PARAMS[1] = -truncate * eps), with
  ``TRANSPOSED`` also KEEPT (Ky, Kx), its transpose (the other direction's mask), and the tile's
  row maxima ROWMAX[tile_l, k] and column maxima COLMAX[tile_k, l] of U (the caller reduces the
  partials to ROWBEST, COLBEST);
* ``pair_fixup_kernel`` (grid (Kx,) with ``ROWS``, else (Ky,)): the best pair of every row (column)
  is kept too, so no point is left with an empty sum: a row whose best U is above THR has it kept
  already and returns at once; the others (rare: a row far from the other cloud) recompute their
  U and keep where U >= ROWBEST[k] (COLBEST[l]), the same float32 values the maxima came from;
* ``pair_dropped_kernel``: DROPPED[tile_k, tile_l] = sum over the tile's pairs with
  KEEP[k, l] == 0 of W_k W_l exp(U_kl / eps) (eps = PARAMS[0]; +inf where it overflows: a
  bound that says nothing, never a wrong small one).

Centres, betas: (K, D) row-major float32; alpha, radius, rho, weight: (K,) float32.
"""

import triton
import triton.language as tl

SLACK = tl.constexpr(3.814697265625e-06)  # 2^-18


@triton.jit
def _bound_tile(CX, AX, BX, RX, HX, CY, AY, BY, RY, HY, offs_k, offs_l, mask_k, mask_l, D: tl.constexpr,
                BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr):
    """U (BLOCK_K, BLOCK_L) of the module docstring, -inf outside the clusters."""
    d2 = tl.zeros((BLOCK_K, BLOCK_L), dtype=tl.float32)
    bx2 = tl.zeros_like(d2)
    by2 = tl.zeros_like(d2)
    s2 = tl.zeros_like(d2)
    for t in tl.static_range(D):
        cx = tl.load(CX + offs_k * D + t, mask=mask_k, other=0.0)
        cy = tl.load(CY + offs_l * D + t, mask=mask_l, other=0.0)
        bx = tl.load(BX + offs_k * D + t, mask=mask_k, other=0.0)
        by = tl.load(BY + offs_l * D + t, mask=mask_l, other=0.0)
        dt = cx[:, None] - cy[None, :]
        d2 += dt * dt
        ex = bx[:, None] - dt
        ey = by[None, :] + dt
        bx2 += ex * ex
        by2 += ey * ey
        sb = bx[:, None] + by[None, :]
        s2 += sb * sb
    ax = tl.load(AX + offs_k, mask=mask_k, other=0.0)
    ay = tl.load(AY + offs_l, mask=mask_l, other=0.0)
    rx = tl.load(RX + offs_k, mask=mask_k, other=0.0)[:, None]
    ry = tl.load(RY + offs_l, mask=mask_l, other=0.0)[None, :]
    hx = tl.load(HX + offs_k, mask=mask_k, other=0.0)
    hy = tl.load(HY + offs_l, mask=mask_l, other=0.0)
    a, b, sab, rr = tl.sqrt(bx2), tl.sqrt(by2), tl.sqrt(s2), rx + ry
    qa = tl.where(a <= rr, 0.5 * a * a, a * rr - 0.5 * rr * rr)
    qb = tl.where(b <= rr, 0.5 * b * b, b * rr - 0.5 * rr * rr)
    lin = tl.minimum(a * rx + b * ry, tl.minimum(qa + sab * ry, qb + sab * rx))
    u = ax[:, None] + ay[None, :] - 0.5 * d2 + lin + hx[:, None] + hy[None, :]
    u += SLACK * (tl.abs(ax)[:, None] + tl.abs(ay)[None, :] + 0.5 * d2 + 1.0)
    return tl.where(mask_k[:, None] & mask_l[None, :], u, float("-inf"))


@triton.jit
def pair_keep_kernel(CX, AX, BX, RX, HX, CY, AY, BY, RY, HY, PARAMS, Kx, Ky, KEEP, KEEPT, ROWMAX, COLMAX,
                     BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr, D: tl.constexpr, TRANSPOSED: tl.constexpr):
    pk, pl = tl.program_id(0), tl.program_id(1)
    offs_k = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_l = pl * BLOCK_L + tl.arange(0, BLOCK_L)
    mask_k, mask_l = offs_k < Kx, offs_l < Ky
    u = _bound_tile(CX, AX, BX, RX, HX, CY, AY, BY, RY, HY, offs_k, offs_l, mask_k, mask_l, D, BLOCK_K, BLOCK_L)
    keep = u > tl.load(PARAMS + 1)
    ptr = KEEP + offs_k.to(tl.int64)[:, None] * Ky + offs_l[None, :]
    tl.store(ptr, keep.to(tl.int8), mask=mask_k[:, None] & mask_l[None, :])
    if TRANSPOSED:  # the same decisions for the (Y, X) direction, so that its mask is this one's transpose
        ptr_t = KEEPT + offs_l.to(tl.int64)[:, None] * Kx + offs_k[None, :]
        tl.store(ptr_t, tl.trans(keep.to(tl.int8)), mask=mask_l[:, None] & mask_k[None, :])
    tl.store(ROWMAX + pl.to(tl.int64) * Kx + offs_k, tl.max(u, axis=1), mask=mask_k)
    tl.store(COLMAX + pk.to(tl.int64) * Ky + offs_l, tl.max(u, axis=0), mask=mask_l)


@triton.jit
def pair_fixup_kernel(CX, AX, BX, RX, HX, CY, AY, BY, RY, HY, PARAMS, ROWBEST, COLBEST, Kx, Ky, KEEP, KEEPT,
                      BLOCK: tl.constexpr, D: tl.constexpr, TRANSPOSED: tl.constexpr, ROWS: tl.constexpr):
    p = tl.program_id(0)
    thr = tl.load(PARAMS + 1)
    one = tl.arange(0, 1)
    if ROWS:
        best = tl.load(ROWBEST + p)
        other = Ky
    else:
        best = tl.load(COLBEST + p)
        other = Kx
    if best <= thr:  # else its best pair is above THR, kept by pair_keep_kernel
        for q0 in range(0, other, BLOCK):
            q = q0 + tl.arange(0, BLOCK)
            mq = q < other
            if ROWS:  # a (1, BLOCK) tile of row p: the same U as pair_keep_kernel's tiles
                k, l, mk, ml = p + one, q, (p + one) < Kx, mq
                u = tl.reshape(_bound_tile(CX, AX, BX, RX, HX, CY, AY, BY, RY, HY, k, l, mk, ml, D, 1, BLOCK), (BLOCK,))
            else:  # a (BLOCK, 1) tile of column p
                k, l, mk, ml = q, p + one, mq, (p + one) < Ky
                u = tl.reshape(_bound_tile(CX, AX, BX, RX, HX, CY, AY, BY, RY, HY, k, l, mk, ml, D, BLOCK, 1), (BLOCK,))
            hit = mq & (u >= best)
            kk = p + 0 * q if ROWS else q
            ll = q if ROWS else p + 0 * q
            tl.store(KEEP + kk.to(tl.int64) * Ky + ll, tl.full((BLOCK,), 1, tl.int8), mask=hit)
            if TRANSPOSED:
                tl.store(KEEPT + ll.to(tl.int64) * Kx + kk, tl.full((BLOCK,), 1, tl.int8), mask=hit)


@triton.jit
def pair_dropped_kernel(CX, AX, BX, RX, HX, WX, CY, AY, BY, RY, HY, WY, PARAMS, KEEP, Kx, Ky, DROPPED,
                        BLOCK_K: tl.constexpr, BLOCK_L: tl.constexpr, D: tl.constexpr):
    pk, pl = tl.program_id(0), tl.program_id(1)
    offs_k = pk * BLOCK_K + tl.arange(0, BLOCK_K)
    offs_l = pl * BLOCK_L + tl.arange(0, BLOCK_L)
    mask_k, mask_l = offs_k < Kx, offs_l < Ky
    u = _bound_tile(CX, AX, BX, RX, HX, CY, AY, BY, RY, HY, offs_k, offs_l, mask_k, mask_l, D, BLOCK_K, BLOCK_L)
    inv_eps = 1.0 / tl.load(PARAMS)
    both = mask_k[:, None] & mask_l[None, :]
    keep = tl.load(KEEP + offs_k.to(tl.int64)[:, None] * Ky + offs_l[None, :], mask=both, other=1)
    wx = tl.load(WX + offs_k, mask=mask_k, other=0.0)
    wy = tl.load(WY + offs_l, mask=mask_l, other=0.0)
    w = wx[:, None] * wy[None, :]
    mass = tl.where((keep == 0) & (w > 0), w * tl.exp(u * inv_eps), 0.0)
    tl.store(DROPPED + pk * tl.num_programs(1) + pl, tl.sum(tl.sum(mass, axis=1), axis=0))
