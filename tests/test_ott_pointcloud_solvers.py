"""OTT-JAX's own solver options and its Sinkhorn-divergence checks on ot_triton_jax.ott.PointCloud.

Each case runs one OTT call twice on the same float32 inputs, once with our geometry and once
with OTT-JAX 0.6.0's own ``ott.geometry.pointcloud.PointCloud``, and compares the results:
costs and potentials to 1e-5 of the largest cost entry (a few float32 roundings of the terms
g_j - C_ij; the two geometries sum in different orders; a 1e-4 relative error in the LSE fails),
gradients to 1e-4 of their largest entry, iteration counts and convergence flags exactly; NaN
never passes. Part (a): ``Sinkhorn`` with momentum (constant and adaptive),
Anderson acceleration, OTT's Gaussian initializer, parallel dual updates, kernel
mode and unbalanced problems; (b) gradients of one of these solves, implicit and unrolled; (c)
the cases of OTT's ``tests/tools/sinkhorn_divergence_test.py`` that take a point-cloud class,
with the class swapped. Tiny problems (Triton interpreter on CPU); everything jitted. Left out:
OTT's SortingInitializer (needs n = m and reads the dense ``cost_matrix``, kept from OTT).
"""

import numpy as np
import pytest

import jax

import ott  # noqa: F401  (a missing peer must fail, not skip)
from ott.geometry import pointcloud as ott_pointcloud
from ott.initializers.linear import initializers
from ott.problems.linear import linear_problem
from ott.solvers import linear
from ott.solvers.linear import acceleration, sinkhorn
from ott.tools import sinkhorn_divergence

from ot_triton_jax.ott import PointCloud
from test_ott_pointcloud import _shapes  # every shape a jaxpr (and the jaxprs inside) computes

OTT = ott_pointcloud.PointCloud
RTOL_VALUE, RTOL_GRAD = 1e-5, 1e-4


