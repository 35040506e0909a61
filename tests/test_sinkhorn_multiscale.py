"""sinkhorn(..., multiscale=MultiscaleOptions()) (OTT conventions on the multiscale backend, CPU:
Triton interpreter, real kernels): with every block kept it is the dense solver's problem, so its
cost, potentials (up to the gauge f + t, g - t) and first and second derivatives match the dense
solve; with truncation the cost stays within the reported bounds; options without meaning raise."""

import pytest
import torch

import torch_api
from torch_api import MultiscaleOptions

EPS, THR = 0.05, 1e-5


def _problem(n, m, d, seed=0, uniform=False):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n, d, generator=g), torch.rand(m, d, generator=g) * 0.9 + 0.15
    if uniform:
        return x, y, torch.full((n,), 1.0 / n), torch.full((m,), 1.0 / m)
    a, b = torch.rand(n, generator=g) + 0.3, torch.rand(m, generator=g) + 0.3
    return x, y, a / a.sum(), b / b.sum()


def _rel(u, ref):
    return float((u.double() - ref.double()).norm() / ref.double().norm())


def _gauge_free(f, g, a):
    """(f - t, g + t) with t the a-weighted mean of f: the potentials' gauge removed."""
    t = (a * f).sum() / a.sum()
    return f - t, g + t


@pytest.mark.parametrize("d, scale", [(1, 1.0), (2, 0.7), (3, 2.0)])
def test_keep_all_is_the_dense_problem(d, scale):
    x, y, a, b = _problem(60, 45, d, seed=d)
    kw = dict(epsilon=EPS, scale_cost=scale, threshold=THR)
    leaves = [t.clone().requires_grad_(True) for t in (x, y, a, b)]
    ms = torch_api.sinkhorn(*leaves, **kw, multiscale=MultiscaleOptions(truncate=None))
    dense_leaves = [t.clone().requires_grad_(True) for t in (x, y, a, b)]
    dense = torch_api.sinkhorn(*dense_leaves, **kw)
    assert bool(ms.converged) and ms.marginal_error <= THR and ms.dropped_mass_bound == 0.0
    assert abs(float(ms.reg_ot_cost) - float(dense.reg_ot_cost)) <= 1e-5 * abs(float(dense.reg_ot_cost))
    fm, gm = _gauge_free(ms.f.detach(), ms.g.detach(), a)
    fd, gd = _gauge_free(dense.f.detach(), dense.g.detach(), a)
    assert _rel(fm, fd) < 1e-4 and _rel(gm, gd) < 1e-4
    grads = torch.autograd.grad(ms.reg_ot_cost, leaves)
    ref = torch.autograd.grad(dense.reg_ot_cost, dense_leaves)
    for name, u, r in zip("xy", grads, ref):
        assert _rel(u, r) < 1e-4, name
    for name, u, r in zip("ab", grads[2:], ref[2:]):  # defined up to a constant (the potentials' gauge)
        assert _rel(u - u.mean(), r - r.mean()) < 1e-4, name


def test_hvp_in_x_is_the_dense_one():
    x, y, a, b = _problem(50, 40, 2, seed=5)
    v = torch.randn(50, 2, generator=torch.Generator().manual_seed(9))
    kw = dict(epsilon=0.1, threshold=THR)

    def hvp(**extra):
        xr = x.clone().requires_grad_(True)
        out = torch_api.sinkhorn(xr, y, a, b, **kw, **extra)
        (gx,) = torch.autograd.grad(out.reg_ot_cost, xr, create_graph=True)
        return torch.autograd.grad((gx * v).sum(), xr)[0]

    assert _rel(hvp(multiscale=MultiscaleOptions(truncate=None)), hvp()) < 2e-3


