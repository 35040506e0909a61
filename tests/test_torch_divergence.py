"""torch_api.sinkhorn_divergence against its JAX twin and OTT-JAX 0.6.0; torch gradients of
reg_ot_cost in epsilon and scale_cost against the JAX ones and float64 central differences;
marginal(axis) / transport_mass against a dense float64 plan.

CPU: Triton interpreter (both frontends run the same kernels). Tiny problems, fresh random
inputs, relative errors; NaN never passes.
"""

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

import ot_triton_jax as otj
import torch_api
from reference import away_from_threshold, plan, sinkhorn_ott, sqdist

import ott  # noqa: F401  (CI installs ott-jax; a missing peer must fail, not skip)
from ott.geometry import pointcloud  # noqa: E402
from ott.tools import sinkhorn_divergence as ott_sd  # noqa: E402

SOLVE = dict(threshold=1e-4, inner_iterations=5, max_iterations=300)


def rel(u, v) -> float:
    u = np.asarray(u.detach().cpu() if isinstance(u, torch.Tensor) else u, np.float64)
    v = np.asarray(v.detach().cpu() if isinstance(v, torch.Tensor) else v, np.float64)
    if u.shape != v.shape or np.isnan(u).any() or not np.isfinite(v).all():
        return float("inf")
    den = np.linalg.norm(v)
    return float(np.linalg.norm(u - v) / den) if den > 0 else float(np.linalg.norm(u))


def problem(n, m, d, shift=0.5, seed=None):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = (rng.standard_normal((m, d)) + shift).astype(np.float32)
    a = rng.uniform(0.2, 1.0, n).astype(np.float32)
    b = rng.uniform(0.2, 1.0, m).astype(np.float32)
    return x, y, (a / a.sum()).astype(np.float32), (b / b.sum()).astype(np.float32)


def leaves(*arrays):
    return [torch.from_numpy(np.array(v)).requires_grad_(True) for v in arrays]


def torch_divergence(x, y, a, b, eps, **kw):
    """(div, out, grads in x, y, a, b, eps) of torch_api.sinkhorn_divergence."""
    tx, ty, ta, tb = leaves(x, y, a, b)
    te = torch.tensor(eps, dtype=torch.float32, requires_grad=True)
    div, out = torch_api.sinkhorn_divergence(tx, ty, ta, tb, epsilon=te, **SOLVE, **kw)
    grads = torch.autograd.grad(div, (tx, ty, ta, tb, te))
    return div, out, grads


def draw(n, m, d, jax_fn):
    """A fresh problem whose stopping blocks (in ``jax_fn``'s result) are not decided by
    float32 noise; returns the problem and that result."""
    for _ in range(10):
        p = problem(n, m, d)
        res = jax_fn(*(jnp.asarray(v) for v in p))
        if away_from_threshold(res[0][1].errors, SOLVE["threshold"]):
            return p, res
    pytest.fail("no problem with errors clear of the threshold in 10 draws")


@pytest.mark.parametrize("kw", [dict(), dict(symmetric_sinkhorn=False, static_b=True, offset_static_b=0.3),
                                dict(precision="tf32")])
def test_divergence_matches_the_jax_twin(kw):
    eps = 0.8

    def jax_div(x, y, a, b, e):
        return otj.sinkhorn_divergence(x, y, a, b, epsilon=e, **SOLVE, **kw)

    vg = jax.value_and_grad(jax_div, argnums=(0, 1, 2, 3, 4), has_aux=True)
    (x, y, a, b), ((dj, oj), gj) = draw(16, 13, 2, lambda *p: vg(*p, eps))
    div, out, gt = torch_divergence(x, y, a, b, eps, **kw)
    assert div.dtype == torch.float32 and div.shape == ()
    assert rel(div, dj) < 1e-5
    static = kw.get("static_b", False)
    for k in range(2 if static else 3):
        # the same loop in both frontends (an (x, x) alternating solve may need more than max_iterations
        # on some draws: both then report it unconverged)
        assert int(out.n_iters[k]) == int(oj.n_iters[k]) and bool(out.converged[k]) == bool(oj.converged[k])
        assert out.errors[k].dtype == torch.float32 and out.errors[k].shape == oj.errors[k].shape
        assert rel(out.errors[k], oj.errors[k]) < 1e-4
        for u, v in zip(out.potentials[k], oj.potentials[k]):
            assert rel(u, v) < 1e-5
        assert rel(out.costs[k], oj.costs[k]) < 1e-5
    if static:
        assert out.potentials[2] is None and out.n_iters[2] is None and float(out.costs[2]) == pytest.approx(0.3)
    for name, u, v in zip("x y a b".split(), gt, gj):
        assert rel(u, v) < 1e-5, name
    # d/deps is a difference of three O(1) terms (float32 cancellation)
    assert rel(gt[4], gj[4]) < 5e-5


