"""SamplesLoss / samples_loss with KL-relaxed marginals (reach, reach_x, reach_y), both frontends.

``reach`` against GeomLoss 0.3.1 (tensorized backend, float64); ``reach_x`` / ``reach_y`` (flash-
sinkhorn 0.4.1's definition) against a float64 dense copy of flash-sinkhorn's loop and debiased loss
(:func:`dense_reference`). Inputs: n != m,
unequal masses, a zero weight in a. Values and potentials to 1e-5 relative (to the largest
entry for potentials), gradients to 1e-5 relative to their norm; HVPs with ``reach`` against the
dense implicit reference (tests/implicit_reference.py) and central differences of GeomLoss's own
gradient; with ``reach_x`` != ``reach_y`` the gradient field's Jacobian (JAX) and its transpose
(torch double backward) against the same reference composed per side. Our kernels compute in float32, on float32-rounded inputs that the references read in
float64.
"""

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

import ot_triton_jax as otj
import torch_api
from geomloss import SamplesLoss as GeomLoss
from geomloss._legacy.sinkhorn_divergence import epsilon_schedule, max_diameter
from torch_api import samples_loss_ops

TOL = 1e-5
BLUR, SCALING = 0.3, 0.6


def problem(seed=0, n=13, m=9, d=2):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g)
    y = torch.rand(m, d, generator=g) + 0.3
    a = torch.rand(n, generator=g) + 0.1
    a[3] = 0.0
    b = 1.5 * (torch.rand(m, generator=g) + 0.1)  # total masses differ
    return tuple(t.to(torch.float32).double() for t in (x, y, a, b))


def ours(frontend, x, y, a, b, potentials=False, **kw):
    """(value, grad_x, grad_y) or (F, G), float64 numpy, through one frontend."""
    if frontend == "torch":
        if potentials:
            return tuple(t.double().numpy() for t in torch_api.SamplesLoss(potentials=True, **kw)(a, x, b, y))
        xr, yr = x.clone().float().requires_grad_(), y.clone().float().requires_grad_()
        v = torch_api.SamplesLoss(**kw)(a.float(), xr, b.float(), yr)
        gx, gy = torch.autograd.grad(v, (xr, yr))
        return float(v), gx.double().numpy(), gy.double().numpy()
    J = lambda t: jnp.asarray(t.numpy().astype(np.float32))
    if potentials:
        return tuple(np.asarray(t, np.float64) for t in otj.samples_loss(J(x), J(y), J(a), J(b), potentials=True,
                                                                          **kw))
    v, (gx, gy) = jax.value_and_grad(lambda x_, y_: otj.samples_loss(x_, y_, J(a), J(b), **kw), (0, 1))(J(x), J(y))
    return float(v), np.asarray(gx, np.float64), np.asarray(gy, np.float64)


def geomloss(x, y, a, b, potentials=False, **kw):
    if potentials:
        F, G = GeomLoss("sinkhorn", p=2, backend="tensorized", potentials=True, **kw)(a, x, b, y)
        return F.reshape(-1).numpy(), G.reshape(-1).numpy()
    xr, yr = x.clone().requires_grad_(), y.clone().requires_grad_()
    v = GeomLoss("sinkhorn", p=2, backend="tensorized", **kw)(a, xr, b, yr)
    gx, gy = torch.autograd.grad(v, (xr, yr))
    return float(v), gx.numpy(), gy.numpy()