def test_truncated_solve_stays_within_its_reports():
    x, y, a, b = _problem(90, 80, 2, seed=3, uniform=True)
    ms = torch_api.sinkhorn(x, y, a, b, epsilon=0.01, threshold=1e-4, multiscale=MultiscaleOptions())
    dense = torch_api.sinkhorn(x, y, a, b, epsilon=0.01, threshold=1e-6, max_iterations=20000)
    assert bool(ms.converged) and bool(dense.converged)
    assert ms.report.kept < 1.0  # something was truncated
    # the cost moves by at most eps x (dropped mass + the marginal error) from the exact one, up to float32
    gap = abs(float(ms.reg_ot_cost) - float(dense.reg_ot_cost))
    assert gap <= 0.01 * (ms.dropped_mass_bound + 10 * ms.marginal_error) + 1e-5 * abs(float(dense.reg_ot_cost))


def test_what_it_cannot_do_raises():
    x, y, a, b = _problem(30, 20, 2)
    with pytest.raises(ValueError, match="max_iterations"):
        torch_api.sinkhorn(x, y, epsilon=0.1, max_iterations=50, multiscale=MultiscaleOptions())
    with pytest.raises(ValueError, match="init"):
        torch_api.sinkhorn(x, y, epsilon=0.1, init=(torch.zeros(30), torch.zeros(20)), multiscale=MultiscaleOptions())
    with pytest.raises(ValueError, match="d <= 3"):
        torch_api.sinkhorn(torch.rand(10, 4), torch.rand(8, 4), epsilon=0.1, multiscale=MultiscaleOptions())
    with pytest.raises(ValueError, match="scaling"):
        MultiscaleOptions(scaling=1.5)
    with pytest.raises(TypeError, match="MultiscaleOptions"):
        torch_api.sinkhorn(x, y, epsilon=0.1, multiscale={"scaling": 0.5})
    with pytest.raises(NotImplementedError, match="epsilon"):
        torch_api.sinkhorn(x, y, epsilon=torch.tensor(0.1, requires_grad=True), multiscale=MultiscaleOptions())
    with pytest.raises(ValueError, match="epsilon"):
        torch_api.sinkhorn(x, y, epsilon=-1.0, multiscale=MultiscaleOptions())
    xr = x.clone().requires_grad_(True)
    out = torch_api.sinkhorn(xr, y, a, b, epsilon=0.1, multiscale=MultiscaleOptions(truncate=None))
    with pytest.raises(NotImplementedError, match="derivatives of f and g"):
        out.f.sum().backward()
    with pytest.raises(NotImplementedError, match="apply"):
        out.apply(torch.ones(20))
    with pytest.raises(NotImplementedError, match="transport_mass"):
        out.transport_mass  # noqa: B018


def test_zero_weights_and_float64_inputs_follow_the_dense_conventions():
    x, y, a, b = _problem(40, 30, 2, seed=1)
    a = a.clone()
    a[:5] = 0.0
    a = (a / a.sum()).double()
    kw = dict(epsilon=0.05, threshold=THR)
    ar, ad = a.clone().requires_grad_(True), a.clone().requires_grad_(True)
    ms = torch_api.sinkhorn(x.double(), y.double(), ar, b.double(), **kw, multiscale=MultiscaleOptions(truncate=None))
    dense = torch_api.sinkhorn(x.double(), y.double(), ad, b.double(), **kw)
    assert ms.reg_ot_cost.dtype == torch.float64
    assert abs(float(ms.reg_ot_cost) - float(dense.reg_ot_cost)) <= 1e-5 * abs(float(dense.reg_ot_cost))
    assert torch.isneginf(ms.f[:5]).all() and torch.isfinite(ms.f[5:]).all()
    (gm,) = torch.autograd.grad(ms.reg_ot_cost, ar)
    (gd,) = torch.autograd.grad(dense.reg_ot_cost, ad)
    s = a > 0
    assert torch.allclose(gm[~s], gd[~s], rtol=1e-5)  # eps sum b off the support, as the dense solver
    assert _rel(gm[s] - gm[s].mean(), gd[s] - gd[s].mean()) < 1e-4
