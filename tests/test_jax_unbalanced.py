"""ot_triton_jax.sinkhorn / sinkhorn_divergence with OTT's KL-relaxed marginals (tau_a, tau_b < 1)
against OTT-JAX 0.6.0 in float64 (tests/ott_reference.py, one subprocess per test case).

The JAX frontend of the rules tests/test_torch_unbalanced.py checks on the PyTorch one (same
problems, same references): damped updates, OTT's relaxed error and reg_ot_cost, its first
derivatives (envelope in x, y; partials at fixed potentials in a, b), unequal masses, n != m,
non-uniform weights with zeros, OTT's TestSinkhornUnbalanced stopping case; under ``jax.jit``
the taus are static, and bad values raise naming the argument.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import ot_triton_jax as otj
from ott_reference import ott_reference
from test_torch_unbalanced import CASES, DIV, EPS_SCALE_CASE, TIGHT, _data, _rel, eps_scale_partials


def _jnp(*ts):
    return tuple(jnp.asarray(t.numpy()) for t in ts)


@pytest.mark.parametrize("case", ["a-relaxed-0.5", "both-0.99-0.5"])
def test_relaxed_solve_and_cost_gradients_match_ott(case):
    tau_a, tau_b, eps, spec = CASES[case]
    xt, yt, at, bt = _data(**spec)
    x, y, a, b = _jnp(xt, yt, at, bt)

    @jax.jit
    def run(x, y, a, b):
        def cost(x, y, a, b):
            out = otj.sinkhorn(x, y, a, b, epsilon=eps, tau_a=tau_a, tau_b=tau_b, **TIGHT)
            return out.reg_ot_cost, out
        (_, out), grads = jax.value_and_grad(cost, argnums=(0, 1, 2, 3), has_aux=True)(x, y, a, b)
        return out, grads

    out, (gx, gy, ga, gb) = run(x, y, a, b)
    assert bool(out.converged)
    ref = ott_reference(["f", "g", "cost", "grad_x", "grad_y", "grad_a", "grad_b"], x=xt, y=yt, a=at, b=bt,
                        eps=eps, tau_a=tau_a, tau_b=tau_b, use_danskin=1)
    pa, pb = np.asarray(a) > 0, np.asarray(b) > 0
    assert np.isinf(np.asarray(out.f)[~pa]).all() and np.isinf(np.asarray(out.g)[~pb]).all()
    errs = {"f": _rel(out.f, ref["f"], pa), "g": _rel(out.g, ref["g"], pb), "cost": _rel(out.reg_ot_cost, ref["cost"]),
            "grad_x": _rel(gx, ref["grad_x"]), "grad_y": _rel(gy, ref["grad_y"]),
            "grad_a": _rel(ga, ref["grad_a"], pa), "grad_b": _rel(gb, ref["grad_b"], pb)}
    assert max(errs.values()) <= 1e-5, errs
    assert not np.asarray(gx)[~pa].any() and not np.asarray(gy)[~pb].any()


def test_ott_sinkhorn_unbalanced_case_stops_where_ott_stops():
    """OTT's TestSinkhornUnbalanced.test_sinkhorn_unbalanced (test_torch_unbalanced's twin)."""
    tau_a, tau_b = 0.8, 0.9
    xt, yt, at, bt = _data(17, 23, 3, seed=5, zeros=False, uniform=True)
    out = otj.sinkhorn(*_jnp(xt, yt, at, bt), epsilon=0.1, threshold=1e-3, tau_a=tau_a, tau_b=tau_b)
    errors = np.asarray(out.errors)
    errors = errors[errors > -1]
    assert bool(out.converged) and 0.0 < float(errors[-1]) < 1e-3
    ref = ott_reference(["cost", "f"], x=xt, y=yt, a=at, b=bt, eps=0.1, tau_a=tau_a, tau_b=tau_b, threshold=1e-3)
    assert int(out.n_iters) == int(ref["n_iters"])
    assert _rel(out.reg_ot_cost, ref["cost"]) <= 1e-5 and _rel(out.f, ref["f"]) <= 1e-5


def test_eps_and_scale_cost_gradients_are_otts_partials():
    """test_torch_unbalanced's twin: d reg_ot_cost / d (epsilon, scale_cost) for tau < 1 under jax.jit."""
    tau_a, tau_b, eps, scale, spec = EPS_SCALE_CASE
    xt, yt, at, bt = _data(**spec)
    x, y, a, b = _jnp(xt, yt, at, bt)

    def cost(e, s):
        return otj.sinkhorn(x, y, a, b, epsilon=e, scale_cost=s, tau_a=tau_a, tau_b=tau_b, **TIGHT).reg_ot_cost

    ge, gs = jax.jit(jax.grad(cost, argnums=(0, 1)))(jnp.float32(eps), jnp.float32(scale))
    ref = ott_reference(["f", "g", "cost"], x=xt, y=yt, a=at, b=bt, eps=eps, scale_cost=scale, tau_a=tau_a,
                        tau_b=tau_b, use_danskin=1)
    want_e, want_s = eps_scale_partials(ref, xt, yt, at, bt, eps, scale, tau_a, tau_b)
    assert _rel(ge, want_e) <= 1e-5 and _rel(gs, want_s) <= 1e-5, (float(ge), want_e, float(gs), want_s)


def test_divergence_matches_ott():
    """OTT's sinkhorn_divergence with tau_a != tau_b: two-potential self terms (f != g), the mass
    term 0.5 eps (sum a - sum b)^2, gradients in x and y."""
    tau_a, tau_b = 0.9, 0.5
    xt, yt, at, bt = _data(15, 11, 2, seed=6, mass_a=1.2, mass_b=0.8)
    x, y, a, b = _jnp(xt, yt, at, bt)

    def div(x, y):
        return otj.sinkhorn_divergence(x, y, a, b, epsilon=1.0, tau_a=tau_a, tau_b=tau_b, **DIV)[0]

    val, (gx, gy) = jax.value_and_grad(div, argnums=(0, 1))(x, y)
    ref = ott_reference(["div", "div_grad_x", "div_grad_y"], x=xt, y=yt, a=at, b=bt, eps=1.0, tau_a=tau_a,
                        tau_b=tau_b, use_danskin=1)
    errs = {"div": _rel(val, ref["div"]), "x": _rel(gx, ref["div_grad_x"]), "y": _rel(gy, ref["div_grad_y"])}
    assert max(errs.values()) <= 1e-5, errs


def test_bad_tau_raises_naming_the_argument():
    x, y, a, b = _jnp(*_data(6, 5, 2, seed=7, zeros=False))
    for name in ("tau_a", "tau_b"):
        for bad, err in ((0.0, ValueError), (1.5, ValueError), (float("nan"), ValueError), ("0.5", TypeError)):
            with pytest.raises(err, match=name):
                otj.sinkhorn(x, y, a, b, epsilon=0.5, **{name: bad})
        with pytest.raises(TypeError, match=name):  # a traced tau: it selects the update rule
            jax.jit(lambda t: otj.sinkhorn(x, y, a, b, epsilon=0.5, **{name: t}).reg_ot_cost)(0.5)
    with pytest.raises(ValueError, match="mass"):  # strict marginals still need equal masses
        otj.sinkhorn(x, y, a, 2.0 * b, epsilon=0.5)
