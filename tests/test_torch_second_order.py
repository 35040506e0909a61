"""Second order and implicit derivatives in torch_api, against a dense float64 implicit reference.

The reference (tests/implicit_reference.py) differentiates dense formulas with torch.func and
one pseudo-inverse; it shares no algebra with the library. Fresh random inputs each run.
"""

import warnings

import pytest
import torch

import torch_api
from implicit_reference import Problem, center_weights
from torch_api import implicit_ops, samples_loss_ops

TOL = 1e-4


def rel(u, ref):
    ref = ref.double()
    assert torch.isfinite(u).all()
    assert ref.norm() > 0, "reference is zero: the test could not fail"
    return float((u.detach().double() - ref).norm() / ref.norm())


def problem(n, m, d, weights, seed=None, shift=0.0):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ())))
    x = torch.randn(n, d, generator=g)
    y = torch.randn(m, d, generator=g) + shift
    if weights == "uniform":
        a, b = torch.full((n,), 1.0 / n), torch.full((m,), 1.0 / m)
    else:
        a, b = torch.rand(n, generator=g) + 0.2, torch.rand(m, generator=g) + 0.2
        if weights == "zeros":
            a[1] = 0.0
            b[-1] = 0.0
        a, b = a / a.sum(), b / b.sum()
    return x, y, a, b, g


# a tight CG (the default rtol 1e-4 is sized for the forward solve's own accuracy)
KW = dict(epsilon=0.4, scale_cost=1.5, threshold=1e-6, implicit=torch_api.ImplicitOptions(rtol=1e-6))


def reference(x, y, a, b):
    """The float64 reference and the float32 bound its conditioning allows (fresh draws are
    sometimes ill-conditioned: a far point, hundreds of iterations; the bound grows with them)."""
    ref = Problem(x, y, a, b, KW["epsilon"], KW["scale_cost"])
    return ref, ref.float32_tolerance(KW["threshold"], TOL)


def solve(x, y, a, b, **kw):
    xr, yr, ar, br = (t.clone().requires_grad_() for t in (x, y, a, b))
    return (xr, yr, ar, br), torch_api.sinkhorn(xr, yr, ar, br, **{**KW, **kw})


@pytest.mark.parametrize("weights,shape", [("uniform", (11, 7)), ("random", (8, 12)), ("zeros", (9, 9))])
def test_double_backward_hvp_x_and_y(weights, shape):
    x, y, a, b, g = problem(*shape, 3, weights)
    vx, vy = torch.randn(x.shape, generator=g), torch.randn(y.shape, generator=g)
    ref, tol = reference(x, y, a, b)
    (xr, yr, _, _), out = solve(x, y, a, b)
    gx, gy = torch.autograd.grad(out.reg_ot_cost, (xr, yr), create_graph=True)
    hx = torch.autograd.grad((gx * vx).sum(), xr, retain_graph=True)[0]
    hy = torch.autograd.grad((gy * vy).sum(), yr)[0]
    assert rel(hx, ref.hvp(vx)[0]) < tol
    assert rel(hy, ref.hvp(vy=vy)[1]) < tol
    # the explicit function gives the same numbers and reports its CG solve
    h, info = torch_api.hvp(x, y, vx, a=a, b=b, **KW)
    assert rel(h, ref.hvp(vx)[0]) < tol and bool(info.cg_converged) and bool(info.solve_converged)
    assert int(info.cg_iterations) > 0


def test_functional_hvp_and_central_differences():
    x, y, a, b, g = problem(10, 8, 2, "random")
    v = torch.randn(x.shape, generator=g)

    def loss(x):
        return torch_api.sinkhorn(x, y, a, b, **KW).reg_ot_cost

    _, h = torch.autograd.functional.hvp(loss, x, v)
    ref, tol = reference(x, y, a, b)
    ref = ref.hvp(v)[0]
    assert rel(h, ref) < tol
    # central differences of our own gradient (float32: a loose bound, it only guards the sign/scale)
    t = 1e-2
    grad = lambda z: torch.autograd.grad(loss(z.requires_grad_()), z)[0]
    fd = (grad(x + t * v) - grad(x - t * v)) / (2 * t)
    assert rel(fd, h.double()) < 2e-2


