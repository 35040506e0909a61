"""The multiscale backend with KL-relaxed marginals, both frontends (CPU: Triton interpreter).

``SamplesLoss`` / ``samples_loss`` with ``reach`` and ``backend="multiscale"``: on one-point clusters
without truncation and without ``tol`` it runs GeomLoss's damped annealed solve, so its value,
potentials and x / y gradients are the dense relaxed backend's (itself tested against GeomLoss) to
float32 rounding. ``sinkhorn(..., tau_a, tau_b, multiscale=MultiscaleOptions(truncate=None))``
converges to OTT's relaxed fixed point: reg_ot_cost, f, g and the x, y, a, b gradients are the
dense relaxed solver's (tested against OTT) to the threshold's accuracy. With truncation, each
last potential is within tau eps times the reported dropped-mass bound of the untruncated update
from the same potentials (a-weighted L1, float64 reference), the rule multiscale_rules states.
Inputs: n != m, unequal masses, non-uniform weights with a zero; tau in {0.5, 0.9}.
"""

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

import ot_triton_jax as otj
import torch_api
from ot_triton_jax.core import multiscale_rules as rules
from torch_api import MultiscaleOptions

BLUR = 0.1  # eps = 0.01: reach 0.1 -> tau = 0.5, reach 0.3 -> tau = 0.9
ONE_POINT = dict(cluster_scale=5e-3, truncate=None, tol=None)  # below the points' spacing (d = 2)


def _problem(seed, n, m, d=2):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n, d, generator=g), torch.rand(m, d, generator=g) * 0.9 + 0.15
    a, b = torch.rand(n, generator=g) + 0.2, torch.rand(m, generator=g) + 0.2
    a[3] = 0.0
    return x, y, 1.2 * a / a.sum(), b / b.sum()


def _rel(u, ref):
    u, ref = np.asarray(u, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(u - ref) / np.linalg.norm(ref))


