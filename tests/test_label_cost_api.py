"""The label-augmented cost in the public API of both frontends, against float64 dense references
(tests/label_reference.py: the full cost matrix C_ij = s (|x_i - y_j|^2 + W[label_x_i, label_y_j])).

* ``sinkhorn`` (OTT convention, s = 1 / scale_cost): reg_ot_cost, f, g (up to their gauge
  (f + t, g - t)), the marginal, and the gradients in x, y, a, b, epsilon and scale_cost;
* ``sinkhorn_divergence``: value and x, y gradients (self terms W[lx, lx], W[ly, ly]);
* ``SamplesLoss`` / ``samples_loss`` (GeomLoss convention, s = 1/2): value, debiased potentials
  and the x, y gradients of GeomLoss's rule;
* the derivatives that are not implemented raise NotImplementedError naming label_cost;
* bad input raises naming the argument, eagerly; under ``jax.jit`` it gives NaN and
  ``converged=False``.

Small problems (n != m, non-uniform weights with a zero, a table with K_x != K_y) under the
Triton interpreter.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ot_triton_jax as otj
import torch_api
from label_reference import geomloss_loss, ott_sinkhorn
from ot_triton_jax.core.schedules import epsilon_schedule

N, M, D, KX, KY = 11, 7, 2, 3, 4
EPS, SCALE = 0.4, 1.5
SOLVE = dict(threshold=1e-6, max_iterations=2000)


def _rel(got, want) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    assert not np.any(np.isnan(got))
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


def _gauge_rel(got, want, mask) -> float:
    """Relative error of a potential defined up to an additive constant (on ``mask``)."""
    d = np.asarray(got, np.float64)[mask] - want[mask]
    return float(np.abs(d - d.mean()).max() / np.abs(want[mask]).max())


def _problem(seed, square=False):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(N, D)), 0.8 * rng.normal(size=(M, D)) + 0.3
    a, b = rng.uniform(0.2, 1.0, N), rng.uniform(0.2, 1.0, M)
    a[2] = 0.0
    a, b = a / a.sum(), b / b.sum()
    kx, ky = (KX, KX) if square else (KX, KY)
    lx, ly = rng.integers(0, kx, N), rng.integers(0, ky, M)
    lx[:kx], ly[:ky] = np.arange(kx), np.arange(ky)  # every class present
    w = rng.uniform(0.0, 2.0, (kx, ky))
    if square:
        w = w + w.T
    return x, y, a, b, lx, ly, w


def _check_ott(ref, a, cost, f, g, gx, gy, ga, geps, gscale, col):
    pa = a > 0
    assert _rel(cost, ref["cost"]) < 1e-5
    assert _gauge_rel(f, ref["f"], pa) < 1e-4 and _gauge_rel(g, ref["g"], np.ones(M, bool)) < 1e-4
    assert _rel(gx, ref["gx"]) < 1e-4 and _rel(gy, ref["gy"]) < 1e-4
    assert _gauge_rel(ga, ref["ga"], pa) < 1e-4  # balanced: defined up to a constant on a > 0
    assert _rel(np.asarray(ga)[~pa], ref["ga"][~pa]) < 1e-5
    assert _rel(geps, ref["geps"]) < 1e-4
    assert _rel(gscale, -ref["gs"] / SCALE ** 2) < 1e-4
    assert _rel(col, ref["plan"].sum(0)) < 1e-5


def test_sinkhorn_torch_matches_dense_reference_and_raises_beyond_first_order():
    x, y, a, b, lx, ly, w = _problem(0)
    ref = ott_sinkhorn(x, y, a, b, lx, ly, w, EPS, s=1.0 / SCALE)
    t = lambda v: torch.tensor(v, dtype=torch.float32, requires_grad=True)
    X, Y, A, B, E, S = t(x), t(y), t(a), t(b), t(EPS), t(SCALE)
    lab = dict(label_x=torch.tensor(lx, dtype=torch.int32), label_y=torch.tensor(ly), label_cost=torch.tensor(w))
    out = torch_api.sinkhorn(X, Y, A, B, epsilon=E, scale_cost=S, **SOLVE, **lab)
    assert bool(out.converged)
    gx, gy, ga, geps, gs = torch.autograd.grad(out.reg_ot_cost, (X, Y, A, E, S))
    _check_ott(ref, a, out.reg_ot_cost.detach(), out.f.detach(), out.g.detach(), gx, gy, ga, geps, gs,
               out.marginal(0).detach())
    with pytest.raises(NotImplementedError, match="label_cost"):
        torch.autograd.grad(out.f.sum(), X)
    with pytest.raises(NotImplementedError, match="label_cost"):
        (gx2,) = torch.autograd.grad(out.reg_ot_cost, X, create_graph=True)
        torch.autograd.grad(gx2.sum(), X)
    with pytest.raises(NotImplementedError, match="label_cost"):
        torch_api.sinkhorn(X, Y, epsilon=EPS, multiscale=torch_api.MultiscaleOptions(), **lab)


def test_sinkhorn_jax_matches_dense_reference_and_raises_beyond_first_order():
    x, y, a, b, lx, ly, w = _problem(1)
    ref = ott_sinkhorn(x, y, a, b, lx, ly, w, EPS, s=1.0 / SCALE)
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    lab = dict(label_x=jnp.asarray(lx, jnp.int32), label_y=jnp.asarray(ly, jnp.int32), label_cost=f32(w))

    def cost(x, y, a, eps, scale):
        out = otj.sinkhorn(x, y, a, f32(b), epsilon=eps, scale_cost=scale, **SOLVE, **lab)
        return out.reg_ot_cost, out

    (c, out), (gx, gy, ga, geps, gs) = jax.value_and_grad(cost, argnums=(0, 1, 2, 3, 4), has_aux=True)(
        f32(x), f32(y), f32(a), f32(EPS), f32(SCALE))
    assert bool(out.converged)
    _check_ott(ref, a, c, out.f, out.g, gx, gy, ga, geps, gs, out.marginal(0))
    short = dict(epsilon=EPS, min_iterations=5, max_iterations=5, inner_iterations=5, **lab)
    with pytest.raises(NotImplementedError, match="label_cost"):
        jax.grad(lambda x: jnp.sum(otj.sinkhorn(x, f32(y), **short).g))(f32(x))
    with pytest.raises(NotImplementedError, match="label_cost"):
        jax.jvp(jax.grad(lambda x: otj.sinkhorn(x, f32(y), **short).reg_ot_cost), (f32(x),), (f32(x),))


def test_sinkhorn_divergence_both_frontends_match_dense_reference():
    x, y, a, b, lx, ly, w = _problem(2, square=True)
    eps, solve = 1.5, dict(threshold=1e-5, max_iterations=2000)  # the self solves converge slower
    terms = [ott_sinkhorn(*p, w, eps) for p in ((x, y, a, b, lx, ly), (x, x, a, a, lx, lx), (y, y, b, b, ly, ly))]
    div = terms[0]["cost"] - 0.5 * (terms[1]["cost"] + terms[2]["cost"])
    gx = terms[0]["gx"] - 0.5 * (terms[1]["gx"] + terms[1]["gy"])
    gy = terms[0]["gy"] - 0.5 * (terms[2]["gx"] + terms[2]["gy"])
    X, Y = (torch.tensor(v, dtype=torch.float32, requires_grad=True) for v in (x, y))
    t = lambda v: torch.tensor(v, dtype=torch.float32)
    dt, _ = torch_api.sinkhorn_divergence(X, Y, t(a), t(b), epsilon=eps, **solve, label_x=torch.tensor(lx),
                                          label_y=torch.tensor(ly), label_cost=t(w))
    dt.backward()
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    (dj, _), (jx, jy) = jax.value_and_grad(lambda x, y: otj.sinkhorn_divergence(
        x, y, f32(a), f32(b), epsilon=eps, **solve, label_x=jnp.asarray(lx), label_y=jnp.asarray(ly),
        label_cost=f32(w)), argnums=(0, 1), has_aux=True)(f32(x), f32(y))
    for value, grad_x, grad_y in ((dt.detach(), X.grad, Y.grad), (dj, jx, jy)):
        assert _rel(value, div) < 1e-5
        assert _rel(grad_x, gx) < 1e-4 and _rel(grad_y, gy) < 1e-4


def test_samples_loss_both_frontends_match_geomloss_reference():
    x, y, a, b, lx, ly, w = _problem(3, square=True)
    blur, scaling = 0.5, 0.5
    pts = np.concatenate([x, y])
    sched = epsilon_schedule(2, float(np.linalg.norm(pts.max(0) - pts.min(0))), blur, scaling)
    loss, F, G, gx, gy = geomloss_loss(x, y, a, b, lx, ly, w, sched)
    t = lambda v: torch.tensor(v, dtype=torch.float32)
    X, Y = (torch.tensor(v, dtype=torch.float32, requires_grad=True) for v in (x, y))
    tl = dict(label_x=torch.tensor(lx), label_y=torch.tensor(ly))
    vt = torch_api.SamplesLoss(blur=blur, scaling=scaling, label_cost=t(w))(t(a), X, t(b), Y, **tl)
    vt.backward()
    Ft, Gt = torch_api.SamplesLoss(blur=blur, scaling=scaling, potentials=True)(t(a), t(x), t(b), t(y),
                                                                              label_cost=t(w), **tl)
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    kw = dict(blur=blur, scaling=scaling, label_x=jnp.asarray(lx), label_y=jnp.asarray(ly), label_cost=f32(w))
    vj, (jx, jy) = jax.value_and_grad(lambda x, y: otj.samples_loss(x, y, f32(a), f32(b), **kw), argnums=(0, 1))(
        f32(x), f32(y))
    Fj, Gj = otj.samples_loss(f32(x), f32(y), f32(a), f32(b), potentials=True, **kw)
    for value, pf, pg, grad_x, grad_y in ((vt.detach(), Ft, Gt, X.grad, Y.grad), (vj, Fj, Gj, jx, jy)):
        assert _rel(value, loss) < 1e-5
        assert _rel(pf, F) < 1e-5 and _rel(pg, G) < 1e-5
        assert _rel(grad_x, gx) < 1e-5 and _rel(grad_y, gy) < 1e-5
    with pytest.raises(NotImplementedError, match="label_cost"):
        jax.jvp(jax.grad(lambda x: otj.samples_loss(x, f32(y), f32(a), f32(b), **dict(kw, scaling=0.1))),
                (f32(x),), (f32(x),))


# ----------------------------------------------------------------------------- bad input

_BAD = [  # (label_x, label_y, label_cost) -> (error type, message fragment)
    (lambda lx, ly, w: (lx.astype(np.float32), ly, w), TypeError, "label_x must hold integer"),
    (lambda lx, ly, w: (lx, ly[:-1], w), ValueError, "label_y must have shape"),
    (lambda lx, ly, w: (lx, ly, w[:, :1]), ValueError, "label_y must index"),
    (lambda lx, ly, w: (lx + 5, ly, w), ValueError, "label_x must index"),
    (lambda lx, ly, w: (lx, ly, np.where(w > 1, np.inf, w)), ValueError, "label_cost must be finite"),
    (lambda lx, ly, w: (lx, ly, w[0]), ValueError, "label_cost must be a 2-D table"),
    (lambda lx, ly, w: (lx, None, None), ValueError, "label_cost, label_y missing"),
]


def test_bad_labels_raise_naming_the_argument_in_both_frontends():
    x, y, a, b, lx, ly, w = _problem(4)
    for make, err, msg in _BAD:
        blx, bly, bw = make(lx, ly, w)
        with pytest.raises(err, match=msg):
            torch_api.sinkhorn(torch.tensor(x), torch.tensor(y), epsilon=EPS, label_x=torch.tensor(blx),
                               label_y=None if bly is None else torch.tensor(bly),
                               label_cost=None if bw is None else torch.tensor(bw))
        with pytest.raises(err, match=msg):
            otj.sinkhorn(jnp.asarray(x), jnp.asarray(y), epsilon=EPS, label_x=jnp.asarray(blx),
                         label_y=None if bly is None else jnp.asarray(bly),
                         label_cost=None if bw is None else jnp.asarray(bw))
    with pytest.raises(ValueError, match="label_cost must be square"):
        torch_api.SamplesLoss()(torch.tensor(x), torch.tensor(y), label_x=torch.tensor(lx),
                                label_y=torch.tensor(ly), label_cost=torch.tensor(w))
    sq = np.arange(9.0).reshape(3, 3)
    with pytest.raises(ValueError, match="label_cost must be symmetric"):
        otj.sinkhorn_divergence(jnp.asarray(x), jnp.asarray(y), epsilon=EPS, label_x=jnp.asarray(lx),
                                label_y=jnp.asarray(ly % 3), label_cost=jnp.asarray(sq))


def test_bad_label_values_under_jit_give_nan_and_not_converged():
    x, y, a, b, lx, ly, w = _problem(5)
    f32 = lambda v: jnp.asarray(v, jnp.float32)

    @jax.jit
    def run(lx, w):
        out = otj.sinkhorn(f32(x), f32(y), epsilon=EPS, max_iterations=20, label_x=lx, label_y=jnp.asarray(ly),
                           label_cost=w)
        return out.reg_ot_cost, out.converged

    for blx, bw in ((lx + 5, w), (lx, np.where(w > 1, np.nan, w))):
        cost, conv = run(jnp.asarray(blx), f32(bw))
        assert np.isnan(float(cost)) and not bool(conv)
    # concrete labels closed over by a jitted function are checked eagerly (read with numpy)
    good = run(jnp.asarray(lx), f32(w))[0]
    jlx, jly, jw, bad = jnp.asarray(lx), jnp.asarray(ly), f32(w), jnp.asarray(lx + 5)
    closed = jax.jit(lambda x: otj.sinkhorn(x, f32(y), epsilon=EPS, max_iterations=20, label_x=jlx, label_y=jly,
                                            label_cost=jw).reg_ot_cost)
    assert abs(float(closed(f32(x))) - float(good)) <= 1e-6 * abs(float(good))
    with pytest.raises(ValueError, match="label_x must index"):
        jax.jit(lambda x: otj.sinkhorn(x, f32(y), epsilon=EPS, label_x=bad, label_y=jly, label_cost=jw).reg_ot_cost)(
            f32(x))


def test_relaxed_marginals_compose_with_labels():
    """tau_a (OTT) and reach_x (flash-sinkhorn's one relaxed marginal) run on the labelled kernels
    (torch; the JAX frontend shares the solves' structure): with a zero table they give the
    unlabelled numbers (the same iterations: convergence is not needed here)."""
    x, y, a, b, lx, ly, _ = _problem(6, square=True)
    zero = np.zeros((KX, KX))
    t = lambda v: torch.tensor(v, dtype=torch.float32, requires_grad=True)
    tl = dict(label_x=torch.tensor(lx), label_y=torch.tensor(ly), label_cost=torch.tensor(zero))
    got, want = [], []
    for lab, sink in ((tl, got), ({}, want)):
        X, Y = t(x), t(y)
        out = torch_api.sinkhorn(X, Y, t(a), t(0.5 * b), epsilon=EPS, tau_a=0.7, max_iterations=20, **lab)
        sink += [out.reg_ot_cost.detach(), *torch.autograd.grad(out.reg_ot_cost, (X, Y))]
        X, Y = t(x), t(y)
        val = torch_api.SamplesLoss(blur=0.5, scaling=0.2, reach_x=1.0)(t(a), X, t(b), Y, **lab)
        sink += [val.detach(), *torch.autograd.grad(val, (X, Y))]
    for u, v in zip(got, want):
        assert _rel(u, v) < 1e-5


def test_samples_loss_batch_with_labels_is_its_problems_on_the_batch_schedule():
    """(B, N, D) with labels (B, N), (B, M) and one W, both frontends: each problem's loss,
    potentials and gradients are the float64 reference's on the batch's eps schedule (GeomLoss's
    one diameter for the batch)."""
    probs = [_problem(s, square=True) for s in (6, 7)]
    x, y, a, b = (np.stack([p[i] for p in probs]) for i in range(4))
    lx, ly = np.stack([p[4] for p in probs]), np.stack([p[5] for p in probs])
    w = probs[0][6]
    blur, scaling = 0.5, 0.5
    pts = np.concatenate([x.reshape(-1, D), y.reshape(-1, D)])
    sched = epsilon_schedule(2, float(np.linalg.norm(pts.max(0) - pts.min(0))), blur, scaling)
    refs = [geomloss_loss(x[k], y[k], a[k], b[k], lx[k], ly[k], w, sched) for k in range(2)]
    t = lambda v: torch.tensor(v, dtype=torch.float32)
    X, Y = (torch.tensor(v, dtype=torch.float32, requires_grad=True) for v in (x, y))
    tl = dict(label_x=torch.tensor(lx), label_y=torch.tensor(ly), label_cost=t(w))
    vt = torch_api.SamplesLoss(blur=blur, scaling=scaling)(t(a), X, t(b), Y, **tl)
    vt.sum().backward()
    Ft, Gt = torch_api.SamplesLoss(blur=blur, scaling=scaling, potentials=True)(t(a), t(x), t(b), t(y), **tl)
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    kw = dict(blur=blur, scaling=scaling, label_x=jnp.asarray(lx), label_y=jnp.asarray(ly), label_cost=f32(w))
    vj, (jx, jy) = jax.value_and_grad(lambda x, y: otj.samples_loss(x, y, f32(a), f32(b), **kw).sum(),
                                      argnums=(0, 1))(f32(x), f32(y))
    lj = otj.samples_loss(f32(x), f32(y), f32(a), f32(b), **kw)
    Fj, Gj = otj.samples_loss(f32(x), f32(y), f32(a), f32(b), potentials=True, **kw)
    for value, pf, pg, grad_x, grad_y in ((vt.detach(), Ft, Gt, X.grad, Y.grad), (lj, Fj, Gj, jx, jy)):
        for k, (loss, F, G, gx, gy) in enumerate(refs):
            assert _rel(value[k], loss) < 1e-5, k
            assert _rel(pf[k], F) < 1e-5 and _rel(pg[k], G) < 1e-5, k
            assert _rel(grad_x[k], gx) < 1e-5 and _rel(grad_y[k], gy) < 1e-5, k
    with pytest.raises(ValueError, match=r"label_y must be a \(2, 7\)"):
        torch_api.SamplesLoss()(t(x), t(y), label_x=torch.tensor(lx), label_y=torch.tensor(ly[:, 1:]),
                                label_cost=t(w))
    with pytest.raises(ValueError, match=r"label_x must be a \(2, 11\)"):
        otj.samples_loss(f32(x), f32(y), label_x=jnp.asarray(lx[0]), label_y=jnp.asarray(ly), label_cost=f32(w))
    with pytest.raises(ValueError, match="label_x must index"):
        torch_api.SamplesLoss()(t(x), t(y), label_x=torch.tensor(lx + 3), label_y=torch.tensor(ly), label_cost=t(w))


def test_jax_batches_with_labels_are_their_single_calls():
    """ot_triton_jax.sinkhorn / sinkhorn_divergence on (B, n, d) with labels (B, n), (B, m) and one
    W: the vmapped single calls (one labelled solve per problem), values and x-gradients; torch's
    batch gives the same costs."""
    probs = [_problem(s, square=True) for s in (8, 9)]
    x, y, a, b = (np.stack([p[i] for p in probs]) for i in range(4))
    lx, ly = np.stack([p[4] for p in probs]), np.stack([p[5] for p in probs])
    w = probs[0][6]
    f32 = lambda v: jnp.asarray(v, jnp.float32)
    kw = dict(epsilon=EPS, label_x=jnp.asarray(lx), label_y=jnp.asarray(ly), label_cost=f32(w), **SOLVE)
    cost = otj.sinkhorn(f32(x), f32(y), f32(a), f32(b), **kw).reg_ot_cost
    gx = jax.grad(lambda x: otj.sinkhorn(x, f32(y), f32(a), f32(b), **kw).reg_ot_cost.sum())(f32(x))
    div = otj.sinkhorn_divergence(f32(x), f32(y), f32(a), f32(b), **kw)[0]
    t = lambda v: torch.tensor(v, dtype=torch.float32)
    tcost = torch_api.sinkhorn(t(x), t(y), t(a), t(b), epsilon=EPS, label_x=torch.tensor(lx),
                               label_y=torch.tensor(ly), label_cost=t(w), **SOLVE).reg_ot_cost
    for k in range(2):
        one = dict(kw, label_x=jnp.asarray(lx[k]), label_y=jnp.asarray(ly[k]))
        ck, gk = jax.value_and_grad(lambda x: otj.sinkhorn(x, f32(y[k]), f32(a[k]), f32(b[k]), **one).reg_ot_cost)(
            f32(x[k]))
        dk = otj.sinkhorn_divergence(f32(x[k]), f32(y[k]), f32(a[k]), f32(b[k]), **one)[0]
        assert _rel(cost[k], ck) < 1e-5 and _rel(gx[k], gk) < 1e-5 and _rel(div[k], dk) < 1e-5, k
        assert _rel(tcost[k].numpy(), ck) < 1e-5, k
    with pytest.raises(ValueError, match=r"label_y must be a \(2, 7\) array"):
        otj.sinkhorn(f32(x), f32(y), **dict(kw, label_y=jnp.asarray(ly[:, 1:])))