def test_mixed_and_weight_second_order():
    x, y, a, b, g = problem(9, 7, 2, "random")
    da = torch.randn(a.shape, generator=g)
    da = da - da.mean()  # mass-preserving (db = 0)
    ref, tol = reference(x, y, a, b)
    ref = ref.hvp(da=da)
    (xr, _, ar, _), out = solve(x, y, a, b)
    ga = torch.autograd.grad(out.reg_ot_cost, ar, create_graph=True)[0]
    hx, ha = torch.autograd.grad((ga * da).sum(), (xr, ar))
    assert rel(hx, ref[0]) < tol  # d/da of grad_x (mixed x-a block)
    assert rel(center_weights(ha), center_weights(ref[2])) < tol


def test_weight_hessian_is_symmetric_on_mass_preserving_directions():
    x, y, a, b, g = problem(6, 5, 2, "random")
    (_, _, ar, _), out = solve(x, y, a, b)
    ga = torch.autograd.grad(out.reg_ot_cost, ar, create_graph=True)[0]
    H = torch.stack([torch.autograd.grad(ga[i], ar, retain_graph=True)[0] for i in range(6)])
    C = torch.eye(6, dtype=torch.float64) - 1.0 / 6
    Hc = C @ H.double() @ C
    assert torch.allclose(Hc, Hc.T, atol=1e-5 * Hc.abs().max())
    ref, tol = reference(x, y, a, b)
    ref = torch.stack([ref.hvp(da=C[:, i])[2] for i in range(6)], 1)
    assert rel(Hc, C @ ref @ C) < tol


@pytest.mark.parametrize("weights", ["uniform", "zeros"])
def test_potentials_vjp(weights):
    x, y, a, b, g = problem(8, 11, 3, weights)
    wf, wg = torch.randn(8, generator=g), torch.randn(11, generator=g)
    wf, wg = torch.where(a > 0, wf, 0.0), torch.where(b > 0, wg, 0.0)
    wg = torch.where(b > 0, wg + (wf.sum() - wg.sum()) / (b > 0).sum(), 0.0)  # gauge invariant
    (xr, yr, ar, br), out = solve(x, y, a, b)
    phi = (wf * torch.where(a > 0, out.f, 0.0)).sum() + (wg * torch.where(b > 0, out.g, 0.0)).sum()
    gx, gy, ga, gb = torch.autograd.grad(phi, (xr, yr, ar, br))
    ref, tol = reference(x, y, a, b)
    rx, ry, ra, rb = ref.potentials_vjp(wf, wg)
    assert rel(gx, rx) < tol and rel(gy, ry) < tol
    assert rel(center_weights(ga, a > 0), center_weights(ra, a > 0)) < tol


@pytest.mark.parametrize("axis", [0, 1])
def test_apply_and_marginal_vjp(axis):
    x, y, a, b, g = problem(9, 7, 2, "random")
    k = 7 if axis == 1 else 9
    v, u = torch.randn(k, generator=g), torch.randn(16 - k, generator=g)
    (xr, yr, ar, br), out = solve(x, y, a, b)
    gx, gy, ga = torch.autograd.grad((out.apply(v, axis=axis) * u).sum(), (xr, yr, ar))
    ref, tol = reference(x, y, a, b)
    rx, ry, ra, _ = ref.apply_vjp(v, u, axis=axis)
    assert rel(gx, rx) < tol and rel(gy, ry) < tol
    assert rel(center_weights(ga), center_weights(ra)) < tol
    # the marginals of the solution are a and b whatever x is: their derivative in x vanishes
    # (the reference's is ~1e-15); ours must be zero to float32 accuracy, not merely small
    (xr, _, _, _), out = solve(x, y, a, b)
    gm = torch.autograd.grad((out.marginal(1) * torch.arange(9.0)).sum(), xr)[0]
    assert torch.isfinite(gm).all() and float(gm.abs().max()) < 1e-4 * float(gx.abs().max())


def test_divergence_hvp():
    x, y, a, b, g = problem(9, 7, 2, "random", shift=0.5)
    v = torch.randn(x.shape, generator=g)
    eps, sc = KW["epsilon"], KW["scale_cost"]
    pxy, tol = reference(x, y, a, b)
    pxx = Problem(x, x, a, a, eps, sc)
    tol = max(tol, pxx.float32_tolerance(KW["threshold"], TOL))
    ref = pxy.hvp(v)[0] - 0.5 * sum(pxx.hvp(v, v)[:2])
    xr = x.clone().requires_grad_()
    div, _ = torch_api.sinkhorn_divergence(xr, y, a, b, **KW)
    gx = torch.autograd.grad(div, xr, create_graph=True)[0]
    assert rel(torch.autograd.grad((gx * v).sum(), xr)[0], ref) < tol
    h, info = torch_api.hvp(x, y, v, a=a, b=b, loss="sinkhorn_divergence", **KW)
    assert rel(h, ref) < tol and bool(info.cg_converged)


