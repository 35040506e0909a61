"""Many OTT problems in one loop: the packed, block-sparse alternating Sinkhorn of a batch.

B problems (x_k, y_k, a_k, b_k) are packed by :mod:`ot_triton_jax.core.batch_layout` (each
problem's rows on row-block boundaries, zero-weight padding) and every half-step of the whole
batch is one launch of the block-sparse LSE kernel, in which the row blocks of problem k stream
only problem k's columns (:func:`.kernel_ops.lse_blocksparse`). Each problem runs OTT's
alternating loop (:func:`.loops.alternating_solve`, whose state and error bookkeeping this one
reproduces) with its own stopping rule: after a measured block of ``inner_iterations`` a problem
whose marginal error is below ``threshold`` (or not finite) stops, its state frozen from then on
while the others go on (its row blocks stream no column in the launches after its stop,
``batch_layout.active_ranges``; their outputs are discarded), so
f, g, ``errors`` and ``n_iters`` of every problem are those of its single solve to float32
rounding. The loop is a ``lax.while_loop`` over blocks that ends when every problem has stopped.

:func:`vmappable_solve` gives the single solve a ``jax.vmap`` rule that runs this loop: a
vmapped :func:`ot_triton_jax.sinkhorn` (and everything built on it: ``segment_sinkhorn``, the
batched gradients) solves all its problems in one launch per half-step; :func:`vmappable_symmetric`
does the same for OTT's symmetric solve of the self terms of ``sinkhorn_divergence``. The rule folds when the
clouds carry no labels and epsilon, scale_cost and threshold are shared by the batch; otherwise it
falls back to one solve per problem (:func:`.batching.loop_over_batch`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..core import batch_layout, unbalanced
from ..core.options import LoopOptions
from . import kernel_ops
from .batching import loop_over_batch
from .kernel_ops import F32, Cloud, masked_log
from .loops import alternating_solve, symmetric_solve
from .packing import batch_rows, layouts, pack, segment_sum, unpack

__all__ = ["batched_solve", "batched_symmetric", "run_batched", "vmappable_solve", "vmappable_symmetric"]


def _problem_rows(layout: batch_layout.CloudLayout) -> jax.Array:
    """The problem of each packed row (B on padding rows)."""
    return jnp.asarray(np.where(layout.segment < 0, len(layout.sizes), layout.segment))


def run_batched(iterate, state: tuple, rows: tuple, err_layout: batch_layout.CloudLayout, threshold, done0,
                opts: LoopOptions):
    """:func:`.loops.run_loop` for B packed problems at once: ``iterate(st, with_err, done) -> (st, err_rows)``
    advances every problem by one iteration (``err_rows``: packed per-row errors on ``err_layout``
    when ``with_err``; ``done`` (B,): the problems stopped before this block, whose work it may skip); ``rows[k]``: the problem of each row of ``state[k]``. After each measured
    block a problem whose error is below ``threshold`` (or not finite) stops and its state is frozen
    from then on. Returns (state, errors (B, n_blocks), n_iters (B,))."""
    B = len(err_layout.sizes)
    inner, min_it, max_it = opts.inner_iterations, opts.min_iterations, opts.max_iterations
    n_blocks, rem = divmod(max_it, inner)

    def block(it0, carry, length):
        st0, errs, done, n_it = carry
        st = st0
        if length <= 16:
            for _ in range(length - 1):
                st = iterate(st, False, done)[0]
        else:
            st = jax.lax.fori_loop(0, length - 1, lambda t, s: iterate(s, False, done)[0], st)
        st, err_rows = iterate(st, True, done)
        e = segment_sum(err_rows, err_layout)
        it = it0 + length - 1
        measured = (it == max_it - 1) | ((it % inner == inner - 1) & (it >= min_it))
        col = it // inner
        errs = errs.at[:, col].set(jnp.where(done, errs[:, col], jnp.where(measured, e, jnp.inf)))
        stop = ~done & measured & (~jnp.isfinite(e) | (e < threshold))
        n_it = jnp.where(done, n_it, it + 1)
        frozen = jnp.concatenate([done, jnp.ones((1,), bool)])
        st = tuple(jnp.where(frozen[r], old, new) for r, old, new in zip(rows, st0, st))
        return st, errs, done | stop, n_it

    carry = (state, jnp.full((B, opts.n_blocks), -1.0, F32), done0, jnp.zeros((B,), jnp.int32))

    def body(loop):
        k, c = loop
        return k + 1, block(k * inner, c, inner)

    _, carry = jax.lax.while_loop(lambda loop: (loop[0] < n_blocks) & ~jnp.all(loop[1][2]), body,
                                  (jnp.int32(0), carry))
    if rem:
        carry = jax.lax.cond(jnp.all(carry[2]), lambda c: c, lambda c: block(n_blocks * inner, c, rem), carry)
    state, errors, _, n_iters = carry
    return state, errors, n_iters


def batched_solve(X: Cloud, Y: Cloud, la: jax.Array, lb: jax.Array, prm: jax.Array, threshold: jax.Array,
                  f0: jax.Array, g0: jax.Array, done0: jax.Array, lx: batch_layout.CloudLayout,
                  ly: batch_layout.CloudLayout, opts: LoopOptions, backend, taus=(1.0, 1.0)):
    """OTT's alternating loop for the B packed problems of ``lx`` / ``ly`` (module docstring).

    X, Y: the packed clouds (any common centring); la, lb: packed log weights (-inf on padding and
    zero weights); prm: :func:`.loops.ott_params` shared by the batch; f0, g0: packed starting
    potentials; done0 (B,): problems that run no iteration (their errors stay -1, n_iters 0).
    Returns packed (f, g), errors (B, n_blocks) and n_iters (B,) int32 with
    :func:`.loops.run_loop`'s meaning for each problem."""
    ra, rb = unbalanced.relax_at("a", taus[0]), unbalanced.relax_at("b", taus[1])
    rx = jnp.asarray(batch_layout.column_ranges(lx, ly))
    ry = jnp.asarray(batch_layout.column_ranges(ly, lx))
    bx, by = (jnp.asarray(batch_layout.block_problems(lay)) for lay in (lx, ly))
    kw = dict(precision=opts.precision, backend=backend)

    def g_update(f, g_old, with_err, ranges=ry):
        return kernel_ops.lse_blocksparse(Y, X, f, prm, ranges, logw_out=lb, pold=g_old if with_err else None,
                                          compute_err=with_err, relax_at=rb, **kw)

    def iterate(st, with_err, done):
        f, g, g_next = st
        ax, ay = batch_layout.active_ranges(jnp, rx, bx, done), batch_layout.active_ranges(jnp, ry, by, done)
        f = kernel_ops.lse_blocksparse(X, Y, g_next, prm, ax, logw_out=la, relax_at=ra, **kw)[0]
        g_new, err = g_update(f, g_next, with_err, ay)
        return (f, g_next, g_new), err

    rows_x, rows_y = _problem_rows(lx), _problem_rows(ly)
    (f, g, _), errors, n_iters = run_batched(iterate, (f0, g0, g_update(f0, None, False)[0]),
                                             (rows_x, rows_y, rows_y), ly, threshold, done0, opts)
    return f, g, errors, n_iters


