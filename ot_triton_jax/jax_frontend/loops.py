"""The JAX solver loops: OTT's alternating and symmetric Sinkhorn, GeomLoss's annealed loop.

Plain functions of stop-gradient'ed arrays (the derivative rules are in
:mod:`.derivatives`). OTT's loops take ``taus`` = (tau_a, tau_b), static floats in (0, 1]: a side
with tau < 1 has a KL-relaxed marginal (:mod:`ot_triton_jax.core.unbalanced`); its updates are
damped by tau in the kernel and its error target is w exp(-pot / rho). Their ``prm`` is then
:func:`ott_params` (with the relaxation's entries). The loop sizes come from a frozen
:class:`ot_triton_jax.core.options.LoopOptions`; ``backend`` picks the launcher.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core import unbalanced
from ..core.options import LoopOptions
from . import kernel_ops
from .kernel_ops import F32, Cloud, make_params, masked_log


def ott_params(eps, s, taus=(1.0, 1.0)) -> jax.Array:
    """PARAMS of OTT's loops: [eps, s] and, with a relaxed marginal, [tau_a, 1/rho_a, tau_b,
    1/rho_b] (core.unbalanced.params_tail; float32, traced with eps)."""
    prm = make_params(eps, s)
    tail = unbalanced.params_tail(eps, *taus)
    if not tail:
        return prm
    return jnp.concatenate([prm, jnp.stack([jnp.asarray(t, F32) for t in tail])])


def run_loop(iterate, state, threshold, ok, opts: LoopOptions):
    """OTT's fixed-point loop around ``iterate(it, state, with_err) -> (state, err)``.

    ``err`` is the marginal error of the state *returned* by iteration ``it``
    (None when ``with_err`` is False). Iterations run in blocks of
    ``inner_iterations`` (aligned on multiples of it); only the last iteration of a
    block can be measured (``opts.measured(it)``), so it alone asks for the error
    and records it at ``errors[it // inner]`` (+inf when not measured, -1 when not
    run). Blocks run in a ``lax.while_loop`` that stops after a measured block
    whose error is below ``threshold`` or not finite (or at once if ``ok`` is
    False); with ``min_iterations == max_iterations`` a fixed-length ``lax.scan``.
    A last partial block keeps ``max_iterations`` a hard cap.
    Returns (state, errors, n_iters).
    """
    inner, min_it, max_it = opts.inner_iterations, opts.min_iterations, opts.max_iterations
    n_blocks, rem = divmod(max_it, inner)
    errors = jnp.full((opts.n_blocks,), -1.0, F32)

    def block(it0, carry, length):
        st, errs = carry
        if length <= 16:  # unrolled: no per-iteration loop bookkeeping
            for t in range(length - 1):
                st, _ = iterate(it0 + t, st, False)
        else:
            st = jax.lax.fori_loop(0, length - 1, lambda t, s: iterate(it0 + t, s, False)[0], st, unroll=8)
        it = it0 + length - 1
        st, e = iterate(it, st, True)
        measured = (it == max_it - 1) | ((it % inner == inner - 1) & (it >= min_it))
        return st, errs.at[it // inner].set(jnp.where(measured, e, jnp.inf))

    carry = (state, errors)
    if min_it == max_it:  # fixed number of iterations: a scan, no stopping test
        carry, _ = jax.lax.scan(lambda c, k: (block(k * inner, c, inner), None), carry,
                                jnp.arange(n_blocks, dtype=jnp.int32))
        if rem:
            carry = block(n_blocks * inner, carry, rem)
        return carry[0], carry[1], jnp.int32(max_it)

    def stop_after(it_end, errs):
        # the block ending at it_end (exclusive) was measured iff it_end - 1 >= min_it
        e = errs[(it_end - 1) // inner]
        return (it_end - 1 >= min_it) & ((~jnp.isfinite(e)) | (e < threshold))

    def cond(loop):
        k, stop, _ = loop
        return (k < n_blocks) & ~stop

    def body(loop):
        k, _, c = loop
        c = block(k * inner, c, inner)
        return k + 1, stop_after((k + 1) * inner, c[1]), c

    k, stop, carry = jax.lax.while_loop(cond, body, (jnp.int32(0), ~ok, carry))
    n_iters = k * inner
    if rem:
        carry = jax.lax.cond(stop, lambda c: c, lambda c: block(n_blocks * inner, c, rem), carry)
        n_iters = jnp.where(stop, n_iters, max_it)
    return carry[0], carry[1], n_iters.astype(jnp.int32)


def alternating_solve(X: Cloud, Y: Cloud, a, b, prm, threshold, f0, g0, ok, opts: LoopOptions, backend,
                      taus=(1.0, 1.0)):
    """OTT's alternating Sinkhorn (g then f). Returns (f, g, errors, n_iters).

    State (f, g, g_next): g_next is the next iteration's g-update, computed
    speculatively at the end of each iteration; its error output is the column
    marginal error of the new (f, g), so measuring costs nothing. With relaxed
    marginals (``taus``) the updates are damped and the error is
    ||P^T 1 - b exp(-g/rho_b)||_1 (OTT's ||P 1 - a exp(-f/rho_a)||_1 is zero after the f-update).
    """
    precision = opts.precision
    la, lb = masked_log(a), masked_log(b)
    ra, rb = unbalanced.relax_at("a", taus[0]), unbalanced.relax_at("b", taus[1])

    relaxed = ra > 0 or rb > 0
    grouped = X.labels is not None  # labelled clouds arrive sorted by label (sinkhorn_solver.by_label)

    def iterate(it, st, with_err):
        f, g, g_next = st[:3]
        # the previous potentials predict the LSE shifts (kernels/lse.py, FOLD; verified there); a
        # relaxed problem extrapolates them where no error is measured on them (unbalanced.shift_hint:
        # st[3] is the f before f, g the g before g_next)
        f_hint = unbalanced.shift_hint(f, st[3]) if relaxed else f
        g_hint = unbalanced.shift_hint(g_next, g) if relaxed and not with_err else g_next
        f_prev, g = f, g_next
        f, _ = kernel_ops.lse_update(X, Y, g, prm, precision=precision, backend=backend, logw_out=la,
                                     pold=f_hint, compute_err=False, fold=True, relax_at=ra, grouped=grouped)
        g_next, err = kernel_ops.lse_update(Y, X, f, prm, precision=precision, backend=backend, logw_out=lb,
                                            pold=g_hint, compute_err=with_err, fold=True, relax_at=rb, grouped=grouped)
        return (f, g, g_next) + ((f_prev,) if relaxed else ()), (jnp.sum(err) if with_err else None)

    g_next, _ = kernel_ops.lse_update(Y, X, f0, prm, precision=precision, backend=backend, logw_out=lb,
                                      relax_at=rb, grouped=grouped)
    state = (f0, g0, g_next) + ((f0,) if relaxed else ())
    (f, g, *_), errors, n_iters = run_loop(iterate, state, threshold, ok, opts)
    return f, g, errors, n_iters


def symmetric_solve(X: Cloud, a, prm, threshold, h0, ok, opts: LoopOptions, backend, tau: float = 1.0):
    """OTT's symmetric solve of the (x, x, a, a) problem as ``sinkhorn_divergence`` runs it
    (``parallel_dual_updates=True``, momentum 0.5, Feydy et al. eq. 25): f = g = h and

        h <- 0.5 h + 0.5 tau (eps log a - eps LSE_j((h_j - C_ij)/eps))

    (non-finite old entries count as 0, as OTT's momentum; ``tau`` = tau_a = tau_b, 1 when
    balanced). The error of a state is ||P 1 - a e^{-h/rho}||_1 + ||P^T 1 - a e^{-h/rho}||_1
    = 2 ||P 1 - a e^{-h/rho}||_1 (rho = inf: the balanced ||P 1 - a||), read off the next update.
    Returns (h, errors, n_iters).
    """
    la = masked_log(a)
    ra = unbalanced.relax_at("a", tau)

    def update(h, with_err):
        u, err = kernel_ops.lse_update(X, X, h, prm, precision=opts.precision, backend=backend,
                                       logw_out=la, pold=h, compute_err=with_err, relax_at=ra)
        return u, (2.0 * jnp.sum(err) if with_err else None)

    def iterate(it, st, with_err):
        h, u = st
        h = 0.5 * jnp.where(jnp.isfinite(h), h, 0.0) + 0.5 * u
        u, e = update(h, with_err)
        return (h, u), e

    u0, _ = update(h0, False)
    (h, _), errors, n_iters = run_loop(iterate, (h0, u0), threshold, ok, opts)
    return h, errors, n_iters


def parallel_solve(X: Cloud, a, prm, threshold, f0, g0, ok, opts: LoopOptions, backend, taus):
    """OTT's parallel solve (momentum 0.5) of the (x, x, a, a) problem with tau_a != tau_b, as
    ``sinkhorn_divergence`` runs it: f and g differ,

        f <- 0.5 f + 0.5 tau_a (eps log a - eps LSE_j((g_j - C_ij)/eps)),
        g <- 0.5 g + 0.5 tau_b (eps log a - eps LSE_i((f_i - C_ij)/eps))

    both from the old (f, g); the error of a state is ||P 1 - a e^{-f/rho_a}||_1 +
    ||P^T 1 - a e^{-g/rho_b}||_1, read off the next updates. Returns (f, g, errors, n_iters).
    """
    la = masked_log(a)
    ra, rb = unbalanced.relax_at("a", taus[0]), unbalanced.relax_at("b", taus[1])

    def updates(f, g, with_err):
        kw = dict(precision=opts.precision, backend=backend, logw_out=la, compute_err=with_err)
        uf, ef = kernel_ops.lse_update(X, X, g, prm, pold=f, relax_at=ra, **kw)
        ug, eg = kernel_ops.lse_update(X, X, f, prm, pold=g, relax_at=rb, **kw)
        return uf, ug, (jnp.sum(ef) + jnp.sum(eg) if with_err else None)

    def momentum(p, u):
        return 0.5 * jnp.where(jnp.isfinite(p), p, 0.0) + 0.5 * u

    def iterate(it, st, with_err):
        f, g, uf, ug = st
        f, g = momentum(f, uf), momentum(g, ug)
        uf, ug, e = updates(f, g, with_err)
        return (f, g, uf, ug), e

    uf0, ug0, _ = updates(f0, g0, False)
    (f, g, _, _), errors, n_iters = run_loop(iterate, (f0, g0, uf0, ug0), threshold, ok, opts)
    return f, g, errors, n_iters


GEOMLOSS_SCALE = 0.5  # GeomLoss's p = 2 cost |x - y|^2 / 2


def dense_softmins(X: Cloud, Y: Cloud, la, lb, precision: str, backend):
    """GeomLoss's softmins of one problem, softmin_i(q) = -eps LSE_j((q_j - C_ij)/eps + log w_j):
    ``pair(f, g, prm)`` -> (softmin of g for the X points, softmin of f for the Y points)
    (``kernel_ops.lse_pair``) and ``own(side, h, prm)`` -> the softmin of h for the points of X
    (side 0) or Y (side 1) against themselves (``kernel_ops.lse_self``)."""
    kw = dict(precision=precision, backend=backend)

    def pair(f, g, prm):
        return tuple(kernel_ops.lse_pair(X, Y, f, g, la, lb, prm, **kw))

    def own(side, h, prm):
        return kernel_ops.lse_self(*((X, h, la) if side == 0 else (Y, h, lb)), prm, **kw)

    return pair, own


def geomloss_solve(X: Cloud, Y: Cloud, la, lb, eps_at, n_eps, last_eps, debias: bool, precision: str, backend,
                   softmins=None):
    """GeomLoss's annealed symmetric loop (``SamplesLoss("sinkhorn", p=2)``).

    ``eps_at(k)`` is the k-th eps of the schedule, ``n_eps`` its length (may be
    traced), ``last_eps`` = blur^2. Returns the (old, new) potential quadruples
    (f_ba, g_ab, f_aa, g_bb) around the last extrapolation (f_aa, g_bb are carried
    unchanged without ``debias``). ``softmins``: (pair, own) as :func:`dense_softmins` (its
    default) returns them; a packed batch passes its block-sparse ones (:mod:`.geomloss_packed`).
    """
    pair, own = softmins or dense_softmins(X, Y, la, lb, precision, backend)

    def sweep(pots, prm):
        f_ba, g_ab, f_aa, g_bb = pots
        out = [*pair(f_ba, g_ab, prm), f_aa, g_bb]
        if debias:
            out[2], out[3] = own(0, f_aa, prm), own(1, g_bb, prm)
        return tuple(out)

    zx, zy = jnp.zeros(X.n, F32), jnp.zeros(Y.n, F32)
    pots = sweep((zx, zy, zx, zy), make_params(eps_at(0), GEOMLOSS_SCALE))

    def body(k, pots):
        new = sweep(pots, make_params(eps_at(k), GEOMLOSS_SCALE))
        return tuple(0.5 * (p + q) for p, q in zip(pots, new))

    pots = jax.lax.fori_loop(0, n_eps, body, pots)
    last = sweep(pots, make_params(last_eps, GEOMLOSS_SCALE))
    return pots, last
