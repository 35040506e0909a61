"""The truncation bound of the multiscale solve (torch_api.multiscale.bounds, CPU, float64): the
pair bound U_kl dominates every point pair of its clusters, is tight for affine potentials, and
the dropped-mass bound dominates the true plan mass of the dropped pairs."""

import pytest
import torch

from torch_api.multiscale import bounds as mb
from torch_api.multiscale import clusters as mc


def _setup(seed, n, m, d, scale):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n, d, generator=g) * 2.0, torch.rand(m, d, generator=g) * 1.6 + 0.3
    a, b = torch.rand(n, generator=g) + 0.1, torch.rand(m, generator=g) + 0.1
    a, b = a / a.sum(), b / b.sum()
    cx, cy = mc.cluster_pair(x, a, y, b, scale)
    xs, ys, as_, bs = x[cx.perm], y[cy.perm], a[cx.perm], b[cy.perm]
    # smooth potentials plus noise: the shape of Sinkhorn potentials, and a residual to bound
    f = 0.3 * (xs ** 2).sum(1) + torch.sin(3 * xs).sum(1) * 0.1 + 0.01 * torch.randn(n, generator=g)
    gg = -0.2 * (ys ** 2).sum(1) + 0.05 * ys.sum(1) + 0.01 * torch.randn(m, generator=g)
    return cx, cy, xs, ys, as_, bs, f, gg


def _pair_bound(gx, fx, gy, fy):
    """float64 U_kl of multiscale.bounds' docstring (the kernels compute it in float32)."""
    D = gx.center[:, None, :] - gy.center[None, :, :]
    a, b = (fx.beta[:, None, :] - D).norm(dim=2), (fy.beta[None, :, :] + D).norm(dim=2)
    s = (fx.beta[:, None, :] + fy.beta[None, :, :]).norm(dim=2)
    rx, ry = gx.radius[:, None], gy.radius[None, :]
    rr = rx + ry
    q = lambda t: torch.where(t <= rr, 0.5 * t * t, t * rr - 0.5 * rr * rr)  # noqa: E731
    lin = torch.minimum(a * rx + b * ry, torch.minimum(q(a) + s * ry, q(b) + s * rx))
    return fx.alpha[:, None] + fy.alpha[None, :] - 0.5 * (D * D).sum(2) + lin + fx.rho[:, None] + fy.rho[None, :]


def _exact_pair_max(cx, cy, xs, ys, f, g):
    score = f.double()[:, None] + g.double()[None, :] - 0.5 * torch.cdist(xs.double(), ys.double()) ** 2
    out = torch.full((cx.k, cy.k), -torch.inf, dtype=torch.float64)
    for k in range(cx.k):
        rows = score[cx.label == k]
        for l in range(cy.k):
            out[k, l] = rows[:, cy.label == l].max()
    return out


@pytest.mark.parametrize("d", [1, 2, 3])
def test_pair_bound_dominates_every_point_pair(d):
    cx, cy, xs, ys, as_, bs, f, g = _setup(d, 90, 70, d, 0.45)
    gx, gy = mb.geometry(xs, as_, cx), mb.geometry(ys, bs, cy)
    u = _pair_bound(gx, mb.fit(gx, f), gy, mb.fit(gy, g))
    exact = _exact_pair_max(cx, cy, xs, ys, f, g)
    assert bool((u >= exact - 1e-12).all())
    # not vacuous: on a typical pair it is loose by less than the clusters' extent
    assert float((u - exact).median()) < float(gx.radius.max() + gy.radius.max())