def test_divergence_matches_ott():
    eps = 1.0

    def theirs(x, y, a, b, e):
        return ott_sd.sinkhorn_divergence(pointcloud.PointCloud, x, y, a=a, b=b, epsilon=e, solve_kwargs=SOLVE)

    vg = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1, 2, 3, 4), has_aux=True))
    (x, y, a, b), ((dr, ref), gr) = draw(18, 15, 3, lambda *p: vg(*p, eps))
    div, out, gt = torch_divergence(x, y, a, b, eps)
    assert rel(div, dr) < 1e-5
    for k in range(3):
        assert int(out.n_iters[k]) == int(ref.n_iters[k])
        assert bool(out.converged[k]) and bool(ref.converged[k])
    for k in range(3):  # symmetric solves: the same iterates as OTT's
        for u, v in zip(out.potentials[k], ref.potentials[k]):
            assert rel(u, v) < 1e-5
        assert out.errors[k].dtype == torch.float32 and out.errors[k].shape == ref.errors[k].shape
        assert rel(out.errors[k], ref.errors[k]) < 1e-3
    for name, u, v in zip("x y a b".split(), gt, gr):
        assert rel(u, v) < 1e-5, name
    assert rel(gt[4], gr[4]) < 5e-5


def test_divergence_properties_and_bad_options():
    x, y, a, b = (torch.from_numpy(v) for v in problem(12, 10, 2))
    same, out = torch_api.sinkhorn_divergence(x, x, a, a, epsilon=0.5, **SOLVE)
    assert abs(float(same)) < 1e-5
    assert all(t.dtype == torch.bool and t.shape == () for t in out.converged)
    assert all(t.dtype == torch.int32 and t.shape == () for t in out.n_iters)
    pos, _ = torch_api.sinkhorn_divergence(x, y, a, b, epsilon=0.5, **SOLVE)
    assert float(pos) > 1e-3
    with pytest.raises(ValueError, match="offset_static_b is only used with static_b=True"):
        torch_api.sinkhorn_divergence(x, y, epsilon=0.5, offset_static_b=1.0)
    with pytest.raises(ValueError, match="same total mass"):
        torch_api.sinkhorn_divergence(x, y, a, 2 * b, epsilon=0.5)


# ----------------------------------------------------------------------------- d/deps, d/dscale_cost


