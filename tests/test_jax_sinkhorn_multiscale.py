"""ot_triton_jax.sinkhorn(..., multiscale=MultiscaleOptions()) (CPU: Triton interpreter): the twin
of torch_api's (tested against the dense solver in test_sinkhorn_multiscale.py): the same cost,
potentials, gradients in x, y, a, b and HVP in x on the same inputs, and its errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ot_triton_jax as otj
import torch_api

KW = dict(epsilon=0.08, scale_cost=1.5, threshold=1e-4)
OPTS = dict(cluster_scale=0.3, truncate=3.0)


def _problem(seed, n, m, d):
    rng = np.random.default_rng(seed)
    x, y = rng.random((n, d)).astype(np.float32), (rng.random((m, d)) * 0.8 + 0.2).astype(np.float32)
    a, b = rng.random(n) + 0.2, rng.random(m) + 0.2
    return x, y, (a / a.sum()).astype(np.float32), (b / b.sum()).astype(np.float32), rng


def rel(u, ref):
    u, ref = np.asarray(u, np.float64), np.asarray(ref, np.float64)
    return float(np.linalg.norm(u - ref) / np.linalg.norm(ref))


def test_cost_potentials_gradients_and_hvp_are_torch_apis():
    x, y, a, b, rng = _problem(2, 64, 50, 2)
    v = rng.normal(size=x.shape).astype(np.float32)
    cost = lambda z, w, u: otj.sinkhorn(z, y, w, u, **KW, multiscale=otj.MultiscaleOptions(**OPTS)).reg_ot_cost  # noqa: E731
    value, (gx, ga, gb) = jax.value_and_grad(cost, argnums=(0, 1, 2))(x, a, b)
    _, hx = jax.jvp(jax.grad(lambda z: cost(z, a, b)), (x,), (v,))
    out = otj.sinkhorn(x, y, a, b, **KW, multiscale=otj.MultiscaleOptions(**OPTS))

    xt, at, bt = (torch.tensor(t, requires_grad=True) for t in (x, a, b))
    ref = torch_api.sinkhorn(xt, torch.tensor(y), at, bt, **KW, multiscale=torch_api.MultiscaleOptions(**OPTS))
    tgx, tga, tgb = torch.autograd.grad(ref.reg_ot_cost, (xt, at, bt), create_graph=True)
    (thx,) = torch.autograd.grad((tgx * torch.tensor(v)).sum(), xt)
    assert ref.report.kept < 1.0  # truncated
    assert abs(float(value) - float(ref.reg_ot_cost)) <= 1e-6 * abs(float(ref.reg_ot_cost))
    assert rel(out.f, ref.f.detach()) < 1e-6 and rel(out.g, ref.g.detach()) < 1e-6
    assert rel(gx, tgx.detach()) < 1e-5 and rel(ga, tga.detach()) < 1e-5 and rel(gb, tgb.detach()) < 1e-5
    assert rel(hx, thx) < 1e-4
    assert out.converged == bool(ref.converged) and out.marginal_error == pytest.approx(ref.marginal_error, rel=1e-2)
    assert out.dropped_mass_bound == pytest.approx(ref.dropped_mass_bound, rel=1e-3)


def test_errors():
    x, y, a, b, _ = _problem(3, 30, 20, 2)
    opts = otj.MultiscaleOptions()
    with pytest.raises(NotImplementedError, match="eagerly"):
        jax.jit(lambda z: otj.sinkhorn(z, y, epsilon=0.1, multiscale=opts).reg_ot_cost)(x)
    with pytest.raises(NotImplementedError, match="derivatives of f and g"):
        jax.grad(lambda z: otj.sinkhorn(z, y, epsilon=0.1, multiscale=opts).f.sum())(x)
    with pytest.raises(NotImplementedError, match="epsilon"):
        jax.grad(lambda e: otj.sinkhorn(x, y, epsilon=e, multiscale=opts).reg_ot_cost)(0.1)
    with pytest.raises(ValueError, match="inner_iterations"):
        otj.sinkhorn(x, y, epsilon=0.1, inner_iterations=5, multiscale=opts)
    with pytest.raises(ValueError, match="backend"):
        otj.sinkhorn(x, y, epsilon=0.1, backend="callback", multiscale=opts)
    with pytest.raises(ValueError, match="d <= 3"):
        otj.sinkhorn(jnp.ones((5, 4)), jnp.zeros((4, 4)), epsilon=0.1, multiscale=opts)
    with pytest.raises(NotImplementedError, match="marginal"):
        otj.sinkhorn(x, y, epsilon=0.1, multiscale=otj.MultiscaleOptions(truncate=None)).marginal(0)
