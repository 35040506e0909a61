"""torch_api.sinkhorn / sinkhorn_divergence with OTT's KL-relaxed marginals (tau_a, tau_b < 1)
against OTT-JAX 0.6.0 in float64 (tests/ott_reference.py, one subprocess per test case).

Rules checked: core/unbalanced.py (damped updates, OTT's relaxed error and reg_ot_cost, its
first derivatives: envelope in x, y, partials at fixed potentials in a, b), unequal masses,
n != m, non-uniform weights with zeros; OTT's own unbalanced cases (tests/solvers/linear/
sinkhorn_test.py: TestSinkhornUnbalanced, TestSinkhornJIT's unbalanced gradient) at small sizes;
bad tau values raise naming the argument. (Second order and the
potentials' derivatives: tests/test_unbalanced_second_order.py.)
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import torch_api
from ott_reference import ott_reference

TIGHT = dict(threshold=1e-6, max_iterations=4000)
DIV = dict(threshold=1e-5, max_iterations=4000)  # the self terms converge slower (momentum 0.5)


def _rel(got, want, mask=None) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if mask is not None:
        got, want = got[mask], want[mask]
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


def _data(n, m, d, seed, *, mass_a=1.0, mass_b=1.0, zeros=True, uniform=False, offset=0.0):
    gen = torch.Generator().manual_seed(seed)
    if uniform:  # OTT's test clouds: uniform in [0, 1]^d
        x, y = torch.rand(n, d, generator=gen), torch.rand(m, d, generator=gen)
    else:
        x, y = torch.randn(n, d, generator=gen), 0.8 * torch.randn(m, d, generator=gen) + 0.3
    a, b = torch.rand(n, generator=gen) + offset, torch.rand(m, generator=gen) + offset
    if zeros:
        a[2], b[m - 1] = 0.0, 0.0
    return x, y, mass_a * a / a.sum(), mass_b * b / b.sum()


def _grads(out, *leaves):
    return torch.autograd.grad(out.reg_ot_cost, leaves)


CASES = {  # name: (tau_a, tau_b, eps, data)
    "a-relaxed-0.5": (0.5, 1.0, 0.6, dict(n=17, m=13, d=2, seed=1, mass_a=1.3, mass_b=0.7)),
    "b-relaxed-0.9": (1.0, 0.9, 0.3, dict(n=17, m=13, d=2, seed=2, mass_a=0.6, mass_b=1.1)),
    "both-0.99-0.5": (0.99, 0.5, 0.6, dict(n=13, m=19, d=3, seed=3, mass_a=1.5, mass_b=1.0)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_relaxed_solve_and_cost_gradients_match_ott(case):
    tau_a, tau_b, eps, spec = CASES[case]
    x, y, a, b = _data(**spec)
    leaves = [t.clone().requires_grad_(True) for t in (x, y, a, b)]
    out = torch_api.sinkhorn(*leaves, epsilon=eps, tau_a=tau_a, tau_b=tau_b, **TIGHT)
    assert bool(out.converged)
    gx, gy, ga, gb = _grads(out, *leaves)
    ref = ott_reference(["f", "g", "cost", "grad_x", "grad_y", "grad_a", "grad_b"], x=x, y=y, a=a, b=b, eps=eps,
                        tau_a=tau_a, tau_b=tau_b, use_danskin=1)
    pa, pb = (a > 0).numpy(), (b > 0).numpy()
    assert torch.isinf(out.f[~torch.from_numpy(pa)]).all() and torch.isinf(out.g[~torch.from_numpy(pb)]).all()
    errs = {"f": _rel(out.f.detach(), ref["f"], pa), "g": _rel(out.g.detach(), ref["g"], pb),
            "cost": _rel(out.reg_ot_cost.detach(), ref["cost"]),
            "grad_x": _rel(gx, ref["grad_x"]), "grad_y": _rel(gy, ref["grad_y"]),
            "grad_a": _rel(ga, ref["grad_a"], pa), "grad_b": _rel(gb, ref["grad_b"], pb)}
    assert max(errs.values()) <= 1e-5, errs
    # zero-weight points: no plan mass, so no x / y gradient
    assert not gx[~torch.from_numpy(pa)].any() and not gy[~torch.from_numpy(pb)].any()


def test_ott_sinkhorn_unbalanced_case_stops_where_ott_stops():
    """OTT's TestSinkhornUnbalanced.test_sinkhorn_unbalanced (lse_mode, momentum 1): tau 0.8 / 0.9,
    eps 0.1, threshold 1e-3, inner_iterations 10, uniform clouds 17 x 23 (d = 3 here, d = 4 in OTT):
    the last recorded error lies in (0, threshold), the loop stops at OTT's iteration, and f and
    reg_ot_cost there are OTT's."""
    tau_a, tau_b = 0.8, 0.9
    x, y, a, b = _data(17, 23, 3, seed=5, zeros=False, uniform=True)
    out = torch_api.sinkhorn(x, y, a, b, epsilon=0.1, threshold=1e-3, tau_a=tau_a, tau_b=tau_b)
    errors = out.errors[out.errors > -1]
    assert bool(out.converged) and 0.0 < float(errors[-1]) < 1e-3
    ref = ott_reference(["cost", "f"], x=x, y=y, a=a, b=b, eps=0.1, tau_a=tau_a, tau_b=tau_b, threshold=1e-3)
    assert int(out.n_iters) == int(ref["n_iters"])
    assert _rel(out.reg_ot_cost, ref["cost"]) <= 1e-5 and _rel(out.f, ref["f"]) <= 1e-5


