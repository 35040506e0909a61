"""mHC kernels, tile layout: one [BLOCK_B, NP, NP] register tile per program.

NP is the next power of two >= n (padding masked: -inf logits, scalings 1),
reductions run along the tile's axes. Forward, unrolled backward and implicit
backward; semantics and the backward recursions are in the docstring of
``kernels/mhc.py``.
"""

import triton
import triton.language as tl

from .mhc_common import LOG2E, _damp, _load_eps, _rcp, _scale_step


@triton.jit
def _tile(pid, B, N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr,
          ROWS_FIRST: tl.constexpr):
    """Offsets (relative to this program's first matrix) and masks of the tile.

    Tile element [b, i, j] is M[b, i, j], or M[b, j, i] when ROWS_FIRST.
    """
    ob = tl.arange(0, BLOCK_B)[:, None, None]
    oi = tl.arange(0, NP)[None, :, None]
    oj = tl.arange(0, NP)[None, None, :]
    if ROWS_FIRST:
        offs = ob * (N * N) + oj * N + oi
    else:
        offs = ob * (N * N) + oi * N + oj
    valid = (oi < N) & (oj < N)
    mask = (ob < B - pid * BLOCK_B) & valid
    return offs, mask, valid


@triton.jit
def _pad_one(v, N: tl.constexpr, NP: tl.constexpr):
    """Padding entries of a length-NP vector set to 1 (so they never divide by 0)."""
    if NP != N:
        v = tl.where((tl.arange(0, NP) < N)[None, :], v, 1.0)
    return v


@triton.jit
def _first_col_normalize(z, log_eps, N: tl.constexpr, NP: tl.constexpr, FAST: tl.constexpr):
    """K = exp(z) / (1^T exp(z) + eps) column-wise, without overflow; z = -inf in the padding."""
    m = tl.maximum(tl.max(z, axis=1), log_eps)
    if NP != N:
        m = tl.where((tl.arange(0, NP) < N)[None, :], m, 0.0)
    e = tl.exp2((z - m[:, None, :]) * LOG2E)
    den = _pad_one(tl.sum(e, axis=1) + tl.exp2((log_eps - m) * LOG2E), N, NP)
    return e * _rcp(den, FAST)[:, None, :]


@triton.jit
def _row_step(K, x, y, eps, N: tl.constexpr, NP: tl.constexpr, HAS_EPS: tl.constexpr,
              FAST: tl.constexpr):
    """x <- x / (x * (K y) + eps); x is indexed along axis 1 of K."""
    a = _pad_one(tl.sum(K * y[:, None, :], axis=2), N, NP)
    return _pad_one(_scale_step(x, a, eps, HAS_EPS, FAST), N, NP)


@triton.jit
def _col_step(K, x, y, eps, N: tl.constexpr, NP: tl.constexpr, HAS_EPS: tl.constexpr,
              FAST: tl.constexpr):
    """y <- y / (y * (K^T x) + eps); y is indexed along axis 2 of K."""
    b = _pad_one(tl.sum(K * x[:, :, None], axis=1), N, NP)
    return _pad_one(_scale_step(y, b, eps, HAS_EPS, FAST), N, NP)


