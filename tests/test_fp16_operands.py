"""FP16 cross-term operands (kernels/split.py split_scaled_kernel, launch_plans.fp16_operands).

The clouds are split into FP16 head and tail of (x - c) S, S a power of two per problem, rows
padded to a multiple of 8 columns, and the kernels undo S in the exponent. Checked here under the interpreter with the real
kernels: the split itself (S from the largest |x - c| of both clouds, exact reconstruction), the
half-step, the plan application and the weighted pass against float64, at coordinates from 1e-6 to
1e6 and with one far outlier, the looped path (d > 64), both frontends, and a whole solve."""

import math

import numpy as np
import pytest
import torch

import torch_api
from ot_triton_jax.core import launch_plans
from torch_api import kernel_ops as ko


def _clouds(n, m, d, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g) * scale, (torch.randn(m, d, generator=g) + 0.5) * scale


def _f64_lse(x, y, pot, eps, logw_in=None):
    C = ((x.double()[:, None] - y.double()[None]) ** 2).sum(-1)
    z = (pot.double()[None] - C) / eps
    if logw_in is not None:
        z = z + logw_in.double()[None]
    return -eps * torch.logsumexp(z, dim=1), C


def test_rule_and_split_layout():
    assert launch_plans.fp16_operands(3) and launch_plans.fp16_operands(64)
    assert launch_plans.kernel_precision("float32", 64) == "fp16x3"
    assert launch_plans.kernel_precision("tf32", 6) == "fp16"
    assert launch_plans.kernel_precision("tf32", 3) == launch_plans.kernel_precision("float32", 5) == "fp16p"
    x, y = _clouds(50, 33, 24, scale=3.0)
    X, Y = ko.clouds(x, y)
    assert X.hi.dtype == torch.float16 and X.lo.dtype == torch.float16 and X.scale.shape == (1,)
    xc, yc = X.x.double(), Y.x.double()
    amax = max(float(xc.abs().max()), float(yc.abs().max()))
    inv_s = 2.0 ** (math.floor(math.log2(amax)) - 14)  # largest |x - c| S in [2^14, 2^15)
    assert float(X.scale) == inv_s and float(Y.scale) == inv_s
    assert X.hi.shape == (50, 24) and launch_plans.operand_stride(24) == 24
    for C in (X, Y):
        xs = C.x.double() / inv_s
        assert float(xs.abs().max()) < 2.0 ** 15
        rebuilt = C.hi.double() + C.lo.double()
        # the tail keeps 11 bits down to FP16's smallest normal, 2^-24 absolute below
        assert float((rebuilt - xs).abs().max()) <= 2.0 ** -22 * float(xs.abs().max())
        assert torch.equal(C.sqnorm, (C.x * C.x).sum(1)) or torch.allclose(C.sqnorm.double(), (C.x.double() ** 2).sum(1),
                                                                           rtol=1e-6)
    # rows padded with zero columns to a multiple of 8: 16-byte aligned tile loads; packed rows of 16 for d <= 5
    assert [launch_plans.operand_stride(d) for d in (1, 3, 5, 6, 8, 17, 64)] == [16, 16, 16, 8, 8, 24, 64]
    X17, _ = ko.clouds(*_clouds(20, 30, 17, seed=10))
    assert X17.hi.shape == (20, 24) and X17.x.shape == (20, 17)
    assert not X17.hi[:, 17:].any() and not X17.lo[:, 17:].any()
    assert float((X17.hi[:, :17].double() + X17.lo[:, :17].double() - X17.x.double() / float(X17.scale)).abs().max()) \
        <= 2.0 ** -22 * float(X17.x.abs().max()) / float(X17.scale)
    X6, _ = ko.clouds(*_clouds(20, 20, 6))
    assert X6.hi.shape == (20, 8) and X6.hi.dtype == torch.float16 and not X6.hi[:, 6:].any()