def dense_reference(x, y, a, b, blur, scaling, rho_x, rho_y, debias=True):
    """flash-sinkhorn 0.4.1's SamplesLoss (symmetric backend, half_cost=True, no weight normalisation:
    GeomLoss's C = |x - y|^2 / 2, eps = blur^2) in float64 on dense matrices: each of OT(a, b),
    OT(a, a), OT(b, b) is solved by one loop (sinkhorn_solvers.sinkhorn_flashstyle_symmetric) with
    rho_x on its first and rho_y on its second marginal: a full update at eps_0 from zero, averaged
    updates over the schedule, a full last extrapolation, each followed by the translation
    _translate_semi_unbalanced when exactly one side is relaxed; each OT value is _autograd._dual_cost;
    S = OT(a, b) - OT(a, a)/2 - OT(b, b)/2. Gradients: autograd through the last extrapolation with its
    inputs and the translation detached and the cost's second argument detached (GeomLoss's rule).
    Potentials: (f_ab - (p_a + q_a)/2, g_ab - (p_b + q_b)/2) (debias), else (f_ab, g_ab).
    Returns ((value, grad_x, grad_y), (F, G))."""
    C = lambda u, v: ((u[:, None, :] - v[None, :, :]) ** 2).sum(-1) / 2
    softmin = lambda eps, c, h: -eps * torch.logsumexp(h[None, :] - c / eps, 1)
    damp = lambda eps, rho: 1.0 if rho is None else 1.0 / (1.0 + eps / rho)
    logw = lambda w: torch.where(w > 0, w.clamp_min(1e-300).log(), torch.tensor(-torch.inf, dtype=w.dtype))
    eps_list = epsilon_schedule(2, max_diameter(x, y), blur, scaling)
    eps = eps_list[-1]
    x, y = x.clone().requires_grad_(), y.clone().requires_grad_()

    def translate(f, g, lu, lv):
        if (rho_x is None) == (rho_y is None):
            return f, g
        if rho_y is not None:
            c = rho_y * (torch.logsumexp(lu, 0) - torch.logsumexp(lv - g / rho_y, 0))
            return f + c, g - c
        c = rho_x * (torch.logsumexp(lv, 0) - torch.logsumexp(lu - f / rho_x, 0))
        return f - c, g + c

    def solve(u, v, wu, wv):
        lu, lv = logw(wu), logw(wv)
        step = lambda f, g, e, cuv, cvu: (damp(e, rho_x) * softmin(e, cuv, lv + g.detach() / e),
                                           damp(e, rho_y) * softmin(e, cvu, lu + f.detach() / e))
        with torch.no_grad():
            cuv, cvu = C(u, v), C(v, u)
            f, g = translate(*step(torch.zeros_like(wu), torch.zeros_like(wv), eps_list[0], cuv, cvu), lu, lv)
            for e in eps_list:
                fn, gn = step(f, g, e, cuv, cvu)
                f, g = translate(0.5 * (f + fn), 0.5 * (g + gn), lu, lv)
        fn, gn = step(f, g, eps, C(u, v.detach()), C(v, u.detach()))
        ft, gt = translate(fn.detach(), gn.detach(), lu, lv)
        f, g = fn + (ft - fn).detach(), gn + (gt - gn).detach()
        w = lambda wt, p, rho: (wt * p).sum() if rho is None else (rho + eps / 2) * (wt * (1 - (-p / rho).exp())).sum()
        return w(wu, f, rho_x) + w(wv, g, rho_y), f, g

    value, f, g = solve(x, y, a, b)
    F, G = f, g
    if debias:
        v_aa, p_a, q_a = solve(x, x, a, a)
        v_bb, p_b, q_b = solve(y, y, b, b)
        value = value - 0.5 * v_aa - 0.5 * v_bb
        F, G = f - 0.5 * (p_a + q_a), g - 0.5 * (p_b + q_b)
    gx, gy = torch.autograd.grad(value, (x, y))
    return (float(value), gx.numpy(), gy.numpy()), (F.detach().numpy(), G.detach().numpy())


def assert_close(got, want, what):
    err = np.linalg.norm(np.asarray(got) - np.asarray(want)) / np.linalg.norm(want)
    assert np.isfinite(np.asarray(got)).all() and err <= TOL, (what, err)