@triton.jit
def _forward_from_start(K, eps, count, N: tl.constexpr, NP: tl.constexpr,
                        BLOCK_B: tl.constexpr, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    """Scalings (x, y) after ``count`` >= 1 iterations (the first is a row step only)."""
    y = tl.full((BLOCK_B, NP), 1.0, tl.float32)
    x = _row_step(K, y, y, eps, N, NP, HAS_EPS, FAST)
    for _ in range(count - 1):
        y = _col_step(K, x, y, eps, N, NP, HAS_EPS, FAST)
        x = _row_step(K, x, y, eps, N, NP, HAS_EPS, FAST)
    return x, y


@triton.jit
def _tile_setup(M, PARAMS, pid, B, N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr,
                ROWS_FIRST: tl.constexpr, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    eps, log_eps = _load_eps(PARAMS, HAS_EPS)
    offs, mask, valid = _tile(pid, B, N, NP, BLOCK_B, ROWS_FIRST)
    base = pid.to(tl.int64) * (BLOCK_B * N * N)
    z = tl.load(M + base + offs, mask=mask, other=0.0).to(tl.float32)
    if NP != N:
        z = tl.where(valid, z, float("-inf"))
    K = _first_col_normalize(z, log_eps, N, NP, FAST)
    return K, eps, base, offs, mask


@triton.jit
def _record(K, x, y, eps, COUNT: tl.constexpr, FIRST: tl.constexpr, N: tl.constexpr,
            NP: tl.constexpr, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    xs = (x,)
    ys = (y,)
    for s in tl.static_range(COUNT):
        if not (FIRST and s == 0):
            y = _col_step(K, x, y, eps, N, NP, HAS_EPS, FAST)
        x = _row_step(K, x, y, eps, N, NP, HAS_EPS, FAST)
        xs = xs + (x,)
        ys = ys + (y,)
    return xs, ys


@triton.jit
def _reverse(K, xs, ys, xb, yb, Kb, eps, COUNT: tl.constexpr, FIRST: tl.constexpr,
             HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    for s in tl.static_range(COUNT - 1, -1, -1):
        xp = xs[s]
        xc = xs[s + 1]
        yc = ys[s + 1]
        ab = -xb * xc * xc
        if HAS_EPS:
            xb = _damp(xb, xc, xp, eps, FAST)
        else:
            xb = tl.zeros_like(xb)
        yb += tl.sum(K * ab[:, :, None], axis=1)
        Kb += ab[:, :, None] * yc[:, None, :]
        if not (FIRST and s == 0):
            yp = ys[s]
            bb = -yb * yc * yc
            if HAS_EPS:
                yb = _damp(yb, yc, yp, eps, FAST)
            else:
                yb = tl.zeros_like(yb)
            xb += tl.sum(K * bb[:, None, :], axis=2)
            Kb += xp[:, :, None] * bb[:, None, :]
    return xb, yb, Kb


@triton.jit
def _adjoint_start(K, G, x, y):
    GK = G * K
    xb = tl.sum(GK * y[:, None, :], axis=2)
    yb = tl.sum(GK * x[:, :, None], axis=1)
    Kb = G * x[:, :, None] * y[:, None, :]
    return xb, yb, Kb


@triton.jit
def _tile_forward(M, PARAMS, B, OUT, N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr,
                  ITERS: tl.constexpr, ROWS_FIRST: tl.constexpr, HAS_EPS: tl.constexpr,
                  FAST: tl.constexpr):
    pid = tl.program_id(0)
    K, eps, base, offs, mask = _tile_setup(M, PARAMS, pid, B, N, NP, BLOCK_B, ROWS_FIRST,
                                           HAS_EPS, FAST)
    x, y = _forward_from_start(K, eps, ITERS, N, NP, BLOCK_B, HAS_EPS, FAST)
    R = x[:, :, None] * K * y[:, None, :]
    tl.store(OUT + base + offs, R.to(OUT.dtype.element_ty), mask=mask)


@triton.jit
def _tile_unrolled(M, G, PARAMS, B, DM, N: tl.constexpr, NP: tl.constexpr,
                   BLOCK_B: tl.constexpr, ITERS: tl.constexpr, SEG: tl.constexpr,
                   ROWS_FIRST: tl.constexpr, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    L0: tl.constexpr = ITERS - ((ITERS - 1) // SEG) * SEG
    NFULL: tl.constexpr = (ITERS - L0) // SEG
    pid = tl.program_id(0)
    K, eps, base, offs, mask = _tile_setup(M, PARAMS, pid, B, N, NP, BLOCK_B, ROWS_FIRST,
                                           HAS_EPS, FAST)
    g = tl.load(G + base + offs, mask=mask, other=0.0).to(tl.float32)
    ones = tl.full((BLOCK_B, NP), 1.0, tl.float32)
    if NFULL > 0:
        x, y = _forward_from_start(K, eps, ITERS - SEG, N, NP, BLOCK_B, HAS_EPS, FAST)
        xs, ys = _record(K, x, y, eps, SEG, False, N, NP, HAS_EPS, FAST)
        xb, yb, Kb = _adjoint_start(K, g, xs[SEG], ys[SEG])
        xb, yb, Kb = _reverse(K, xs, ys, xb, yb, Kb, eps, SEG, False, HAS_EPS, FAST)
        for kk in range(1, NFULL):
            x, y = _forward_from_start(K, eps, ITERS - (kk + 1) * SEG, N, NP, BLOCK_B,
                                       HAS_EPS, FAST)
            xs, ys = _record(K, x, y, eps, SEG, False, N, NP, HAS_EPS, FAST)
            xb, yb, Kb = _reverse(K, xs, ys, xb, yb, Kb, eps, SEG, False, HAS_EPS, FAST)
        xs, ys = _record(K, ones, ones, eps, L0, True, N, NP, HAS_EPS, FAST)
        xb, yb, Kb = _reverse(K, xs, ys, xb, yb, Kb, eps, L0, True, HAS_EPS, FAST)
    else:
        xs, ys = _record(K, ones, ones, eps, L0, True, N, NP, HAS_EPS, FAST)
        xb, yb, Kb = _adjoint_start(K, g, xs[L0], ys[L0])
        xb, yb, Kb = _reverse(K, xs, ys, xb, yb, Kb, eps, L0, True, HAS_EPS, FAST)
    w = tl.sum(Kb * K, axis=1)
    dm = K * (Kb - w[:, None, :])
    tl.store(DM + base + offs, dm.to(DM.dtype.element_ty), mask=mask)


@triton.jit
def _tile_implicit(M, G, PARAMS, B, DM, N: tl.constexpr, NP: tl.constexpr,
                   BLOCK_B: tl.constexpr, ITERS: tl.constexpr, ROWS_FIRST: tl.constexpr,
                   HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    pid = tl.program_id(0)
    K, eps, base, offs, mask = _tile_setup(M, PARAMS, pid, B, N, NP, BLOCK_B, ROWS_FIRST,
                                           HAS_EPS, FAST)
    g = tl.load(G + base + offs, mask=mask, other=0.0).to(tl.float32)
    x, y = _forward_from_start(K, eps, ITERS, N, NP, BLOCK_B, HAS_EPS, FAST)
    R = x[:, :, None] * K * y[:, None, :]

    oi = tl.arange(0, NP)[None, :, None]
    oj = tl.arange(0, NP)[None, None, :]
    ov = tl.arange(0, NP)[None, :]
    valid_ij = (oi < N) & (oj < N)

    r = tl.sum(R, axis=2)
    rinv = tl.where(r > 0.0, _rcp(tl.where(r > 0.0, r, 1.0), FAST), 0.0)
    RG = R * g
    s_r = tl.sum(RG, axis=2)
    s_c = tl.sum(RG, axis=1)
    rhs = s_c - tl.sum(R * (s_r * rinv)[:, :, None], axis=1)

    # W = R^T diag(r)^-1 R, one outer product per row i of R
    Rs = R * rinv[:, :, None]
    W = tl.zeros((BLOCK_B, NP, NP), tl.float32)
    for i in range(N):
        r_i = tl.sum(tl.where(oi == i, R, 0.0), axis=1)
        rs_i = tl.sum(tl.where(oi == i, Rs, 0.0), axis=1)
        W += r_i[:, :, None] * rs_i[:, None, :]

    # A = Laplacian(W) + (1/n) 1 1^T on the valid block, identity on the padding
    eye = oi == oj
    off_sum = tl.sum(tl.where(eye, 0.0, W), axis=2)
    A = tl.where(eye, off_sum[:, :, None], -W)
    A = tl.where(valid_ij, A + 1.0 / N, tl.where(eye, 1.0, 0.0))
    v = tl.where(ov < N, rhs, 0.0)

    # Gauss-Jordan elimination (SPD: no pivoting); v becomes the solution
    for p in range(N):
        row_p = tl.sum(tl.where(oi == p, A, 0.0), axis=1)
        col_p = tl.sum(tl.where(oj == p, A, 0.0), axis=2)
        piv = tl.sum(tl.where(ov == p, col_p, 0.0), axis=1)
        v_p = tl.sum(tl.where(ov == p, v, 0.0), axis=1)
        inv = tl.where(piv != 0.0, _rcp(tl.where(piv != 0.0, piv, 1.0), FAST), 0.0)
        row_n = row_p * inv[:, None]
        v_pn = v_p * inv
        f = tl.where(ov == p, 0.0, col_p)
        A = tl.where(oi == p, row_n[:, None, :], A - f[:, :, None] * row_n[:, None, :])
        v = tl.where(ov == p, v_pn[:, None], v - f * v_pn[:, None])

    u = (s_r - tl.sum(R * v[:, None, :], axis=2)) * rinv
    dm = (g - u[:, :, None] - v[:, None, :]) * R
    tl.store(DM + base + offs, dm.to(DM.dtype.element_ty), mask=mask)
