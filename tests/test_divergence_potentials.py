"""Derivatives of the Sinkhorn divergence's self-term potentials (the (x, x) and (y, y) problems'
f, g; OTT's symmetric solve's h) in the points and weights, both frontends, single calls and
batches, against central differences of a float64 solve of the self problem. Non-uniform weights
with zeros, n != m; balanced, relaxed with tau_a == tau_b (h) and tau_a != tau_b (f != g)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ot_triton_jax as otj
import torch_api
from reference import self_potentials

EPS, THR = 0.5, 1e-6
CASES = [(1.0, 1.0), (0.9, 0.9), (0.8, 0.95)]


def _data(seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(17, 3, generator=g), 0.8 * torch.randn(12, 3, generator=g) + 0.3
    a, b = torch.rand(17, generator=g) + 0.2, torch.rand(12, generator=g) + 0.2
    a[3], b[5] = 0.0, 0.0
    return x, y, a / a.sum(), b / b.sum(), g


def _cotangents(w, g):
    """Cotangents of (f, g) of a self problem with weights w: zero where w == 0 (-inf potentials)."""
    uf, ug = torch.randn(w.shape[0], generator=g), torch.randn(w.shape[0], generator=g)
    return torch.where(w > 0, uf, 0.0), torch.where(w > 0, ug, 0.0)


def _phi(f, g, uf, ug):
    fin = torch.isfinite(f)
    return (torch.where(fin, uf * f, 0.0) + torch.where(fin, ug * g, 0.0)).sum()


def _fd(z, w, taus, uf, ug, v, dw, t=1e-4):
    """Central difference of <uf, f> + <ug, g> of the float64 self problem along (v, dw)."""
    val = lambda s: float(_phi(*self_potentials(z.double() + s * v, w.double() + s * dw, EPS, taus), uf.double(),
                               ug.double()))
    return (val(t) - val(-t)) / (2 * t)


def _directions(z, w, g):
    v = torch.randn(z.shape, generator=g, dtype=torch.float64)
    dw = torch.where(w > 0, torch.randn(w.shape, generator=g, dtype=torch.float64), 0.0)
    return v, dw


def _check(gz, gw, z, w, taus, uf, ug, g, tol=5e-4, weights=True):
    v, dw = _directions(z, w, g)
    for grad, dirs in ((gz, (v, 0 * dw)), (gw, (0 * v, dw)))[:2 if weights else 1]:
        ref = _fd(z, w, taus, uf, ug, *dirs)
        ours = float((torch.as_tensor(np.asarray(grad)).double() * (dirs[0] if grad is gz else dirs[1])).sum())
        assert np.isfinite(ours) and abs(ours - ref) <= tol * max(abs(ref), 1e-3), (ours, ref)


def _torch_grads(x, y, a, b, taus, side, uf, ug, batch=False):
    """Gradients of <uf, f> + <ug, g> of the self term of ``side`` in its points and weights; with
    ``batch``, of a packed (2, n, d) batch (weights without gradients) whose problem 1 is this one
    and problem 0 a copy without gradients: the points' gradient alone."""
    leaves = [t.clone().requires_grad_(not batch or i < 2) for i, t in enumerate((x, y, a, b))]
    args = [torch.stack([t.detach(), t]) for t in leaves] if batch else leaves
    _, out = torch_api.sinkhorn_divergence(*args, epsilon=EPS, threshold=THR, tau_a=taus[0], tau_b=taus[1])
    f, g = out.potentials[1 + side]
    if batch:
        f, g = f[1], g[1]
    z, w = (leaves[0], leaves[2]) if side == 0 else (leaves[1], leaves[3])
    return torch.autograd.grad(_phi(f, g, uf, ug), (z, w) if not batch else (z,))


def _case(taus, side):
    """The data of case (taus, side): (x, y, a, b, generator), the side's points and weights, and
    cotangents of its self potentials."""
    data = _data(side + 3 * CASES.index(taus))
    z, w = (data[0], data[2]) if side == 0 else (data[1], data[3])
    return (data, z, w) + _cotangents(w, data[4])