def assert_potentials(got, want, what):
    for u, v, side in zip(got, want, "FG"):
        u, v = np.asarray(u).reshape(-1), np.asarray(v).reshape(-1)
        err = np.abs(u - v).max() / np.abs(v).max()
        assert np.isfinite(u).all() and err <= TOL, (what, side, err)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_reach_matches_geomloss(frontend):
    """Value, gradients in x and y against GeomLoss with reach in {0.1, 1, 10}; potentials at two of
    the settings (the same loop: the potentials differ from the loss's terms only in the output)."""
    x, y, a, b = problem(seed=1)
    for reach, debias in ((0.1, True), (1.0, True), (10.0, True), (1.0, False)):
        kw = dict(blur=BLUR, scaling=SCALING, reach=reach, debias=debias)
        v, gx, gy = ours(frontend, x, y, a, b, **kw)
        v0, gx0, gy0 = geomloss(x, y, a, b, **kw)
        assert abs(v - v0) <= TOL * abs(v0), (reach, debias, v, v0)
        assert_close(gx, gx0, f"grad x, reach={reach}, debias={debias}")
        assert_close(gy, gy0, f"grad y, reach={reach}, debias={debias}")
        if (reach, debias) in ((0.1, True), (1.0, False)):
            assert_potentials(ours(frontend, x, y, a, b, potentials=True, **kw),
                              geomloss(x, y, a, b, potentials=True, **kw), f"reach={reach}, debias={debias}")


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_one_relaxed_marginal_matches_dense_reference(frontend):
    """reach_x only, reach_y only, reach_x != reach_y (flash-sinkhorn's definition: self problems with
    rho_x on the first and rho_y on the second marginal, translation with one relaxed side) against
    :func:`dense_reference`: values, gradients in x and y, potentials (debiased, and without debias,
    which are flash-sinkhorn's own potentials). The reference reproduces GeomLoss when both sides
    share one rho (checked first)."""
    x, y, a, b = problem(seed=2, n=11, m=14)
    (v, gx, gy), (F, G) = dense_reference(x, y, a, b, BLUR, SCALING, 0.5**2, 0.5**2)
    v0, gx0, gy0 = geomloss(x, y, a, b, blur=BLUR, scaling=SCALING, reach=0.5)
    assert abs(v - v0) <= 1e-12 * abs(v0) and np.allclose(gx, gx0, rtol=1e-10, atol=1e-14)
    for reach_x, reach_y, pot_debias in ((0.5, None, True), (None, 2.0, False), (0.5, 2.0, None)):
        kw = dict(blur=BLUR, scaling=SCALING, reach_x=reach_x, reach_y=reach_y)
        rx, ry = (None if r is None else r**2 for r in (reach_x, reach_y))
        (v0, gx0, gy0), _ = dense_reference(x, y, a, b, BLUR, SCALING, rx, ry)
        v, gx, gy = ours(frontend, x, y, a, b, **kw)
        assert abs(v - v0) <= TOL * abs(v0), (reach_x, reach_y, v, v0)
        assert_close(gx, gx0, f"grad x, reach_x={reach_x}, reach_y={reach_y}")
        assert_close(gy, gy0, f"grad y, reach_x={reach_x}, reach_y={reach_y}")
        if pot_debias is not None:
            _, pots0 = dense_reference(x, y, a, b, BLUR, SCALING, rx, ry, debias=pot_debias)
            assert_potentials(ours(frontend, x, y, a, b, potentials=True, debias=pot_debias, **kw), pots0,
                              f"{reach_x}, {reach_y}, debias={pot_debias}")


