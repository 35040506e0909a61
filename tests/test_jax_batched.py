"""Many problems per call in JAX: ``jax.vmap(sinkhorn)`` folded into one packed loop,
``segment_sinkhorn`` (ragged clouds), and ``samples_loss`` on (B, N, D) batches or under
``jax.vmap`` (GeomLoss's annealed loop packed, jax_frontend/geomloss_packed.py), against loops
of single solves.

The folded loop (jax_frontend/batched_loop.py) packs the problems' clouds into one cloud per
side (one common centre and float16 split for the batch): each problem's numbers equal its
single solve to float32 rounding, not bit for bit (RTOL relative to the largest entry), its
iteration count and convergence flag exactly. Real kernels (Triton interpreter), small sizes,
non-uniform weights with zeros, n != m, fresh random inputs.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import ot_triton_jax as otj
from ot_triton_jax.jax_frontend import batched_loop

RTOL = 2e-5
SOLVE = dict(threshold=1e-3, inner_iterations=2, max_iterations=80)


def close(u, v, what="", rtol=RTOL):
    """|u - v| <= rtol max|v| on the finite entries, the same non-finite entries; NaN never passes."""
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    assert u.shape == v.shape, (what, u.shape, v.shape)
    assert not np.isnan(v).any() and not np.isnan(u).any(), what
    fin = np.isfinite(v)
    assert np.array_equal(fin, np.isfinite(u)) and np.array_equal(u[~fin], v[~fin]), what
    scale = max(np.abs(v[fin]).max(), 1e-30)
    err = np.abs(u[fin] - v[fin]).max()
    assert err <= rtol * scale, (what, float(err), float(scale))


def problems(batch, n, m, d, rng):
    """``batch`` problems of different spreads (different iteration counts), weights with zeros."""
    scale = np.linspace(0.5, 1.3, batch)[:, None, None]
    x = rng.standard_normal((batch, n, d)) * scale
    y = (rng.standard_normal((batch, m, d)) + 0.4) * scale
    a = rng.uniform(0.2, 1.0, (batch, n))
    b = rng.uniform(0.2, 1.0, (batch, m))
    a[:, 1], b[:, -1] = 0.0, 0.0
    a, b = a / a.sum(1, keepdims=True), b / b.sum(1, keepdims=True)
    return tuple(jnp.asarray(v, jnp.float32) for v in (x, y, a, b))


@pytest.fixture
def folds(monkeypatch):
    """How many times the packed loop was traced (the vmap rule folded the batch)."""
    calls = []
    real = batched_loop.batched_solve

    def counted(*args, **kw):
        calls.append(len(args[9].sizes))
        return real(*args, **kw)

    monkeypatch.setattr(batched_loop, "batched_solve", counted)
    return calls


def fields(x, y, a, b, **kw):
    out = otj.sinkhorn(x, y, a, b, epsilon=0.4, **SOLVE, **kw)
    return out.f, out.g, out.reg_ot_cost, out.errors, out.n_iters, out.converged


def check_problem(got, want, k, what):
    for name, u, v in zip(("f", "g", "cost", "errors"), got[:4], want[:4]):
        close(u[k], v, f"{what}[{k}].{name}")
    assert int(got[4][k]) == int(want[4]) and bool(got[5][k]) == bool(want[5]), (what, k, got[4], want[4])


@pytest.mark.parametrize("taus", [(1.0, 1.0), (0.9, 1.0)], ids=["balanced", "relaxed-a"])
def test_vmap_of_sinkhorn_is_one_packed_loop_equal_to_single_solves(folds, taus):
    rng = np.random.default_rng(11)
    x, y, a, b = problems(3, 13, 9, 3, rng)
    kw = dict(tau_a=taus[0], tau_b=taus[1])
    got = jax.jit(jax.vmap(lambda *v: fields(*v, **kw)))(x, y, a, b)
    assert folds == [3]
    single = jax.jit(lambda *v: fields(*v, **kw))
    for k in range(3):
        check_problem(got, single(x[k], y[k], a[k], b[k]), k, "vmap")
    assert len(set(np.asarray(got[4]).tolist())) > 1  # each problem stopped on its own error


def test_vmap_with_a_shared_cloud_and_an_invalid_problem(folds):
    rng = np.random.default_rng(12)
    x, y, a, b = problems(3, 8, 11, 2, rng)
    a = a.at[2, 0].set(-0.1)  # problem 2: a negative weight -> NaN outputs, no iteration (under jit)
    got = jax.jit(jax.vmap(fields, in_axes=(None, 0, 0, 0)))(x[0], y, a, b)
    assert folds == [3]
    single = jax.jit(fields)
    for k in range(2):
        check_problem(got, single(x[0], y[k], a[k], b[k]), k, "shared x")
    assert np.isnan(np.asarray(got[2][2])) and int(got[4][2]) == 0 and not bool(got[5][2])


def test_grad_and_hvp_under_vmap_equal_single_solves(folds):
    rng = np.random.default_rng(13)
    x, y, a, b = problems(2, 10, 7, 2, rng)
    vx = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def cost(x, y, a, b):
        return otj.sinkhorn(x, y, a, b, epsilon=0.5, threshold=1e-6, inner_iterations=5,
                            max_iterations=600).reg_ot_cost

    grad = jax.grad(cost, (0, 1))

    def hvp(x, y, a, b, v):
        return jax.jvp(lambda u: grad(u, y, a, b), (x,), (v,))[1]

    gx, gy = jax.jit(jax.vmap(grad))(x, y, a, b)
    hx, hy = jax.jit(jax.vmap(hvp))(x, y, a, b, vx)
    assert len(folds) >= 2  # the solves of both calls ran packed
    for k in range(2):
        wx, wy = jax.jit(grad)(x[k], y[k], a[k], b[k])
        close(gx[k], wx, f"grad x[{k}]"), close(gy[k], wy, f"grad y[{k}]")
        ux, uy = jax.jit(hvp)(x[k], y[k], a[k], b[k], vx[k])
        close(hx[k], ux, f"hvp x[{k}]", rtol=1e-4), close(hy[k], uy, f"hvp y[{k}]", rtol=1e-4)
        assert np.abs(np.asarray(ux)).max() > 1e-3


def test_segment_sinkhorn_ragged_costs_and_gradients(folds):
    rng = np.random.default_rng(14)
    sx, sy = [6, 1, 10], [5, 8, 1]  # a problem of one point on each side
    x = jnp.asarray(rng.standard_normal((sum(sx), 3)), jnp.float32)
    y = jnp.asarray(rng.standard_normal((sum(sy), 3)) + 0.3, jnp.float32)
    wx = rng.uniform(0.2, 1.0, sum(sx))
    wx[2] = 0.0
    wy = rng.uniform(0.2, 1.0, sum(sy))
    ox, oy = np.cumsum([0] + sx), np.cumsum([0] + sy)
    for k in range(3):  # equal masses per segment
        wy[oy[k]:oy[k + 1]] *= wx[ox[k]:ox[k + 1]].sum() / wy[oy[k]:oy[k + 1]].sum()
    wx, wy = jnp.asarray(wx, jnp.float32), jnp.asarray(wy, jnp.float32)
    ids_y = np.repeat(np.arange(3), sy)
    kw = dict(epsilon=0.5, threshold=1e-4, inner_iterations=2, max_iterations=300)

    def total(x, y, wx, wy):
        c = otj.segment_sinkhorn(x, y, num_per_segment_x=sx, segment_ids_y=ids_y, weights_x=wx, weights_y=wy,
                                 **kw)
        return jnp.sum(c * jnp.arange(1.0, 4.0)), c

    (_, cost), (gx, gy) = jax.value_and_grad(total, (0, 1), has_aux=True)(x, y, wx, wy)
    assert folds
    # ids in any order (OTT's default indices_are_sorted=False), padded to a fixed max_measure_size
    perm = np.random.default_rng(3).permutation(sum(sy))
    cost_p, gy_p = jax.value_and_grad(lambda y: jnp.sum(otj.segment_sinkhorn(
        x, y, num_per_segment_x=sx, segment_ids_y=ids_y[perm], weights_x=wx, weights_y=wy[perm],
        max_measure_size=12, **kw) * jnp.arange(1.0, 4.0)))(y[perm])
    close(cost_p, jnp.sum(cost * jnp.arange(1.0, 4.0)), "cost, unsorted ids"), close(gy_p, gy[perm], "grad y, unsorted")
    single = jax.jit(jax.value_and_grad(lambda *v: otj.sinkhorn(*v, **kw).reg_ot_cost, (0, 1)))
    for k in range(3):
        rx, ry = slice(ox[k], ox[k + 1]), slice(oy[k], oy[k + 1])
        c1, (gx1, gy1) = single(x[rx], y[ry], wx[rx], wy[ry])
        close(cost[k], c1, f"cost[{k}]")
        close(gx[rx], (k + 1) * gx1, f"grad x[{k}]"), close(gy[ry], (k + 1) * gy1, f"grad y[{k}]")


def test_segment_sinkhorn_bad_input():
    x, y = jnp.zeros((5, 2)), jnp.ones((4, 2))
    kw = dict(epsilon=0.5)
    with pytest.raises(ValueError, match="exactly one of num_per_segment_x and segment_ids_x"):
        otj.segment_sinkhorn(x, y, num_per_segment_y=[2, 2], **kw)
    with pytest.raises(ValueError, match="max_measure_size .2. must be at least the largest segment .3"):
        otj.segment_sinkhorn(x, y, segment_ids_x=[0, 1, 0, 1, 1], num_per_segment_y=[2, 2], max_measure_size=2, **kw)
    with pytest.raises(ValueError, match="segments of y hold 3 points"):
        otj.segment_sinkhorn(x, y, num_per_segment_x=[2, 3], num_per_segment_y=[2, 1], **kw)
    with pytest.raises(ValueError, match="different numbers of segments"):
        otj.segment_sinkhorn(x, y, num_per_segment_x=[2, 3], num_per_segment_y=[4], **kw)
    with pytest.raises(ValueError, match="segment 1: weights_x and weights_y must have the same total mass"):
        otj.segment_sinkhorn(x, y, num_per_segment_x=[2, 3], num_per_segment_y=[2, 2], weights_x=jnp.ones(5),
                             weights_y=jnp.ones(4), **kw)
    with pytest.raises(TypeError, match="must be concrete"):
        jax.jit(lambda ids: otj.segment_sinkhorn(x, y, segment_ids_x=ids, num_per_segment_y=[2, 2], **kw))(
            jnp.asarray([0, 0, 1, 1, 1]))


def test_vmap_of_sinkhorn_divergence_runs_its_self_terms_packed(monkeypatch):
    calls = []
    real = batched_loop.batched_symmetric

    def counted(*args, **kw):
        calls.append(len(args[6].sizes))
        return real(*args, **kw)

    monkeypatch.setattr(batched_loop, "batched_symmetric", counted)
    rng = np.random.default_rng(15)
    x, y, a, b = problems(3, 9, 12, 2, rng)

    def div(x, y, a, b):
        d, out = otj.sinkhorn_divergence(x, y, a, b, epsilon=0.4, **SOLVE)
        return d, out.n_iters

    got = jax.jit(jax.vmap(div))(x, y, a, b)
    assert calls == [3, 3]  # the (x, x) and (y, y) terms, each one packed loop
    grad = jax.jit(jax.vmap(jax.grad(lambda *v: div(*v)[0], (0, 1))))(x, y, a, b)
    vx = jnp.asarray(rng.standard_normal(x.shape), jnp.float32)

    def hvp(x, y, a, b, v):  # forward over reverse: the divergence's HVP in x
        return jax.jvp(lambda u: jax.grad(lambda u: div(u, y, a, b)[0])(u), (x,), (v,))[1]

    hess = jax.jit(jax.vmap(hvp))(x, y, a, b, vx)
    for k in range(3):
        want = jax.jit(div)(x[k], y[k], a[k], b[k])
        close(got[0][k], want[0], f"divergence[{k}]")
        assert [int(v[k]) for v in got[1]] == [int(v) for v in want[1]], (got[1], want[1])
        gx, gy = jax.jit(jax.grad(lambda *v: div(*v)[0], (0, 1)))(x[k], y[k], a[k], b[k])
        close(grad[0][k], gx, f"grad x[{k}]"), close(grad[1][k], gy, f"grad y[{k}]")
        hk = jax.jit(hvp)(x[k], y[k], a[k], b[k], vx[k])
        close(hess[k], hk, f"hvp x[{k}]", rtol=1e-4)
        assert float(jnp.abs(hk).max()) > 1e-3


# ----------------------------------------------------------------------------- GeomLoss (samples_loss)

GEOMLOSS = dict(blur=0.1, scaling=0.5, diameter=4.0)  # a given diameter: one schedule for every call


@pytest.fixture
def geomloss_folds(monkeypatch):
    """The batch sizes of the packed annealed loops traced (jax_frontend/geomloss_packed.py)."""
    from ot_triton_jax.jax_frontend import geomloss_packed
    calls = []
    real = geomloss_packed.packed_softmins

    def counted(*args, **kw):
        calls.append(len(args[4].sizes))
        return real(*args, **kw)

    monkeypatch.setattr(geomloss_packed, "packed_softmins", counted)
    return calls


def far_problems(rng, batch=3, n=20, m=13, d=3):
    """Problems far apart (offsets 0, 5, -3), non-uniform weights with zeros, equal masses."""
    off = np.asarray([0.0, 5.0, -3.0])[:batch, None, None]
    x = rng.standard_normal((batch, n, d)) * 0.5 + off
    y = rng.standard_normal((batch, m, d)) * 0.7 + 0.3 + off
    a, b = rng.uniform(0.2, 1.0, (batch, n)), rng.uniform(0.2, 1.0, (batch, m))
    a[:, 2], a[1, 7], b[:, 0], b[2, 5] = 0.0, 0.0, 0.0, 0.0
    a, b = a / a.sum(1, keepdims=True), b / b.sum(1, keepdims=True)
    return tuple(jnp.asarray(v, jnp.float32) for v in (x, y, a, b))


def test_samples_loss_batch_is_one_packed_loop_equal_to_single_calls(geomloss_folds):
    x, y, a, b = far_problems(np.random.default_rng(21))
    loss = lambda x, y, a, b: otj.samples_loss(x, y, a, b, **GEOMLOSS)  # noqa: E731
    pots = lambda x, y, a, b: otj.samples_loss(x, y, a, b, potentials=True, **GEOMLOSS)  # noqa: E731
    grad = jax.grad(lambda x, y, a, b: jnp.sum(loss(x, y, a, b)), (0, 1))
    got = jax.jit(loss)(x, y, a, b), jax.jit(pots)(x, y, a, b), jax.jit(grad)(x, y, a, b)
    assert geomloss_folds == [3, 3, 3]  # the (B, N, D) loss, potentials and gradient: one packed loop each
    single = jax.jit(loss), jax.jit(pots), jax.jit(jax.grad(loss, (0, 1)))
    for k in range(3):
        want = [f(x[k], y[k], a[k], b[k]) for f in single]
        close(got[0][k], want[0], f"loss[{k}]", rtol=1e-5)
        for i, name in enumerate(("F", "G")):
            close(got[1][i][k], want[1][i], f"potential {name}[{k}]", rtol=1e-5)
            close(got[2][i][k], want[2][i], f"grad {'xy'[i]}[{k}]", rtol=1e-5)
        assert float(want[0]) > 1e-3 and np.abs(np.asarray(want[2][0])).max() > 1e-3  # not a trivial problem
    # jax.vmap of the single loss (a given diameter: a shared schedule) folds too
    del geomloss_folds[:]
    vg = jax.jit(jax.vmap(jax.value_and_grad(loss, (0, 1))))(x, y, a, b)
    assert geomloss_folds == [3]
    for k in range(3):
        close(vg[0][k], got[0][k], f"vmap loss[{k}]", rtol=1e-5)
        close(vg[1][0][k], got[2][0][k], f"vmap grad x[{k}]", rtol=1e-5)
        close(vg[1][1][k], got[2][1][k], f"vmap grad y[{k}]", rtol=1e-5)
    # traced points and diameter=None: a device schedule per problem, so one loop per problem (traced only)
    del geomloss_folds[:]
    jax.make_jaxpr(jax.vmap(lambda x, y: otj.samples_loss(x, y, blur=0.1)))(x, y)
    assert geomloss_folds == []


def test_samples_loss_batch_with_reach_is_one_packed_loop(geomloss_folds):
    """Both marginals relaxed alike (reach): packed as well; unequal reaches stay per problem."""
    x, y, a, b = far_problems(np.random.default_rng(22))
    b = b * 1.3  # unequal masses: allowed with relaxed marginals
    loss = lambda x, y: otj.samples_loss(x, y, a, b, reach=0.7, **GEOMLOSS)  # noqa: E731
    grad = jax.grad(lambda x, y: jnp.sum(loss(x, y)), (0, 1))
    got = jax.jit(loss)(x, y), jax.jit(grad)(x, y)
    assert geomloss_folds == [3, 3]
    for k in range(3):
        one = lambda x, y: otj.samples_loss(x, y, a[k], b[k], reach=0.7, **GEOMLOSS)  # noqa: E731
        close(got[0][k], jax.jit(one)(x[k], y[k]), f"loss[{k}]", rtol=1e-5)
        want = jax.jit(jax.grad(one, (0, 1)))(x[k], y[k])
        close(got[1][0][k], want[0], f"grad x[{k}]", rtol=1e-5), close(got[1][1][k], want[1], f"grad y[{k}]", rtol=1e-5)
    del geomloss_folds[:]
    jax.make_jaxpr(lambda x, y: otj.samples_loss(x, y, a, b, reach_x=0.7, **GEOMLOSS))(x, y)
    assert geomloss_folds == []


def test_leading_batch_dimensions_are_the_vmapped_calls(folds):
    """sinkhorn, sinkhorn_divergence and hvp given x (B, n, d), y (B, m, d), a (B, n), b (B, m) are
    jax.vmap of the single call (one packed loop), each problem its single call's numbers."""
    rng = np.random.default_rng(17)
    x, y, a, b = problems(2, 10, 7, 2, rng)
    got = fields(x, y, a, b)
    assert folds == [2]
    single = jax.jit(fields)
    for k in range(2):
        check_problem(got, single(x[k], y[k], a[k], b[k]), k, "leading batch")
    kw = dict(epsilon=0.5, threshold=1e-6, max_iterations=600)
    div, _ = otj.sinkhorn_divergence(x, y, a, b, **kw)
    v = jnp.asarray(rng.standard_normal(y.shape), jnp.float32)
    h, info = otj.hvp(x, y, v, a=a, b=b, wrt="y", **kw)
    assert div.shape == (2,) and h.shape == y.shape and info.cg_iterations.shape == (2,)
    for k in range(2):
        close(div[k], otj.sinkhorn_divergence(x[k], y[k], a[k], b[k], **kw)[0], f"divergence[{k}]")
        close(h[k], otj.hvp(x[k], y[k], v[k], a=a[k], b=b[k], wrt="y", **kw)[0], f"hvp[{k}]", rtol=1e-4)
    with pytest.raises(ValueError, match="same B"):
        otj.sinkhorn(x, y[:1], epsilon=0.5)
    with pytest.raises(ValueError, match=r"b must be a \(2, 7\) array"):
        otj.sinkhorn(x, y, a, b[:, :6], epsilon=0.5)
    with pytest.raises(NotImplementedError, match="takes no init"):
        otj.sinkhorn(x, y, epsilon=0.5, init=(a, b))


