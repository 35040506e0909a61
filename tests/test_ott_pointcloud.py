"""ot_triton_jax.ott.PointCloud: OTT-JAX's solvers on the streaming kernels (CPU, Triton interpreter).

Every result is compared with OTT-JAX 0.6.0's own dense ``PointCloud`` on the same inputs (float32,
fresh random inputs per test): the geometry operations, their derivatives (``jax.grad``,
``jax.jvp``), OTT's Sinkhorn (implicit and unrolled differentiation, an HVP), its Sinkhorn
divergence and its segmented solves, plus a few of OTT's own Sinkhorn checks with the geometry
swapped. Tiny sizes; everything jitted so each kernel variant is traced once.
"""

import os
import subprocess
import sys

import numpy as np  # noqa: E402
import pytest  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ott  # noqa: E402,F401  (a missing peer must fail, not skip)
from ott.geometry import costs, segment  # noqa: E402
from ott.geometry import pointcloud as ott_pointcloud  # noqa: E402
from ott.problems.linear import linear_problem  # noqa: E402
from ott.solvers.linear import sinkhorn  # noqa: E402
from ott.tools import segment_sinkhorn, sinkhorn_divergence  # noqa: E402

from ot_triton_jax.ott import PointCloud  # noqa: E402

OTT = ott_pointcloud.PointCloud
RTOL = 1e-4