def _hvps(frontend, x, y, a, b, vx, vy, **kw):
    """(H vx)_x and (H vy)_y of the loss, float64 numpy: torch double backward / JAX jvp of grad."""
    if frontend == "torch":
        out = []
        for side, v in ((0, vx), (1, vy)):
            pts = [x.clone().requires_grad_(), y.clone().requires_grad_()]
            (g,) = torch.autograd.grad(torch_api.SamplesLoss(**kw)(a, pts[0], b, pts[1]), pts[side], create_graph=True)
            out.append(torch.autograd.grad((g * v).sum(), pts[side])[0].double().numpy())
        return out
    J = lambda t: jnp.asarray(t.numpy())
    L = lambda x_, y_: otj.samples_loss(x_, y_, J(a), J(b), **kw)
    hx = jax.jvp(jax.grad(lambda x_: L(x_, J(y))), (J(x),), (J(vx),))[1]
    hy = jax.jvp(jax.grad(lambda y_: L(J(x), y_)), (J(y),), (J(vy),))[1]
    return np.asarray(hx, np.float64), np.asarray(hy, np.float64)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_reach_hvp_is_c_times_the_relaxed_hessian_at_its_potentials(frontend):
    """With reach, the HVP of the loss in x and y is c H_S v: S OTT's relaxed divergence (tau =
    rho / (rho + eps) on both marginals, C = |x - y|^2 / 2) at the solve's final potentials,
    c = (rho + eps/2) / (rho + eps); against the dense float64 implicit reference. Off the fixed
    point the reference's relaxed Jacobian (the target a exp(-f/rho) differentiated) and ours (the
    plan's row sums r / tau) differ by the schedule's residual: ~1e-3 at scaling 0.95, hence the
    bound (it is 4e-2 at scaling 0.6)."""
    from implicit_reference import Problem

    x, y, a, b = (t.float() for t in problem(seed=5))
    g = torch.Generator().manual_seed(6)
    vx, vy = torch.randn(x.shape, generator=g), torch.randn(y.shape, generator=g)
    blur, reach, scaling = 0.5, 0.8, 0.95  # a slow schedule: potentials near the fixed point
    eps, rho = blur ** 2, reach ** 2
    hx, hy = _hvps(frontend, x, y, a, b, vx, vy, blur=blur, scaling=scaling, reach=reach)
    _, _, f_ba, g_ab, f_aa, g_bb, *_ = samples_loss_ops.solve(x, y, a, b, blur, scaling, None, True, "float32",
                                                              True, rho, rho, True)
    la, lb = (torch.log(torch.where(w > 0, w, 1.0)).double() for w in (a, b))
    f, gg, hxx, hyy = f_ba[0] + eps * la, g_ab[0] + eps * lb, f_aa[0] + eps * la, g_bb[0] + eps * lb
    tau, c = rho / (rho + eps), (rho + 0.5 * eps) / (rho + eps)
    taus = (tau, tau)
    pxy = Problem(x, y, a, b, eps, 2.0, potentials=(f, gg), taus=taus)
    pxx = Problem(x, x, a, a, eps, 2.0, potentials=(hxx, hxx), taus=taus)
    pyy = Problem(y, y, b, b, eps, 2.0, potentials=(hyy, hyy), taus=taus)
    ref_x = c * (pxy.hvp(vx)[0] - 0.5 * sum(pxx.hvp(vx, vx)[:2])).numpy()
    ref_y = c * (pxy.hvp(vy=vy)[1] - 0.5 * sum(pyy.hvp(vy, vy)[:2])).numpy()
    for h, ref in ((hx, ref_x), (hy, ref_y)):
        assert np.isfinite(h).all() and np.linalg.norm(ref) > 0
        assert np.linalg.norm(h - ref) / np.linalg.norm(ref) < 5e-3


def test_reach_hvp_is_the_derivative_of_geomloss_gradient():
    """The definition checked without our algebra: central differences of GeomLoss 0.3.1's own
    float64 gradient (a fixed diameter, so that the schedule does not move with x; a slow
    schedule, so that its potentials are near the fixed point) against our HVP in x."""
    x, y, a, b = problem(seed=7)
    v = torch.randn(x.shape, generator=torch.Generator().manual_seed(8)).double()
    kw = dict(blur=0.7, scaling=0.99, reach=1.0, diameter=2.0)

    def grad(xx):
        xr = xx.clone().requires_grad_()
        return torch.autograd.grad(GeomLoss("sinkhorn", p=2, backend="tensorized", **kw)(a, xr, b, y), xr)[0]

    h = 1e-4
    fd = ((grad(x + h * v) - grad(x - h * v)) / (2 * h)).numpy()
    hx, _ = _hvps("torch", x.float(), y.float(), a.float(), b.float(), v.float(), torch.zeros_like(y).float(), **kw)
    assert np.linalg.norm(hx - fd) / np.linalg.norm(fd) < 5e-3


