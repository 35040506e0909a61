"""The multiscale annealed solve (torch_api.multiscale_solve, CPU: Triton interpreter, real
block-sparse kernels) against a float64 dense re-implementation of the same algorithm, whose
truncation acts on the full cost matrix through the same row-block masks."""

import pytest
import torch

from ot_triton_jax.core import launch_plans, multiscale_rules as rules, runtime
from ot_triton_jax.core.schedules import epsilon_schedule
from torch_api import multiscale_clusters as mc
from torch_api.multiscale_solve import anneal


def _softmin(eps, c, logw, pot, mask=None):
    z = logw[None, :] + (pot[None, :] - c) / eps
    if mask is not None:
        z = torch.where(mask, z, -torch.inf)
    return -eps * torch.logsumexp(z, dim=1)


def _reference(x, y, a, b, blur, scaling, diameter, scale, truncate, block_m):
    """float64: the module docstring's steps 1-5 on dense matrices."""
    x, y, a, b = x.double(), y.double(), a.double(), b.double()
    cx, cy = mc.cluster_pair(x.float(), a.float(), y.float(), b.float(), scale)
    eps_list = epsilon_schedule(2, diameter, blur, scaling)
    jump = rules.jump_index(eps_list, scale)
    xs, ys, la, lb = x[cx.perm], y[cy.perm], a[cx.perm].log(), b[cy.perm].log()
    wxc = torch.zeros(cx.k, dtype=torch.float64).index_add_(0, cx.label, a[cx.perm])
    wyc = torch.zeros(cy.k, dtype=torch.float64).index_add_(0, cy.label, b[cy.perm])

    def centroids(c, w, pts, wk):
        sums = torch.zeros(c.k, pts.shape[1], dtype=torch.float64).index_add_(0, c.label, w[:, None] * pts)
        return sums / wk[:, None]

    xc, yc = centroids(cx, a[cx.perm], xs, wxc), centroids(cy, b[cy.perm], ys, wyc)
    cost = lambda p, q: 0.5 * torch.cdist(p, q) ** 2  # noqa: E731
    P, Q, lp, lq, masks = xc, yc, wxc.log(), wyc.log(), (None,) * 4

    def sweep(pots, eps):
        f, g, fa, gb = pots
        return (_softmin(eps, cost(P, Q), lq, g, masks[0]), _softmin(eps, cost(Q, P), lp, f, masks[1]),
                _softmin(eps, cost(P, P), lp, fa, masks[2]), _softmin(eps, cost(Q, Q), lq, gb, masks[3]))

    zx, zy = torch.zeros(cx.k, dtype=torch.float64), torch.zeros(cy.k, dtype=torch.float64)
    pots = sweep((zx, zy, zx, zy), eps_list[0])
    for k, eps in enumerate(eps_list):
        pots = tuple(0.5 * (p + q) for p, q in zip(pots, sweep(pots, eps)))
        if k == jump:
            f, g, fa, gb = pots
            t = truncate if k < len(eps_list) - 1 else None

            def point_mask(fc, gc, ca, cb):
                keep = mc.keep_clusters(fc, gc, ca, cb, eps, t)
                rb = mc.row_block_mask(keep, ca.label, block_m).bool()
                return rb[torch.arange(len(ca.label)) // block_m][:, cb.label]

            masks = (point_mask(f, g, cx, cy), point_mask(g, f, cy, cx), point_mask(fa, fa, cx, cx),
                     point_mask(gb, gb, cy, cy))
            pots = (_softmin(eps, cost(xs, yc), wyc.log(), g), _softmin(eps, cost(ys, xc), wxc.log(), f),
                    _softmin(eps, cost(xs, xc), wxc.log(), fa), _softmin(eps, cost(ys, yc), wyc.log(), gb))
            P, Q, lp, lq = xs, ys, la, lb
    final = sweep(pots, eps_list[-1])
    inv = (torch.argsort(cx.perm), torch.argsort(cy.perm)) * 2
    last = dict(xs=xs, ys=ys, la=la, lb=lb, old=pots, masks=masks, eps=eps_list[-1], inv=inv)
    return tuple(p[i] for p, i in zip(final, inv)), jump, masks, last


def _problem(seed, n, m, d):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n, d, generator=g) * 4.0, torch.rand(m, d, generator=g) * 3.2 + 0.6
    a, b = torch.rand(n, generator=g) + 0.2, torch.rand(m, generator=g) + 0.2
    return x, y, a / a.sum(), b / b.sum()


CASES = [(1, None, 0.8), (2, 5.0, 0.6), (3, 2.0, 0.9), (1, 5.0, 0.3), (2, None, 0.04)]


