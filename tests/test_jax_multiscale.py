"""ot_triton_jax.samples_loss(backend="multiscale") (CPU: Triton interpreter): the twin of
torch_api.SamplesLoss(backend="multiscale") (tested against float64 references in
test_multiscale_*.py): the same value, potentials, gradients and HVP on the same inputs, and its
errors (eager only)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ot_triton_jax as otj
import torch_api
from ot_triton_jax.jax_frontend.samples_loss_multiscale import last_multiscale_report

KW = dict(blur=0.3, scaling=0.5, backend="multiscale", cluster_scale=0.5, truncate=2.0, tol=1e-2)


def _problem(seed, n, m, d):
    rng = np.random.default_rng(seed)
    x = (rng.random((n, d)) * 4.0).astype(np.float32)
    y = (rng.random((m, d)) * 3.6 + 0.5).astype(np.float32)
    a, b = rng.random(n) + 0.2, rng.random(m) + 0.2
    return x, y, (a / a.sum()).astype(np.float32), (b / b.sum()).astype(np.float32), rng


def rel(u, ref):
    u, ref = np.asarray(u, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(u - ref) / np.linalg.norm(ref))


def test_value_potentials_gradients_and_hvp_are_torch_apis():
    x, y, a, b, rng = _problem(1, 72, 56, 2)
    v = rng.normal(size=x.shape).astype(np.float32)
    loss = lambda z, w, u=y: otj.samples_loss(z, u, w, b, **KW)  # noqa: E731
    value, (gx, ga, gy) = jax.value_and_grad(loss, argnums=(0, 1, 2))(x, a, y)
    report = last_multiscale_report()
    _, hx = jax.jvp(jax.grad(lambda z: loss(z, a)), (x,), (v,))
    F, G = otj.samples_loss(x, y, a, b, potentials=True, **KW)


    tl = torch_api.SamplesLoss("sinkhorn", **KW)
    xt, at, yt = (torch.tensor(t, requires_grad=True) for t in (x, a, y))
    vt = tl(at, xt, torch.tensor(b), yt)
    gxt, gat, gyt = torch.autograd.grad(vt, (xt, at, yt), create_graph=True)
    (hxt,) = torch.autograd.grad((gxt * torch.tensor(v)).sum(), xt)
    Ft, Gt = torch_api.SamplesLoss("sinkhorn", potentials=True, **KW)(at, xt, torch.tensor(b), torch.tensor(y))
    res = tl.last_multiscale
    assert 0.0 < res.kept < 1.0 and res.converged  # real truncation, converged to tol
    assert report["clusters"] == res.clusters and report["converged"] and report["kept"] == res.kept
    assert report["taylor_passes"] == res.taylor_passes == 0  # the CPU takes the direct pass by default
    assert abs(float(value) - float(vt)) <= 1e-6 * abs(float(vt))
    assert rel(F, Ft.detach()) < 1e-6 and rel(G, Gt.detach()) < 1e-6
    assert rel(gx, gxt.detach()) < 1e-6 and rel(ga, gat.detach()) < 1e-6
    # the same sides asked for on both: the finishing sweeps take the same passes (which sides are
    # asked for chooses between the fused mean pass and the plain one, whose float32 rounding differs)
    assert rel(gy, gyt.detach()) < 1e-6
    assert rel(hx, hxt) < 1e-5


def test_errors_name_the_fix():
    x, y, a, b, _ = _problem(2, 40, 30, 2)
    with pytest.raises(NotImplementedError, match="runs eagerly"):
        jax.jit(lambda z: otj.samples_loss(z, y, a, b, **KW))(x)
    with pytest.raises(NotImplementedError, match="runs eagerly"):
        jax.vmap(lambda z: otj.samples_loss(z, y, a, b, **KW))(jnp.stack([x, x]))
    with pytest.raises(NotImplementedError, match="forward-over-reverse"):
        jax.grad(lambda z: jnp.sum(jax.grad(lambda w: otj.samples_loss(w, y, a, b, **KW))(z) ** 2))(x)
    with pytest.raises(NotImplementedError, match="one problem at a time"):
        otj.samples_loss(jnp.stack([x, x]), jnp.stack([y, y]), **KW)
    with pytest.raises(ValueError, match="d <= 3"):
        otj.samples_loss(np.ones((5, 4), np.float32), np.ones((6, 4), np.float32), **KW)
    with pytest.raises(ValueError, match="truncate"):
        otj.samples_loss(x, y, a, b, **{**KW, "truncate": -1.0})
    with pytest.raises(ValueError, match="tol"):
        otj.samples_loss(x, y, a, b, **{**KW, "tol": 0.0})
