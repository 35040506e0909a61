"""OTT-JAX's Gromov–Wasserstein solver with ot_triton_jax.ott.PointCloud geometries (CPU).

What OTT-JAX 0.6.0's ``GromovWasserstein`` asks of a point-cloud geometry:

* ``GromovWasserstein.__call__`` first calls ``QuadraticProblem.to_low_rank()`` (squared-Euclidean
  point clouds count as low-rank convertible): ``PointCloud.to_LRCGeometry()`` returns OTT's
  ``LRCGeometry`` built from x and y when n m > (n + m) d, else the point cloud itself.
* The linearizations (the first from ``QuadraticInitializer``, the next ones from
  ``QuadraticProblem.update_linearization``; 0.6.0 has no ``init_linearization``) call, on
  geom_xx and geom_yy, ``apply_square_cost(marginal, axis=1)`` (a non-linear ``fn``: the dense
  cost matrix) and ``apply_cost(arr, axis=1, fn=h, is_linear=True)`` (OTT's squared-Euclidean
  factorisation, ``arr`` a vector or the plan), and on geom_xy ``cost_matrix`` (n x m). The
  geometry's ``inv_scale_cost`` enters all three (ours: the closed-form ``"mean"``).
* The linear problem it builds holds a dense ``ott.geometry.geometry.Geometry``: the inner
  Sinkhorn solves never call the point cloud's streamed operations.

So every case compares OTT's solver on our geometries with the same solve on OTT's
``PointCloud``: d = 6 keeps the point clouds (n m <= (n + m) d for 9 x 9, 11 x 11 and 9 x 11), so
the linearization reads our geometry; d = 2 is the usual low-rank conversion. ``scale_cost="mean"``
routes the cost scale through our closed form. Float32, tiny sizes, everything jitted.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import ott  # noqa: F401  (a missing peer must fail, not skip)
from ott.geometry import geometry, low_rank
from ott.geometry import pointcloud as ott_pointcloud
from ott.initializers.quadratic import initializers as quad_initializers
from ott.problems.quadratic import quadratic_problem
from ott.solvers.linear import sinkhorn
from ott.solvers.quadratic import gromov_wasserstein

from ot_triton_jax.ott import PointCloud

OTT = ott_pointcloud.PointCloud
RTOL = 1e-4
EPS = 0.5
FUSED = 0.7


def assert_close(ours, ref, rtol=RTOL, floor=1e-6, what=""):
    """max |ours - ref| <= rtol * max |ref| + floor; same shape, all finite."""
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, (ours.shape, ref.shape)
    assert np.isfinite(ours).all() and np.isfinite(ref).all()
    err, scale = np.max(np.abs(ours - ref)), np.max(np.abs(ref))
    assert err <= rtol * scale + floor, f"{what}: error {err:.3g} vs scale {scale:.3g}"


def problem(seed, d, n=9, m=11):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (n, d))
    y = 1.3 * jax.random.normal(k[1], (m, d)) + 0.3
    a = jax.random.uniform(k[2], (n,)) + 0.2
    b = jax.random.uniform(k[3], (m,)) + 0.2
    return x, y, a / a.sum(), b / b.sum()


def quad_problem(cls, x, y, a, b, prob_scale_cost=None):
    """Fused GW: geom_xx on x, geom_yy on y, the linear term on (x, y); geometries at
    scale_cost="mean" unless the problem sets the scale (then the geometries start at 1)."""
    sc = "mean" if prob_scale_cost is None else 1.0
    return quadratic_problem.QuadraticProblem(
        cls(x, scale_cost=sc), cls(y, scale_cost=sc), cls(x, y, scale_cost=sc), fused_penalty=FUSED,
        scale_cost=prob_scale_cost, a=a, b=b)


def solver():
    # fixed iteration counts (inner and outer) so both solves run the same steps
    lin = sinkhorn.Sinkhorn(min_iterations=100, max_iterations=100)
    return gromov_wasserstein.GromovWasserstein(lin, epsilon=EPS, min_iterations=3, max_iterations=3)


def gw_solve(cls, x, y, a, b):
    out = solver()(quad_problem(cls, x, y, a, b))
    lin = out.linear_state
    return {"f": lin.f, "g": lin.g, "reg_gw_cost": out.reg_gw_cost, "matrix": out.matrix,
            "costs": out.costs, "lin_cost": out.geom.cost_matrix}


# ============================================================================ (a) the fused GW solve


@pytest.mark.parametrize("d", [6, 2])
def test_fused_gw_solve_matches_ott(d):
    x, y, a, b = problem(d, d)
    prob = quad_problem(PointCloud, x, y, a, b).to_low_rank()
    # the path OTT's solver takes: our point clouds (d = 6) or OTT's low-rank factors (d = 2)
    kinds = (PointCloud,) if d == 6 else (low_rank.LRCGeometry,)
    assert all(type(g) in kinds for g in (prob.geom_xx, prob.geom_yy, prob.geom_xy))

    ours = jax.jit(lambda *arr: gw_solve(PointCloud, *arr))(x, y, a, b)
    ref = jax.jit(lambda *arr: gw_solve(OTT, *arr))(x, y, a, b)
    assert np.all(np.asarray(ref["costs"]) != -1)  # three outer iterations ran
    for key in ref:
        assert_close(ours[key], ref[key], what=key)
    # a real coupling: marginals a, b (balanced problem, converged inner solve)
    np.testing.assert_allclose(ours["matrix"].sum(1), a, atol=1e-4)
    np.testing.assert_allclose(ours["matrix"].sum(0), b, atol=1e-4)


# ============================================================================ (b) one linearization


def linearizations(cls, x, y, a, b, transport):
    """The initial linear problem and the update from ``transport``, with the problem-level
    scale_cost (set_scale_cost rebuilds our geometry through its pytree)."""
    prob = quad_problem(cls, x, y, a, b, prob_scale_cost="mean")
    assert type(prob.geom_xx) is cls and type(prob.geom_xy) is cls
    init = quad_initializers.QuadraticInitializer()(prob, epsilon=EPS)
    upd = prob.update_linearization(transport, EPS, old_transport_mass=1.0)
    return init, upd


def test_linearization_step_matches_ott():
    x, y, a, b = problem(1, 6)
    # one shared transport: OTT's Sinkhorn on OTT's initial linearization
    init_ref = quad_initializers.QuadraticInitializer()(quad_problem(OTT, x, y, a, b, "mean"), epsilon=EPS)
    transport = jax.jit(sinkhorn.Sinkhorn())(init_ref)

    def step(cls):
        def run(x, y, a, b, transport):
            init, upd = linearizations(cls, x, y, a, b, transport)
            assert type(init.geom) is geometry.Geometry and type(upd.geom) is geometry.Geometry  # dense
            return {"init": init.geom.cost_matrix, "upd": upd.geom.cost_matrix, "a": upd.a, "b": upd.b,
                    "eps": upd.geom.epsilon, "init_eps": init.geom.epsilon}
        return jax.jit(run)(x, y, a, b, transport)

    ours, ref = step(PointCloud), step(OTT)
    for key in ref:
        assert_close(ours[key], ref[key], what=key)

    # and both equal the formula (squared loss, dense float64 numpy):
    # L = (Cxx^2 p) 1^T + 1 (Cyy^2 q)^T - 2 Cxx P Cyy + fused * Cxy, scale_cost "mean" on each
    X, Y, P = (np.asarray(v, np.float64) for v in (x, y, transport.matrix))

    def cost(u, v):
        c = ((u[:, None, :] - v[None, :, :]) ** 2).sum(-1)
        return c / c.mean()

    cxx, cyy, cxy = cost(X, X), cost(Y, Y), cost(X, Y)
    p, q = P.sum(1), P.sum(0)
    upd = (cxx ** 2 @ p)[:, None] + (cyy ** 2 @ q)[None, :] - 2 * cxx @ P @ cyy + FUSED * cxy
    A, B = np.asarray(a, np.float64), np.asarray(b, np.float64)
    init = (cxx ** 2 @ A)[:, None] + (cyy ** 2 @ B)[None, :] - 2 * np.outer(cxx @ A, cyy @ B) + FUSED * cxy
    assert_close(ours["upd"], upd)
    assert_close(ours["init"], init)


# ============================================================================ (c) a gradient in x


def test_gw_cost_gradient_in_x_matches_ott():
    # OTT 0.6.0 differentiates the regularized GW cost of the last linearization: the outer loop's
    # transport enters under stop_gradient, the final linearization is rebuilt from the
    # differentiable geometries, and its Sinkhorn cost carries the gradient (implicit
    # differentiation, the default). d = 6 only: at d = 2 the geometries become OTT's LRCGeometry
    # before any of ours is read (test (a) covers that path)
    x, y, a, b = problem(16, 6)

    def grad(cls):
        return jax.jit(jax.grad(lambda x: gw_solve(cls, x, y, a, b)["reg_gw_cost"]))(x)

    ours, ref = grad(PointCloud), grad(OTT)
    assert np.abs(np.asarray(ref)).max() > 1e-3  # a non-trivial gradient
    assert_close(ours, ref)