def test_fit_is_exact_for_affine_potentials():
    cx, cy, xs, ys, as_, bs, _, _ = _setup(5, 80, 60, 3, 0.5)
    gx = mb.geometry(xs, as_, cx)
    f = 0.7 + xs.double() @ torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64)
    fit = mb.fit(gx, f)
    assert float(fit.rho.max()) < 1e-9
    many = (gx.count > 3)
    torch.testing.assert_close(fit.beta[many], torch.tensor([0.3, -1.2, 2.0], dtype=torch.float64).expand(
        int(many.sum()), 3), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("d,eps,truncate", [(1, 0.02, 5.0), (2, 0.05, 3.0), (3, 0.05, 2.0)])
def test_dropped_mass_bounds_the_dropped_plan_mass(d, eps, truncate):
    cx, cy, xs, ys, as_, bs, f, g = _setup(10 + d, 100, 80, d, 0.35)
    gx, gy = mb.geometry(xs, as_, cx), mb.geometry(ys, bs, cy)
    fx, fy = mb.fit(gx, f), mb.fit(gy, g)
    keep = mb.keep_pairs(gx, fx, gy, fy, eps, truncate)
    assert bool(keep.any(1).all()) and bool(keep.any(0).all())  # no cluster left with an empty sum
    assert 0 < int(keep.sum()) < keep.numel()
    expo = (f.double()[:, None] + g.double()[None, :] - 0.5 * torch.cdist(xs.double(), ys.double()) ** 2) / eps
    plan = as_.double()[:, None] * bs.double()[None, :] * torch.exp(expo)
    dropped = ~keep[cx.label][:, cy.label]
    true = float(plan[dropped].sum())
    bound = float(mb.dropped_mass(gx, fx, gy, fy, eps, keep))
    assert 0.0 < true <= bound
    # a kept pair is one whose bound exceeds -truncate eps (or a best pair)
    u = _pair_bound(gx, fx, gy, fy)
    assert bool(keep[u > -truncate * eps].all())
    # the kernels' float32 U is the float64 one raised by a margin of ~2^-18 |terms|: nothing far
    # below the threshold is kept, except the rows' and columns' best pairs
    best = (u == u.max(1, keepdim=True).values) | (u == u.max(0, keepdim=True).values)
    assert not bool((keep & ~best & (u < -truncate * eps - 1e-3)).any())
    plain = float((gx.weight[:, None] * gy.weight[None, :] * torch.exp(u / eps))[~keep].sum())
    assert plain <= bound <= 1.01 * plain
    assert float(mb.dropped_mass(gx, fx, gy, fy, eps, torch.ones_like(keep))) == 0.0
    assert bool(mb.keep_pairs(gx, fx, gy, fy, eps, None).all())
    # the same launch writes the (y, x) direction's mask: the exact transpose
    both = mb.keep_pairs(gx, fx, gy, fy, eps, truncate, transposed=True)
    assert torch.equal(both[0], keep) and torch.equal(both[1], keep.t())


def test_row_and_column_best_pairs_are_kept_when_the_rule_keeps_nothing():
    cx, cy, xs, ys, as_, bs, f, g = _setup(3, 90, 70, 2, 0.3)
    gx, gy = mb.geometry(xs, as_, cx), mb.geometry(ys, bs, cy)
    fx, fy = mb.fit(gx, f - 5.0), mb.fit(gy, g - 5.0)  # every U < -5: the threshold alone keeps nothing
    keep = mb.keep_pairs(gx, fx, gy, fy, 1e-3, 1.0)
    u = _pair_bound(gx, fx, gy, fy)
    assert bool(keep.any(1).all()) and bool(keep.any(0).all())
    assert bool(keep[torch.arange(cx.k), u.argmax(1)].all()) and bool(keep[u.argmax(0), torch.arange(cy.k)].all())
    assert int(keep.sum()) <= cx.k + cy.k
    # the fix-up writes the transposed mask too
    both = mb.keep_pairs(gx, fx, gy, fy, 1e-3, 1.0, transposed=True)
    assert torch.equal(both[0], keep) and torch.equal(both[1], keep.t())
    # some rows empty, others not: only the empty ones gain their best pair
    shift = torch.where(torch.arange(cx.k, dtype=torch.float64) % 2 == 0, 0.0, -5.0)
    fx2 = mb.Fit(alpha=mb.fit(gx, f).alpha + shift, beta=mb.fit(gx, f).beta, rho=mb.fit(gx, f).rho)
    fy2 = mb.fit(gy, g)
    keep2 = mb.keep_pairs(gx, fx2, gy, fy2, 0.05, 2.0)
    u2 = _pair_bound(gx, fx2, gy, fy2)
    rule = u2 > -2.0 * 0.05 + 1e-4
    assert bool(keep2[rule].all()) and bool(keep2.any(1).all()) and bool(keep2.any(0).all())
    empty_rows = ~(u2 > -2.0 * 0.05 - 1e-4).any(1)
    assert bool(empty_rows.any()) and bool((~empty_rows).any())
    assert bool(keep2[empty_rows.nonzero()[:, 0], u2[empty_rows].argmax(1)].all())
