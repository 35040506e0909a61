"""mHC kernels, one-matrix-per-thread ("SoA") layout (n <= 8): forward and unrolled backward.

Every entry of a matrix is its own [BLOCK_B] tensor (a tuple of N*N of them;
vectors are tuples of N): all arithmetic is elementwise, no shuffles, no
replicated work, loops run over exactly N. Memory stays coalesced: a
[BLOCK_B, NP] tile per matrix row is loaded in one piece and split into its
entries by a cascade of ``tl.split``; stores join the entries back with
``tl.join``. The implicit backward of this layout is in
``mhc_soa_implicit.py``; semantics and the backward recursions are in the
docstring of ``kernels/mhc.py``.
"""

import triton
import triton.language as tl

from .mhc_common import LOG2E, _damp, _load_eps, _rcp, _scale_step


@triton.jit
def _split_entries(t, BLOCK_B: tl.constexpr, E: tl.constexpr):
    """[BLOCK_B, E] -> tuple of E [BLOCK_B] tensors, entry e at position e (E = 2^k <= 64)."""
    if E == 1:
        return (tl.reshape(t, (BLOCK_B,)),)
    parts = (t,)
    for k in tl.static_range(6):
        if (2 << k) <= E:
            lo = ()
            hi = ()
            for q in tl.static_range(1 << k):
                a, b = tl.split(tl.reshape(parts[q], (BLOCK_B, E >> (k + 1), 2)))
                lo = lo + (a,)
                hi = hi + (b,)
            parts = lo + hi
    out = ()
    for e in tl.static_range(E):
        out = out + (tl.reshape(parts[e], (BLOCK_B,)),)
    return out


@triton.jit
def _join_entries(parts, BLOCK_B: tl.constexpr, E: tl.constexpr):
    """Inverse of _split_entries: tuple of E [BLOCK_B] tensors -> [BLOCK_B, E]."""
    cur = ()
    for e in tl.static_range(E):
        cur = cur + (tl.reshape(parts[e], (BLOCK_B, 1)),)
    for k in tl.static_range(5, -1, -1):
        if (2 << k) <= E:
            nxt = ()
            for q in tl.static_range(1 << k):
                j = tl.join(cur[q], cur[q + (1 << k)])
                nxt = nxt + (tl.reshape(j, (BLOCK_B, E >> k)),)
            cur = nxt
    return cur[0]


@triton.jit
def _soa_tile(pid, B, N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr):
    ob = tl.arange(0, BLOCK_B)[:, None]
    oe = tl.arange(0, NP * NP)[None, :]
    oi = oe // NP
    oj = oe % NP
    offs = ob * (N * N) + oi * N + oj
    mask = (ob < B - pid * BLOCK_B) & (oi < N) & (oj < N)
    return offs, mask


@triton.jit
def _soa_load(PTR, nvalid, N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr,
              TRANSPOSE: tl.constexpr):
    """The N*N entries (row-major; of the transpose if TRANSPOSE) as float32 [BLOCK_B] tensors.

    One [BLOCK_B, NP] load per matrix row, so each thread reads its own
    matrix's row as one vector; splitting it into entries stays in-thread.
    """
    ob = tl.arange(0, BLOCK_B)[:, None]
    oj = tl.arange(0, NP)[None, :]
    mask = ob < nvalid
    if NP != N:
        mask = mask & (oj < N)
    ent = ()
    for i in tl.static_range(N):
        t = tl.load(PTR + ob * (N * N) + i * N + oj, mask=mask, other=0.0).to(tl.float32)
        parts = _split_entries(t, BLOCK_B, NP)
        for j in tl.static_range(N):
            ent = ent + (parts[j],)
    if TRANSPOSE:
        out = ()
        for i in tl.static_range(N):
            for j in tl.static_range(N):
                out = out + (ent[j * N + i],)
        ent = out
    return ent


