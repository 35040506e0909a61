"""The truncated coarse-to-fine lift of the multiscale solve (CPU: Triton interpreter, real kernels):
kernels/lift_gathered.py against float64 over the same kept pairs (with a good and a far-off shift),
the Jensen fits of multiscale.bounds.lifted_fit against the dense float64 lift at every point,
multiscale.bounds.cover, the masks' pair lists (kernels/mask_lists.py), and the solve with the truncated lift (multiscale.lift.LIFT "always")
against the dense lift ("never"): the same potentials to the truncation's size, and a reported
dropped-mass bound that still covers the untruncated last extrapolation."""

import pytest
import torch

from torch_api import kernel_ops
from torch_api.multiscale import bounds as mb, clusters as mc
from torch_api.multiscale import lift as ms_lift, solve as ms


def _clusters(seed, n, d, scale):
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, d, generator=g, dtype=torch.float64)
    a = torch.rand(n, generator=g, dtype=torch.float64) + 0.2
    a /= a.sum()
    c, _ = mc.cluster_pair(x.float(), a.float(), x.float(), a.float(), scale)
    return x[c.perm], a[c.perm], c, g


def _dense_lift(xs, cent, pot, logw, eps, mask=None):
    """float64 -eps LSE_l ((pot_l - |x_i - c_l|^2 / 2) / eps + logw_l), over mask's columns (rows: points)."""
    z = (pot[None, :] - 0.5 * torch.cdist(xs, cent) ** 2) / eps + logw[None, :]
    if mask is not None:
        z = torch.where(mask, z, -torch.inf)
    return -eps * torch.logsumexp(z, dim=1)


@pytest.mark.parametrize("shape,density", [((37, 150), 0.3), ((130, 70), 0.02), ((5, 300), 0.0), ((64, 64), 1.0)])
def test_mask_lists_equal_the_masks_nonzeros(shape, density):
    """kernels/mask_lists.py: the k-major list (offsets, columns, rows) is torch.nonzero's, with
    empty rows, an empty mask and a full one; columns past one block (64 on the CPU)."""
    g = torch.Generator().manual_seed(int(density * 100) + shape[0])
    keep = torch.rand(shape, generator=g) < density
    nz = keep.nonzero()
    lptr, lidx, rows, host = mc.mask_lists(keep, with_rows=True)
    assert torch.equal(host, lptr.cpu())
    assert lptr.dtype == torch.int64 and lidx.dtype == torch.int32 and rows.dtype == torch.int32
    assert torch.equal(lptr, torch.searchsorted(nz[:, 0], torch.arange(shape[0] + 1)))
    assert torch.equal(lidx.long(), nz[:, 1]) and torch.equal(rows.long(), nz[:, 0])
    lptr2, lidx2, none, _ = mc.mask_lists(keep)
    assert none is None and torch.equal(lptr2, lptr) and torch.equal(lidx2, lidx)
    # several masks with one host read: each its own lists (None entries stay None)
    many = mc.kept_lists_many([keep, None, keep.t().contiguous()])
    assert many[1] is None and torch.equal(many[0][1], lidx)
    assert torch.equal(many[2][1].long(), keep.t().nonzero()[:, 1])


@pytest.mark.parametrize("d", [1, 2, 3])
def test_lift_kernel_matches_float64_over_the_kept_pairs(d):
    xs, _, c, g = _clusters(d, 90, d, 0.3)
    kc = 40
    cent = torch.rand(kc, d, generator=g, dtype=torch.float64)
    pot = 0.02 * torch.randn(kc, generator=g, dtype=torch.float64)
    logw = torch.log(torch.rand(kc, generator=g, dtype=torch.float64) + 0.1)
    keep = torch.rand(c.k, kc, generator=g) < 0.4
    keep[torch.arange(c.k), torch.randint(0, kc, (c.k,), generator=g)] = True  # every row keeps a pair
    eps = 0.01
    ref = _dense_lift(xs, cent, pot, logw, eps, keep[c.label])
    X, C = kernel_ops.clouds(xs.float(), cent.float())
    prm = kernel_ops.params(eps, 0.5, xs.device)
    lptr, lidx = mc.kept_lists(keep)
    assert int(lptr[-1]) == int(keep.sum())
    for shift in (ref + 0.5 * eps * torch.rand(ref.shape, generator=g, dtype=torch.float64),  # a good prediction
                  ref + 80.0 * eps, ref - 80.0 * eps):  # far off: the chunk is redone with a running max
        out = kernel_ops.lift_gathered(X, c.start, lptr, lidx, C, pot.float(), logw.float(), shift.float(), prm)
        assert torch.isfinite(out).all()
        err = float((out.double() - ref).abs().max())
        assert err <= 2e-5 * eps + 1e-6 * float(ref.abs().max()), err