def assert_close(ours, ref, rtol=RTOL, floor=1e-6):
    """max |ours - ref| <= rtol * max |ref| (+ a float32 floor for quantities that are zero in
    exact arithmetic); same shape, same non-finite pattern, no NaN."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert not np.isnan(ours).any() and not np.isnan(ref).any()
    fin = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(ours), fin)
    np.testing.assert_array_equal(ours[~fin], ref[~fin])
    if fin.any():
        err = np.max(np.abs(ours[fin] - ref[fin]))
        scale = np.max(np.abs(ref[fin]))
        assert err <= rtol * scale + floor, f"error {err:.3g} vs scale {scale:.3g}"


def problem(seed, n=9, m=11, d=2, shift=0.3):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (n, d))
    y = jax.random.normal(k[1], (m, d)) + shift
    a = jax.random.uniform(k[2], (n,)) + 0.2
    b = jax.random.uniform(k[3], (m,)) + 0.2
    return x, y, a / a.sum(), b / b.sum()


def potentials(seed, n, m):
    """Potentials of a plan with entries <= 1 (as Sinkhorn's are): f, g = 0.2 * noise - 1."""
    k = jax.random.split(jax.random.key(seed), 2)
    return 0.2 * jax.random.normal(k[0], (n,)) - 1.0, 0.2 * jax.random.normal(k[1], (m,)) - 1.0


# ============================================================================ (a) the operations


def _ops(geom_cls, x, y, f, g, vec_n, vec_m, eps, scale_cost):
    """Every streamed operation on both axes, with and without a vector."""
    geom = geom_cls(x, y, epsilon=eps, scale_cost=scale_cost)
    out = {}
    for axis, vec in ((0, vec_n), (1, vec_m)):
        out[f"lse{axis}"] = geom.apply_lse_kernel(f, g, eps, axis=axis)[0]
        val, sign = geom.apply_lse_kernel(f, g, eps, vec=vec, axis=axis)
        out[f"lse_vec{axis}"], out[f"sign{axis}"] = val, sign
        out[f"kernel{axis}"] = geom.apply_kernel(jnp.abs(vec), eps, axis=axis)
        out[f"marginal{axis}"] = geom.marginal_from_potentials(f, g, axis=axis)
        out[f"apply{axis}"] = geom.apply_transport_from_potentials(f, g, vec, axis=axis)
        out[f"apply_batch{axis}"] = geom.apply_transport_from_potentials(f, g, jnp.stack([vec, vec ** 2]), axis=axis)
        u, v = jnp.exp(f / eps), jnp.exp(g / eps)
        out[f"scalings{axis}"] = geom.apply_transport_from_scalings(u, v, jnp.stack([vec, -vec]), axis=axis)
        out[f"cost{axis}"] = geom.apply_cost(vec[:, None], axis=axis)
    return out


def _inputs(seed, n=9, m=11):
    x, y, _, _ = problem(seed, n, m)
    f, g = potentials(seed + 1, n, m)
    # signed and varying across the clouds, so that P vec takes both signs (the weighted LSE's sign)
    vec_n = 2 * (x[:, 0] - jnp.mean(x[:, 0]))
    vec_m = 2 * (y[:, 0] - jnp.mean(y[:, 0]))
    return x, y, f, g, vec_n, vec_m


def test_operations_match_ott_both_axes():
    x, y, f, g, vec_n, vec_m = _inputs(0)
    eps = jnp.float32(0.7)
    ours = jax.jit(lambda *a: _ops(PointCloud, *a, 2.5))(x, y, f, g, vec_n, vec_m, eps)
    ref = jax.jit(lambda *a: _ops(OTT, *a, 2.5))(x, y, f, g, vec_n, vec_m, eps)
    assert set(ours) == set(ref)
    for name in ref:
        assert_close(ours[name], ref[name], floor=1e-6 if "sign" not in name else 0.0)
    # the weighted LSE saw both signs
    assert (np.asarray(ref["sign0"]) < 0).any() and (np.asarray(ref["sign0"]) > 0).any()


def test_infinite_potentials_pass_through():
    """f = -inf (a zero weight) gives OTT's -inf rows and zero plan rows."""
    x, y, f, g, vec_n, vec_m = _inputs(3)
    f, g = f.at[2].set(-jnp.inf), g.at[4].set(-jnp.inf)
    eps = 0.6
    geoms = [cls(x, y, epsilon=eps) for cls in (PointCloud, OTT)]
    for axis in (0, 1):
        outs = [jax.jit(lambda f, g, gm=gm: (gm.apply_lse_kernel(f, g, eps, axis=axis)[0],
                                              gm.marginal_from_potentials(f, g, axis=axis),
                                              gm.apply_transport_from_potentials(f, g, vec_n if axis == 0 else vec_m,
                                                                                 axis=axis)))(f, g)
                for gm in geoms]
        for o, r in zip(*outs):
            assert_close(o, r)
    assert np.isneginf(np.asarray(outs[1][0])).any()


def _loss(geom_cls, op, axis, scale_cost):
    """A scalar of one operation, differentiable in x, y, f, g, vec and eps."""
    w_out = jax.random.normal(jax.random.key(8), (9 if axis == 1 else 11,))

    def loss(x, y, f, g, vec, eps):
        geom = geom_cls(x, y, epsilon=eps, scale_cost=scale_cost)
        if op == "lse":
            out = geom.apply_lse_kernel(f, g, eps, axis=axis)[0]
        elif op == "lse_vec":
            out = geom.apply_lse_kernel(f, g, eps, vec=vec, axis=axis)[0]
        elif op == "kernel":
            out = geom.apply_kernel(jnp.abs(vec) + 0.1, eps, axis=axis)
        elif op == "marginal":
            out = geom.marginal_from_potentials(f, g, axis=axis)
        else:
            out = geom.apply_transport_from_potentials(f, g, vec, axis=axis)
        return jnp.sum(jnp.sin(out) * w_out)

    return loss


@pytest.mark.parametrize("op", ["lse", "lse_vec", "kernel", "marginal", "apply"])
def test_derivatives_match_ott(op):
    """jax.grad in (x, y, f, g, vec, eps) and jax.jvp along a random direction, both axes,
    a numeric scale_cost, against OTT's dense geometry (its autodiff through the n x m matrix)."""
    x, y, f, g, vec_n, vec_m = _inputs(10 + len(op))
    eps = jnp.float32(0.8)
    for axis, vec in ((0, vec_n), (1, vec_m)):
        args = (x, y, f, g, vec, eps)
        tangents = tuple(jax.random.normal(jax.random.key(20 + i), jnp.shape(a)) for i, a in enumerate(args))
        results = []
        for cls in (PointCloud, OTT):
            loss = _loss(cls, op, axis, 1.5)
            grads = jax.jit(jax.grad(loss, argnums=tuple(range(6))))(*args)
            tan = jax.jit(lambda *a: jax.jvp(loss, a, tangents)[1])(*args)
            results.append((grads, tan))
        (g_ours, t_ours), (g_ref, t_ref) = results
        for go, gr in zip(g_ours, g_ref):
            assert_close(go, gr)
        assert_close(t_ours, t_ref)


def test_scale_cost_options_and_errors():
    x, y, f, g, _, vec_m = _inputs(30)
    eps = 0.9
    for option in ("mean", "max_cost", "median", "max_norm", "max_bound"):
        ours, ref = PointCloud(x, y, epsilon=eps, scale_cost=option), OTT(x, y, epsilon=eps, scale_cost=option)
        assert_close(ours.inv_scale_cost, ref.inv_scale_cost)
        assert_close(ours.apply_lse_kernel(f, g, eps, axis=1)[0], ref.apply_lse_kernel(f, g, eps, axis=1)[0])
    # "mean" depends on x: its derivative flows through the streamed operation

    def loss(cls):
        return lambda x: jnp.sum(cls(x, y, epsilon=eps, scale_cost="mean").apply_lse_kernel(f, g, eps, axis=1)[0] ** 2)

    assert_close(jax.jit(jax.grad(loss(PointCloud)))(x), jax.jit(jax.grad(loss(OTT)))(x))
    # the default epsilon (0.05 std of the cost) and the cost summaries, without the n x m matrix
    ours, ref = PointCloud(x, y, scale_cost=2.0), OTT(x, y, scale_cost=2.0)
    assert_close(ours.epsilon, ref.epsilon)
    assert_close(ours.std_cost_matrix, ref.std_cost_matrix)
    assert_close(ours.mean_cost_matrix, ref.mean_cost_matrix)
    with pytest.raises(ValueError, match="scale_cost"):
        PointCloud(x, y, scale_cost="std")
    with pytest.raises(ValueError, match="cost_fn"):
        PointCloud(x, y, cost_fn=costs.Euclidean())
    with pytest.raises(ValueError, match="precision"):
        PointCloud(x, y, precision="fp8")


def test_pytree_and_vmap():
    x, y, f, g, _, _ = _inputs(40)
    geom = PointCloud(x, y, epsilon=0.5, scale_cost=2.0, precision="float32")
    leaves, tree = jax.tree_util.tree_flatten(geom)
    back = jax.tree_util.tree_unflatten(tree, leaves)
    assert type(back) is PointCloud and back._precision == "float32" and back._scale_cost == 2.0
    assert_close(back.x, x)
    # a geometry through jit, and a batch of geometries through vmap
    xs = jnp.stack([x, 1.2 * x])
    def run(cls):
        return jax.jit(jax.vmap(lambda x: cls(x, y, epsilon=0.5).apply_lse_kernel(f, g, 0.5, axis=1)[0]))(xs)

    assert_close(run(PointCloud), run(OTT))


def test_import_without_ott_says_how_to_install():
    code = ("import sys; sys.modules['ott'] = None\n"
            "import ot_triton_jax\n"
            "try:\n    import ot_triton_jax.ott\nexcept ImportError as e:\n    print('ERR', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "ERR" in out.stdout and "pip install ott-jax" in out.stdout


# ============================================================================ (b) OTT's Sinkhorn


def _solve(cls, y, a, b, eps, **kw):
    def reg_cost(x):
        out = sinkhorn.Sinkhorn(threshold=1e-3, **kw)(linear_problem.LinearProblem(cls(x, y, epsilon=eps), a, b))
        return out.reg_ot_cost, (out.f, out.g, out.n_iters)

    return reg_cost


@pytest.mark.parametrize("implicit", [True, False], ids=["implicit", "unrolled"])
def test_sinkhorn_and_gradients_match_ott(implicit):
    """f, g, reg_ot_cost, the iteration count, jax.grad in x and one HVP (jax.jvp of jax.grad)."""
    x, y, a, b = problem(50)
    # unrolled: fewer iterations (a measure every 2) to differentiate twice
    kw = {} if implicit else {"implicit_diff": None, "inner_iterations": 2}
    eps = 1.0 if implicit else 2.0
    t = jax.random.normal(jax.random.key(51), x.shape)
    results = []
    for cls in (PointCloud, OTT):
        value_and_grad = jax.value_and_grad(_solve(cls, y, a, b, eps, **kw), has_aux=True)
        # one program: the solve, its gradient (primal of the JVP) and the HVP (its tangent)
        ((cost, (f, g, iters)), grad), (_, hvp) = jax.jit(lambda x, t: jax.jvp(value_and_grad, (x,), (t,)))(x, t)
        results.append((cost, f, g, iters, grad, hvp))
    ours, ref = results
    assert int(ours[3]) == int(ref[3]) > 1
    for o, r in zip(ours[:3] + ours[4:], ref[:3] + ref[4:]):
        assert_close(o, r)


def _shapes(jaxpr, acc):
    """The shapes of every value a jaxpr (and the jaxprs inside it) computes."""
    for eqn in jaxpr.eqns:
        acc.update(tuple(getattr(v.aval, "shape", ())) for v in eqn.outvars)
        for p in eqn.params.values():
            for q in (p if isinstance(p, (list, tuple)) else [p]):
                inner = getattr(q, "jaxpr", q)
                if hasattr(inner, "eqns"):
                    _shapes(inner, acc)
    return acc


def test_solve_and_derivatives_form_no_n_by_m_array():
    """The traced Sinkhorn solve, its gradient (implicit and unrolled) and its HVP hold nothing
    of n x m (OTT's dense geometry does: the check can fail)."""
    n, m = 9, 11
    x, y, a, b = problem(55, n, m)
    t = jnp.ones_like(x)

    def nm_shapes(cls, **kw):
        fn = lambda x: _solve(cls, y, a, b, 1.0, **kw)(x)[0]  # noqa: E731
        found = set()
        for g in (fn, jax.grad(fn), lambda x: jax.jvp(jax.grad(fn), (x,), (t,))[1]):
            found |= {s for s in _shapes(jax.make_jaxpr(g)(x).jaxpr, set()) if n in s and m in s}
        return found

    assert nm_shapes(PointCloud) == set() and nm_shapes(PointCloud, implicit_diff=None) == set()
    assert (n, m) in nm_shapes(OTT)


# ============================================================================ (c, d) OTT's tools


def test_sinkhorn_divergence_matches_ott():
    x, y, a, b = problem(70)

    def div(cls):
        return lambda x: sinkhorn_divergence.sinkhorn_divergence(
            cls, x, y, a=a, b=b, epsilon=0.5, solve_kwargs={"threshold": 1e-3})[0]

    vals = [jax.jit(jax.value_and_grad(div(cls)))(x) for cls in (PointCloud, OTT)]
    assert_close(vals[0][0], vals[1][0])
    assert_close(vals[0][1], vals[1][1])


def test_segment_sinkhorn_via_vmap():
    """``segment_sinkhorn`` builds OTT's own PointCloud; the same segmented solve on the kernels is a
    ``jax.vmap`` of a solve with our geometry over ``segment_point_cloud``'s padded segments."""
    k = jax.random.split(jax.random.key(80), 2)
    x, y = jax.random.normal(k[0], (11, 2)), jax.random.normal(k[1], (13, 2)) + 0.2
    nx, ny = (5, 6), (6, 7)
    ref = segment_sinkhorn.segment_sinkhorn(x, y, num_per_segment_x=nx, num_per_segment_y=ny, epsilon=2.0,
                                            sinkhorn_kwargs={"threshold": 1e-3, "inner_iterations": 4})
    pad = costs.SqEuclidean._padder(2)
    xs, wa, _ = segment.segment_point_cloud(x, num_per_segment=nx, padding_vector=pad)
    ys, wb, _ = segment.segment_point_cloud(y, num_per_segment=ny, padding_vector=pad)

    def one(x, y, a, b):
        prob = linear_problem.LinearProblem(PointCloud(x, y, epsilon=2.0), a, b)
        return sinkhorn.Sinkhorn(threshold=1e-3, inner_iterations=4)(prob).reg_ot_cost

    ours = jax.jit(jax.vmap(one))(xs, ys, wa, wb)
    assert ours.shape == (2,)
    assert_close(ours, ref)


# ============================================================================ (e) OTT's own checks, geometry swapped


@pytest.mark.parametrize("lse_mode", [True, False], ids=["lse", "kernel"])
def test_zero_weights_converge_like_ott(lse_mode):
    """Uniform clouds in the unit square with a zero weight on each side: the solve stops under
    its threshold, with OTT's potentials (-inf where the weight is zero) and OTT's costs."""
    k = jax.random.split(jax.random.key(90), 4)
    x, y = jax.random.uniform(k[0], (10, 2)), jax.random.uniform(k[1], (12, 2))
    a = jax.random.uniform(k[2], (10,)).at[0].set(0.0)
    b = jax.random.uniform(k[3], (12,)).at[3].set(0.0)
    a, b = a / a.sum(), b / b.sum()

    def run(cls):
        prob = linear_problem.LinearProblem(cls(x, y, epsilon=0.1), a, b)
        out = sinkhorn.Sinkhorn(threshold=1e-3, lse_mode=lse_mode, inner_iterations=5)(prob)
        return out.errors, out.f, out.g, out.reg_ot_cost, out.primal_cost

    ours, ref = jax.jit(lambda: run(PointCloud))(), jax.jit(lambda: run(OTT))()
    errors = np.asarray(ours[0])
    assert errors[errors > -1][-1] < 1e-3
    np.testing.assert_array_equal(np.asarray(ours[0]) > -1, np.asarray(ref[0]) > -1)
    for o, r in zip(ours[1:], ref[1:]):
        assert_close(o, r, rtol=1e-4 if lse_mode else 1e-3)  # scalings lose digits at eps = 0.1
    if lse_mode:
        assert np.isneginf(np.asarray(ours[1])[0]) and np.isneginf(np.asarray(ours[2])[3])


def test_relative_epsilon_scales_with_the_cloud():
    """With epsilon relative to the standard deviation of the cost, scaling both clouds by c
    scales epsilon and the potentials by c^2 (squared cost), as with OTT's own geometry; the
    default epsilon (0.05 of that deviation) is OTT's."""
    x, y, a, b = problem(100, 8, 10)
    c = 2.5

    def f_of(x, y):
        geom = PointCloud(x, y, epsilon=0.5, relative_epsilon="std")
        out = sinkhorn.Sinkhorn(threshold=1e-3)(linear_problem.LinearProblem(geom, a, b))
        return geom.epsilon, out.f

    (eps1, f1), (eps2, f2) = jax.jit(f_of)(x, y), jax.jit(f_of)(c * x, c * y)
    assert_close(eps2, c ** 2 * eps1)
    assert_close(f2, c ** 2 * f1, rtol=1e-3)
    assert_close(eps1, OTT(x, y, epsilon=0.5, relative_epsilon="std").epsilon)
    assert_close(PointCloud(x, y).epsilon, OTT(x, y).epsilon)


def test_warm_start_converges_at_once():
    """Restarting from the potentials of a converged solve meets the threshold at the first check."""
    x, y, a, b = problem(110)
    solver = sinkhorn.Sinkhorn(threshold=1e-3, inner_iterations=1)
    prob = linear_problem.LinearProblem(PointCloud(x, y, epsilon=0.5), a, b)
    first = jax.jit(lambda: solver(prob))()
    again = jax.jit(lambda: solver(prob, init=(first.f, first.g)))()
    e1, e2 = np.asarray(first.errors), np.asarray(again.errors)
    assert e1[e1 > -1][-1] < 1e-3 and (e1 > -1).sum() > 1
    assert (e2 > -1).sum() == 1 and e2[0] < 1e-3