@pytest.mark.parametrize("taus", CASES)
@pytest.mark.parametrize("side", [0, 1])
def test_torch_self_potentials_derivatives(taus, side):
    (x, y, a, b, g), z, w, uf, ug = _case(taus, side)
    gz, gw = _torch_grads(x, y, a, b, taus, side, uf, ug)
    _check(gz, gw, z, w, taus, uf, ug, g)


@pytest.mark.parametrize("taus", [(1.0, 1.0), (0.9, 0.9)])
def test_torch_packed_batch_self_potentials_derivatives(taus):
    """The packed (B, n, d) divergence: each problem's self potentials h have its single call's VJP
    in the points (both sides)."""
    x, y, a, b, g = _data(11)
    for side, (z, w) in enumerate(((x, a), (y, b))):
        uf, ug = _cotangents(w, g)
        (gz,) = _torch_grads(x, y, a, b, taus, side, uf, ug, batch=True)
        (single,) = _torch_grads(x, y, a, b, taus, side, uf, ug)[:1]
        assert float((gz - single).norm() / single.norm()) < 1e-5
        _check(gz, torch.zeros_like(w), z, w, taus, uf, ug, g, weights=False)


@pytest.mark.parametrize("taus", CASES)
@pytest.mark.parametrize("side", [0, 1])
def test_jax_self_potentials_derivatives(taus, side):
    (x, y, a, b, g), z, w, uf, ug = _case(taus, side)
    ufj, ugj = jnp.asarray(uf.numpy()), jnp.asarray(ug.numpy())

    def phi(*args):
        _, out = otj.sinkhorn_divergence(*args, epsilon=EPS, threshold=THR, tau_a=taus[0], tau_b=taus[1])
        f, gg = out.potentials[1 + side]
        fin = jnp.isfinite(f)
        return jnp.sum(jnp.where(fin, ufj * f, 0.0) + jnp.where(fin, ugj * gg, 0.0))

    args = [jnp.asarray(t.numpy()) for t in (x, y, a, b)]
    idx = (0, 2) if side == 0 else (1, 3)
    gz, gw = jax.jit(jax.grad(phi, argnums=idx))(*args)
    _check(gz, gw, z, w, taus, uf, ug, g)
    if taus == (1.0, 1.0):  # under jax.vmap (the packed symmetric loop): problem 1 of two, problem 0 unweighted
        scale = jnp.asarray([0.0, 1.0])
        batched = lambda *v: jnp.sum(scale * jax.vmap(phi)(*v))
        gzb, gwb = jax.jit(jax.grad(batched, argnums=idx))(*[jnp.stack([t, t]) for t in args])
        assert float(jnp.abs(gzb[0]).max()) == 0.0
        assert float(jnp.linalg.norm(gzb[1] - gz) / jnp.linalg.norm(gz)) < 1e-5
        assert float(jnp.linalg.norm(gwb[1] - gw) / jnp.linalg.norm(gw)) < 1e-5


def test_self_potentials_second_derivatives_and_epsilon_raise():
    x, y, a, b, g = _data(5)
    xr = x.clone().requires_grad_()
    _, out = torch_api.sinkhorn_divergence(xr, y, a, b, epsilon=EPS)
    (gx,) = torch.autograd.grad(out.potentials[1][0][0], xr, create_graph=True)
    assert torch.isfinite(gx).all()
    with pytest.raises(NotImplementedError, match="second derivatives of the potentials"):
        torch.autograd.grad(gx.sum(), xr)
    eps = torch.tensor(EPS, requires_grad=True)
    _, out = torch_api.sinkhorn_divergence(x, y, a, b, epsilon=eps)
    with pytest.raises(NotImplementedError, match="epsilon or scale_cost"):
        torch.autograd.grad(out.potentials[1][0][0], eps)
