"""mHC implicit backward, one-matrix-per-thread ("SoA") layout (n <= 8).

Replays the forward, then solves the corrected fixed-point system
(diag(c) - R^T diag(r)^-1 R) v = s_c - R^T diag(r)^-1 s_r (as the Laplacian
of W = R^T diag(r)^-1 R plus (1/n) 1 1^T, Gauss-Jordan without pivoting) per
matrix in registers. See the docstring of ``kernels/mhc.py``.
"""

import triton
import triton.language as tl

from .mhc_common import _rcp
from .mhc_soa import _soa_forward_from_start, _soa_load, _soa_setup, _soa_store


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