def batched_symmetric(X: Cloud, la: jax.Array, prm: jax.Array, threshold: jax.Array, h0: jax.Array,
                      done0: jax.Array, lx: batch_layout.CloudLayout, opts: LoopOptions, backend, tau: float = 1.0):
    """OTT's symmetric solve (:func:`.loops.symmetric_solve`: h <- 0.5 h + 0.5 tau (eps log a - eps
    LSE_j((h_j - C_ij)/eps)), error 2 ||P 1 - a e^{-h/rho}||_1) for the B packed self problems of
    ``lx``, each with its own stop (:func:`run_batched`). Returns packed h, errors, n_iters."""
    ra = unbalanced.relax_at("a", tau)
    rxx = jnp.asarray(batch_layout.column_ranges(lx, lx))
    bx = jnp.asarray(batch_layout.block_problems(lx))

    def update(h, with_err, ranges=rxx):
        u, err = kernel_ops.lse_blocksparse(X, X, h, prm, ranges, logw_out=la, pold=h if with_err else None,
                                            compute_err=with_err, relax_at=ra, precision=opts.precision,
                                            backend=backend)
        return u, (2.0 * err if with_err else None)

    def iterate(st, with_err, done):
        h, u = st
        h = 0.5 * jnp.where(jnp.isfinite(h), h, 0.0) + 0.5 * u
        u, err = update(h, with_err, batch_layout.active_ranges(jnp, rxx, bx, done))
        return (h, u), err

    rows = _problem_rows(lx)
    (h, _), errors, n_iters = run_batched(iterate, (h0, update(h0, False)[0]), (rows, rows), lx, threshold, done0,
                                          opts)
    return h, errors, n_iters