@pytest.mark.parametrize("d", [1, 2, 3])
def test_lifted_fit_bounds_the_dense_lift_at_every_point(d):
    """f(x) <= f(cbar) + <x - cbar, cbar - m> + |x - cbar|^2 / 2 (Jensen), as a fit on each cluster."""
    xs, a, c, g = _clusters(10 + d, 120, d, 0.25)
    kc, eps = 30, 0.02
    cent = torch.rand(kc, d, generator=g, dtype=torch.float64)
    pot = 0.05 * torch.randn(kc, generator=g, dtype=torch.float64)
    logw = torch.log(torch.rand(kc, generator=g, dtype=torch.float64) + 0.1)
    geo = mb.geometry(xs, a, c)
    cbar = c.centroid.double()
    value = _dense_lift(cbar, cent, pot, logw, eps)
    w = torch.softmax((pot[None, :] - 0.5 * torch.cdist(cbar, cent) ** 2) / eps + logw[None, :], dim=1)
    fit = mb.lifted_fit(geo, geo.center - cbar, value, cbar - w @ cent)
    lifted = _dense_lift(xs, cent, pot, logw, eps)
    pred = mb.predict(geo, fit)
    assert bool((lifted <= pred + 1e-12).all()), float((lifted - pred).max())
    # and not far above it: the bound's slack is at most the cluster's r^2 / 2 plus Jensen's gap
    assert float((pred - lifted).max()) < 0.5 * float(geo.radius.max()) ** 2 + 5.0 * eps


def test_cover_raises_rho_to_the_largest_residual():
    xs, a, c, g = _clusters(5, 100, 2, 0.3)
    geo = mb.geometry(xs, a, c)
    pot = torch.randn(xs.shape[0], generator=g, dtype=torch.float64)
    base = mb.Fit(alpha=torch.zeros(c.k, dtype=torch.float64), beta=torch.ones(c.k, 2, dtype=torch.float64),
                  rho=torch.zeros(c.k, dtype=torch.float64))
    fit = mb.cover(geo, base, pot)
    pred = mb.predict(geo, fit)
    assert bool((pot <= pred + 1e-12).all())
    resid = pot - (geo.u * fit.beta[c.label]).sum(1)  # the residual reaches rho on every cluster
    top = torch.full((c.k,), -torch.inf, dtype=torch.float64).scatter_reduce(0, c.label, resid, "amax")
    assert torch.allclose(top, fit.rho)


@pytest.mark.parametrize("d", [1, 2, 3])
def test_solve_with_the_truncated_lift(monkeypatch, d):
    g = torch.Generator().manual_seed(20 + d)
    n, m = 90, 70
    x, y = torch.rand(n, d, generator=g), torch.rand(m, d, generator=g) * 0.8 + 0.1
    a, b = torch.rand(n, generator=g) + 0.2, torch.rand(m, generator=g) + 0.2
    a, b = a / a.sum(), b / b.sum()
    kw = dict(blur=0.1, scaling=0.5, diameter=float(d) ** 0.5, cluster_scale=0.2, truncate=2.0, tol=5e-3)
    out = {}
    for lift in ("never", "always"):
        monkeypatch.setattr(ms_lift, "LIFT", lift)
        out[lift] = ms.anneal(x, y, a, b, **kw)
    dense, trunc = out["never"], out["always"]
    assert 0.0 < trunc.kept < 1.0 and trunc.converged and trunc.marginal_error <= kw["tol"]
    eps = trunc.eps[-1]
    for p, q in zip(trunc.new, dense.new):  # the same solve up to the lift's truncation
        assert float((p.double() - q.double()).abs().max()) < 0.05 * eps
    # the bound still covers the untruncated last extrapolation from the same potentials
    xd, yd = x.double(), y.double()
    f, gg, fa, gb = (p.double() for p in trunc.old)
    la, lb = a.double().log(), b.double().log()
    full = (_dense_lift(xd, yd, gg, lb, eps), _dense_lift(yd, xd, f, la, eps),
            _dense_lift(xd, xd, fa, la, eps), _dense_lift(yd, yd, gb, lb, eps))
    value = lambda p: float((a.double() * (p[0] - p[2])).sum() + (b.double() * (p[1] - p[3])).sum())  # noqa: E731
    gap = abs(value(tuple(p.double() for p in trunc.new)) - value(full))
    assert 0.0 < trunc.dropped_mass_bound < 1.0
    assert gap <= eps * trunc.dropped_mass_bound + 1e-6 * abs(value(full)), (gap, eps * trunc.dropped_mass_bound)
