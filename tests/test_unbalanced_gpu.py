"""KL-relaxed marginals on the GPU: CUDA-graph replays of the relaxed loops (alternating,
symmetric and two-potential self terms, GeomLoss's damped loop) equal their eager launches
bitwise, and the converged relaxed solve agrees with a float64 dense solve of OTT's damped
updates (core/unbalanced.py)."""

import pytest
import torch

import torch_api
from torch_api import cuda_graphs

pytestmark = pytest.mark.gpu


def _inputs(seed, n=700, m=600, d=3, mass_b=1.3):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x, y = torch.randn(n, d, device="cuda", generator=gen), torch.randn(m, d, device="cuda", generator=gen) + 0.3
    a, b = torch.rand(n, device="cuda", generator=gen) + 0.1, torch.rand(m, device="cuda", generator=gen) + 0.1
    a[5], b[7] = 0.0, 0.0
    return x, y, a / a.sum(), mass_b * b / b.sum()


def _replays_match_eager(run, monkeypatch) -> None:
    inputs = [_inputs(1), _inputs(2)]
    monkeypatch.setenv("OT_TRITON_CUDA_GRAPHS", "0")
    want = [run(*p) for p in inputs]
    monkeypatch.delenv("OT_TRITON_CUDA_GRAPHS")
    cuda_graphs.clear()
    for p, w in zip(inputs + inputs[::-1], want + want[::-1]):
        for u, v in zip(run(*p), w):
            assert torch.equal(u, v), (u, v)
    assert cuda_graphs._sets, "the solves did not go through the graphs"


@pytest.mark.parametrize("taus", [(0.7, 0.7), (1.0, 0.5)])
def test_relaxed_alternating_replay_equals_eager(taus, monkeypatch):
    def run(x, y, a, b):
        out = torch_api.sinkhorn(x, y, a, b, epsilon=0.05, tau_a=taus[0], tau_b=taus[1])
        return out.f, out.g, out.errors, out.n_iters, out.reg_ot_cost.detach()
    _replays_match_eager(run, monkeypatch)


@pytest.mark.parametrize("taus", [(0.8, 0.8), (0.9, 0.5)])
def test_relaxed_divergence_replay_equals_eager(taus, monkeypatch):
    def run(x, y, a, b):
        div, out = torch_api.sinkhorn_divergence(x, y, a, b, epsilon=0.05, tau_a=taus[0], tau_b=taus[1])
        return (div.detach(),) + tuple(c.detach() for c in out.costs if c is not None)
    _replays_match_eager(run, monkeypatch)


@pytest.mark.parametrize("reach", [dict(reach=0.5), dict(reach_y=0.5)])
def test_reach_replay_equals_eager(reach, monkeypatch):
    loss = torch_api.SamplesLoss("sinkhorn", p=2, blur=0.05, scaling=0.5, **reach)

    def run(x, y, a, b):
        xg = x.clone().requires_grad_(True)
        value = loss(a, xg, b, y)
        return value.detach(), torch.autograd.grad(value, xg)[0]
    _replays_match_eager(run, monkeypatch)


def test_converged_relaxed_solve_matches_float64():
    x, y, a, b = _inputs(3, n=2000, m=1500, d=16)
    eps, ta, tb = 0.5, 0.9, 0.6
    out = torch_api.sinkhorn(x, y, a, b, epsilon=eps, tau_a=ta, tau_b=tb, threshold=1e-6, max_iterations=5000)
    assert bool(out.converged)
    X, Y, A, B = (t.double() for t in (x, y, a, b))
    C = torch.cdist(X, Y) ** 2
    la = torch.where(A > 0, A.clamp_min(1e-300).log(), -torch.inf)
    lb = torch.where(B > 0, B.clamp_min(1e-300).log(), -torch.inf)
    f, g = torch.zeros_like(A), torch.zeros_like(B)
    for _ in range(5000):
        g = tb * (eps * lb - eps * torch.logsumexp((f[:, None] - C) / eps, 0))
        f = ta * (eps * la - eps * torch.logsumexp((g[None, :] - C) / eps, 1))
    sa, sb = A > 0, B > 0
    assert torch.isinf(out.f[~sa]).all() and torch.isinf(out.g[~sb]).all()
    err_f = (out.f.double()[sa] - f[sa]).norm() / f[sa].norm()
    err_g = (out.g.double()[sb] - g[sb]).norm() / g[sb].norm()
    assert err_f < 1e-4 and err_g < 1e-4, (float(err_f), float(err_g))


def test_reach_hvp_matches_the_relaxed_reference():
    """The HVP of SamplesLoss(reach=...) in x on the GPU (torch double backward and JAX's jvp of
    grad) against c times the dense float64 relaxed Hessian at the solve's potentials (tests/
    test_samples_loss_unbalanced.py states the definition and the bound)."""
    import jax
    import jax.numpy as jnp

    import ot_triton_jax as otj
    from implicit_reference import Problem
    from torch_api import samples_loss_ops

    x, y, a, b = _inputs(4, n=400, m=300, d=3)
    v = torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(5))
    blur, reach, scaling = 0.5, 0.8, 0.95
    eps, rho = blur ** 2, reach ** 2
    kw = dict(blur=blur, reach=reach, scaling=scaling)
    xr = x.clone().requires_grad_()
    (gx,) = torch.autograd.grad(torch_api.SamplesLoss(**kw)(a, xr, b, y), xr, create_graph=True)
    (h_torch,) = torch.autograd.grad((gx * v).sum(), xr)
    J = lambda t: jnp.asarray(t.cpu().numpy())  # noqa: E731
    h_jax = jax.jvp(jax.grad(lambda z: otj.samples_loss(z, J(y), J(a), J(b), **kw)), (J(x),), (J(v),))[1]
    _, _, f_ba, g_ab, f_aa, _, *_ = samples_loss_ops.solve(x, y, a, b, blur, scaling, None, True, "float32", True,
                                                           rho, rho, True)
    la, lb = (torch.log(torch.where(w > 0, w, 1.0)).double().cpu() for w in (a, b))
    f, g, h = (p[0].double().cpu() + eps * lw for p, lw in ((f_ba, la), (g_ab, lb), (f_aa, la)))
    tau, c = rho / (rho + eps), (rho + 0.5 * eps) / (rho + eps)
    cpu = [t.cpu() for t in (x, y, a, b, v)]
    pxy = Problem(cpu[0], cpu[1], cpu[2], cpu[3], eps, 2.0, potentials=(f, g), taus=(tau, tau))
    pxx = Problem(cpu[0], cpu[0], cpu[2], cpu[2], eps, 2.0, potentials=(h, h), taus=(tau, tau))
    ref = c * (pxy.hvp(cpu[4])[0] - 0.5 * sum(pxx.hvp(cpu[4], cpu[4])[:2]))
    for got in (h_torch.double().cpu(), torch.as_tensor(jax.device_get(h_jax)).double()):
        assert torch.isfinite(got).all()
        assert float((got - ref).norm() / ref.norm()) < 5e-3