def _fold(opts: LoopOptions, backend, taus):
    """The batched rule of :func:`vmappable_solve`: pack the problems and run :func:`batched_solve`
    (None where it does not apply: labels, or batched loop parameters)."""

    def rule(axis_size, in_batched, X, Y, a, b, prm, threshold, f0, g0, ok):
        bX, bY, ba, bb, bprm, bthr, bf, bg, bok = in_batched
        if X.labels is not None or bprm or bthr:
            return None
        B = axis_size
        n, m, d = X.x.shape[-2], Y.x.shape[-2], X.x.shape[-1]
        xs = batch_rows(X.x, bX.x, B)
        ys = batch_rows(Y.x, bY.x, B)
        lx, ly = layouts(B, n, m, d, opts.precision)
        # each problem's clouds are already centred on their own centre: packing them keeps every
        # problem's cost; the packed clouds get one common centre and split (kernel_ops.clouds)
        Xp, Yp = kernel_ops.clouds(pack(xs, lx), pack(ys, ly), backend=backend)
        la = pack(masked_log(batch_rows(a, ba, B)), lx, -jnp.inf)
        lb = pack(masked_log(batch_rows(b, bb, B)), ly, -jnp.inf)
        f0p = pack(batch_rows(f0, bf, B), lx, -jnp.inf)
        g0p = pack(batch_rows(g0, bg, B), ly, -jnp.inf)
        done0 = ~(ok if bok else jnp.broadcast_to(ok, (B,)))
        f, g, errors, n_iters = batched_solve(Xp, Yp, la, lb, prm, threshold, f0p, g0p, done0, lx, ly, opts,
                                              backend, taus)
        outs = (unpack(f, lx).reshape(B, n), unpack(g, ly).reshape(B, m), errors, n_iters)
        return outs, (True, True, True, True)

    return rule


def _fold_symmetric(opts: LoopOptions, backend, tau: float):
    """The batched rule of :func:`vmappable_symmetric` (None with labels or batched loop parameters)."""

    def rule(axis_size, in_batched, X, a, prm, threshold, h0, ok):
        bX, ba, bprm, bthr, bh, bok = in_batched
        if X.labels is not None or bprm or bthr:
            return None
        B, (n, d) = axis_size, X.x.shape[-2:]
        lx, _ = layouts(B, n, n, d, opts.precision)
        (Xp,) = kernel_ops.clouds(pack(batch_rows(X.x, bX.x, B), lx), backend=backend)
        la = pack(masked_log(batch_rows(a, ba, B)), lx, -jnp.inf)
        h0p = pack(batch_rows(h0, bh, B), lx, -jnp.inf)
        done0 = ~(ok if bok else jnp.broadcast_to(ok, (B,)))
        h, errors, n_iters = batched_symmetric(Xp, la, prm, threshold, h0p, done0, lx, opts, backend, tau)
        return (unpack(h, lx).reshape(B, n), errors, n_iters), (True, True, True)

    return rule


def vmappable_symmetric(opts: LoopOptions, backend, tau: float = 1.0):
    """:func:`.loops.symmetric_solve` (X, a, prm, threshold, h0, ok) -> (h, errors, n_iters) on
    stop-gradient'ed values, whose ``jax.vmap`` runs all self problems in one packed loop
    (:func:`batched_symmetric`) where it can."""
    return loop_over_batch(lambda *v: symmetric_solve(*v, opts, backend, tau),
                           fold=_fold_symmetric(opts, backend, tau))


def vmappable_solve(opts: LoopOptions, backend, taus=(1.0, 1.0)):
    """:func:`.loops.alternating_solve` (X, Y, a, b, prm, threshold, f0, g0, ok) -> (f, g, errors,
    n_iters) on stop-gradient'ed values, whose ``jax.vmap`` runs all problems in one loop
    (:func:`batched_solve`) where it can, one solve per problem otherwise."""
    return loop_over_batch(lambda *v: alternating_solve(*v, opts, backend, taus), fold=_fold(opts, backend, taus))