def _relaxed_jacobian(x, y, a, b, vx, vy, blur, scaling, rho_x, rho_y):
    """(J v, J^T v) per side, float64 numpy: J the Jacobian of the loss's gradient field at our float32
    solve's final potentials, composed from the dense implicit reference (tests/implicit_reference.py)
    without the library's algebra: G_x = c_x grad_x R(x, y) - [c_x grad_1 R_a(x, x) + c_y grad_2 R_a(x, x)] / 2
    (torch_api/samples_loss.py), R the relaxed reg_ot_cost (tau per marginal), c = (rho + eps/2) / (rho + eps)
    per relaxed side, 1 on a strict one; the self problems keep their two potentials."""
    from implicit_reference import Problem

    eps = blur ** 2
    _, _, f_ba, g_ab, f_aa, g_bb, *_ = samples_loss_ops.solve(x, y, a, b, blur, scaling, None, True, "float32",
                                                              True, rho_x, rho_y, True)
    side = lambda r: (1.0, 1.0) if r is None else (r / (r + eps), (r + 0.5 * eps) / (r + eps))
    (tx, cx), (ty, cy) = side(rho_x), side(rho_y)
    out = []
    for k, (s_, t_, ws, wt, own, pot, v) in enumerate(((x, y, a, b, f_aa[0], f_ba[0], vx), (y, x, b, a, g_bb[0], g_ab[0], vy))):
        lw = torch.log(torch.where(ws > 0, ws, 1.0)).double()
        lo = torch.log(torch.where(wt > 0, wt, 1.0)).double()
        other = (g_ab if k == 0 else f_ba)[0] + eps * lo
        n, v = s_.shape[0], v.double()
        pots = (pot + eps * lw, other) if k == 0 else (other, pot + eps * lw)
        cross = Problem(x, y, a, b, eps, 2.0, potentials=pots, taus=(tx, ty))
        own_p = Problem(s_, s_, ws, ws, eps, 2.0, potentials=(own[:n] + eps * lw, own[n:] + eps * lw), taus=(tx, ty))
        c = (cx, cy)[k]
        hv = lambda w: cross.hvp(w)[0] if k == 0 else cross.hvp(vy=w)[1]
        s1, s2 = own_p.hvp(v, v)[:2]
        jv = c * hv(v) - 0.5 * (cx * s1 + cy * s2)
        s1, s2 = own_p.hvp(cx * v, cy * v)[:2]
        jtv = hv(c * v) - 0.5 * (s1 + s2)
        out.append((jv.numpy(), jtv.numpy()))
    return out


@pytest.mark.parametrize("frontend,reach_x,reach_y", [("torch", 0.5, None), ("jax", 0.5, None), ("torch", None, 0.7),
                                                      ("jax", 0.5, 1.5)])
def test_unequal_reaches_hvp_is_the_jacobian_of_the_gradient(frontend, reach_x, reach_y):
    """With reach_x != reach_y the gradient field's Jacobian J is not symmetric: a JAX jvp of grad gives
    J v, a torch double backward J^T v (a VJP), each against the float64 composition of
    :func:`_relaxed_jacobian`, x and y sides, n != m, unequal masses, a zero weight. The bound is the
    schedule's residual at scaling 0.99 (measured 2e-4 to 6e-3); one relaxed marginal makes J far
    enough from symmetric (2e-2 to 3e-2) that the other product fails it by a factor of 5 or more."""
    x, y, a, b = (t.float() for t in problem(seed=5))
    g = torch.Generator().manual_seed(6)
    vx, vy = torch.randn(x.shape, generator=g), torch.randn(y.shape, generator=g)
    blur, scaling = 0.5, 0.99
    rx, ry = (None if r is None else r ** 2 for r in (reach_x, reach_y))
    got = _hvps(frontend, x, y, a, b, vx, vy, blur=blur, scaling=scaling, reach_x=reach_x, reach_y=reach_y)
    for h, (jv, jtv) in zip(got, _relaxed_jacobian(x, y, a, b, vx, vy, blur, scaling, rx, ry)):
        want, other = (jv, jtv) if frontend == "jax" else (jtv, jv)
        err = np.linalg.norm(h - want) / np.linalg.norm(want)
        assert np.isfinite(h).all() and err < 1e-2, (frontend, reach_x, reach_y, err)
        if reach_x is None or reach_y is None:
            assert np.linalg.norm(h - other) / np.linalg.norm(other) > 5 * err