def ott_kl_cost(f, g, x, y, a, b, eps, scale, tau_a, tau_b) -> float:
    """OTT's ``compute_kl_reg_cost`` (lse mode) in float64 at given potentials: per side sum a (f - eps log a)
    (tau = 1) or -sum a rho (exp(-(f - eps log a) / rho) - 1), rho = eps tau / (1 - tau), plus
    eps (sum a sum b - sum P), P = exp((f + g - |x - y|^2 / scale) / eps)."""
    x, y, a, b, f, g = (np.asarray(v, dtype=np.float64) for v in (x, y, a, b, f, g))
    c = ((x[:, None, :] - y[None, :, :]) ** 2).sum(-1) / scale
    with np.errstate(divide="ignore"):
        plan = np.exp((f[:, None] + g[None, :] - c) / eps)

    def side(w, p, tau):
        s = w > 0
        h = p[s] - eps * np.log(w[s])
        if tau == 1.0:
            return float((w[s] * h).sum())
        rho = eps * tau / (1.0 - tau)
        return float(-(w[s] * rho * np.expm1(-h / rho)).sum())
    return side(a, f, tau_a) + side(b, g, tau_b) + eps * (a.sum() * b.sum() - plan.sum())


def eps_scale_partials(ref, x, y, a, b, eps, scale, tau_a, tau_b) -> tuple[float, float]:
    """d reg_ot_cost / d (epsilon, scale_cost) as OTT's defaults define them for tau < 1 (use_danskin: the
    partials at OTT's float64 potentials ``ref["f"], ref["g"]``), by central differences of
    :func:`ott_kl_cost`; its value at (eps, scale) is checked against OTT's cost first."""
    cost = lambda e, s: ott_kl_cost(ref["f"], ref["g"], x, y, a, b, e, s, tau_a, tau_b)  # noqa: E731
    assert _rel(cost(eps, scale), ref["cost"]) <= 1e-10
    he, hs = 1e-6 * eps, 1e-6 * scale
    return ((cost(eps + he, scale) - cost(eps - he, scale)) / (2 * he),
            (cost(eps, scale + hs) - cost(eps, scale - hs)) / (2 * hs))


EPS_SCALE_CASE = (0.9, 0.5, 0.6, 1.7, dict(n=13, m=19, d=3, seed=3, mass_a=1.5, mass_b=1.0))


def test_eps_and_scale_cost_gradients_are_otts_partials():
    tau_a, tau_b, eps, scale, spec = EPS_SCALE_CASE
    x, y, a, b = _data(**spec)
    e, s = torch.tensor(eps, requires_grad=True), torch.tensor(scale, requires_grad=True)
    out = torch_api.sinkhorn(x, y, a, b, epsilon=e, scale_cost=s, tau_a=tau_a, tau_b=tau_b, **TIGHT)
    ge, gs = torch.autograd.grad(out.reg_ot_cost, (e, s))
    ref = ott_reference(["f", "g", "cost"], x=x, y=y, a=a, b=b, eps=eps, scale_cost=scale, tau_a=tau_a,
                        tau_b=tau_b, use_danskin=1)
    want_e, want_s = eps_scale_partials(ref, x, y, a, b, eps, scale, tau_a, tau_b)
    assert bool(out.converged)
    assert _rel(ge, want_e) <= 1e-5 and _rel(gs, want_s) <= 1e-5, (float(ge), want_e, float(gs), want_s)