@pytest.mark.parametrize("side", ["x", "y"])
def test_divergence_double_backward_solves_the_self_terms_symmetric_system(side, monkeypatch):
    """A near-diagonal self plan (eps small against the spacing): the double backward of the
    divergence moves each self term's one cloud on the symmetric system (the pair's Schur
    system crawls there; tests/test_self_term_hvp.py), and matches the float64 Hessian."""
    g = torch.Generator().manual_seed(3)
    x, y = torch.rand(30, 2, generator=g), torch.rand(24, 2, generator=g) + 0.2
    a, b = torch.rand(30, generator=g) + 0.2, torch.rand(24, generator=g) + 0.2
    a[4], b[-1] = 0.0, 0.0
    a, b = a / a.sum(), b / b.sum()
    eps, kw = 0.02, dict(threshold=1e-6, implicit=torch_api.ImplicitOptions(rtol=1e-6))
    pxy, self_ref = Problem(x, y, a, b, eps, 1.0), Problem(*((x, x, a, a) if side == "x" else (y, y, b, b)), eps, 1.0)
    v = torch.randn((x if side == "x" else y).shape, generator=g)
    ref = (pxy.hvp(v)[0] if side == "x" else pxy.hvp(None, v)[1]) - 0.5 * sum(self_ref.hvp(v, v)[:2])
    tol = max(pxy.float32_tolerance(1e-6, TOL), self_ref.float32_tolerance(1e-6, TOL))
    seen = []
    real = implicit_ops.imp.hessian_apply

    def spy(*args, **kwargs):
        seen.append(bool(args[-1]) if len(args) > 9 else bool(kwargs.get("symmetric", False)))
        return real(*args, **kwargs)

    monkeypatch.setattr(implicit_ops.imp, "hessian_apply", spy)
    xr, yr = x.clone().requires_grad_(side == "x"), y.clone().requires_grad_(side == "y")
    moving = xr if side == "x" else yr
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        div, out = torch_api.sinkhorn_divergence(xr, yr, a, b, epsilon=eps, **kw)
        grad = torch.autograd.grad(div, moving, create_graph=True)[0]
        hv = torch.autograd.grad((grad * v).sum(), moving)[0]
    assert not [w for w in caught if "conjugate gradient" in str(w.message)]  # CG converged
    assert all(bool(c) for c in out.converged)
    assert sorted(seen) == [False, True]  # the (x, y) term on the pair system, the self term on the symmetric one
    assert rel(hv, ref) < tol


def test_samples_loss_hvp_is_the_converged_hessian_at_its_potentials():
    x, y, a, b, g = problem(8, 6, 2, "random", shift=0.3)
    v = torch.randn(x.shape, generator=g)
    blur = 1.0
    eps = blur ** 2
    loss = torch_api.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=0.8)
    _, h = torch.autograd.functional.hvp(lambda z: loss(a, z, b, y), x, v)
    # the solve's own potentials (OTT convention), and the dense Hessian of the debiased loss there
    F, G, f_ba, g_ab, f_aa, g_bb, *_ = samples_loss_ops.solve(x, y, a, b, blur, 0.8, None, True, "float32", True)
    la, lb = a.log(), b.log()
    pxy = Problem(x, y, a, b, eps, 2.0, potentials=(f_ba[0] + eps * la, g_ab[0] + eps * lb))
    pxx = Problem(x, x, a, a, eps, 2.0, potentials=(f_aa[0] + eps * la, f_aa[0] + eps * la))
    ref = pxy.hvp(v)[0] - 0.5 * sum(pxx.hvp(v, v)[:2])
    assert rel(h, ref) < TOL