@triton.jit
def _soa_store(PTR, offs, mask, vals, N: tl.constexpr, NP: tl.constexpr,
               BLOCK_B: tl.constexpr, TRANSPOSE: tl.constexpr):
    zero = tl.zeros_like(vals[0])
    parts = ()
    for i in tl.static_range(NP):
        for j in tl.static_range(NP):
            if i < N and j < N:
                if TRANSPOSE:
                    parts = parts + (vals[j * N + i],)
                else:
                    parts = parts + (vals[i * N + j],)
            else:
                parts = parts + (zero,)
    t = _join_entries(parts, BLOCK_B, NP * NP)
    tl.store(PTR + offs, t.to(PTR.dtype.element_ty), mask=mask)


@triton.jit
def _soa_first_col_normalize(z, log_eps, N: tl.constexpr, FAST: tl.constexpr):
    """K = exp(z) / (1^T exp(z) + eps) column-wise, without overflow (see module doc)."""
    cols = ()
    for j in tl.static_range(N):
        m = z[j]
        for i in tl.static_range(1, N):
            m = tl.maximum(m, z[i * N + j])
        m = tl.maximum(m, log_eps)
        den = tl.exp2((log_eps - m) * LOG2E)
        col = ()
        for i in tl.static_range(N):
            e = tl.exp2((z[i * N + j] - m) * LOG2E)
            den += e
            col = col + (e,)
        inv = _rcp(den, FAST)
        for i in tl.static_range(N):
            cols = cols + (col[i] * inv,)
    K = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            K = K + (cols[j * N + i],)
    return K


