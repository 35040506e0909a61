"""ot_triton_jax.sinkhorn_divergence vs OTT-JAX 0.6.0 and ot_triton_jax.samples_loss vs
torch_api.SamplesLoss (itself tested against GeomLoss) and a float64 dense GeomLoss loop.

CPU: callback backend, Triton interpreter. Fresh random inputs; relative errors; NaN never passes.
"""

import numpy as np
import pytest
import torch

import jax
import jax.numpy as jnp

import ot_triton_jax as otj
from ot_triton_jax.core.schedules import epsilon_schedule
from reference import away_from_threshold

import ott  # noqa: F401  (CI installs ott-jax; a missing peer must fail, not skip)
from ott.geometry import pointcloud  # noqa: E402
from ott.tools import sinkhorn_divergence as ott_sd  # noqa: E402


def rel(u, v) -> float:
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    if u.shape != v.shape or np.isnan(u).any() or not np.isfinite(v).all():
        return float("inf")
    den = np.linalg.norm(v)
    return float(np.linalg.norm(u - v) / den) if den > 0 else float(np.linalg.norm(u))


def problem(n, m, d, seed=None, shift=0.5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, d)).astype(np.float32)
    y = (rng.standard_normal((m, d)) + shift).astype(np.float32)
    a = rng.uniform(0.2, 1.0, n).astype(np.float32)
    b = rng.uniform(0.2, 1.0, m).astype(np.float32)
    return tuple(jnp.asarray(v) for v in (x, y, a / a.sum(), b / b.sum()))


SOLVE = dict(threshold=1e-4, inner_iterations=5, max_iterations=400)


def ott_div(x, y, a, b, eps, **kw):
    return ott_sd.sinkhorn_divergence(pointcloud.PointCloud, x, y, a=a, b=b, epsilon=eps,
                                      solve_kwargs=SOLVE, **kw)


@pytest.mark.parametrize("kw", [dict(), dict(symmetric_sinkhorn=False),
                                dict(static_b=True, offset_static_b=0.3)])
def test_sinkhorn_divergence_matches_ott(kw):
    eps = 1.0

    def ours(x, y, a, b, eps):
        return otj.sinkhorn_divergence(x, y, a, b, epsilon=eps, **SOLVE, **kw)

    def theirs(x, y, a, b, eps):
        return ott_div(x, y, a, b, eps, **kw)

    theirs_vg = jax.jit(jax.value_and_grad(theirs, argnums=(0, 1, 2, 3, 4), has_aux=True))
    for _ in range(10):  # fresh problems until OTT's stopping blocks are not decided by float32 noise
        x, y, a, b = problem(30, 25, 3)
        (dr, ref), gr = theirs_vg(x, y, a, b, eps)
        if away_from_threshold(ref.errors, SOLVE["threshold"]):
            break
    else:
        pytest.fail("no problem with errors clear of the threshold in 10 draws")
    (d, out), g = jax.value_and_grad(ours, argnums=(0, 1, 2, 3, 4), has_aux=True)(x, y, a, b, eps)
    assert rel(d, dr) < 1e-5
    for k in range(3 if not kw.get("static_b") else 2):
        assert int(out.n_iters[k]) == int(ref.n_iters[k])
        assert bool(out.converged[k]) and bool(ref.converged[k])
    assert rel(out.potentials[0][0], ref.potentials[0][0]) < 1e-5
    if kw.get("symmetric_sinkhorn", True):  # symmetric solves: same iterates as OTT
        assert rel(out.potentials[1][0], ref.potentials[1][0]) < 1e-5
    for name, u, v in zip("x y a b".split(), g, gr):
        assert rel(u, v) < 1e-5, name
    # d/deps is a difference of three O(1) terms (float32 cancellation): 5e-5
    assert rel(g[4], gr[4]) < 5e-5


def test_sinkhorn_divergence_jit_and_properties():
    x, y, a, b = problem(20, 20, 2)
    traces = []

    @jax.jit
    def div(x, y, eps):
        traces.append(1)
        return otj.sinkhorn_divergence(x, y, a, b, epsilon=eps, **SOLVE)[0]

    v1, v2 = div(x, y, 0.4), div(x, y, 0.8)
    assert len(traces) == 1 and abs(float(v1) - float(v2)) > 1e-4
    assert rel(v1, otj.sinkhorn_divergence(x, y, a, b, epsilon=0.4, **SOLVE)[0]) < 1e-6
    # S(x, x) = 0 and S > 0 for different measures
    same, _ = otj.sinkhorn_divergence(x, x, a, a, epsilon=0.4, **SOLVE)
    assert abs(float(same)) < 1e-5 and float(v1) > 1e-3


# ----------------------------------------------------------------------------- samples_loss