def _samples_loss(frontend, backend, x, y, a, b, potentials, **kw):
    """(value or (F, G), grad_x, grad_y), numpy; with potentials, the gradients of a fixed
    nonlinear functional of (F, G) (both sides' rows weighted differently)."""
    wF, wG = torch.linspace(-1.0, 2.0, x.shape[0]), torch.linspace(0.5, 1.5, y.shape[0])
    extra = ONE_POINT if backend == "multiscale" else {}
    if frontend == "torch":
        xs, ys = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
        out = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=0.5, backend=backend, potentials=potentials,
                                    **kw, **extra)(a, xs, b, ys)
        s = (wF * out[0]).sum() + (wG * out[1] ** 2).sum() if potentials else out
        gx, gy = torch.autograd.grad(s, (xs, ys))
        vals = [o.detach().numpy() for o in out] if potentials else float(out)
        return vals, gx.numpy(), gy.numpy()
    ja, jb, jF, jG = (jnp.asarray(t.numpy()) for t in (a, b, wF, wG))

    def f(xx, yy):
        out = otj.samples_loss(xx, yy, ja, jb, blur=BLUR, scaling=0.5, backend=backend, potentials=potentials,
                               **kw, **extra)
        return ((jnp.sum(jF * out[0]) + jnp.sum(jG * out[1] ** 2)) if potentials else out), out
    (_, out), (gx, gy) = jax.value_and_grad(f, (0, 1), has_aux=True)(jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
    vals = [np.asarray(o) for o in out] if potentials else float(out)
    return vals, np.asarray(gx), np.asarray(gy)


@pytest.mark.parametrize("frontend,reach,modes", [("torch", 0.1, (False, True)), ("jax", 0.3, (False,))])
def test_reach_on_one_point_clusters_is_the_dense_relaxed_loss(frontend, reach, modes):
    """The loss (GeomLoss's relaxed terms) and the potentials with their x, y gradients; the JAX
    frontend runs the same torch solve and gradient rule, checked here through the loss."""
    x, y, a, b = _problem(1, 40, 30)
    for potentials in modes:
        ms = _samples_loss(frontend, "multiscale", x, y, a, b, potentials, reach=reach)
        dense = _samples_loss(frontend, "online", x, y, a, b, potentials, reach=reach)
        if potentials:
            for p, q in zip(ms[0], dense[0]):
                assert _rel(p, q) < 5e-6
        else:
            assert abs(ms[0] - dense[0]) <= 5e-6 * abs(dense[0])
        assert _rel(ms[1], dense[1]) < 1e-5 and _rel(ms[2], dense[2]) < 1e-5


def _sinkhorn(frontend, x, y, a, b, multiscale, **kw):
    """(reg_ot_cost, f, g, (grad_x, grad_y, grad_a, grad_b)), numpy."""
    if frontend == "torch":
        leaves = [t.clone().requires_grad_(True) for t in (x, y, a, b)]
        out = torch_api.sinkhorn(*leaves, multiscale=multiscale, **kw)
        grads = torch.autograd.grad(out.reg_ot_cost, leaves)
        return float(out.reg_ot_cost), out.f.detach().numpy(), out.g.detach().numpy(), [g.numpy() for g in grads]

    def cost(*z):
        out = otj.sinkhorn(*z, multiscale=multiscale, **kw)
        return out.reg_ot_cost, (out.f, out.g)
    (v, (f, g)), grads = jax.value_and_grad(cost, (0, 1, 2, 3), has_aux=True)(*(jnp.asarray(t.numpy()) for t in (x, y, a, b)))
    return float(v), np.asarray(f), np.asarray(g), [np.asarray(t) for t in grads]


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_reach_hvp_on_one_point_clusters_is_the_dense_relaxed_hvp(frontend):
    """The HVP of the loss in x and y (torch double backward, JAX jvp of grad) equals the dense
    relaxed backend's, itself tested against the float64 implicit reference and GeomLoss."""
    x, y, a, b = _problem(5, 30, 24)
    g = torch.Generator().manual_seed(9)
    vx, vy = torch.randn(x.shape, generator=g), torch.randn(y.shape, generator=g)

    def hvps(backend):
        kw = dict(blur=BLUR, scaling=0.5, reach=0.3, backend=backend, **(ONE_POINT if backend == "multiscale" else {}))
        if frontend == "torch":
            out = []
            for side, v in ((0, vx), (1, vy)):
                pts = [x.clone().requires_grad_(True), y.clone().requires_grad_(True)]
                (gr,) = torch.autograd.grad(torch_api.SamplesLoss(**kw)(a, pts[0], b, pts[1]), pts[side],
                                            create_graph=True)
                out.append(torch.autograd.grad((gr * v).sum(), pts[side])[0].numpy())
            return out
        ja, jb, jx, jy = (jnp.asarray(t.numpy()) for t in (a, b, x, y))
        hx = jax.jvp(jax.grad(lambda xx: otj.samples_loss(xx, jy, ja, jb, **kw)), (jx,), (jnp.asarray(vx.numpy()),))[1]
        hy = jax.jvp(jax.grad(lambda yy: otj.samples_loss(jx, yy, ja, jb, **kw)), (jy,), (jnp.asarray(vy.numpy()),))[1]
        return [np.asarray(hx), np.asarray(hy)]

    for h, ref in zip(hvps("multiscale"), hvps("online")):
        assert np.isfinite(h).all() and _rel(h, ref) < 1e-4


@pytest.mark.parametrize("frontend,tau_a,tau_b", [("torch", 0.5, 0.9), ("jax", 0.9, 0.5)])
def test_sinkhorn_tau_on_the_multiscale_backend_is_the_dense_relaxed_solve(frontend, tau_a, tau_b):
    x, y, a, b = _problem(2, 36, 28)
    b[5] = 0.0
    kw = dict(epsilon=0.05, threshold=1e-5, tau_a=tau_a, tau_b=tau_b)
    ms = _sinkhorn(frontend, x, y, a, b, MultiscaleOptions(truncate=None), **kw)
    dense = _sinkhorn(frontend, x, y, a, b, None, **kw)
    assert abs(ms[0] - dense[0]) <= 1e-5 * abs(dense[0])
    for p, q, w in ((ms[1], dense[1], a), (ms[2], dense[2], b)):
        s = w.numpy() > 0
        assert np.all(np.isneginf(p[~s])) and _rel(p[s], q[s]) < 2e-5
    for name, p, q in zip("xyab", ms[3], dense[3]):
        assert _rel(p, q) < 2e-5, name


def test_truncated_relaxed_potentials_are_within_the_reported_bound():
    """The last extrapolation on the kept blocks against the untruncated damped update from the same
    potentials (float64): sum_i a_i |f_i - f_full,i| <= tau eps dropped_mass_bound for each of the
    four updates (multiscale_rules: relaxed marginals)."""
    from torch_api.multiscale.solve import anneal
    x, y, a, b = _problem(3, 72, 56)
    rho_ = 0.1 ** 2
    res = anneal(x, y, a, b, BLUR, 0.5, 1.5, cluster_scale=0.15, truncate=2.0, tol=5e-3, rho=(rho_, rho_))
    eps = BLUR ** 2
    tau = rho_ / (rho_ + eps)
    assert res.kept < 0.9 and 0.0 < res.dropped_mass_bound < 1.0 and res.converged
    X, Y, A, B = (t.double() for t in (x, y, a, b))
    pts, wts = (X, Y, X, Y), (A, B, A, B)

    def full(src, tgt, w_tgt, pot_tgt):
        C = 0.5 * torch.cdist(src, tgt) ** 2
        t = torch.where(w_tgt > 0, torch.log(torch.where(w_tgt > 0, w_tgt, 1.0)), -torch.inf) + (pot_tgt - C) / eps
        return -tau * eps * torch.logsumexp(t, 1)
    for k, (s, t) in enumerate(((0, 1), (1, 0), (0, 0), (1, 1))):
        ref = full(pts[s], pts[t], wts[t], res.old[(1, 0, 2, 3)[k]].double())  # the other side's old potential
        gap = float((wts[s] * (res.new[k].double() - ref).abs()).sum())
        assert gap <= tau * eps * res.dropped_mass_bound + 1e-6, k


def test_bound_potential_and_what_raises():
    p = torch.tensor([-2.0, -0.1, 0.0, 0.3])
    h = rules.bound_potential(torch, p, 0.01, 0.01)  # tau = 0.5
    assert torch.equal(h, torch.maximum(p, 2.0 * p)) and rules.bound_potential(torch, p, 0.01, None) is p
    x, y, a, b = _problem(4, 12, 10)
    xs = x.clone().requires_grad_(True)
    F, _ = torch_api.SamplesLoss(blur=BLUR, reach=0.3, backend="multiscale", potentials=True, **ONE_POINT)(a, xs, b, y)
    (gx,) = torch.autograd.grad(F.sum(), xs, create_graph=True)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        torch.autograd.grad(gx.sum(), xs)
    out = torch_api.sinkhorn(xs, y, a, b, epsilon=0.05, threshold=1e-3, tau_a=0.5, tau_b=0.9,
                             multiscale=MultiscaleOptions(truncate=None))
    (gx,) = torch.autograd.grad(out.reg_ot_cost, xs, create_graph=True)
    with pytest.raises(NotImplementedError, match="second derivatives"):
        torch.autograd.grad(gx.sum(), xs)
    for kw in (dict(reach_x=0.3), dict(reach_y=0.3)):
        with pytest.raises(NotImplementedError, match="relaxes both marginals"):
            torch_api.SamplesLoss(backend="multiscale", **kw)