@triton.jit
def _soa_row_step(K, x, y, eps, N: tl.constexpr, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    out = ()
    for i in tl.static_range(N):
        a = K[i * N] * y[0]
        for j in tl.static_range(1, N):
            a += K[i * N + j] * y[j]
        out = out + (_scale_step(x[i], a, eps, HAS_EPS, FAST),)
    return out


@triton.jit
def _soa_col_step(K, x, y, eps, N: tl.constexpr, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    out = ()
    for j in tl.static_range(N):
        b = K[j] * x[0]
        for i in tl.static_range(1, N):
            b += K[i * N + j] * x[i]
        out = out + (_scale_step(y[j], b, eps, HAS_EPS, FAST),)
    return out


@triton.jit
def _soa_fill(like, value, N: tl.constexpr):
    v = tl.full(like.shape, value, tl.float32)
    out = ()
    for i in tl.static_range(N):
        out = out + (v,)
    return out


@triton.jit
def _soa_forward_from_start(K, eps, count, N: tl.constexpr, HAS_EPS: tl.constexpr,
                            FAST: tl.constexpr):
    """Scalings (x, y) after ``count`` >= 1 iterations (the first is a row step only)."""
    y = _soa_fill(K[0], 1.0, N)
    x = _soa_row_step(K, y, y, eps, N, HAS_EPS, FAST)
    for _ in range(count - 1):
        y = _soa_col_step(K, x, y, eps, N, HAS_EPS, FAST)
        x = _soa_row_step(K, x, y, eps, N, HAS_EPS, FAST)
    return x, y


@triton.jit
def _soa_record(K, x, y, eps, COUNT: tl.constexpr, FIRST: tl.constexpr, N: tl.constexpr,
                HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    """Run COUNT iterations from (x, y); return the COUNT + 1 states of x and of y.

    FIRST: the first of them is iteration 1 (row step only).
    """
    xs = (x,)
    ys = (y,)
    for s in tl.static_range(COUNT):
        if not (FIRST and s == 0):
            y = _soa_col_step(K, x, y, eps, N, HAS_EPS, FAST)
        x = _soa_row_step(K, x, y, eps, N, HAS_EPS, FAST)
        xs = xs + (x,)
        ys = ys + (y,)
    return xs, ys


@triton.jit
def _soa_reverse(K, xs, ys, xb, yb, Kb, eps, COUNT: tl.constexpr, FIRST: tl.constexpr,
                 N: tl.constexpr, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    """Pull the adjoints (xb, yb, Kb) back through the COUNT recorded iterations."""
    for s in tl.static_range(COUNT - 1, -1, -1):
        xp = xs[s]
        xc = xs[s + 1]
        yc = ys[s + 1]
        # row step: xc = xp / (xp * (K yc) + eps)
        ab = ()
        nxb = ()
        for i in tl.static_range(N):
            ab = ab + (-xb[i] * xc[i] * xc[i],)
            if HAS_EPS:
                nxb = nxb + (_damp(xb[i], xc[i], xp[i], eps, FAST),)
        nyb = ()
        for j in tl.static_range(N):
            acc = yb[j]
            for i in tl.static_range(N):
                acc += K[i * N + j] * ab[i]
            nyb = nyb + (acc,)
        yb = nyb
        nKb = ()
        for i in tl.static_range(N):
            for j in tl.static_range(N):
                nKb = nKb + (Kb[i * N + j] + ab[i] * yc[j],)
        Kb = nKb
        if not (FIRST and s == 0):
            # column step: yc = yp / (yp * (K^T xp) + eps)
            yp = ys[s]
            bb = ()
            nyb = ()
            for j in tl.static_range(N):
                bb = bb + (-yb[j] * yc[j] * yc[j],)
                if HAS_EPS:
                    nyb = nyb + (_damp(yb[j], yc[j], yp[j], eps, FAST),)
            if HAS_EPS:
                yb = nyb
            else:
                yb = _soa_fill(K[0], 0.0, N)
            xb2 = ()
            for i in tl.static_range(N):
                if HAS_EPS:
                    acc = nxb[i]
                    for j in tl.static_range(N):
                        acc += K[i * N + j] * bb[j]
                else:
                    acc = K[i * N] * bb[0]
                    for j in tl.static_range(1, N):
                        acc += K[i * N + j] * bb[j]
                xb2 = xb2 + (acc,)
            xb = xb2
            nKb = ()
            for i in tl.static_range(N):
                for j in tl.static_range(N):
                    nKb = nKb + (Kb[i * N + j] + xp[i] * bb[j],)
            Kb = nKb
        else:
            if HAS_EPS:
                xb = nxb
            else:
                xb = _soa_fill(K[0], 0.0, N)
    return xb, yb, Kb


@triton.jit
def _soa_adjoint_start(K, G, x, y, N: tl.constexpr):
    """Adjoints of x, y, K from G = dL/dR, R = diag(x) K diag(y)."""
    GK = ()
    for e in tl.static_range(N * N):
        GK = GK + (G[e] * K[e],)
    xb = ()
    for i in tl.static_range(N):
        acc = GK[i * N] * y[0]
        for j in tl.static_range(1, N):
            acc += GK[i * N + j] * y[j]
        xb = xb + (acc,)
    yb = ()
    for j in tl.static_range(N):
        acc = GK[j] * x[0]
        for i in tl.static_range(1, N):
            acc += GK[i * N + j] * x[i]
        yb = yb + (acc,)
    Kb = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            Kb = Kb + (G[i * N + j] * x[i] * y[j],)
    return xb, yb, Kb


@triton.jit
def _soa_first_backward(K, Kb, N: tl.constexpr):
    """dM = K * (Kb - 1 w^T), w_j = sum_i Kb_ij K_ij."""
    w = ()
    for j in tl.static_range(N):
        acc = Kb[j] * K[j]
        for i in tl.static_range(1, N):
            acc += Kb[i * N + j] * K[i * N + j]
        w = w + (acc,)
    dm = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            dm = dm + (K[i * N + j] * (Kb[i * N + j] - w[j]),)
    return dm


@triton.jit
def _soa_setup(M, PARAMS, pid, B, N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr,
               ROWS_FIRST: tl.constexpr, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    """Pointer offsets (int64 base folded in), mask, eps and K of this program's matrices."""
    eps, log_eps = _load_eps(PARAMS, HAS_EPS)
    offs, mask = _soa_tile(pid, B, N, NP, BLOCK_B)
    base = pid.to(tl.int64) * (BLOCK_B * N * N)
    z = _soa_load(M + base, B - pid * BLOCK_B, N, NP, BLOCK_B, ROWS_FIRST)
    K = _soa_first_col_normalize(z, log_eps, N, FAST)
    return K, eps, base, offs, mask


@triton.jit
def _soa_forward(M, PARAMS, B, OUT, N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr,
                 ITERS: tl.constexpr, ROWS_FIRST: tl.constexpr, HAS_EPS: tl.constexpr,
                 FAST: tl.constexpr):
    pid = tl.program_id(0)
    K, eps, base, offs, mask = _soa_setup(M, PARAMS, pid, B, N, NP, BLOCK_B, ROWS_FIRST,
                                          HAS_EPS, FAST)
    x, y = _soa_forward_from_start(K, eps, ITERS, N, HAS_EPS, FAST)
    R = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            R = R + (x[i] * K[i * N + j] * y[j],)
    _soa_store(OUT + base, offs, mask, R, N, NP, BLOCK_B, ROWS_FIRST)


@triton.jit
def _soa_unrolled(M, G, PARAMS, B, DM, N: tl.constexpr, NP: tl.constexpr,
                  BLOCK_B: tl.constexpr, ITERS: tl.constexpr, SEG: tl.constexpr,
                  ROWS_FIRST: tl.constexpr, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    L0: tl.constexpr = ITERS - ((ITERS - 1) // SEG) * SEG
    NFULL: tl.constexpr = (ITERS - L0) // SEG
    pid = tl.program_id(0)
    K, eps, base, offs, mask = _soa_setup(M, PARAMS, pid, B, N, NP, BLOCK_B, ROWS_FIRST,
                                          HAS_EPS, FAST)
    g = _soa_load(G + base, B - pid * BLOCK_B, N, NP, BLOCK_B, ROWS_FIRST)
    ones = _soa_fill(K[0], 1.0, N)
    if NFULL > 0:
        x, y = _soa_forward_from_start(K, eps, ITERS - SEG, N, HAS_EPS, FAST)
        xs, ys = _soa_record(K, x, y, eps, SEG, False, N, HAS_EPS, FAST)
        xb, yb, Kb = _soa_adjoint_start(K, g, xs[SEG], ys[SEG], N)
        xb, yb, Kb = _soa_reverse(K, xs, ys, xb, yb, Kb, eps, SEG, False, N, HAS_EPS, FAST)
        for kk in range(1, NFULL):
            x, y = _soa_forward_from_start(K, eps, ITERS - (kk + 1) * SEG, N, HAS_EPS, FAST)
            xs, ys = _soa_record(K, x, y, eps, SEG, False, N, HAS_EPS, FAST)
            xb, yb, Kb = _soa_reverse(K, xs, ys, xb, yb, Kb, eps, SEG, False, N, HAS_EPS, FAST)
        xs, ys = _soa_record(K, ones, ones, eps, L0, True, N, HAS_EPS, FAST)
        xb, yb, Kb = _soa_reverse(K, xs, ys, xb, yb, Kb, eps, L0, True, N, HAS_EPS, FAST)
    else:
        xs, ys = _soa_record(K, ones, ones, eps, L0, True, N, HAS_EPS, FAST)
        xb, yb, Kb = _soa_adjoint_start(K, g, xs[L0], ys[L0], N)
        xb, yb, Kb = _soa_reverse(K, xs, ys, xb, yb, Kb, eps, L0, True, N, HAS_EPS, FAST)
    dm = _soa_first_backward(K, Kb, N)
    _soa_store(DM + base, offs, mask, dm, N, NP, BLOCK_B, ROWS_FIRST)