def test_padding_problem_has_nothing_to_transport():
    """A problem of a batch whose a and b are all zero: reg_ot_cost 0, zero gradients, converged
    at the first measurement, as torch_api.sinkhorn_batch gives; the others are their single solves."""
    rng = np.random.default_rng(12)
    x, y, a, b = problems(3, 10, 7, 2, rng)
    a, b = a.at[2].set(0.0), b.at[2].set(0.0)
    kw = dict(epsilon=0.5, threshold=1e-5)
    out = otj.sinkhorn(x, y, a, b, **kw)
    gx, gy = jax.grad(lambda x, y: otj.sinkhorn(x, y, a, b, **kw).reg_ot_cost.sum(), argnums=(0, 1))(x, y)
    assert float(out.reg_ot_cost[2]) == 0.0 and bool(out.converged[2]) and int(out.n_iters[2]) == 10
    assert not np.asarray(gx[2]).any() and not np.asarray(gy[2]).any()
    assert np.isfinite(np.asarray(gx)).all() and np.isfinite(np.asarray(gy)).all()
    for k in range(2):
        ref = otj.sinkhorn(x[k], y[k], a[k], b[k], **kw)
        assert int(out.n_iters[k]) == int(ref.n_iters)
        close(out.reg_ot_cost[k], ref.reg_ot_cost, f"cost {k}")
    costs = otj.segment_sinkhorn(x.reshape(-1, 2), y.reshape(-1, 2), num_segments=3, num_per_segment_x=(10,) * 3,
                                 num_per_segment_y=(7,) * 3, weights_x=a.reshape(-1), weights_y=b.reshape(-1), **kw)
    assert float(costs[2]) == 0.0
    close(costs[:2], out.reg_ot_cost[:2], "segment costs")