@pytest.mark.parametrize("d", [1, 3, 5])
def test_packed_layout(d):
    """d <= 5: hi holds the rows layout [lo, hi, hi, 0...] and lo the columns layout [hi, lo, hi,
    0..., 1] of the same FP16 parts (16 columns), and rows . columns is the three-product sum."""
    x, y = _clouds(30, 20, d, scale=2.0, seed=d)
    X, Y = ko.clouds(x, y)
    assert X.hi.shape == (30, 16) and Y.lo.shape == (20, 16) and X.x.shape == (30, d)
    for C in (X, Y):
        lo, hi = C.hi[:, :d], C.hi[:, d:2 * d]
        assert torch.equal(C.hi[:, 2 * d:3 * d], hi)
        assert torch.equal(C.lo[:, :d], hi) and torch.equal(C.lo[:, d:2 * d], lo) and torch.equal(C.lo[:, 2 * d:3 * d], hi)
        assert not C.hi[:, 3 * d:].any() and not C.lo[:, 3 * d:15].any() and bool((C.lo[:, 15] == 1).all())
        xs = C.x.double() / float(C.scale)
        assert float((hi.double() + lo.double() - xs).abs().max()) <= 2.0 ** -22 * float(xs.abs().max())
    cross = X.hi.double() @ Y.lo.double().T * float(X.scale) * float(Y.scale)
    ref = X.x.double() @ Y.x.double().T
    assert float((cross - ref).abs().max()) <= 2.0 ** -20 * float(ref.abs().max())


def test_packed_half_step_both_precisions_float32_accurate():
    """At d <= 5 "tf32" runs the same one packed product as "float32": both float32-accurate,
    online and FOLD, against float64."""
    x, y = _clouds(48, 40, 3, seed=7)
    eps = 0.1
    X, Y = ko.clouds(x, y)
    pot = torch.randn(40, generator=torch.Generator().manual_seed(8)) * eps
    prm = ko.params(eps, 1.0, x.device)
    ref, C = _f64_lse(X.x, Y.x, pot, eps)
    for prec in ("float32", "tf32"):
        out, _ = ko.lse_update(X, Y, pot, prm, prec)
        assert float((out.double() - ref).abs().max()) < 2e-6 * float(C.max())
        folded, _ = ko.lse_update(X, Y, pot, prm, prec, pold=ref.float(), fold=True)
        assert float((folded.double() - ref).abs().max()) < 2e-6 * float(C.max())


@pytest.mark.parametrize("scale", [1e-6, 1.0, 1e6])
def test_half_step_float32_against_float64(scale):
    x, y = _clouds(48, 40, 24, scale=scale, seed=1)
    eps = 0.5 * scale ** 2
    X, Y = ko.clouds(x, y)
    pot = torch.randn(40, generator=torch.Generator().manual_seed(2)) * eps
    prm = ko.params(eps, 1.0, x.device)
    ref, _ = _f64_lse(x, y, pot, eps)
    out, _ = ko.lse_update(X, Y, pot, prm, "float32")
    # relative to the cost's scale (|x - y|^2 ~ 2 d scale^2): float32 rounding of the potentials
    assert float((out.double() - ref).abs().max()) < 2e-6 * 2 * 24 * scale ** 2
    tf, _ = ko.lse_update(X, Y, pot, prm, "tf32")  # one FP16 product: TF32's accuracy
    err_tf = float((tf.double() - ref).abs().max()) / (2 * 24 * scale ** 2)
    assert 1e-6 < err_tf < 3e-3


def test_outlier_does_not_overflow():
    """One point 1e4 away: S comes from it (all of both clouds, not a sample), nothing overflows,
    and the half-step's error stays at float32's rounding of the centred squared norms (which
    bounds the TF32 parts as well: they measured the same ratio, 2.9 at d = 12 against 3.1 here)."""
    x, y = _clouds(64, 40, 20, seed=3)
    x[17] = 1e4
    X, Y = ko.clouds(x, y)
    assert bool(torch.isfinite(X.hi.float()).all()) and bool(torch.isfinite(X.lo.float()).all())
    pot = torch.zeros(40)
    ref, _ = _f64_lse(x, y, pot, 0.5)
    out, _ = ko.lse_update(X, Y, pot, ko.params(0.5, 1.0, x.device), "float32")
    assert bool(torch.isfinite(out).all())
    ulps = 2.0 ** -24 * (X.sqnorm.double() + Y.sqnorm.double().max())
    assert float(((out.double() - ref).abs() / ulps).max()) < 8


@pytest.mark.parametrize("d", [19, 80])
def test_apply_and_weighted_against_float64(d):
    """P v (p = 3 on FMAs, p = d on the tensor cores), P 1 and the HVP's weighted pass, with
    potentials from the float64 half-step so that only the kernels' rounding shows."""
    x, y = _clouds(40, 36, d, seed=4)
    eps = 2.0 * d
    X, Y = ko.clouds(x, y)
    prm = ko.params(eps, 1.0, x.device)
    g = torch.zeros(36)
    f, C = _f64_lse(x, y, g, eps)
    P = torch.exp((f[:, None] + g.double()[None] - C) / eps)
    for v in (y[:, :3], y):
        pv, rs = ko.apply_plan(X, Y, f.float(), g, prm, "float32", v=v)
        ref = P @ v.double()
        assert float((pv.double() - ref).norm() / ref.norm()) < 2e-5
        assert float((rs.double() - P.sum(1)).abs().max()) < 2e-5
    w, wa, wb = x[:, :4], y[:, :4], y[:, :2]
    out = ko.apply_weighted(X, Y, f.float(), g, prm, "float32", w, wa, wb)
    ref = ((P * (w.double() @ wa.double().T)) @ wb.double())
    assert float((out.double() - ref).norm() / ref.norm()) < 2e-5


