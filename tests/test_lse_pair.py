"""The symmetric update from one sweep (kernels/lse_pair.py; kernel_calls.lse_pair / lse_self).

Under the interpreter with the real kernels, against float64 softmins: the fused sweep with
several row groups, column groups and row blocks per group (the column partials added up across
a program's row blocks), unequal sizes, zero weights, the finishing kernel's online fallback
(potentials far from the fixed point, as at the first steps of an eps-schedule), the resident
path (16 < d <= 64), the two-half-step modes ("fold", "online") that the plan falls back to
(d > 64) or that an A/B run picks, and the JAX frontend on the same descriptions."""

import numpy as np
import pytest
import torch

from ot_triton_jax.core import kernel_calls, pair_plans
from torch_api import kernel_ops as ko


def _softmin64(x, y, g, logw, eps, s=0.5):
    """-eps LSE_j((g_j - s|x_i - y_j|^2)/eps + logw_j), float64."""
    C = s * torch.cdist(x.double(), y.double(), compute_mode="donot_use_mm_for_euclid_dist") ** 2
    return -eps * torch.logsumexp((g.double()[None] - C) / eps + logw.double()[None], dim=1)


def _problem(n, m, d, seed, zero_weight=True):
    gen = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=gen), torch.randn(m, d, generator=gen) + 0.3
    a, b = torch.rand(n, generator=gen) + 0.1, torch.rand(m, generator=gen) + 0.1
    if zero_weight:
        a[3] = 0.0
    a, b = a / a.sum(), b / b.sum()
    la = torch.where(a > 0, a.clamp_min(1e-30).log(), -torch.inf)
    return x, y, la, b.log()


def _near_fixed_point(X, Y, la, lb, eps):
    """(f, g) one symmetric step from zero: close to what the sweeps see after the first eps."""
    f = _softmin64(X.x, Y.x, torch.zeros(Y.n), lb, eps).float()
    g = _softmin64(Y.x, X.x, torch.zeros(X.n), la, eps).float()
    return f, g


def _rel(out, ref):
    assert torch.isfinite(out).all()
    return float((out.double() - ref).abs().max() / ref.abs().max())


@pytest.fixture
def pair_mode(monkeypatch):
    def set_mode(mode, self_mode="online"):
        monkeypatch.setattr(pair_plans, "PAIR_MODE", mode)
        monkeypatch.setattr(pair_plans, "SELF_MODE", self_mode)
        kernel_calls.lse_pair.cache_clear()
        kernel_calls.lse_self.cache_clear()
    yield set_mode
    kernel_calls.lse_pair.cache_clear()
    kernel_calls.lse_self.cache_clear()


