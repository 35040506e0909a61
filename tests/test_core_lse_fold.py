"""The fixed-shift LSE loop (kernels/lse.py, FOLD) against the online-max loop and float64.

FOLD predicts each row's shift from the previous potential and falls back to the
online max when the prediction is off; both branches must give the online result.
"""

import pytest
import torch

from torch_api.kernel_ops import clouds, lse_update, params

EPS = 0.2


def problem(n, m, d, seed):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, d, generator=g), torch.randn(m, d, generator=g) + 0.3
    b = torch.rand(m, generator=g) + 0.1
    a = torch.rand(n, generator=g) + 0.1
    a[3] = 0.0  # a zero-weight row: -inf potential, must not trigger NaN
    b[5] = 0.0
    return x, y, a / a.sum(), b / b.sum(), torch.randn(m, generator=g)


def logw(w):
    return torch.where(w > 0, w.clamp_min(1e-38).log(), -torch.inf)


def reference(x, y, a, gpot, b):
    """float64 OTT update f_i = eps log a_i - eps LSE_j((g_j - |x_i - y_j|^2)/eps) (g carries log b)."""
    c = torch.cdist(x.double(), y.double()) ** 2
    z = (gpot.double()[None, :] - c) / EPS
    return EPS * logw(a).double() - EPS * torch.logsumexp(z, dim=1)


@pytest.mark.parametrize("precision", ["float32", "tf32"])
@pytest.mark.parametrize("d", [3, 8, 40])
def test_fold_matches_online_and_float64(precision, d):
    x, y, a, b, gpot = problem(70, 90, d, seed=d)
    gpot = torch.where(b > 0, gpot, -torch.inf)
    X, Y = clouds(x, y)
    prm = params(EPS, 1.0, "cpu")
    online, _ = lse_update(X, Y, gpot, prm, precision, logw_out=logw(a))
    # a good prediction (the exact answer, jittered) and a bad one (off by ~500 in log2 units)
    for pold in (online + 0.01 * torch.randn(70), online + 70.0):
        folded, _ = lse_update(X, Y, gpot, prm, precision, logw_out=logw(a), pold=pold,
                               compute_err=False, fold=True)
        assert torch.equal(torch.isinf(folded), torch.isinf(online))
        fin = torch.isfinite(online)
        assert torch.isinf(folded[3]) and folded[3] < 0
        tol = 1e-5 if precision == "float32" else 3e-3
        assert (folded[fin] - online[fin]).abs().max() <= tol * online[fin].abs().max()
        ref = reference(x, y, a, gpot, b)
        assert (folded[fin].double() - ref[fin]).abs().max() <= tol * ref[fin].abs().max()


def test_fold_error_output_unchanged():
    """compute_err with fold: the marginal error is the one of the online loop."""
    x, y, a, b, gpot = problem(50, 60, 3, seed=7)
    X, Y = clouds(x, y)
    prm = params(EPS, 1.0, "cpu")
    pold, _ = lse_update(X, Y, gpot, prm, "float32", logw_out=logw(a))
    pold = pold + 0.05
    f0, e0 = lse_update(X, Y, gpot, prm, "float32", logw_out=logw(a), pold=pold)
    f1, e1 = lse_update(X, Y, gpot, prm, "float32", logw_out=logw(a), pold=pold, fold=True)
    fin = torch.isfinite(f0)
    assert (f1[fin] - f0[fin]).abs().max() < 1e-5
    # the error is |marginal - a_i|: float32 rounding of marginals of size a_i
    assert (e1 - e0).abs().max() < 2e-5 * a.max()


def test_fold_needs_pold():
    x, y, a, b, gpot = problem(20, 20, 2, seed=1)
    with pytest.raises(ValueError, match="pold"):
        lse_update(*clouds(x, y), gpot, params(EPS, 1.0, "cpu"), "float32", fold=True)


def test_resident_fold_plans():
    """16 < d <= 64: FOLD only with one column range per program, and only when the row
    blocks fill the GPU; the online loop with the column split otherwise (launch_plans)."""
    from ot_triton_jax.core import launch_plans as lp

    big = lp.lse_plan(65536, 65536, 64, "float32", True, fold=True)
    assert big.constexprs["FOLD"] and big.constexprs["SPLIT"] == 1 and big.grid == (512, 1) and big.constexprs["PAIRED"]
    small = lp.lse_plan(8192, 8192, 64, "float32", True, fold=True)
    assert small.constexprs["FOLD"] and small.constexprs["SPLIT"] == 1 and small.grid == (128, 1)
    for n, d, prec in [(4096, 64, "float32"), (8192, 64, "tf32"), (8192, 128, "float32")]:
        plan = lp.lse_plan(n, n, d, prec, True, fold=True)
        assert not plan.constexprs["FOLD"], (n, d, prec)
        assert plan == lp.lse_plan(n, n, d, prec, True, fold=False)
    assert lp.lse_plan(8192, 8192, 64, "float32", True, fold=False).constexprs["SPLIT"] > 1


@pytest.mark.parametrize("m", [100, 150])
def test_paired_fold_loop_equals_single(m):
    """PAIRED (two column tiles per loop step, the GPU plan of 16 < d <= 64 float32) sums the
    same tiles in the same order as the one-tile loop: equal outputs, including a last step
    whose second tile is partly or wholly past m (interpreter tiles of 64 columns)."""
    from dataclasses import replace

    from ot_triton_jax.core import kernel_calls as kc
    from torch_api.kernel_ops import run

    x, y, a, b, gpot = problem(70, m, 40, seed=m)
    gpot = torch.where(b > 0, gpot, -torch.inf)
    X, Y = clouds(x, y)
    prm = params(EPS, 1.0, "cpu")
    online, _ = lse_update(X, Y, gpot, prm, "float32", logw_out=logw(a))
    pold = online + 0.01 * torch.randn(70)
    seq = kc.lse_update(70, m, 40, "float32", False, False, True, True, False, True)
    update = [c for c in seq.calls if c.kernel is kc.lse_update_kernel][0]
    assert update.constexprs["FOLD"] and update.constexprs["BLOCK_N"] == 64
    paired = kc.CallSequence(tuple(replace(c, flags={**c.flags, "PAIRED": True}) if c is update else c
                                   for c in seq.calls), seq.results)
    arrays = {"x_hi": X.hi, "x_lo": X.lo, "y_hi": Y.hi, "y_lo": Y.lo, "x_sq": X.sqnorm, "y_sq": Y.sqnorm,
              "params": prm, "x_scale": X.scale, "y_scale": Y.scale, "pot": gpot, "logw_out": logw(a), "pold": pold}
    assert [c.constexprs.get("PAIRED") for c in paired.calls if c.kernel is kc.lse_update_kernel] == [True]
    one, _ = run(seq, dict(arrays), "cpu")
    two, _ = run(paired, dict(arrays), "cpu")
    assert torch.equal(one, two)
    fin = torch.isfinite(online)
    assert (two[fin] - online[fin]).abs().max() <= 1e-5 * online[fin].abs().max()