def test_jax_frontend_same_split_and_update():
    import jax.numpy as jnp

    from ot_triton_jax.jax_frontend import kernel_ops as jko

    x, y = _clouds(40, 30, 32, seed=5)
    Xt, Yt = ko.clouds(x, y)
    Xj, Yj = jko.clouds(jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
    assert Xj.hi.dtype == jnp.float16 and float(Xj.scale[0]) == float(Xt.scale)
    np.testing.assert_array_equal(np.asarray(Xj.hi), Xt.hi.numpy())
    np.testing.assert_array_equal(np.asarray(Yj.lo), Yt.lo.numpy())
    pot = torch.randn(30, generator=torch.Generator().manual_seed(6))
    out_t, _ = ko.lse_update(Xt, Yt, pot, ko.params(4.0, 1.0, x.device), "float32")
    out_j, _ = jko.lse_update(Xj, Yj, jnp.asarray(pot.numpy()), jko.make_params(4.0, 1.0), precision="float32")
    np.testing.assert_allclose(np.asarray(out_j), out_t.numpy(), rtol=0, atol=1e-6 * float(out_t.abs().max()))


def test_solve_at_d32_matches_float64():
    """torch_api.sinkhorn (default options) at d = 32 against float64 iterations to convergence."""
    from reference import sinkhorn_ott

    x, y = _clouds(40, 32, 32, seed=7)
    eps = 8.0
    out = torch_api.sinkhorn(x, y, epsilon=eps, threshold=1e-6, max_iterations=500)
    assert bool(out.converged)
    a, b = torch.full((40,), 1 / 40), torch.full((32,), 1 / 32)
    f_ref, g_ref, cost_ref = sinkhorn_ott(x.double(), y.double(), a, b, eps, tol=1e-13, iters=20000)
    c = f_ref.mean() - out.f.double().mean()
    assert float((out.f.double() + c - f_ref).norm() / f_ref.norm()) < 1e-5
    assert abs(float(out.reg_ot_cost) - float(cost_ref)) <= 1e-5 * abs(float(cost_ref))


def test_scale_covers_every_cloud_of_a_problem():
    """clouds(x, y, u, v) (the multiscale solve passes four): the centre comes from the first and
    last, but S from the largest |x - c| of all four; a far point in the second cloud sets it."""
    x, y = _clouds(30, 20, 16, seed=8)
    u, v = _clouds(12, 10, 16, seed=9)
    y[5] = 3000.0
    clouds = ko.clouds(x, y, u, v)
    amax = max(float(c.x.double().abs().max()) for c in clouds)
    inv_s = 2.0 ** (math.floor(math.log2(amax)) - 14)
    for c in clouds:
        assert float(c.scale) == inv_s
        assert bool(torch.isfinite(c.hi.float()).all()) and float(c.hi.float().abs().max()) < 2.0 ** 15


@pytest.fixture
def tf32_parts(monkeypatch):
    """The TF32 parts (the baseline the FP16 operands were measured against): FP16_MIN_D raised, and the
    cached plans and call descriptions dropped before and after."""
    from ot_triton_jax.core import kernel_calls

    def clear():
        launch_plans.clear_cache()
        for name in ("center", "absmax", "split_centered", "lse_update", "apply_plan", "apply_weighted"):
            getattr(kernel_calls, name).cache_clear()

    clear()
    monkeypatch.setattr(launch_plans, "FP16_MIN_D", 10 ** 9)
    yield
    monkeypatch.undo()
    clear()


def test_tf32_parts_baseline_still_float32_accurate(tf32_parts):
    x, y = _clouds(36, 28, 5, seed=11)
    X, Y = ko.clouds(x, y)
    assert X.hi.dtype == torch.float32 and X.scale is None and X.hi.shape == (36, 5)
    pot = torch.randn(28, generator=torch.Generator().manual_seed(12))
    ref, _ = _f64_lse(x, y, pot, 0.5)
    out, _ = ko.lse_update(X, Y, pot, ko.params(0.5, 1.0, x.device), "float32")
    assert float((out.double() - ref).abs().max() / ref.abs().max()) < 2e-6