def dense_geomloss(x, y, a, b, blur, scaling, debias=True):
    """GeomLoss's sinkhorn loop (p=2, tensorized) in float64, for the value and potentials."""
    x, y, a, b = (torch.from_numpy(np.asarray(v, np.float64)) for v in (x, y, a, b))
    C = lambda u, v: ((u[:, None] - v[None]) ** 2).sum(-1) / 2  # noqa: E731
    Cxy, Cyx, Cxx, Cyy = C(x, y), C(y, x), C(x, x), C(y, y)
    la, lb = a.log(), b.log()
    pts = torch.cat([x, y])
    diam = float((pts.max(0).values - pts.min(0).values).norm())
    eps_list = epsilon_schedule(2, diam, blur, scaling)

    def sm(eps, Cm, h):
        return -eps * torch.logsumexp(h[None, :] - Cm / eps, 1)

    e = eps_list[0]
    f_ba, g_ab = sm(e, Cxy, lb), sm(e, Cyx, la)
    f_aa, g_bb = sm(e, Cxx, la), sm(e, Cyy, lb)
    for e in eps_list:
        ft, gt = sm(e, Cxy, lb + g_ab / e), sm(e, Cyx, la + f_ba / e)
        fa, gb = sm(e, Cxx, la + f_aa / e), sm(e, Cyy, lb + g_bb / e)
        f_ba, g_ab, f_aa, g_bb = (f_ba + ft) / 2, (g_ab + gt) / 2, (f_aa + fa) / 2, (g_bb + gb) / 2
    e = eps_list[-1]
    f_ba, g_ab, f_aa, g_bb = (sm(e, Cxy, lb + g_ab / e), sm(e, Cyx, la + f_ba / e),
                              sm(e, Cxx, la + f_aa / e), sm(e, Cyy, lb + g_bb / e))
    F, G = (f_ba - f_aa, g_ab - g_bb) if debias else (f_ba, g_ab)
    return float((a * F).sum() + (b * G).sum()), F.numpy(), G.numpy()


@pytest.mark.parametrize("debias", [True, False])
def test_samples_loss_matches_float64_geomloss_loop(debias):
    x, y, a, b = problem(28, 22, 3)
    val = otj.samples_loss(x, y, a, b, blur=0.1, scaling=0.6, debias=debias)
    F, G = otj.samples_loss(x, y, a, b, blur=0.1, scaling=0.6, debias=debias, potentials=True)
    v64, F64, G64 = dense_geomloss(x, y, a, b, 0.1, 0.6, debias)
    assert rel(val, v64) < 1e-5
    assert rel(F, F64) < 1e-4 and rel(G, G64) < 1e-4


def test_samples_loss_agrees_with_torch_samples_loss():
    import torch_api

    x, y, a, b = problem(30, 25, 3)
    kw = dict(blur=0.1, scaling=0.5)
    val = otj.samples_loss(x, y, a, b, **kw)
    g = jax.grad(lambda *z: otj.samples_loss(*z, **kw), argnums=(0, 1, 2, 3))(x, y, a, b)
    tx, ty, ta, tb = (torch.from_numpy(np.array(v)).requires_grad_(True) for v in (x, y, a, b))
    tval = torch_api.SamplesLoss(**kw)(ta, tx, tb, ty)
    gt = torch.autograd.grad(tval, (tx, ty, ta, tb))
    # value to 1e-6; the gradients (x_i - (P y)_i style differences of potentials-driven
    # plans, and F, G) carry the float32 input-preparation differences of the two
    # frontends (centring, log, |x|^2: see test_jax_sinkhorn), measured ~3e-6 and once
    # 1.04e-5 (the a, b gradients are the potentials, which drift along the neutral
    # shift (F + c, G - c) of GeomLoss's symmetric updates): 3e-5
    assert rel(val, tval.detach().numpy()) < 1e-6
    for u, v in zip(g, gt):
        assert rel(u, v.numpy()) < 3e-5


def test_samples_loss_gradient_rule_and_jit_schedule():
    x, y, a, b = problem(24, 18, 2)
    kw = dict(blur=0.2, scaling=0.5)
    F, G = otj.samples_loss(x, y, a, b, potentials=True, **kw)
    gx, ga = jax.grad(lambda x, a: otj.samples_loss(x, y, a, b, **kw), argnums=(0, 1))(x, a)
    assert rel(ga, F) < 1e-6  # grad_a = F (GeomLoss detaches a inside F)
    # grad_x = a_i * dF_i/dx_i: the VJP of F with cotangent a
    _, vjp = jax.vjp(lambda x: otj.samples_loss(x, y, a, b, potentials=True, **kw)[0], x)
    assert rel(vjp(a)[0], gx) < 1e-6
    # under jit with traced points the schedule is built on the device: same result, no retrace
    traces = []

    @jax.jit
    def loss(x, y):
        traces.append(1)
        return otj.samples_loss(x, y, a, b, **kw)

    assert rel(loss(x, y), otj.samples_loss(x, y, a, b, **kw)) < 1e-6
    loss(x * 1.5, y)  # larger diameter: longer schedule, same trace
    assert len(traces) == 1