@pytest.mark.parametrize("tau_a,tau_b", [(0.9, 0.9), (0.9, 0.5)])
def test_divergence_matches_ott(tau_a, tau_b):
    """OTT's sinkhorn_divergence(..., tau_a, tau_b): the (x, x) / (y, y) solves with parallel
    updates and momentum 0.5 (f != g when tau_a != tau_b), plus 0.5 eps (sum a - sum b)^2."""
    x, y, a, b = _data(15, 11, 2, seed=6, mass_a=1.2, mass_b=0.8)
    xs, ys, as_ = (t.clone().requires_grad_(True) for t in (x, y, a))
    div, dout = torch_api.sinkhorn_divergence(xs, ys, as_, b, epsilon=1.0, tau_a=tau_a, tau_b=tau_b, **DIV)
    assert all(bool(c) for c in dout.converged)
    f_xx, g_xx = dout.potentials[1]
    assert (f_xx is g_xx) == (tau_a == tau_b)
    gx, gy, ga = torch.autograd.grad(div, (xs, ys, as_))
    ref = ott_reference(["div", "div_grad_x", "div_grad_y"], x=x, y=y, a=a, b=b, eps=1.0, tau_a=tau_a, tau_b=tau_b,
                        use_danskin=1)
    errs = {"div": _rel(div.detach(), ref["div"]), "x": _rel(gx, ref["div_grad_x"]),
            "y": _rel(gy, ref["div_grad_y"])}
    assert max(errs.values()) <= 1e-5, errs
    # the a-gradient: the xy and xx terms' partials at fixed potentials plus the mass term's
    # eps (sum a - sum b) (OTT's defaults differentiate the divergence so, use_danskin)
    xy = torch_api.sinkhorn(xs, ys, as_, b, epsilon=1.0, tau_a=tau_a, tau_b=tau_b, **DIV)
    (ga_xy,) = torch.autograd.grad(xy.reg_ot_cost, as_)
    assert torch.isfinite(ga).all() and not torch.allclose(ga, ga_xy)


def test_bad_tau_raises_naming_the_argument():
    x, y, a, b = _data(6, 5, 2, seed=7, zeros=False)
    for name in ("tau_a", "tau_b"):
        for bad, err in ((0.0, ValueError), (1.5, ValueError), (float("nan"), ValueError), ("0.5", TypeError)):
            with pytest.raises(err, match=name):
                torch_api.sinkhorn(x, y, a, b, epsilon=0.5, **{name: bad})
            with pytest.raises(err, match=name):
                torch_api.sinkhorn_divergence(x, y, a, b, epsilon=0.5, **{name: bad})
    with pytest.raises(ValueError, match="mass"):  # strict marginals still need equal masses
        torch_api.sinkhorn(x, y, a, 2.0 * b, epsilon=0.5)


def test_relaxed_cost_and_gradient_compile_without_graph_breaks():
    """torch.compile(fullgraph=True) traces the relaxed solve, reg_ot_cost and its backward (the
    taus are float attributes of the custom ops) and gives the eager numbers."""
    x, y, a, b = _data(9, 7, 2, seed=9, mass_a=1.2)

    def loss(x, y, a):
        out = torch_api.sinkhorn(x, y, a, b, epsilon=0.5, tau_a=0.7, tau_b=0.9, max_iterations=40)
        return out.reg_ot_cost

    def value_and_grads(fn):
        leaves = [t.clone().requires_grad_(True) for t in (x, y, a)]
        v = fn(*leaves)
        return (v.detach(),) + torch.autograd.grad(v, leaves)

    eager = value_and_grads(loss)
    compiled = value_and_grads(torch.compile(loss, fullgraph=True, backend="aot_eager"))
    for got, want in zip(compiled, eager):
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-7), (got, want)


@pytest.mark.parametrize("taus,warm", [((1.0, 1.0), False), ((0.9, 1.0), False), ((0.9, 1.0), True)])
def test_the_loop_predicts_shifts_only_where_they_hold(monkeypatch, taus, warm):
    """The fixed shift (FOLD) is predicted from the previous potential except where it cannot hold
    (core.unbalanced.folds): the first g-update, the first f-update from the zero start, and from the
    zero start with a relaxed side both updates of iteration 1 (a warm start predicts them). The values do
    not depend on it: the same potentials as a solve that never predicts."""
    from torch_api import sinkhorn_loops
    x, y, a, b = _data(9, 7, 2, seed=11)
    seen, real = [], sinkhorn_loops.lse_update
    monkeypatch.setattr(sinkhorn_loops, "lse_update", lambda *v, **kw: seen.append(kw["fold"]) or real(*v, **kw))
    kw = dict(epsilon=0.5, tau_a=taus[0], tau_b=taus[1], min_iterations=4, max_iterations=4, inner_iterations=4)
    init = torch_api.sinkhorn(x, y, a, b, **kw) if warm else None
    seen.clear()
    start = {} if init is None else dict(init=(init.f, init.g))
    out = torch_api.sinkhorn(x, y, a, b, **kw, **start)
    early = taus != (1.0, 1.0) and not warm
    first = [False, warm]  # iteration 0: (g, f)
    second = [not early, not early]
    assert seen == first + second + [True] * 4 + [True], seen  # 4 iterations, then the final (measuring) g-update
    monkeypatch.setattr(sinkhorn_loops, "lse_update", lambda *v, **kw: real(*v, **{**kw, "fold": False}))
    ref = torch_api.sinkhorn(x, y, a, b, **kw, **start)
    assert _rel(out.f, ref.f, (a > 0).numpy()) <= 1e-6 and _rel(out.g, ref.g, (b > 0).numpy()) <= 1e-6