@pytest.mark.parametrize("n,m,d,precision", [(100, 70, 3, "float32"), (70, 100, 2, "tf32"), (80, 40, 20, "float32")])
def test_pair_matches_float64(n, m, d, precision):
    x, y, la, lb = _problem(n, m, d, seed=n + d)
    X, Y = ko.clouds(x, y)
    eps = 0.3
    f, g = _near_fixed_point(X, Y, la, lb, eps)
    seq = kernel_calls.lse_pair(n, m, d, precision, False)
    assert pair_plans.pair_mode(n, m, d, precision) == "fused"
    assert [c.kernel for c in seq.calls] == [kernel_calls.pair_prep_kernel, kernel_calls.lse_pair_kernel,
                                             kernel_calls.lse_pair_finish_kernel, kernel_calls.lse_pair_finish_kernel]
    plan = seq.calls[1].plan
    assert plan.grid[1] == 2 and plan.constexprs["GROUP_ROWS"] == 2  # column groups, row blocks per group
    assert plan.grid[0] == -(-n // (2 * plan.constexprs["BLOCK_M"]))
    fo, go = ko.lse_pair(X, Y, f, g, la, lb, ko.params(eps, 0.5, "cpu"), precision)
    tol = 2e-6 if precision == "float32" else 5e-3
    assert _rel(fo, _softmin64(X.x, Y.x, g, lb, eps)) < tol
    assert _rel(go, _softmin64(Y.x, X.x, f, la, eps)) < tol


@pytest.mark.parametrize("offset", [60.0, -60.0])
def test_pair_fallback_when_shift_is_far(offset):
    """f off by 60 / eps ~ 290 in log2 units: every fixed-shift sum leaves [2^-60, 2^100] and both
    finishing launches redo their rows with the online max; exact all the same."""
    x, y, la, lb = _problem(60, 50, 3, seed=7)
    X, Y = ko.clouds(x, y)
    eps = 0.3
    f, g = _near_fixed_point(X, Y, la, lb, eps)
    f = f + offset
    fo, go = ko.lse_pair(X, Y, f, g, la, lb, ko.params(eps, 0.5, "cpu"), "float32")
    assert _rel(fo, _softmin64(X.x, Y.x, g, lb, eps)) < 2e-6
    assert _rel(go, _softmin64(Y.x, X.x, f, la, eps)) < 2e-6


def test_pair_from_zero_potentials_at_small_eps():
    """The first sweep of a schedule at a small eps: zero potentials, sums far out of range."""
    x, y, la, lb = _problem(40, 45, 3, seed=3)
    X, Y = ko.clouds(x, y)
    eps = 0.01
    zx, zy = torch.zeros(40), torch.zeros(45)
    fo, go = ko.lse_pair(X, Y, zx, zy, la, lb, ko.params(eps, 0.5, "cpu"), "float32")
    assert _rel(fo, _softmin64(X.x, Y.x, zy, lb, eps)) < 2e-6
    assert _rel(go, _softmin64(Y.x, X.x, zx, la, eps)) < 2e-6


@pytest.mark.parametrize("mode", ["fold", "online"])
def test_two_half_step_modes_agree_with_fused(mode, pair_mode):
    x, y, la, lb = _problem(50, 40, 3, seed=11)
    X, Y = ko.clouds(x, y)
    eps = 0.2
    f, g = _near_fixed_point(X, Y, la, lb, eps)
    prm = ko.params(eps, 0.5, "cpu")
    fused = ko.lse_pair(X, Y, f, g, la, lb, prm, "float32")
    pair_mode("fused", self_mode="triangle")
    self_triangle = ko.lse_self(X, f, la, prm, "float32")
    pair_mode(mode, self_mode=mode)
    seq = kernel_calls.lse_pair(50, 40, 3, "float32", False)
    kinds = (kernel_calls.lse_update_kernel, kernel_calls.lse_combine_kernel, kernel_calls.column_bias_kernel)
    assert all(c.kernel in kinds for c in seq.calls)
    updates = [c for c in seq.calls if c.kernel is kernel_calls.lse_update_kernel]
    assert len(updates) == 2 and updates[0].constexprs["FOLD"] == (mode == "fold")
    two = ko.lse_pair(X, Y, f, g, la, lb, prm, "float32")
    for a, b in zip(fused, two):
        assert float((a - b).abs().max() / b.abs().max()) < 1e-6
    self_two = ko.lse_self(X, f, la, prm, "float32")  # lse_update, FOLD in "fold" mode, online in "online"
    self_update = [c for c in kernel_calls.lse_self(50, 3, "float32", False).calls if c.kernel is kernel_calls.lse_update_kernel]
    assert self_update[0].constexprs["FOLD"] == (mode == "fold")
    assert float((self_triangle - self_two).abs().max() / self_two.abs().max()) < 1e-6
    assert _rel(self_two, _softmin64(X.x, X.x, f, la, eps)) < 2e-6


def test_looped_dimension_runs_two_fold_half_steps():
    """d > 64 has no resident x block: the plan runs two FOLD half-steps."""
    assert pair_plans.pair_mode(30, 35, 70, "float32") == "fold"
    x, y, la, lb = _problem(30, 35, 70, seed=5)
    X, Y = ko.clouds(x, y)
    eps = 2.0
    f, g = _near_fixed_point(X, Y, la, lb, eps)
    fo, go = ko.lse_pair(X, Y, f, g, la, lb, ko.params(eps, 0.5, "cpu"), "float32")
    assert _rel(fo, _softmin64(X.x, Y.x, g, lb, eps)) < 2e-6
    assert _rel(go, _softmin64(Y.x, X.x, f, la, eps)) < 2e-6


def test_fused_sweep_size_rule():
    """d <= 16 fuses the two sides up to FUSED_K16_PAIRS pairs and runs two fold half-steps
    beyond; d > 16 keeps the fused sweep at any size."""
    big = pair_plans.FUSED_K16_PAIRS
    assert pair_plans.pair_mode(2 ** 16, big // 2 ** 16, 3, "float32") == "fused"
    assert pair_plans.pair_mode(2 ** 16, big // 2 ** 16 + 1, 16, "tf32") == "fold"
    assert pair_plans.pair_mode(2 ** 20, 2 ** 20, 64, "float32") == "fused"
    kernels = [c.kernel for c in kernel_calls.lse_pair(2 ** 17, 2 ** 17, 3, "float32", True).calls]
    assert kernels.count(kernel_calls.lse_update_kernel) == 2 and kernel_calls.lse_pair_kernel not in kernels
    kernels = [c.kernel for c in kernel_calls.lse_pair(2 ** 17, 2 ** 17, 64, "float32", True).calls]
    assert kernel_calls.lse_pair_kernel in kernels


def test_bad_mode_is_named(pair_mode):
    pair_mode("atomic")
    with pytest.raises(ValueError, match="PAIR_MODE"):
        kernel_calls.lse_pair(10, 10, 3, "float32", False)
    pair_mode("fused", self_mode="square")
    with pytest.raises(ValueError, match="SELF_MODE"):
        kernel_calls.lse_self(10, 3, "float32", False)


@pytest.mark.parametrize("n,d,precision,offset", [(100, 3, "float32", 0.0), (70, 2, "tf32", 0.0),
                                                  (90, 20, "float32", 0.0), (64, 3, "float32", 40.0),
                                                  (20, 3, "float32", 0.0), (200, 3, "float32", 0.0)])
def test_self_triangle_matches_float64(n, d, precision, offset, pair_mode):
    """One sweep of the pairs j >= i (SELF): the diagonal tiles, the tiles below it (skipped, their
    column slots zero), several row and column groups; ``offset`` moves the shift out of range
    (the finishing kernel's online fallback)."""
    pair_mode("fused", self_mode="triangle")
    x, _, la, _ = _problem(n, 5, d, seed=n + 1)
    X, = ko.clouds(x)
    eps = 0.3
    f = _softmin64(X.x, X.x, torch.zeros(n), la, eps).float() + offset
    seq = kernel_calls.lse_self(n, d, precision, False)
    assert [c.kernel for c in seq.calls] == [kernel_calls.pair_prep_kernel, kernel_calls.lse_pair_kernel,
                                             kernel_calls.lse_pair_finish_kernel]
    plan = seq.calls[1].plan
    assert seq.calls[1].constexprs["SELF"] and plan.constexprs["BLOCK_M"] % plan.constexprs["BLOCK_N"] == 0
    groups = -(-n // (2 * plan.constexprs["BLOCK_M"]))  # 2 row blocks per group under the interpreter
    assert pair_plans.self_groups(plan, n) == groups and plan.grid == (groups * (groups + 1) // 2, 1)
    prm = ko.params(eps, 0.5, "cpu")
    out = ko.lse_self(X, f, la, prm, precision)
    ref = _softmin64(X.x, X.x, f, la, eps)
    # these potentials are small (|f| ~ 0.2): the absolute error is float32's (the |x|^2 / eps terms),
    # and as large as lse.py's online update of the same side
    online = ko.lse_update(X, X, f, prm, precision, logw_in=la)[0]
    err, err_online = (float((o.double() - ref).abs().max()) for o in (out, online))
    scale = max(1.0, float(ref.abs().max()))
    assert torch.isfinite(out).all() and err < (3e-6 if precision == "float32" else 1e-2) * scale
    assert err <= 1.5 * err_online + 1e-7


def test_jax_frontend_runs_the_same_pair():
    import jax.numpy as jnp

    from ot_triton_jax.jax_frontend import kernel_ops as jko

    x, y, la, lb = _problem(40, 50, 3, seed=13)
    X, Y = ko.clouds(x, y)
    eps = 0.25
    f, g = _near_fixed_point(X, Y, la, lb, eps)
    JX, JY = jko.clouds(jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
    fo, go = jko.lse_pair(JX, JY, jnp.asarray(f.numpy()), jnp.asarray(g.numpy()), jnp.asarray(la.numpy()),
                          jnp.asarray(lb.numpy()), jko.make_params(eps, 0.5), precision="float32")
    assert np.abs(np.asarray(fo) - _softmin64(X.x, Y.x, g, lb, eps).numpy()).max() < 2e-6 * np.abs(np.asarray(fo)).max()
    assert np.abs(np.asarray(go) - _softmin64(Y.x, X.x, f, la, eps).numpy()).max() < 2e-6 * np.abs(np.asarray(go)).max()
    h = jko.lse_self(JX, jnp.asarray(f.numpy()), jnp.asarray(la.numpy()), jko.make_params(eps, 0.5),
                     precision="float32")
    assert np.abs(np.asarray(h) - _softmin64(X.x, X.x, f, la, eps).numpy()).max() < 2e-6 * np.abs(np.asarray(h)).max()


@pytest.mark.gpu
@pytest.mark.parametrize("n,m,d,precision", [(65536, 40000, 3, "float32"), (20000, 30000, 16, "float32"),
                                             (30000, 20000, 64, "float32"), (30000, 20000, 3, "tf32")])
def test_pair_on_gpu_matches_float64_and_fold(n, m, d, precision, pair_mode):
    """The GPU plans (tall tiles, 16 row groups, column groups, several row blocks per group) against
    float64 on 512 rows / columns, and against two FOLD half-steps: the fused sweep changes rounding
    only."""
    gen = torch.Generator().manual_seed(d)
    x, y = torch.randn(n, d, generator=gen).cuda(), (torch.randn(m, d, generator=gen) + 0.5).cuda()
    a, b = torch.rand(n, generator=gen).cuda() + 0.1, torch.rand(m, generator=gen).cuda() + 0.1
    a[::7] = 0.0
    a, b = a / a.sum(), b / b.sum()
    la, lb = torch.where(a > 0, a.clamp_min(1e-30).log(), -torch.inf), b.log()
    X, Y = ko.clouds(x, y)
    eps = 0.1
    prm = ko.params(eps, 0.5, "cuda")
    f, g = torch.zeros(n, device="cuda"), torch.zeros(m, device="cuda")
    for _ in range(4):  # toward the fixed point (the first update also runs the online fallback)
        fn, gn = ko.lse_pair(X, Y, f, g, la, lb, prm, precision)
        f, g = 0.5 * (f + fn), 0.5 * (g + gn)
    fo, go = ko.lse_pair(X, Y, f, g, la, lb, prm, precision)
    rows = torch.randperm(n, generator=gen)[:512].cuda()
    cols = torch.randperm(m, generator=gen)[:512].cuda()
    tol = 2e-6 if precision == "float32" else 5e-3
    assert _rel(fo[rows], _softmin64(X.x[rows], Y.x, g, lb, eps)) < tol
    assert _rel(go[cols], _softmin64(Y.x[cols], X.x, f, la, eps)) < tol
    pair_mode("fold")
    f2, g2 = ko.lse_pair(X, Y, f, g, la, lb, prm, precision)
    tol = 2e-6 if precision == "float32" else 1e-3  # two float32 roundings of the same sums
    assert float((fo - f2).norm() / f2.norm()) < tol and float((go - g2).norm() / g2.norm()) < tol


@pytest.mark.gpu
@pytest.mark.parametrize("n,d,precision", [(65536, 3, "float32"), (20000, 16, "float32"), (30000, 64, "tf32")])
def test_self_triangle_on_gpu(n, d, precision, pair_mode):
    """The SELF sweep with the GPU plans (tall tiles, idle programs below the diagonal) against
    float64 on 512 points and against lse.py's online update of the same side."""
    pair_mode("fused", self_mode="triangle")
    gen = torch.Generator().manual_seed(d + 1)
    x = torch.randn(n, d, generator=gen).cuda()
    a = torch.rand(n, generator=gen).cuda() + 0.1
    a[::5] = 0.0
    a = a / a.sum()
    la = torch.where(a > 0, a.clamp_min(1e-30).log(), -torch.inf)
    X, = ko.clouds(x)
    eps = 0.1
    prm = ko.params(eps, 0.5, "cuda")
    f = torch.zeros(n, device="cuda")
    for _ in range(4):
        f = 0.5 * (f + ko.lse_self(X, f, la, prm, precision))
    out = ko.lse_self(X, f, la, prm, precision)
    online = ko.lse_update(X, X, f, prm, precision, logw_in=la)[0]
    rows = torch.randperm(n, generator=gen)[:512].cuda()
    ref = _softmin64(X.x[rows], X.x, f, la, eps)
    # |f| ~ 0.2 here: bound the error by float32's on |f| ~ 1 (as the CPU test) and by the online update's
    err, err_online = (float((o[rows].double() - ref).abs().max()) for o in (out, online))
    assert torch.isfinite(out).all() and err < (3e-6 if precision == "float32" else 1e-2) * max(1.0, float(ref.abs().max()))
    assert err <= 1.5 * err_online + 1e-7