@pytest.mark.parametrize("preconditioner", ["jacobi", "neumann"])
def test_preconditioners_agree(preconditioner):
    x, y, a, b, g = problem(10, 9, 2, "random")
    v = torch.randn(x.shape, generator=g)
    opts = torch_api.ImplicitOptions(rtol=1e-6, preconditioner=preconditioner, neumann_terms=2)
    h, info = torch_api.hvp(x, y, v, a=a, b=b, **{**KW, "implicit": opts})
    ref, tol = reference(x, y, a, b)
    assert rel(h, ref.hvp(v)[0]) < tol
    assert bool(info.cg_converged)


def test_unconverged_cg_warns():
    x, y, a, b, g = problem(10, 9, 2, "random")
    v = torch.randn(x.shape, generator=g)
    opts = torch_api.ImplicitOptions(rtol=1e-9, max_iter=1)
    with pytest.warns(RuntimeWarning, match="conjugate gradient stopped unconverged"):
        _, info = torch_api.hvp(x, y, v, a=a, b=b, **{**KW, "implicit": opts})
    assert not bool(info.cg_converged) and int(info.cg_iterations) == 1


def test_derivatives_through_epsilon_raise():
    x, y, a, b, _ = problem(6, 5, 2, "uniform")
    xr, eps = x.clone().requires_grad_(), torch.tensor(0.5, requires_grad=True)
    out = torch_api.sinkhorn(xr, y, epsilon=eps)
    ge = torch.autograd.grad(out.reg_ot_cost, eps, create_graph=True)[0]  # first order in eps works
    assert torch.isfinite(ge)
    with pytest.raises(NotImplementedError, match="epsilon"):
        torch.autograd.grad(ge, xr)
    out = torch_api.sinkhorn(x, y, epsilon=eps)
    with pytest.raises(NotImplementedError, match="epsilon"):
        torch.autograd.grad(out.f.sum() - out.g.sum(), eps)


def test_bad_hvp_arguments():
    x, y, _, _, _ = problem(6, 5, 2, "uniform")
    with pytest.raises(ValueError, match="wrt"):
        torch_api.hvp(x, y, x, wrt="a", epsilon=0.5)
    with pytest.raises(ValueError, match="loss"):
        torch_api.hvp(x, y, x, loss="kl", epsilon=0.5)
    with pytest.raises(ValueError, match="shape of y"):
        torch_api.hvp(x, y, x, wrt="y", epsilon=0.5)
    with pytest.raises(ValueError, match="preconditioner"):
        torch_api.ImplicitOptions(preconditioner="ilu")
    with pytest.raises(ValueError, match="max_iter"):
        torch_api.ImplicitOptions(max_iter=0)
    with pytest.raises(TypeError, match="ImplicitOptions"):
        torch_api.sinkhorn(x, y, epsilon=0.5, implicit={"rtol": 1e-3})


def test_a_cg_solved_exactly_reports_converged():
    """A one-point cloud with relaxed marginals: CG reaches a zero residual before its error window
    fills, then meets p^T S p = 0; the solve is exact and must say so (no RuntimeWarning). The
    mixed HVP against central differences of the gradient (the relaxed HVPs' accuracy is checked
    against OTT-JAX in test_unbalanced_second_order.py)."""
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1, 3, generator=g), torch.randn(6, 3, generator=g) * 1.5 + 0.3
    a, b = torch.ones(1), torch.rand(6, generator=g) + 0.1
    b = 2.5 * b / b.sum()
    vx, vy = torch.randn(x.shape, generator=g), torch.randn(y.shape, generator=g)
    kw = dict(epsilon=0.5, threshold=1e-6, tau_a=0.8, tau_b=0.95)

    def grads(x, y, create_graph=False):
        xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
        out = torch_api.sinkhorn(xr, yr, a, b, **kw)
        assert bool(out.converged)
        return (xr, yr), torch.autograd.grad(out.reg_ot_cost, (xr, yr), create_graph=create_graph)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        (xr, yr), (gx, gy) = grads(x, y, True)
        hx, hy = torch.autograd.grad((gx * vx).sum() + (gy * vy).sum(), (xr, yr))
    assert not [w for w in caught if "conjugate gradient" in str(w.message)]
    t = 1e-2
    plus, minus = grads(x + t * vx, y + t * vy)[1], grads(x - t * vx, y - t * vy)[1]
    fd = [(p - m) / (2 * t) for p, m in zip(plus, minus)]
    assert rel(hx, fd[0].double()) < 2e-2 and rel(hy, fd[1].double()) < 2e-2
