"""Batched Sinkhorn-Knopp for mHC: (B, n, n) logits -> doubly-stochastic matrices.

Pure ``@triton.jit`` code (no torch, no jax). A program owns ``BLOCK_B`` whole
matrices; nothing but the logits (and, backward, the output gradient) is read
from memory and nothing but the result is written.

Semantics (``ROWS_FIRST=False``; ``ROWS_FIRST=True`` is the same computation
on the transposed matrix, done by transposed loads and stores):

    P^0 = exp(M);  T = ITERS times:  P <- P / (1^T P + eps)   (columns)
                                     P <- P / (P 1 + eps)     (rows)

``eps`` >= 0 is added to every denominator, exactly as written. It is read
from ``PARAMS[0]`` at run time when ``HAS_EPS``; ``HAS_EPS=False`` means
eps == 0 (the kernels then skip the eps terms entirely).

How it is computed (float32, whatever the input dtype):

* The first column normalization is done stably: with
  ``m_j = max(max_i M_ij, log eps)``,
  ``K_ij = exp(M_ij - m_j) / (sum_i exp(M_ij - m_j) + exp(log eps - m_j))``,
  which equals ``exp(M_ij) / (sum_i exp(M_ij) + eps)`` but never overflows
  (any finite logits). Entries of K lie in [0, 1].
* The remaining 2T - 1 half-steps run in the scaling domain,
  ``P = diag(x) K diag(y)``: a row step is ``x <- x / (x * (K y) + eps)``, a
  column step ``y <- y / (y * (K^T x) + eps)``; the result is
  ``R = diag(x) K diag(y)`` after T row steps and T - 1 column steps.
* Underflow: a logit more than ~87 below its column's maximum gives
  ``K_ij = 0`` (float32 ``exp``); a row of K that is entirely zero gives a
  NaN/inf matrix when eps == 0. NaN and +inf logits make their own matrix
  NaN and nothing else (every operation is per matrix); -inf is an exact
  zero entry.
* ``FAST`` (GPU plans): divisions and reciprocals use ``div.approx`` /
  ``rcp.approx`` (<= 2 ulp; every denominator is a row or column sum, or a
  ratio of scalings, far inside [2^-126, 2^126] for finite logits).

Backward, "unrolled" (exact gradient of the computed T-step map): reverse mode
through the scaling recursion. With adjoints xb, yb of x, y and Kb of K:

    row step  x' = x / (x (K y) + eps):    ab = -xb' x'^2,  xb = xb' eps (x'/x)^2,
                                           yb += K^T ab,    Kb += ab y^T
    col step  y' = y / (y (K^T x) + eps):  bb = -yb' y'^2,  yb = yb' eps (y'/y)^2,
                                           xb += K bb,      Kb += x bb^T
    start     xb = (G * K) y,  yb = (G * K)^T x,  Kb = G * x y^T   (G = dL/dR)
    end       dM = K * (Kb - 1 w^T),  w_j = sum_i Kb_ij K_ij     (first step + exp)

The reverse sweep needs x_t, y_t of every iteration. They are kept in
registers for a segment of ``SEG`` iterations; segments are replayed
last-first, each one's starting state recomputed on chip from the logits
(``SEG >= ITERS``: a single replay; smaller ``SEG``: less register state,
``SEG * NSEG * (NSEG + 1) / 2`` replayed iterations for NSEG segments).

Backward, "implicit" (gradient of the fixed point; exact only when the
forward has converged): the forward is replayed to get R, then with
``r = R 1``, ``s_r = (R * G) 1``, ``s_c = (R * G)^T 1``:

    (diag(c) - R^T diag(r)^-1 R) v = s_c - R^T diag(r)^-1 s_r,
    u = diag(r)^-1 (s_r - R v),       dM = (G - u 1^T - 1 v^T) * R.

The system matrix is formed as the Laplacian of W = R^T diag(r)^-1 R
(off-diagonal -W_jk, diagonal sum_{k != j} W_jk: equal to diag(c) - W when
c = R^T 1, and free of cancellation), made definite by adding (1/n) 1 1^T
(its null space is span(1), the gauge of (u, v); the gradient does not depend
on it) and solved by Gauss-Jordan elimination without pivoting (symmetric
positive definite); the divisions by r and by the pivots are guarded. With
eps > 0 the fixed point has marginals 1 - eps, which this system also covers.

Two layouts, chosen by the launch plan (constexpr ``SOA``):

* ``SOA=True`` (n <= 8): one matrix per thread. Every entry is its own
  [BLOCK_B] tensor (a tuple of N*N of them; vectors are tuples of N): all
  arithmetic is elementwise, no shuffles, no replicated work, loops run over
  exactly N. Memory stays coalesced: the [BLOCK_B, NP*NP] tile is loaded and
  stored in one piece and split into (joined from) its entries by a cascade
  of ``tl.split`` / ``tl.join``.
* ``SOA=False``: one [BLOCK_B, NP, NP] register tile (NP = next power of two
  >= n, padding masked), reductions along its axes.

Argument order: input pointers and integer sizes, then outputs, then
constexprs. ``PARAMS`` is a float32 array ``[eps]``.
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)


# ----------------------------------------------------------------------------- scalars


@triton.jit
def _div(a, b, FAST: tl.constexpr):
    """a / b; FAST (GPU only): div.approx.ftz.f32."""
    if FAST:
        return tl.inline_asm_elementwise("div.approx.ftz.f32 $0, $1, $2;", "=r,r,r", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a / b


@triton.jit
def _rcp(b, FAST: tl.constexpr):
    """1 / b; FAST (GPU only): rcp.approx.ftz.f32."""
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=r,r", [b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return 1.0 / b


@triton.jit
def _load_eps(PARAMS, HAS_EPS: tl.constexpr):
    """(eps, log eps); eps is the constant 0.0 unless HAS_EPS."""
    if HAS_EPS:
        eps = tl.load(PARAMS).to(tl.float32)
        log_eps = tl.where(eps > 0.0, tl.log(tl.where(eps > 0.0, eps, 1.0)), float("-inf"))
    else:
        eps = 0.0
        log_eps = float("-inf")
    return eps, log_eps


@triton.jit
def _scale_step(v, s, eps, HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    """v / (v * s + eps), s = (K y) or (K^T x): one row or column step on a scaling."""
    if HAS_EPS:
        return _div(v, v * s + eps, FAST)
    else:
        return _rcp(s, FAST)


@triton.jit
def _damp(vb, vc, vp, eps, FAST: tl.constexpr):
    """Adjoint of v in v' = v / (v s + eps), given that of v': vb * eps * (v'/v)^2."""
    q = _div(vc, vp, FAST)
    return vb * (eps * q * q)


# ----------------------------------------------------------------------------- SoA layout (n <= 8)


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


@triton.jit
def _soa_implicit(M, G, PARAMS, B, DM, N: tl.constexpr, NP: tl.constexpr,
                  BLOCK_B: tl.constexpr, ITERS: tl.constexpr, ROWS_FIRST: tl.constexpr,
                  HAS_EPS: tl.constexpr, FAST: tl.constexpr):
    pid = tl.program_id(0)
    K, eps, base, offs, mask = _soa_setup(M, PARAMS, pid, B, N, NP, BLOCK_B, ROWS_FIRST,
                                          HAS_EPS, FAST)
    g = _soa_load(G + base, B - pid * BLOCK_B, N, NP, BLOCK_B, ROWS_FIRST)
    x, y = _soa_forward_from_start(K, eps, ITERS, N, HAS_EPS, FAST)
    R = ()
    for i in tl.static_range(N):
        for j in tl.static_range(N):
            R = R + (x[i] * K[i * N + j] * y[j],)
    # row sums (guarded inverse), s_r, s_c
    rinv = ()
    s_r = ()
    for i in tl.static_range(N):
        r = R[i * N]
        sr = R[i * N] * g[i * N]
        for j in tl.static_range(1, N):
            r += R[i * N + j]
            sr += R[i * N + j] * g[i * N + j]
        rinv = rinv + (tl.where(r > 0.0, _rcp(tl.where(r > 0.0, r, 1.0), FAST), 0.0),)
        s_r = s_r + (sr,)
    # right-hand side s_c - R^T diag(r)^-1 s_r
    v = ()
    for j in tl.static_range(N):
        acc = R[j] * (g[j] - s_r[0] * rinv[0])
        for i in tl.static_range(1, N):
            acc += R[i * N + j] * (g[i * N + j] - s_r[i] * rinv[i])
        v = v + (acc,)
    # W = R^T diag(r)^-1 R (symmetric), A = Laplacian(W) + 1/n
    W = ()
    for j in tl.static_range(N):
        for k in tl.static_range(N):
            if k < j:
                W = W + (W[k * N + j],)
            else:
                acc = R[j] * R[k] * rinv[0]
                for i in tl.static_range(1, N):
                    acc += R[i * N + j] * R[i * N + k] * rinv[i]
                W = W + (acc,)
    A = ()
    for j in tl.static_range(N):
        diag = tl.zeros_like(R[0])
        for k in tl.static_range(N):
            if k != j:
                diag += W[j * N + k]
        for k in tl.static_range(N):
            if k == j:
                A = A + (diag + 1.0 / N,)
            else:
                A = A + (1.0 / N - W[j * N + k],)
    # Gauss-Jordan, no pivoting (SPD)
    for p in tl.static_range(N):
        piv = A[p * N + p]
        inv = tl.where(piv != 0.0, _rcp(tl.where(piv != 0.0, piv, 1.0), FAST), 0.0)
        rowp = ()
        for k in tl.static_range(N):
            rowp = rowp + (A[p * N + k] * inv,)
        vp = v[p] * inv
        nA = ()
        nv = ()
        for j in tl.static_range(N):
            if j == p:
                nA = nA + rowp
                nv = nv + (vp,)
            else:
                f = A[j * N + p]
                for k in tl.static_range(N):
                    nA = nA + (A[j * N + k] - f * rowp[k],)
                nv = nv + (v[j] - f * vp,)
        A = nA
        v = nv
    dm = ()
    for i in tl.static_range(N):
        acc = s_r[i] - R[i * N] * v[0]
        for j in tl.static_range(1, N):
            acc -= R[i * N + j] * v[j]
        u = acc * rinv[i]
        for j in tl.static_range(N):
            dm = dm + ((g[i * N + j] - u - v[j]) * R[i * N + j],)
    _soa_store(DM + base, offs, mask, dm, N, NP, BLOCK_B, ROWS_FIRST)


# ----------------------------------------------------------------------------- tile layout


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


# ----------------------------------------------------------------------------- kernels


@triton.jit
def mhc_forward_kernel(
    M, PARAMS, B,
    OUT,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr, ITERS: tl.constexpr,
    ROWS_FIRST: tl.constexpr, HAS_EPS: tl.constexpr, SOA: tl.constexpr, FAST: tl.constexpr,
):
    """OUT[b] = Sinkhorn-Knopp(M[b]) for b < B, ITERS iterations (module docstring)."""
    if SOA:
        _soa_forward(M, PARAMS, B, OUT, N, NP, BLOCK_B, ITERS, ROWS_FIRST, HAS_EPS, FAST)
    else:
        _tile_forward(M, PARAMS, B, OUT, N, NP, BLOCK_B, ITERS, ROWS_FIRST, HAS_EPS, FAST)


@triton.jit
def mhc_backward_unrolled_kernel(
    M, G, PARAMS, B,
    DM,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr, ITERS: tl.constexpr,
    SEG: tl.constexpr, ROWS_FIRST: tl.constexpr, HAS_EPS: tl.constexpr, SOA: tl.constexpr,
    FAST: tl.constexpr,
):
    """DM = (dOUT/dM)^T G, exact for the ITERS-step map; the forward is replayed on chip.

    Iterations 1..L0 form the leading segment (L0 in [1, SEG]), then come
    NFULL segments of SEG. Reverse order: the last full segment, the other
    full segments (a run-time loop), the leading segment.
    """
    if SOA:
        _soa_unrolled(M, G, PARAMS, B, DM, N, NP, BLOCK_B, ITERS, SEG, ROWS_FIRST, HAS_EPS, FAST)
    else:
        _tile_unrolled(M, G, PARAMS, B, DM, N, NP, BLOCK_B, ITERS, SEG, ROWS_FIRST, HAS_EPS, FAST)


@triton.jit
def mhc_backward_implicit_kernel(
    M, G, PARAMS, B,
    DM,
    N: tl.constexpr, NP: tl.constexpr, BLOCK_B: tl.constexpr, ITERS: tl.constexpr,
    ROWS_FIRST: tl.constexpr, HAS_EPS: tl.constexpr, SOA: tl.constexpr, FAST: tl.constexpr,
):
    """DM by implicit differentiation of the fixed point, at the replayed ITERS-step R."""
    if SOA:
        _soa_implicit(M, G, PARAMS, B, DM, N, NP, BLOCK_B, ITERS, ROWS_FIRST, HAS_EPS, FAST)
    else:
        _tile_implicit(M, G, PARAMS, B, DM, N, NP, BLOCK_B, ITERS, ROWS_FIRST, HAS_EPS, FAST)
