"""torch_api.sinkhorn on the real kernels (Triton interpreter on CPU) vs float64 references."""

import math

import pytest
import torch

import torch_api
from reference import plan, reg_ot_cost, rel_err, sinkhorn_ott, sqdist, weights

EPS = 0.3


def cloud(n, d, seed, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * 0.7 + shift




def centered(f, g, a):
    """Remove the (f + c, g - c) ambiguity: shift by the a-weighted mean of f."""
    fin = torch.isfinite(f)
    c = (f[fin].double() * a[fin].double()).sum() / a[fin].double().sum()
    return f.double() - c, g.double() + c


def solve(x, y, a, b, **kw):
    kw.setdefault("epsilon", EPS)
    kw.setdefault("threshold", 1e-6)
    kw.setdefault("max_iterations", 1000)
    return torch_api.sinkhorn(x, y, a, b, **kw)


CASES = [
    # n, m, d, weights kind
    (37, 23, 1, "random"),
    (40, 31, 3, "uniform"),
    (29, 44, 8, "zeros"),
    (33, 27, 20, "random"),   # tensor-core path, single K tile with masked tail
    (21, 18, 70, "uniform"),  # K tiled over d (70 > 64)
    (9, 7, 4096, "random"),   # the largest supported d: 64 chunks of 64 columns
]


@pytest.mark.parametrize("n,m,d,kind", CASES)
def test_potentials_cost_and_plan_match_float64(n, m, d, kind):
    x, y = cloud(n, d, 1), cloud(m, d, 2, shift=0.3)
    if kind == "uniform":
        a = b = None
        aa, bb = torch.full((n,), 1 / n), torch.full((m,), 1 / m)
    elif kind == "zeros":
        aa, bb = weights(n, 3, zeros=(0, 5)), weights(m, 4, zeros=(7,))
        a, b = aa, bb
    else:
        aa, bb = weights(n, 3), weights(m, 4)
        a, b = aa, bb
    scale = 0.5 * d
    out = solve(x, y, a, b, scale_cost=scale)
    assert bool(out.converged) and int(out.n_iters) < 1000
    f_ref, g_ref, cost_ref = sinkhorn_ott(x, y, aa, bb, EPS, scale_cost=scale)
    f, g = centered(out.f, out.g, aa)
    fr, gr = centered(f_ref, g_ref, aa)
    # marginal threshold 1e-6 -> potentials agree to ~1e-6 relative
    assert rel_err(f, fr) < 2e-5
    assert rel_err(g, gr) < 2e-5
    if kind == "zeros":
        assert torch.isinf(out.f[[0, 5]]).all() and torch.isinf(out.g[7])
    assert abs(float(out.reg_ot_cost) - float(cost_ref)) < 1e-5 * abs(float(cost_ref)) + 1e-6
    # matrix-free apply and marginals against the dense plan of the returned potentials
    P = plan(out.f, out.g, sqdist(x, y) / scale, EPS)
    v = torch.randn(m, 3)
    u = torch.randn(n)
    assert rel_err(out.apply(v, axis=1), P @ v.double()) < 1e-5
    assert rel_err(out.apply(u, axis=0), P.T @ u.double()) < 1e-5
    rows, cols = out.marginals()
    assert rel_err(rows, aa) < 1e-5
    assert (cols.double() - bb.double()).abs().sum() < 1e-5


def test_gradients_match_envelope_reference_and_finite_differences():
    n, m, d = 24, 19, 3
    x, y = cloud(n, d, 5), cloud(m, d, 6, shift=0.4)
    a, b = weights(n, 7), weights(m, 8)
    leaves = [t.clone().requires_grad_() for t in (x, y, a, b)]
    out = solve(*leaves, threshold=1e-7)
    out.reg_ot_cost.backward()
    # envelope reference: dense float64 cost with the potentials frozen
    X, Y, A, B = [t.detach().double().requires_grad_() for t in (x, y, a, b)]
    ref = reg_ot_cost(out.f, out.g, A, B, sqdist(X, Y), EPS)
    ref.backward()
    for leaf, r in zip(leaves, (X, Y, A, B)):
        assert rel_err(leaf.grad, r.grad) < 1e-5
    # finite differences of the full solve along a fixed random direction in x; h = 1e-2 left
    # a truncation error of up to 2.8e-4 (near the tolerance for some directions), 3e-3 <= 3e-5
    dx = torch.randn(n, d, generator=torch.Generator().manual_seed(11))
    h = 3e-3
    cp = float(solve(x + h * dx, y, a, b, threshold=1e-7).reg_ot_cost)
    cm = float(solve(x - h * dx, y, a, b, threshold=1e-7).reg_ot_cost)
    fd = (cp - cm) / (2 * h)
    an = float((leaves[0].grad * dx).sum())
    assert abs(fd - an) < 2e-3 * abs(an) + 1e-4


def test_zero_weights_and_duplicate_points_give_finite_gradients():
    n, m, d = 20, 16, 3
    x, y = cloud(n, d, 9), cloud(m, d, 10)
    x[3] = x[4]  # duplicate points
    y[0] = x[1]  # a point present in both clouds
    a, b = weights(n, 11, zeros=(2,)), weights(m, 12, zeros=(5, 6))
    xr = x.clone().requires_grad_()
    yr = y.clone().requires_grad_()
    out = solve(xr, yr, a, b)
    out.reg_ot_cost.backward()
    assert torch.isfinite(out.reg_ot_cost)
    assert torch.isfinite(xr.grad).all() and torch.isfinite(yr.grad).all()
    assert torch.all(xr.grad[2] == 0) and torch.all(yr.grad[[5, 6]] == 0)
    f_ref, g_ref, c_ref = sinkhorn_ott(x, y, a, b, EPS)
    assert abs(float(out.reg_ot_cost) - float(c_ref)) < 1e-5 * abs(float(c_ref))


def test_matches_ott_jax():
    import jax
    import jax.numpy as jnp
    from ott.geometry import pointcloud
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn as ott_sinkhorn

    jax.config.update("jax_enable_x64", False)
    n, m, d = 30, 25, 3
    x, y = cloud(n, d, 13), cloud(m, d, 14, shift=0.5)
    a, b = weights(n, 15), weights(m, 16)
    kw = dict(threshold=1e-4, inner_iterations=5, max_iterations=500)
    out = solve(x, y, a, b, **kw)

    def ott_cost(xj, yj, aj, bj):
        geom = pointcloud.PointCloud(xj, yj, epsilon=EPS)
        prob = linear_problem.LinearProblem(geom, aj, bj)
        return ott_sinkhorn.Sinkhorn(**kw)(prob)

    res = ott_cost(*(jnp.asarray(t.numpy()) for t in (x, y, a, b)))
    assert bool(res.converged) == bool(out.converged)
    assert int(res.n_iters) == int(out.n_iters)
    f_o, g_o = torch.from_numpy(jax.device_get(res.f).copy()), torch.from_numpy(jax.device_get(res.g).copy())
    assert rel_err(out.f, f_o) < 1e-5
    assert rel_err(out.g, g_o) < 1e-5
    assert abs(float(out.reg_ot_cost) - float(res.reg_ot_cost)) < 1e-5 * abs(float(res.reg_ot_cost))
    ott_err = torch.from_numpy(jax.device_get(res.errors).copy())
    # OTT's layout: float32, one entry per block, +inf not measured, -1 not run
    assert out.errors.dtype == ott_err.dtype == torch.float32 and out.errors.shape == ott_err.shape
    both = torch.isfinite(ott_err) & (ott_err >= 0)
    assert torch.equal(both, torch.isfinite(out.errors) & (out.errors >= 0))
    assert torch.equal(out.errors[~both], ott_err[~both])
    # float32 noise of a sum of |marginal_i - a_i| is ~1e-6 absolute (both sides round differently)
    assert torch.allclose(out.errors[both], ott_err[both], rtol=1e-3, atol=1e-6)
    # gradients: OTT's default differentiation (Danskin for reg_ot_cost)
    gx, gy, ga, gb = jax.grad(lambda *t: ott_cost(*t).reg_ot_cost, argnums=(0, 1, 2, 3))(
        *(jnp.asarray(t.numpy()) for t in (x, y, a, b)))
    leaves = [t.clone().requires_grad_() for t in (x, y, a, b)]
    solve(*leaves, **kw).reg_ot_cost.backward()
    for leaf, r in zip(leaves, (gx, gy, ga, gb)):
        assert rel_err(leaf.grad, torch.from_numpy(jax.device_get(r).copy())) < 1e-4


def test_error_schedule_and_non_convergence_are_reported():
    n, m, d = 20, 20, 2
    x, y = cloud(n, d, 17), cloud(m, d, 18, shift=2.0)
    out = solve(x, y, None, None, epsilon=0.05, threshold=1e-9, inner_iterations=3, max_iterations=7)
    assert int(out.n_iters) == 7 and not bool(out.converged)
    assert out.errors.shape == (3,) and out.errors.dtype == torch.float32
    assert math.isfinite(float(out.errors[0])) and math.isfinite(float(out.errors[1]))
    assert float(out.errors[2]) > 1e-9  # error after the last iteration is measured
    out = solve(x, y, None, None, epsilon=0.5, threshold=1e-3, inner_iterations=2, min_iterations=6,
                max_iterations=100)
    n_iters = int(out.n_iters)
    assert bool(out.converged) and n_iters >= 6 and n_iters % 2 == 0
    assert torch.isinf(out.errors[0]) and torch.isinf(out.errors[1])  # before min_iterations
    assert float(out.errors[n_iters // 2 - 1]) < 1e-3
    assert torch.all(out.errors[n_iters // 2:] == -1)


def test_low_precision_inputs_and_inputs_untouched():
    n, m, d = 18, 15, 4
    x, y = cloud(n, d, 19), cloud(m, d, 20)
    for dt in (torch.bfloat16, torch.float16, torch.float64):
        xl, yl = x.to(dt).requires_grad_(), y.to(dt)
        before = xl.detach().clone()
        out = solve(xl, yl, None, None)
        out.reg_ot_cost.backward()
        assert xl.grad.dtype == dt
        assert torch.equal(xl.detach(), before)
        f_ref, g_ref, c_ref = sinkhorn_ott(xl.detach().float(), yl.float(), torch.full((n,), 1 / n),
                                           torch.full((m,), 1 / m), EPS)
        assert abs(float(out.reg_ot_cost) - float(c_ref)) < 1e-5 * abs(float(c_ref))


def test_tf32_precision_runs_and_is_close():
    x, y = cloud(20, 12, 21), cloud(22, 12, 22)
    out = solve(x, y, None, None, precision="tf32")
    _, _, c_ref = sinkhorn_ott(x, y, torch.full((20,), 1 / 20), torch.full((22,), 1 / 22), EPS)
    assert abs(float(out.reg_ot_cost) - float(c_ref)) < 1e-3 * abs(float(c_ref))


def test_init_warm_start_converges_immediately():
    x, y = cloud(16, 3, 23), cloud(14, 3, 24)
    out = solve(x, y, None, None)
    warm = solve(x, y, None, None, init=(out.f, out.g), inner_iterations=1)
    assert bool(warm.converged) and int(warm.n_iters) <= 2


BAD = [
    (lambda x, y, a, b: (x[None], y, a, b), {}, ValueError, r"a batch takes x \(B, n, d\) and y \(B, m, d\)"),
    (lambda x, y, a, b: (x[None, None], y, a, b), {}, ValueError, "x must have shape"),
    (lambda x, y, a, b: (x, y[:, :2], a, b), {}, ValueError, "same dimension d"),
    (lambda x, y, a, b: (x[:0], y, None, b), {}, ValueError, "x is empty"),
    (lambda x, y, a, b: (x, y, -a, b), {}, ValueError, "a has negative"),
    (lambda x, y, a, b: (x, y, a, b * float("nan")), {}, ValueError, "b contains NaN"),
    (lambda x, y, a, b: (x, y, a[:-1], b), {}, ValueError, r"a must have shape \(10,\)"),
    (lambda x, y, a, b: (x, y, a, b * 2), {}, ValueError, "same total mass"),
    (lambda x, y, a, b: (x.clone().index_fill_(0, torch.tensor([1]), float("inf")), y, a, b), {},
     ValueError, "x contains NaN or Inf"),
    (lambda x, y, a, b: (x, y.double(), a, b), {}, TypeError, "same dtype"),
    (lambda x, y, a, b: (x, y.to("meta"), a, b), {}, ValueError, "same device"),
    (lambda x, y, a, b: (x.int(), y, a, b), {}, TypeError, "x must be float"),
    (lambda x, y, a, b: (x, y, a, b), {"epsilon": 0.0}, ValueError, "epsilon must be"),
    (lambda x, y, a, b: (x, y, a, b), {"epsilon": -1.0}, ValueError, "epsilon must be"),
    (lambda x, y, a, b: (x, y, a, b), {"scale_cost": float("nan")}, ValueError, "scale_cost"),
    (lambda x, y, a, b: (x, y, a, b), {"precision": "fp16"}, ValueError, "precision must be"),
    (lambda x, y, a, b: (x, y, a, b), {"inner_iterations": 0}, ValueError, "inner_iterations"),
    (lambda x, y, a, b: (x, y, a, b), {"min_iterations": 5, "max_iterations": 3}, ValueError, "min_iterations"),
]


@pytest.mark.parametrize("make,kw,exc,match", BAD)
def test_bad_input_is_rejected_with_the_argument_named(make, kw, exc, match):
    x, y = cloud(10, 3, 25), cloud(12, 3, 26)
    a, b = weights(10, 27), weights(12, 28)
    kw = {"epsilon": EPS, **kw}
    with pytest.raises(exc, match=match):
        torch_api.sinkhorn(*make(x, y, a, b), **kw)


def test_apply_rejects_wrong_shapes():
    x, y = cloud(10, 3, 29), cloud(12, 3, 30)
    out = solve(x, y, None, None)
    with pytest.raises(ValueError, match=r"shape \(12,\)"):
        out.apply(torch.ones(10), axis=1)
    with pytest.raises(ValueError, match="axis must be"):
        out.apply(torch.ones(10), axis=2)


@pytest.mark.parametrize("precision", ["float32", "tf32"])
def test_cost_is_the_dual_objective_at_the_returned_potentials(precision):
    # Not converged (5 iterations): reg_ot_cost is OTT's formula at (f, g) with the mass term
    # sum P of the plan they define (float32: a row-sum pass with the "fixed4" cross term; tf32: sum a,
    # its value right after the final f-update), here against float64.
    x, y = cloud(38, 12, 41), cloud(29, 12, 42, shift=0.3)
    a, b = weights(38, 43), weights(29, 44)
    out = solve(x, y, a, b, min_iterations=5, max_iterations=5, precision=precision)
    assert int(out.n_iters) == 5 and not bool(out.converged)
    ref = reg_ot_cost(out.f, out.g, a, b, sqdist(x, y), EPS)
    if precision == "tf32":
        mass = plan(out.f, out.g, sqdist(x, y), EPS).sum()
        ref = ref + EPS * (mass - a.double().sum())
    assert abs(float(out.reg_ot_cost) - float(ref)) / abs(float(ref)) < 1e-6


def test_cost_read_under_no_grad_keeps_its_gradient():
    # reg_ot_cost is computed on first access; reading it under no_grad first must not cut the
    # autograd link of a later read
    x = cloud(20, 4, 51).requires_grad_()
    y = cloud(17, 4, 52)
    out = solve(x, y, None, None, max_iterations=50)
    with torch.no_grad():
        v0 = out.reg_ot_cost.clone()
    v1 = out.reg_ot_cost
    assert v1.requires_grad and torch.equal(v0, v1.detach())
    (gx,) = torch.autograd.grad(v1, x)
    P = plan(out.f, out.g, sqdist(x.detach(), y), EPS)
    ref = 2 * (P.sum(1)[:, None] * x.detach().double() - P @ y.double())
    assert rel_err(gx, ref) < 1e-5


def test_outputs_are_tensors_on_the_solve_device():
    # converged / n_iters are 0-d tensors and errors float32 on the solve's device, as in the JAX
    # frontend (no host read is needed to hand them out, so torch.compile traces them)
    x, y = cloud(12, 2, 61), cloud(10, 2, 62)
    out = solve(x, y, None, None, epsilon=0.5, threshold=1e-4, inner_iterations=4, max_iterations=40)
    assert out.converged.dtype == torch.bool and out.converged.shape == ()
    assert out.n_iters.dtype == torch.int32 and out.n_iters.shape == ()
    assert out.errors.dtype == torch.float32 and out.errors.shape == (10,)
    assert {t.device for t in (out.f, out.g, out.errors, out.converged, out.n_iters)} == {x.device}
    k = int(out.n_iters) // 4  # blocks run
    assert bool(out.converged) and 0 < k < 10 and int(out.n_iters) == 4 * k
    assert torch.all(out.errors[:k] >= 0) and float(out.errors[k - 1]) < 1e-4
    assert torch.all(out.errors[k:] == -1)
    assert torch.equal(out.potentials[0], out.f) and out.threshold == 1e-4


def test_value_errors_raise_from_inside_the_solve_op():
    # values (not shapes) are read inside the custom op: the same messages, raised eagerly
    x, y = cloud(10, 3, 63), cloud(12, 3, 64)
    with pytest.raises(ValueError, match="epsilon must be a finite number > 0"):
        torch_api.sinkhorn(x, y, epsilon=torch.tensor(-0.5))
    with pytest.raises(ValueError, match="scale_cost must be"):
        torch_api.sinkhorn(x, y, epsilon=EPS, scale_cost=torch.tensor(float("inf")))
    with pytest.raises(ValueError, match="epsilon must be a scalar"):
        torch_api.sinkhorn(x, y, epsilon=torch.ones(2))
    with pytest.raises(ValueError, match="a is all zeros"):
        torch_api.sinkhorn(x, y, torch.zeros(10), None, epsilon=EPS)
