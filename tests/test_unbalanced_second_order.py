"""Second order and implicit derivatives with OTT's KL-relaxed marginals (tau_a, tau_b < 1), both
frontends, against OTT-JAX 0.6.0 in float64 (tests/ott_reference.py, one subprocess per case).

Checked (core/implicit_solve.py: H = [[diag(r/tau_a), P], [P^T, diag(c/tau_b)]], no gauge):
* HVPs of reg_ot_cost in x and y: ``hvp`` (explicit) and the autodiff idiom of each frontend
  (torch double backward, jax.jvp(jax.grad)), against ``hvp_env_x`` / ``hvp_env_y``: the derivative
  of the envelope gradient (OTT's default gradient in x, y) with OTT's potentials moving;
* the implicit VJP of the potentials f, g in x, y, a, b (OTT's ImplicitDiff, ``pot_vjp``);
* the VJP of ``apply`` (P v through the potentials) in x, y, a, b (one case);
* HVPs of sinkhorn_divergence (torch ``hvp`` in x, jax.jvp(jax.grad) in y; one case, tau_a != tau_b:
  the self problems' two potentials) against ``div_hvp_env_x`` / ``div_hvp_env_y``;
* second derivatives involving the weights raise in both frontends.
Cases: one side relaxed and both, unequal masses, n != m, non-uniform weights with a zero.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

import ot_triton_jax as otj
import torch_api
from ott_reference import ott_reference

RTOL = 1e-4
SOLVE = dict(threshold=1e-6, max_iterations=4000)

CASES = {  # name: (tau_a, tau_b, eps, n, m, d, mass_a, mass_b, seed, with apply (else the divergence))
    "b-relaxed-0.8": (1.0, 0.8, 0.5, 12, 9, 2, 1.3, 0.8, 11, True),
    "both-0.99-0.5": (0.99, 0.5, 0.4, 9, 13, 3, 0.7, 1.2, 12, False),
}


def _rel(got, want, mask=None) -> float:
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if mask is not None:
        got, want = got[mask], want[mask]
    assert np.all(np.isfinite(got)), "non-finite result"
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-300))


def _data(n, m, d, mass_a, mass_b, seed):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(n, d)), 0.8 * rng.normal(size=(m, d)) + 0.3
    a, b = rng.uniform(0.2, 1.0, n), rng.uniform(0.2, 1.0, m)
    a[2], b[m - 1] = 0.0, 0.0
    data = dict(x=x, y=y, a=mass_a * a / a.sum(), b=mass_b * b / b.sum(),
                vx=rng.normal(size=(n, d)), vy=rng.normal(size=(m, d)), wf=rng.normal(size=n),
                wg=rng.normal(size=m), vapply=rng.normal(size=m), u=rng.normal(size=n))
    return {k: v.astype(np.float32).astype(np.float64) for k, v in data.items()}


def _check(got: dict, ref: dict, a, b):
    sa, sb = a > 0, b > 0
    for key, val in got.items():
        mask = sa if key.endswith("_a") else sb if key.endswith("_b") else None
        assert _rel(val, ref[key], mask) < RTOL, (key, _rel(val, ref[key], mask))


def _torch_side(D, tau_a, tau_b, eps, with_apply) -> dict:
    T = lambda k: torch.tensor(D[k], dtype=torch.float32)
    kw = dict(epsilon=eps, tau_a=tau_a, tau_b=tau_b, **SOLVE)
    got = {}
    got["hvp_env_x"], info = torch_api.hvp(T("x"), T("y"), T("vx"), wrt="x", a=T("a"), b=T("b"), **kw)
    assert bool(info.cg_converged) and bool(info.solve_converged)
    x, y, a, b = (T(k).requires_grad_(True) for k in "xyab")
    out = torch_api.sinkhorn(x, y, a, b, **kw)  # one solve serves the rest
    (gy,) = torch.autograd.grad(out.reg_ot_cost, y, create_graph=True)  # double backward in y
    (got["hvp_env_y"],) = torch.autograd.grad((gy * T("vy")).sum(), y)
    sa = a.detach() > 0
    phi = torch.where(sa, T("wf") * torch.where(sa, out.f, 0.0), 0.0).sum() + (T("wg") * out.g)[b.detach() > 0].sum()
    grads = torch.autograd.grad(phi, (x, y, a, b), retain_graph=with_apply)
    got.update(zip(("pot_vjp_x", "pot_vjp_y", "pot_vjp_a", "pot_vjp_b"), grads))
    if with_apply:
        pv = out.apply(T("vapply"), axis=1)
        got["apply_value"] = pv
        grads = torch.autograd.grad((pv * T("u")).sum(), (x, y, a, b))
        got.update(zip(("apply_vjp_x", "apply_vjp_y", "apply_vjp_a", "apply_vjp_b"), grads))
    if not with_apply:
        got["div_hvp_env_x"], info = torch_api.hvp(T("x"), T("y"), T("vx"), wrt="x", a=T("a"), b=T("b"),
                                                   loss="sinkhorn_divergence", **kw)
        assert bool(info.cg_converged) and bool(info.solve_converged)
    return {k: v.detach().numpy() for k, v in got.items()}


def _jax_side(D, tau_a, tau_b, eps, with_apply) -> dict:
    J = lambda k: jnp.asarray(D[k], jnp.float32)
    kw = dict(epsilon=eps, tau_a=tau_a, tau_b=tau_b, **SOLVE)
    x, y, a, b = (J(k) for k in "xyab")
    got = {}
    got["hvp_env_y"], info = otj.hvp(x, y, J("vy"), wrt="y", a=a, b=b, **kw)
    assert bool(info.cg_converged) and bool(info.solve_converged)
    cost = lambda x: otj.sinkhorn(x, y, a, b, **kw).reg_ot_cost
    got["hvp_env_x"] = jax.jvp(jax.grad(cost), (x,), (J("vx"),))[1]

    def outputs(x, y, a, b):  # one solve: phi of the potentials and P v
        out = otj.sinkhorn(x, y, a, b, **kw)
        pf = jnp.where(a > 0, J("wf") * jnp.where(a > 0, out.f, 0.0), 0.0)
        phi = pf.sum() + jnp.where(b > 0, J("wg") * jnp.where(b > 0, out.g, 0.0), 0.0).sum()
        return phi, (out.apply(J("vapply"), axis=1) if with_apply else jnp.zeros(()))

    (_, pv), vjp = jax.vjp(outputs, x, y, a, b)
    got.update(zip(("pot_vjp_x", "pot_vjp_y", "pot_vjp_a", "pot_vjp_b"), vjp((jnp.ones(()), jnp.zeros_like(pv)))))
    if with_apply:
        got["apply_value"] = pv
        got.update(zip(("apply_vjp_x", "apply_vjp_y", "apply_vjp_a", "apply_vjp_b"),
                       vjp((jnp.zeros(()), J("u")))))
    else:
        div = lambda y: otj.sinkhorn_divergence(x, y, a, b, **kw)[0]
        got["div_hvp_env_y"] = jax.jvp(jax.grad(div), (y,), (J("vy"),))[1]
    return {k: np.asarray(v) for k, v in got.items()}


@pytest.mark.parametrize("case", list(CASES))
def test_relaxed_hvps_and_potential_vjps_match_ott(case):
    tau_a, tau_b, eps, n, m, d, mass_a, mass_b, seed, with_apply = CASES[case]
    D = _data(n, m, d, mass_a, mass_b, seed)
    quantities = ["hvp_env_x", "hvp_env_y", "pot_vjp"] + (["apply"] if with_apply else
                                                          ["div_hvp_env_x", "div_hvp_env_y"])
    ref = ott_reference(quantities, eps=eps, tau_a=tau_a, tau_b=tau_b, **D)
    _check(_torch_side(D, tau_a, tau_b, eps, with_apply), ref, D["a"], D["b"])
    _check(_jax_side(D, tau_a, tau_b, eps, with_apply), ref, D["a"], D["b"])


def test_relaxed_second_derivatives_in_the_weights_raise():
    D = _data(8, 7, 2, 1.0, 1.4, 13)
    kw = dict(epsilon=0.5, tau_b=0.8, max_iterations=30)
    x, y, a, b = (torch.tensor(D[k], dtype=torch.float32).requires_grad_(True) for k in "xyab")
    out = torch_api.sinkhorn(x, y, a, b, **kw)
    gx, ga = torch.autograd.grad(out.reg_ot_cost, (x, a), create_graph=True)
    with pytest.raises(NotImplementedError, match="in a or b"):
        torch.autograd.grad(ga.sum(), x)
    with pytest.raises(NotImplementedError, match="in a or b"):
        torch.autograd.grad((gx * gx).sum(), a)
    J = lambda k: jnp.asarray(D[k], jnp.float32)
    grad_a = jax.grad(lambda a: otj.sinkhorn(J("x"), J("y"), a, J("b"), **kw).reg_ot_cost)
    with pytest.raises(NotImplementedError, match="in a or b"):
        jax.jvp(grad_a, (J("a"),), (J("a"),))