def test_samples_loss_batch():
    x, y, a, b = problem(16, 12, 2)
    x2, y2, a2, b2 = problem(16, 12, 2)
    xb, yb, ab, bb = (jnp.stack(p) for p in ((x, x2), (y, y2), (a, a2), (b, b2)))
    kw = dict(blur=0.2, diameter=6.0)  # one shared schedule
    vals = otj.samples_loss(xb, yb, ab, bb, **kw)
    assert vals.shape == (2,)
    assert rel(vals[0], otj.samples_loss(x, y, a, b, **kw)) < 1e-6
    assert rel(vals[1], otj.samples_loss(x2, y2, a2, b2, **kw)) < 1e-6
    F, G = otj.samples_loss(xb, yb, ab[..., None], bb[..., None], potentials=True, **kw)
    assert F.shape == (2, 16) and G.shape == (2, 12)


def test_samples_loss_traced_bad_values_give_nan():
    x, y, a, b = problem(10, 8, 2)
    loss = jax.jit(lambda x, a: otj.samples_loss(x, y, a, b, blur=0.3))
    assert np.isfinite(float(loss(x, a)))
    for xx, aa in [(x.at[0, 0].set(jnp.nan), a), (x, 2.0 * a), (x, a.at[0].set(-a[0])), (x, 0.0 * a)]:
        assert np.isnan(float(loss(xx, aa)))
    F, G = jax.jit(lambda a: otj.samples_loss(x, y, a, b, blur=0.3, potentials=True))(2.0 * a)
    assert np.isnan(np.asarray(F)).all() and np.isnan(np.asarray(G)).all()


def test_samples_loss_bad_input():
    x, y, a, b = problem(10, 8, 2)
    cases = [
        (dict(loss="energy"), NotImplementedError, "loss='energy'"),
        (dict(p=1), NotImplementedError, "p=1"),
        (dict(reach=0.0), ValueError, "reach must be a positive finite float"),
        (dict(cluster_scale=0.1), ValueError, "cluster_scale=0.1 only has a meaning with backend='multiscale'"),
        (dict(tol=1e-3), ValueError, "tol=0.001 only has a meaning with backend='multiscale'"),
        (dict(blur=-1.0), ValueError, "blur"),
        (dict(scaling=1.5), ValueError, "scaling"),
        (dict(b=b * 3), ValueError, "same total mass"),
        (dict(a=jnp.ones(3)), ValueError, "a must have shape"),
        (dict(y=jnp.ones((8, 3))), ValueError, "same dimension"),
        (dict(x=x.at[0, 0].set(jnp.inf)), ValueError, "x contains NaN or Inf"),
    ]
    for change, exc, msg in cases:
        kw = {**dict(x=x, y=y, a=a, b=b), **change}
        with pytest.raises(exc, match=msg):
            otj.samples_loss(kw.pop("x"), kw.pop("y"), kw.pop("a"), kw.pop("b"), **kw)
    # GeomLoss backend names are accepted and mean "auto"
    v = otj.samples_loss(x, y, a, b, backend="tensorized")
    assert rel(v, otj.samples_loss(x, y, a, b)) < 1e-7
    with pytest.raises(ValueError, match="offset_static_b"):
        otj.sinkhorn_divergence(x, y, a, b, epsilon=0.5, offset_static_b=1.0)


def test_the_balance_check_sums_on_the_device_to_float64_accuracy():
    """The eager mass check (jax_frontend.checks: float32 sums of 64 entries on the device, float64
    on the host) against numpy's float64 sums: within 4e-6 relative for a long row, per row for a
    batch, a length not a multiple of 64; and 5e-6 apart in mass passes, 3e-5 raises."""
    from ot_triton_jax.jax_frontend.checks import READER, check_balanced
    rng = np.random.default_rng(3)
    w = rng.random(200_003).astype(np.float32)
    got = READER.rows_sum(jnp.asarray(w))
    assert len(got) == 1 and abs(got[0] - w.astype(np.float64).sum()) <= 4e-6 * w.astype(np.float64).sum()
    batch = rng.random((3, 1000)).astype(np.float32)
    np.testing.assert_allclose(READER.rows_sum(jnp.asarray(batch)), batch.astype(np.float64).sum(-1), rtol=4e-6)
    a = rng.random(5000).astype(np.float32)
    a /= a.sum()
    check_balanced(jnp.asarray(a), jnp.asarray(a * np.float32(1 + 5e-6)))
    with pytest.raises(ValueError, match="same total mass"):
        check_balanced(jnp.asarray(a), jnp.asarray(a * np.float32(1 + 3e-5)))