def test_epsilon_and_scale_cost_gradients_match_jax_and_central_differences():
    eps0, scale0 = 0.4, 1.3
    tight = dict(threshold=1e-6, inner_iterations=5, max_iterations=2000)
    x, y, a, b = problem(14, 11, 2, shift=0.3)
    tx, ty, ta, tb = leaves(x, y, a, b)
    te = torch.tensor(eps0, dtype=torch.float64, requires_grad=True)  # any float dtype: grads come back in it
    ts = torch.tensor(scale0, dtype=torch.float32, requires_grad=True)
    out = torch_api.sinkhorn(tx, ty, ta, tb, epsilon=te, scale_cost=ts, **tight)
    assert bool(out.converged)
    grads = torch.autograd.grad(out.reg_ot_cost, (tx, ty, ta, tb, te, ts))
    assert grads[4].dtype == torch.float64 and grads[5].dtype == torch.float32

    # the JAX frontend (same kernels, same formulas)
    gj = jax.grad(lambda *z: otj.sinkhorn(z[0], z[1], z[2], z[3], epsilon=z[4], scale_cost=z[5],
                                          **tight).reg_ot_cost, argnums=(0, 1, 2, 3, 4, 5))(
        *(jnp.asarray(v) for v in (x, y, a, b)), jnp.float32(eps0), jnp.float32(scale0))
    for name, u, v in zip("x y a b eps scale".split(), grads, gj):
        assert rel(u, v) < 1e-5, name

    # central differences of the converged float64 cost (envelope theorem at the optimum)
    X, Y, A, B = (torch.from_numpy(v).double() for v in (x, y, a, b))

    def cost(eps, scale):
        return float(sinkhorn_ott(X, Y, A, B, eps, scale_cost=scale, iters=20000, tol=1e-13)[2])

    h = 1e-4
    fd_eps = (cost(eps0 + h, scale0) - cost(eps0 - h, scale0)) / (2 * h)
    fd_scale = (cost(eps0, scale0 + h) - cost(eps0, scale0 - h)) / (2 * h)
    assert abs(float(grads[4]) - fd_eps) < 2e-5 * abs(fd_eps)
    assert abs(float(grads[5]) - fd_scale) < 2e-5 * abs(fd_scale)


def test_numbers_and_tensors_without_grad_give_the_same_solve():
    x, y, a, b = (torch.from_numpy(v) for v in problem(10, 9, 2))
    kw = dict(threshold=1e-4, max_iterations=100)
    o1 = torch_api.sinkhorn(x, y, a, b, epsilon=0.6, scale_cost=2.0, **kw)
    o2 = torch_api.sinkhorn(x, y, a, b, epsilon=torch.tensor(0.6), scale_cost=torch.tensor([2.0]), **kw)
    assert torch.equal(o1.f, o2.f) and torch.equal(o1.g, o2.g) and torch.equal(o1.errors, o2.errors)
    assert torch.equal(o1.reg_ot_cost, o2.reg_ot_cost) and not o2.reg_ot_cost.requires_grad


# ----------------------------------------------------------------------------- marginals


@pytest.mark.parametrize("iters", [3, 200])
def test_marginals_and_transport_mass_match_the_dense_plan(iters):
    # unconverged (3 iterations: the column marginal is off b) and converged
    eps, scale = 0.3, 0.7
    # seeded: the bounds below are float32 accuracy with little room (worst 5e-6 over 25 seeds;
    # an unseeded draw once gave 1.02e-5 for the apply against P^T v's own norm)
    x, y, a, b = (torch.from_numpy(v) for v in problem(17, 13, 3, seed=7))
    a = a.clone()
    a[[2, 5]] = 0.0
    a = a / a.sum()
    out = torch_api.sinkhorn(x, y, a, b, epsilon=eps, scale_cost=scale, threshold=1e-6, inner_iterations=1,
                             min_iterations=min(iters, 3), max_iterations=iters)
    P = plan(out.f, out.g, sqdist(x, y) / scale, eps)
    rows, cols = out.marginal(1), out.marginal(0)
    assert rows.shape == (17,) and cols.shape == (13,) and rows.dtype == torch.float32
    assert rel(rows, P.sum(1)) < 1e-5 and rel(cols, P.sum(0)) < 1e-5
    assert torch.all(rows[[2, 5]] == 0)
    # the sum of the row sums above (each within 1e-5 of float64), summed in float32
    assert rel(out.transport_mass, P.sum()) < 1e-5 and out.transport_mass.shape == ()
    r2, c2 = out.marginals()
    assert torch.equal(r2, rows) and torch.equal(c2, cols)
    if iters == 3:
        assert float((cols.double() - b.double()).abs().sum()) > 1e-4
    v = torch.randn(17, 2, dtype=torch.float64, generator=torch.Generator().manual_seed(iters))
    # float32 accuracy of a signed sum is relative to the sum of magnitudes P^T |v| (cancellation)
    err = (out.apply(v, axis=0).double() - P.T @ v).norm() / (P.T @ v.abs()).norm()
    assert float(err) < 1e-5
    with pytest.raises(ValueError, match="axis must be"):
        out.marginal(2)