def test_second_derivatives_of_relaxed_potentials_raise():
    x, y, a, b = (t.float() for t in problem(seed=3, n=6, m=5))
    kw = dict(blur=BLUR, scaling=SCALING, reach_x=1.0, potentials=True)
    xr = x.clone().requires_grad_()
    F, _ = torch_api.SamplesLoss(**kw)(a, xr, b, y)
    (gx,) = torch.autograd.grad(F.sum(), xr, create_graph=True)
    with pytest.raises(NotImplementedError, match="potentials"):
        torch.autograd.grad(gx.sum(), xr)
    J = lambda t: jnp.asarray(t.numpy())
    f = lambda x_: otj.samples_loss(x_, J(y), J(a), J(b), **kw)[0].sum()
    with pytest.raises(NotImplementedError, match="potentials"):
        jax.jvp(jax.grad(f), (J(x),), (jnp.ones_like(J(x)),))


BAD_REACH = [
    (dict(reach=0.0), ValueError, "reach must be a positive finite float"),
    (dict(reach=-1.0), ValueError, "reach must be a positive finite float"),
    (dict(reach=float("nan")), ValueError, "reach must be a positive finite float"),
    (dict(reach="1"), TypeError, "reach must be None"),
    (dict(reach_x=0.0), ValueError, "reach_x must be a positive finite float"),
    (dict(reach_y=-1.0), ValueError, "reach_y must be a positive finite float"),
    (dict(reach=1.0, reach_x=1.0), ValueError, "either reach .* or reach_x / reach_y"),
    (dict(reach=1.0, reach_y=2.0), ValueError, "either reach .* or reach_x / reach_y"),
    (dict(reach_x=1.0, backend="multiscale"), NotImplementedError, "backend='multiscale' relaxes both marginals"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_REACH)
def test_bad_reach_raises_naming_the_argument(kw, exc, match):
    x, y, a, b = (t.float() for t in problem(seed=4, n=5, m=4))
    with pytest.raises(exc, match=match):
        torch_api.SamplesLoss(**kw)
    with pytest.raises(exc, match=match):
        otj.samples_loss(jnp.asarray(x.numpy()), jnp.asarray(y.numpy()), **kw)


def test_unequal_masses_need_a_relaxed_marginal():
    x, y, a, b = (t.float() for t in problem(seed=5, n=5, m=4))
    with pytest.raises(ValueError, match="mass"):
        torch_api.SamplesLoss(blur=BLUR)(a, x, b, y)
    with pytest.raises(ValueError, match="mass"):
        otj.samples_loss(*(jnp.asarray(t.numpy()) for t in (x, y, a, b)), blur=BLUR)


def test_relaxed_hvp_op_transpose_is_its_adjoint():
    """``samples_loss_ops.hvp`` with reach_x != reach_y: <J v, u> = <v, J^T u> over (x, y) jointly
    (the torch double backward and its own backward rely on ``transpose``), and J is not symmetric."""
    x, y, a, b = (t.float() for t in problem(seed=4, n=7, m=6))
    rx, ry = 0.5 ** 2, None
    blur = 0.5
    solved = samples_loss_ops.solve(x, y, a, b, blur, 0.6, None, True, "float32", True, rx, ry, True)
    pots, eps = solved[2:6], solved[10]
    g = torch.Generator().manual_seed(9)
    v, u = [(torch.randn(x.shape, generator=g), torch.randn(y.shape, generator=g)) for _ in range(2)]
    jv = samples_loss_ops.hvp(x, y, a, b, *pots, eps, *v, True, "float32", rx, ry, False)
    jtu = samples_loss_ops.hvp(x, y, a, b, *pots, eps, *u, True, "float32", rx, ry, True)
    ju = samples_loss_ops.hvp(x, y, a, b, *pots, eps, *u, True, "float32", rx, ry, False)
    dot = lambda p, q: float(sum((s.double() * t.double()).sum() for s, t in zip(p, q)))
    lhs, rhs = dot(jv, u), dot(v, jtu)
    assert abs(lhs - rhs) <= 1e-4 * abs(lhs), (lhs, rhs)
    assert abs(dot(v, ju) - lhs) > 1e-2 * abs(lhs)