def assert_close(ours, ref, rtol=RTOL_VALUE, scale=0.0):
    """max |ours - ref| <= rtol * max(scale, max |ref| over finite entries), same shape, same
    infinite entries, no NaN anywhere. ``scale``: the largest cost entry where potentials are
    compared (f_i = -eps LSE_j((g_j - C_ij) / eps) rounds g_j - C_ij, not f_i)."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert not np.isnan(ours).any() and not np.isnan(ref).any(), (ours, ref)
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(ours), fin)
    np.testing.assert_array_equal(ours[~fin], ref[~fin])
    err, scale = np.max(np.abs(ours[fin] - ref[fin]), initial=0.0), max(scale, np.max(np.abs(ref[fin]), initial=0.0))
    assert err <= rtol * scale, f"error {err:.3g} vs {rtol:g} * scale {scale:.3g}"


def problem(seed, n=9, m=12, d=2, zeros=True):
    """Gaussian clouds (y shifted), non-uniform weights summing to 1, with a zero on each side."""
    k = jax.random.split(jax.random.key(seed), 4)
    x, y = jax.random.normal(k[0], (n, d)), jax.random.normal(k[1], (m, d)) + 0.4
    a, b = jax.random.uniform(k[2], (n,)) + 0.2, jax.random.uniform(k[3], (m,)) + 0.2
    a, b = (a.at[1].set(0.0), b.at[4].set(0.0)) if zeros else (a, b)
    return x, y, a / a.sum(), b / b.sum()


# ============================================================================ (a) solver options

# name -> (Sinkhorn kwargs, LinearProblem kwargs, epsilon)
OPTIONS = {
    "momentum": ({"momentum": acceleration.Momentum(value=1.3)}, {}, 0.5),
    "anderson": ({"anderson": acceleration.AndersonAcceleration(memory=3)}, {}, 0.5),
    "gaussian_init": ({"initializer": initializers.GaussianInitializer()}, {}, 0.5),
    # parallel updates need averaging (OTT's docstring); threshold 1e-3: they converge slowly
    "parallel": ({"parallel_dual_updates": True, "momentum": acceleration.Momentum(value=0.5),
                  "threshold": 1e-3}, {}, 1.0),
    # kernel mode (scalings) with Lehmann's adaptive momentum from iteration 20 on
    "kernel_adaptive_momentum": ({"lse_mode": False, "momentum": acceleration.Momentum(start=20, error_threshold=1.0)},
                                 {}, 0.3),
    "unbalanced": ({}, {"tau_a": 0.9, "tau_b": 0.8}, 0.5),
}


def _run(cls, x, y, a, b, solver_kw, prob_kw, eps):
    prob = linear_problem.LinearProblem(cls(x, y, epsilon=eps), a, b, **prob_kw)
    out = sinkhorn.Sinkhorn(**{"threshold": 1e-4, "inner_iterations": 5, **solver_kw})(prob)
    return out.reg_ot_cost, out.f, out.g, out.n_iters, out.converged, out.errors


def max_cost(*pairs):
    """The largest entry of the squared-Euclidean costs between the given pairs of clouds."""
    return max(float(np.max(np.sum((np.asarray(u)[:, None] - np.asarray(v)[None]) ** 2, -1))) for u, v in pairs)


def _compare_solves(ours, ref, cmax):
    """Both converged, same iteration count and error pattern; cost, f, g to 1e-5 of cmax."""
    cost, f, g, iters, conv, errors = ours
    r_cost, r_f, r_g, r_iters, r_conv, r_errors = ref
    assert bool(r_conv) and bool(conv) and int(iters) == int(r_iters) > 5
    np.testing.assert_array_equal(np.asarray(errors) > -1, np.asarray(r_errors) > -1)
    for o, r in ((cost, r_cost), (f, r_f), (g, r_g)):
        assert_close(o, r, scale=cmax)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_sinkhorn_options_match_ott(name):
    """The option's solve on our geometry: OTT's results, a zero weight giving -inf potentials,
    and nothing n x m in the traced program (the option runs on the streamed operations)."""
    solver_kw, prob_kw, eps = OPTIONS[name]
    x, y, a, b = problem(len(name))
    traced = jax.jit(lambda *args: _run(PointCloud, *args, solver_kw, prob_kw, eps)).trace(x, y, a, b)
    assert not {s for s in _shapes(traced.jaxpr.jaxpr, set()) if 9 in s and 12 in s}
    ours = traced.lower().compile()(x, y, a, b)
    ref = jax.jit(lambda *args: _run(OTT, *args, solver_kw, prob_kw, eps))(x, y, a, b)
    _compare_solves(ours, ref, max_cost((x, y)))
    assert np.isneginf(np.asarray(ours[1])[1]) and np.isneginf(np.asarray(ours[2])[4])


# ============================================================================ (b) gradients


@pytest.mark.parametrize("implicit", [True, False], ids=["implicit", "unrolled"])
def test_gradient_with_momentum_unbalanced_matches_ott(implicit):
    """jax.grad of reg_ot_cost in x for an unbalanced solve with momentum (no zero weights:
    OTT's gradient is NaN at a point of weight zero)."""
    x, y, a, b = problem(30, zeros=False)
    kw = {"momentum": acceleration.Momentum(value=1.2), "inner_iterations": 2}
    if not implicit:
        kw["implicit_diff"] = None

    def loss(cls):
        def reg_cost(x):
            prob = linear_problem.LinearProblem(cls(x, y, epsilon=1.0), a, b, tau_a=0.9, tau_b=0.8)
            out = sinkhorn.Sinkhorn(threshold=1e-3, **kw)(prob)
            return out.reg_ot_cost, out.n_iters
        return jax.jit(jax.value_and_grad(reg_cost, has_aux=True))

    ((c1, it1), g1), ((c2, it2), g2) = loss(PointCloud)(x), loss(OTT)(x)
    assert int(it1) == int(it2) > 2
    assert_close(c1, c2)
    assert_close(g1, g2, rtol=RTOL_GRAD)


# ============================================================================ (c) OTT's divergence tests


def uniform_problem(seed, n=13, m=17, d=3, zero=False):
    """OTT's test set-up: uniform clouds in the unit cube, random weights (a zero in a if asked)."""
    k = jax.random.split(jax.random.key(seed), 4)
    x, y = jax.random.uniform(k[0], (n, d)), jax.random.uniform(k[1], (m, d))
    a, b = jax.random.uniform(k[2], (n,)), jax.random.uniform(k[3], (m,))
    a = a.at[2].set(0.0) if zero else a
    return x, y, a / a.sum(), b / b.sum()


def _div(cls, x, y, **kw):
    """(divergence, output, the epsilons of the geometries), one jitted call."""
    def run(x, y):
        div, out = sinkhorn_divergence.sinkhorn_divergence(cls, x, y, **kw)
        return div, out, [g.epsilon for g in out.geoms if g is not None]
    return jax.jit(run)(x, y)


def _compare_divergences(ours, ref, iter_slack=0):
    """The divergence, the three pairs of potentials (to 1e-5 of the largest cost entry of the
    three geometries: the divergence is a difference of costs of that size), iteration counts,
    convergence flags (counts within ``iter_slack``); our output holds our geometries."""
    (d1, o1, _), (d2, o2, _) = ours, ref
    cmax = max_cost(*((g.x, g.y) for g in o2.geoms if g is not None))
    assert_close(d1, d2, scale=cmax)
    for pair1, pair2 in zip(o1.potentials, o2.potentials):
        for p1, p2 in zip(pair1, pair2):
            assert (p1 is None) == (p2 is None)
            if p2 is not None:
                assert_close(p1, p2, scale=cmax)
    assert all(abs(int(i) - int(j)) <= iter_slack for i, j in zip(o1.n_iters, o2.n_iters))
    assert [bool(c) for c in o1.converged] == [bool(c) for c in o2.converged]
    assert all(type(g) is PointCloud for g in o1.geoms if g is not None)


def test_divergence_point_cloud_matches_ott():
    """OTT's test_euclidean_point_cloud (squared Euclidean, full rank): positive, the symmetric
    terms need fewer iterations, equals the three separate solves, static_b with the (y, y) cost
    as offset gives the same value; with a zero weight in a."""
    x, y, a, b = uniform_problem(0, zero=True)
    kw = {"epsilon": 0.1, "a": a, "b": b}
    ours, ref = _div(PointCloud, x, y, **kw), _div(OTT, x, y, **kw)
    _compare_divergences(ours, ref)
    div, out, _ = ours
    it_xy, it_xx, it_yy = out.n_iters
    assert float(div) >= 0.0 and it_xx < it_xy and it_yy < it_xy

    def separate_and_static():
        c_xy, c_xx, c_yy = (linear.solve(PointCloud(u, v, epsilon=0.1), a=wu, b=wv).reg_ot_cost
                            for u, v, wu, wv in ((x, y, a, b), (x, x, a, a), (y, y, b, b)))
        static = sinkhorn_divergence.sinkhorn_divergence(PointCloud, x, y, static_b=True, offset_static_b=c_yy, **kw)
        return c_xy - 0.5 * (c_xx + c_yy), static

    separate, (static, out_static) = jax.jit(separate_and_static)()
    # OTT's tolerances: the separate solves use plain updates, the divergence symmetric ones
    np.testing.assert_allclose(float(div), float(separate), rtol=1e-5, atol=1e-5)
    assert out_static.geoms[2] is None and out_static.potentials[2] == (None, None)
    np.testing.assert_allclose(float(static), float(div), rtol=1e-5, atol=1e-5)


def test_divergence_with_itself_is_zero():
    """OTT's check: the divergence of a cloud to itself is ~0 at threshold 1e-5, and the
    symmetric updates need fewer iterations than the plain (x, y) solve. The iteration counts may
    differ by one (an error checked at every iteration): the marginal error near 1e-5 is known
    to ~1e-7 (potentials to ~1e-6 of the cost, times 1/epsilon = 10), so float32 rounding can
    move the crossing of the threshold by one iteration."""
    x, _, a, _ = uniform_problem(1)
    kw = {"a": a, "b": a, "epsilon": 0.1, "solve_kwargs": {"inner_iterations": 1, "threshold": 1e-5}}
    ours, ref = _div(PointCloud, x, x, **kw), _div(OTT, x, x, **kw)
    _compare_divergences(ours, ref, iter_slack=1)
    assert abs(float(ours[0])) <= 1e-5 and ours[1].n_iters[1] < ours[1].n_iters[0]


def test_divergence_not_sharing_epsilon():
    """OTT's autoepsilon check with share_epsilon=False: each term takes its own default epsilon
    (0.05 std of its cost entries, in closed form here), so the (x, y) and (x, x) ones differ."""
    x, y, a, b = uniform_problem(2)
    kw = {"a": a, "b": b, "share_epsilon": False, "solve_kwargs": {"threshold": 1e-2}}
    ours, ref = _div(PointCloud, x, y, **kw), _div(OTT, x, y, **kw)
    _compare_divergences(ours, ref)
    eps = np.asarray(ours[2])
    assert float(ours[0]) > 0.0 and abs(eps[0] - eps[1]) > 0
    assert_close(eps, ref[2])


def test_divergence_unbalanced_matches_ott():
    """OTT's unbalanced case: tau_a = 0.8, tau_b = 0.9, threshold 1e-2, unequal masses."""
    x, y, a, b = uniform_problem(3)
    kw = {"a": a + 0.001, "b": b + 0.002, "epsilon": 0.1,
          "solve_kwargs": {"threshold": 1e-2, "tau_a": 0.8, "tau_b": 0.9}}
    ours, ref = _div(PointCloud, x, y, **kw), _div(OTT, x, y, **kw)
    _compare_divergences(ours, ref)
    assert float(ours[0]) > 0.0


def test_divergence_anderson_default_epsilon():
    """OTT's test_euclidean_momentum_params (Anderson, memory 6, default epsilon: shared by the
    three terms, OTT's autoepsilon check): Anderson on the (x, y) solve, parallel updates with
    momentum 0.5 on the symmetric ones; every term ends under the threshold."""
    x, y, a, b = uniform_problem(4)
    kw = {"a": a, "b": b, "solve_kwargs": {"anderson": acceleration.AndersonAcceleration(memory=6),
                                           "threshold": 3.2e-3}}
    ours, ref = _div(PointCloud, x, y, **kw), _div(OTT, x, y, **kw)
    _compare_divergences(ours, ref)
    eps = np.asarray(ours[2])
    assert float(ours[0]) > 0.0 and all(bool(c) for c in ours[1].converged) and eps[0] == eps[1] == eps[2]
    assert_close(eps, ref[2])
    # OTT reads errors[-1], which is -1 (unused) unless the budget ran out: the last one computed
    assert all(np.asarray(e)[np.asarray(e) > -1][-1] < 3.2e-3 for e in ours[1].errors)


def test_divergence_gradient_matches_ott():
    """OTT's TestSinkhornDivergenceGrad: jax.grad in x at epsilon 1, threshold 0.05, against
    OTT's gradient (OTT's test checks a finite difference to 1e-2; this is the stronger check)."""
    x, y, a, b = uniform_problem(5, n=13, m=12)

    def loss(cls):
        return lambda x: sinkhorn_divergence.sinkhorn_divergence(
            cls, x, y, a=a, b=b, epsilon=1.0, solve_kwargs={"threshold": 0.05})[0]

    (v1, g1), (v2, g2) = (jax.jit(jax.value_and_grad(loss(cls)))(x) for cls in (PointCloud, OTT))
    assert_close(v1, v2, scale=max_cost((x, y), (x, x), (y, y)))  # a difference of costs
    assert_close(g1, g2, rtol=RTOL_GRAD)