@pytest.mark.parametrize("d,truncate,scale", CASES)
def test_anneal_matches_the_float64_algorithm(d, truncate, scale):
    x, y, a, b = _problem(d, 70, 55, d)
    both = torch.cat([x, y])
    blur, scaling, diam = 0.1, 0.5, float((both.max(0).values - both.min(0).values).norm())
    out = anneal(x, y, a, b, blur, scaling, diam, cluster_scale=scale, truncate=truncate)
    block_m = launch_plans.blocksparse_block_m(d, "float32", runtime.on_gpu())
    ref, jump, masks, _ = _reference(x, y, a, b, blur, scaling, diam, scale, truncate, block_m)
    assert out.jump == jump
    if truncate is not None and jump < len(out.eps) - 1:
        assert 0.0 < out.kept < 1.0, "the case should drop some cluster pairs"
        if d == 1:  # 16-row blocks of a sorted line: whole blocks of far columns are skipped
            assert not bool(masks[0].all())
    assert out.dropped_mass_bound >= 0.0 and out.dropped_mass_bound < float("inf")
    if truncate is None:
        assert out.dropped_mass_bound == 0.0
    elif d == 1:
        assert out.dropped_mass_bound > 0.0
    for mine, theirs in zip(out.new, ref):
        assert torch.isfinite(mine).all()
        err = float((mine.double() - theirs).norm() / theirs.norm())
        assert err < 2e-5, err


def _grad_x_reference(last, a):
    """float64 autograd of sum_i a_i (f_ba - f_aa)(x_i) through the last extrapolation only."""
    xs = last["xs"].clone().requires_grad_(True)
    ys, old, masks, eps = last["ys"], last["old"], last["masks"], last["eps"]
    cost = lambda p, q: 0.5 * torch.cdist(p, q) ** 2  # noqa: E731
    f_ba = _softmin(eps, cost(xs, ys), last["lb"], old[1], masks[0])
    f_aa = _softmin(eps, cost(xs, last["xs"]), last["la"], old[2], masks[2])
    (gx,) = torch.autograd.grad((a.double()[torch.argsort(last["inv"][0])] * (f_ba - f_aa)).sum(), xs)
    return gx[last["inv"][0]]


@pytest.mark.parametrize("d,truncate,scale", [CASES[1], CASES[3]])
def test_direction_is_the_last_extrapolations_gradient(d, truncate, scale):
    from torch_api.multiscale_solve import direction
    x, y, a, b = _problem(d + 10, 64, 48, d)
    both = torch.cat([x, y])
    blur, scaling, diam = 0.1, 0.5, float((both.max(0).values - both.min(0).values).norm())
    out = anneal(x, y, a, b, blur, scaling, diam, cluster_scale=scale, truncate=truncate)
    block_m = launch_plans.blocksparse_block_m(d, "float32", runtime.on_gpu())
    _, _, masks, last = _reference(x, y, a, b, blur, scaling, diam, scale, truncate, block_m)
    assert not bool(masks[0].all()) or d > 1
    mine = a[:, None] * direction(out, 0)
    ref = _grad_x_reference(last, a)
    err = float((mine.double() - ref).norm() / ref.norm())
    assert err < 1e-4, err


def test_samples_loss_multiscale_value_gradient_and_errors():
    from torch_api import SamplesLoss
    d, truncate, scale = CASES[3]
    x, y, a, b = _problem(21, 60, 50, d)
    both = torch.cat([x, y])
    blur, diam = 0.1, float((both.max(0).values - both.min(0).values).norm())
    loss = SamplesLoss("sinkhorn", blur=blur, scaling=0.5, backend="multiscale", cluster_scale=scale,
                       truncate=truncate)
    xg = x.clone().requires_grad_(True)
    value = loss(a, xg, b, y)
    block_m = launch_plans.blocksparse_block_m(d, "float32", runtime.on_gpu())
    ref, _, masks, last = _reference(x, y, a, b, blur, 0.5, diam, scale, truncate, block_m)
    f_ba, g_ab, f_aa, g_bb = ref
    ref_value = float((a.double() * (f_ba - f_aa)).sum() + (b.double() * (g_ab - g_bb)).sum())
    assert abs(float(value) - ref_value) <= 1e-5 * abs(ref_value)
    assert not bool(masks[0].all()) and 0.0 < loss.last_multiscale.kept < 1.0
    (gx,) = torch.autograd.grad(value, xg, create_graph=True)
    ref_gx = _grad_x_reference(last, a)
    assert float((gx.double() - ref_gx).norm() / ref_gx.norm()) < 1e-4
    with pytest.raises(RuntimeError):  # no HVP yet: double backward raises, never a silent zero
        torch.autograd.grad(gx.sum(), xg)
    with pytest.raises(ValueError, match="d <= 3"):
        loss(torch.rand(10, 4), torch.rand(12, 4))
    with pytest.raises(NotImplementedError, match="one problem at a time"):
        loss(torch.rand(2, 10, 2), torch.rand(2, 12, 2))
    with pytest.raises(ValueError, match="only has a meaning with backend='multiscale'"):
        SamplesLoss("sinkhorn", cluster_scale=0.1)
    with pytest.raises(ValueError, match="truncate"):
        SamplesLoss("sinkhorn", backend="multiscale", truncate=-1.0)
