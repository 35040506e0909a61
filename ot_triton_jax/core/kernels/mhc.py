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

Files: this one holds the three entry kernels (the only names the frontends
import); ``mhc_common.py`` the shared scalar helpers (division, eps, one
scaling step); ``mhc_soa.py`` the SOA forward and unrolled backward,
``mhc_soa_implicit.py`` the SOA implicit backward; ``mhc_tile.py`` the tile
layout (all three passes).

Argument order: input pointers and integer sizes, then outputs, then
constexprs. ``PARAMS`` is a float32 array ``[eps]``.
"""

import triton
import triton.language as tl

from .mhc_soa import _soa_forward, _soa_unrolled
from .mhc_soa_implicit import _soa_implicit
from .mhc_tile import _tile_forward, _tile_implicit, _tile_unrolled


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
