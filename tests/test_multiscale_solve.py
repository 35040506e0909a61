"""The multiscale annealed solve (torch_api.multiscale.solve, CPU: Triton interpreter, real
block-sparse kernels) against a float64 dense re-implementation of the same algorithm, whose
truncation acts on the full cost matrix through the same row-block masks."""

import pytest
import torch

from ot_triton_jax.core import multiscale_plans, multiscale_rules as rules, runtime
from ot_triton_jax.core.schedules import epsilon_schedule
from torch_api.multiscale import clusters as mc
from torch_api.multiscale.anderson import extrapolate
from torch_api.multiscale.solve import anneal


def _softmin(eps, c, logw, pot, mask=None):
    z = logw[None, :] + (pot[None, :] - c) / eps
    if mask is not None:
        z = torch.where(mask, z, -torch.inf)
    return -eps * torch.logsumexp(z, dim=1)


def _dense_mask(rng, n, m, block_m):
    """(n, m) bool: row i keeps the columns of its row block's ranges."""
    keep = torch.zeros(-(-n // block_m), m, dtype=torch.bool)
    for blk, runs in enumerate(rng.tolist()):
        for lo, hi in runs:
            keep[blk, lo:hi] = True
    return keep[torch.arange(n) // block_m]


def _reference(x, y, a, b, blur, scaling, diameter, scale, trace, block_m, coarse_finish=None):
    """float64: the module docstring's steps on dense matrices; the fine sweeps use the masks the
    solve recorded in ``trace`` (the last one is the last extrapolation). ``coarse_finish``: the
    solve's coarse finishing steps when it ran with ``tol`` (None: GeomLoss's path)."""
    x, y, a, b = x.double(), y.double(), a.double(), b.double()
    cx, cy = mc.cluster_pair(x.float(), a.float(), y.float(), b.float(), scale)
    eps_list = epsilon_schedule(2, diameter, blur, scaling)
    jump = rules.jump_index(eps_list, scale) if coarse_finish is None else len(eps_list) - 1
    xs, ys, la, lb = x[cx.perm], y[cy.perm], a[cx.perm].log(), b[cy.perm].log()
    wxc = torch.zeros(cx.k, dtype=torch.float64).index_add_(0, cx.label, a[cx.perm])
    wyc = torch.zeros(cy.k, dtype=torch.float64).index_add_(0, cy.label, b[cy.perm])

    def centroids(c, w, pts, wk):
        sums = torch.zeros(c.k, pts.shape[1], dtype=torch.float64).index_add_(0, c.label, w[:, None] * pts)
        return sums / wk[:, None]

    xc, yc = centroids(cx, a[cx.perm], xs, wxc), centroids(cy, b[cy.perm], ys, wyc)
    cost = lambda p, q: 0.5 * torch.cdist(p, q) ** 2  # noqa: E731

    def sweep(P, Q, lp, lq, pots, eps, masks=(None,) * 4):
        f, g, fa, gb = pots
        return (_softmin(eps, cost(P, Q), lq, g, masks[0]), _softmin(eps, cost(Q, P), lp, f, masks[1]),
                _softmin(eps, cost(P, P), lp, fa, masks[2]), _softmin(eps, cost(Q, Q), lq, gb, masks[3]))

    avg = lambda ps, qs: tuple(0.5 * (p + q) for p, q in zip(ps, qs))  # noqa: E731
    coarse = (xc, yc, wxc.log(), wyc.log())
    zx, zy = torch.zeros(cx.k, dtype=torch.float64), torch.zeros(cy.k, dtype=torch.float64)
    pots = sweep(*coarse, (zx, zy, zx, zy), eps_list[0])
    for k in range(jump + 1):
        pots = avg(pots, sweep(*coarse, pots, eps_list[k]))
    w = rules.FINISH_OMEGA

    def finish(P, Q, lp, pots, new, eps, kind, gamma, history, mask=None):
        """The solve's finishing step of this ``kind`` (over-relaxed or Anderson with its recorded
        coefficients), on the points (P, Q) with log-weights lp of P."""
        if kind.endswith("finish"):
            f = (1 - w) * pots[0] + w * new[0]
            g = (1 - w) * pots[1] + w * _softmin(eps, cost(Q, P), lp, f, mask)
            return (f, g) + avg(pots[2:], new[2:]), []
        history = (history + [new[0]])[-rules.ANDERSON_DEPTH:]
        f = new[0] if gamma is None else extrapolate(history, gamma)
        return (f, _softmin(eps, cost(Q, P), lp, f, mask)) + avg(pots[2:], new[2:]), history

    coarse_steps = [t for t in trace if t[2].startswith("coarse_")]
    assert len(coarse_steps) == (coarse_finish or 0)
    trace = [t for t in trace if not t[2].startswith("coarse_")]
    history = []
    for _, _, kind, gamma in coarse_steps:
        new = sweep(*coarse, pots, eps_list[-1])
        pots, history = finish(xc, yc, wxc.log(), pots, new, eps_list[-1], kind, gamma, history)
    f, g, fa, gb = pots
    e = eps_list[jump]
    pots = (_softmin(e, cost(xs, yc), wyc.log(), g), _softmin(e, cost(ys, xc), wxc.log(), f),
            _softmin(e, cost(xs, xc), wxc.log(), fa), _softmin(e, cost(ys, yc), wyc.log(), gb))
    n, m = len(xs), len(ys)
    new, masks, kind = pots, (None,) * 4, "final"  # no trace: the jump's extrapolation is the last one
    history = []  # the Anderson steps' T(f), with the solve's recorded mixing coefficients
    for eps, rng, kind, *mix in trace:
        masks = (_dense_mask(rng[0], n, m, block_m), _dense_mask(rng[1], m, n, block_m),
                 _dense_mask(rng[2], n, n, block_m), _dense_mask(rng[3], m, m, block_m))
        new = sweep(xs, ys, la, lb, pots, eps, masks)
        if kind == "average":
            pots = avg(pots, new)
        elif kind in ("finish", "anderson"):
            pots, history = finish(xs, ys, la, pots, new, eps, kind, mix[0], history, masks[1])
    assert kind == "final"
    inv = (torch.argsort(cx.perm), torch.argsort(cy.perm)) * 2
    last = dict(xs=xs, ys=ys, la=la, lb=lb, old=pots, masks=masks, eps=trace[-1][0], inv=inv)
    return tuple(p[i] for p, i in zip(new, inv)), jump, masks, last


def _problem(seed, n, m, d):
    g = torch.Generator().manual_seed(seed)
    x, y = torch.rand(n, d, generator=g) * 4.0, torch.rand(m, d, generator=g) * 3.2 + 0.6
    a, b = torch.rand(n, generator=g) + 0.2, torch.rand(m, generator=g) + 0.2
    return x, y, a / a.sum(), b / b.sum()


# (d, truncate, cluster_scale, tol): tol with blur 0.3 (a few finishing steps), without it 0.1
CASES = [(1, None, 0.8, None), (2, 5.0, 0.6, 1e-2), (3, 2.0, 0.9, None), (1, 5.0, 0.3, 1e-2), (2, None, 0.04, 3e-2)]


def _solve(seed, n, m, d, truncate, scale, tol, scaling=0.5):
    x, y, a, b = _problem(seed, n, m, d)
    blur = 0.1 if tol is None else 0.3
    both = torch.cat([x, y])
    diam = float((both.max(0).values - both.min(0).values).norm())
    trace = []
    out = anneal(x, y, a, b, blur, scaling, diam, cluster_scale=scale, truncate=truncate, tol=tol, trace=trace)
    block_m = multiscale_plans.blocksparse_block_m(d, "float32", runtime.on_gpu())
    ref = _reference(x, y, a, b, blur, scaling, diam, scale, trace, block_m,
                     None if tol is None else out.coarse_finish_sweeps)
    return (x, y, a, b), out, ref, trace


@pytest.mark.parametrize("d,truncate,scale,tol", CASES)
def test_anneal_matches_the_float64_algorithm(d, truncate, scale, tol):
    _, out, (ref, jump, masks, _), trace = _solve(d, 70, 55, d, truncate, scale, tol)
    assert out.jump == jump and out.sweeps == sum(1 for t in trace if not t[2].startswith("coarse_"))
    if trace:
        assert out.sweeps == len(out.eps) - 1 - jump + out.finish_sweeps + 1
    if tol is not None:  # the whole schedule on the clusters, converged there before the lift
        assert jump == len(out.eps) - 1 and out.coarse_finish_sweeps > 0
    if truncate is not None:
        assert 0.0 < out.kept < 1.0, "the case should drop some cluster pairs"
        assert not bool(masks[0].all())
        assert 0.0 < out.dropped_mass_bound < float("inf")
    else:
        assert out.dropped_mass_bound == 0.0 and out.kept == 1.0
    if tol is not None:
        assert out.converged and out.marginal_error <= tol
    for mine, theirs in zip(out.new, ref):
        assert torch.isfinite(mine).all()
        err = float((mine.double() - theirs).norm() / theirs.norm())
        assert err < 2e-5, err


@pytest.mark.parametrize("d", [1, 2, 3])
def test_keep_all_on_one_point_clusters_is_the_dense_solve(d):
    """cluster_scale below the points' spacing: every cluster is one point, the coarse problem is
    the fine one, nothing is truncated: GeomLoss's dense annealed solve (the online backend)."""
    from torch_api import SamplesLoss
    x, y, a, b = _problem(40 + d, 60, 50, d)
    kw = dict(blur=0.1, scaling=0.5)
    dense = SamplesLoss("sinkhorn", backend="online", potentials=True, **kw)(a, x, b, y)
    scale = {1: 1e-4, 2: 5e-3, 3: 2e-2}[d]  # below the points' spacing, grids under 2^24 voxels
    ms = SamplesLoss("sinkhorn", backend="multiscale", potentials=True, cluster_scale=scale, truncate=None,
                     tol=None, **kw)
    mine = ms(a, x, b, y)
    assert ms.last_multiscale.clusters == (60, 50)
    for p, q in zip(mine, dense):  # float32 summation order apart (a few ulps), the same numbers
        assert float((p.double() - q.double()).norm() / q.double().norm()) < 5e-6
    value = lambda F, G: float((a.double() * F.double()).sum() + (b.double() * G.double()).sum())  # noqa: E731
    assert abs(value(*mine) - value(*dense)) <= 1e-6 * abs(value(*dense))


@pytest.mark.parametrize("d,truncate,scale,tol", [CASES[1], CASES[3], (3, 1.0, 0.5, 1e-2)])
def test_truncated_value_is_within_the_reported_bound(d, truncate, scale, tol):
    """The loss of the truncated last extrapolation is within eps * dropped_mass_bound of the
    untruncated one from the same potentials; the reported marginal error is the truncated plans'."""
    (x, y, a, b), out, (ref, _, masks, last), _ = _solve(30 + d, 80, 64, d, truncate, scale, tol)
    eps = out.eps[-1]
    cost = lambda p, q: 0.5 * torch.cdist(p, q) ** 2  # noqa: E731
    xs, ys, la, lb = last["xs"], last["ys"], last["la"], last["lb"]
    f, g, fa, gb = last["old"]
    full = (_softmin(eps, cost(xs, ys), lb, g), _softmin(eps, cost(ys, xs), la, f),
            _softmin(eps, cost(xs, xs), la, fa), _softmin(eps, cost(ys, ys), lb, gb))
    inv = last["inv"]
    full = tuple(p[i] for p, i in zip(full, inv))
    value = lambda p: float((a.double() * (p[0] - p[2])).sum() + (b.double() * (p[1] - p[3])).sum())  # noqa: E731
    gap = abs(value(tuple(q.double() for q in out.new)) - value(full))
    assert out.dropped_mass_bound > 0.0
    assert gap <= eps * out.dropped_mass_bound + 1e-6 * abs(value(full)), (gap, eps * out.dropped_mass_bound)
    # the marginal error of the plans entering the last extrapolation, on their kept blocks
    plan = torch.exp((f[:, None] + g[None, :] - cost(xs, ys)) / eps + la[:, None] + lb[None, :])
    err = float((torch.where(masks[0], plan, 0.0).sum(1) - la.exp()).abs().sum())
    assert err <= out.marginal_error * (1 + 1e-3) + 1e-6 and out.marginal_error <= tol


def test_finishing_warns_when_it_cannot_reach_tol(monkeypatch):
    monkeypatch.setattr(rules, "MAX_FINISH_SWEEPS", 2)
    monkeypatch.setattr(rules, "MAX_COARSE_SWEEPS", 10)  # tol is out of reach of the clusters too
    x, y, a, b = _problem(7, 40, 30, 2)
    with pytest.warns(RuntimeWarning, match="above tol"):
        out = anneal(x, y, a, b, 0.05, 0.5, 4.0, cluster_scale=0.5, truncate=3.0, tol=1e-12)
    assert not out.converged and out.finish_sweeps == 2 and out.marginal_error > 1e-12


def _grad_x_reference(last, a):
    """float64 autograd of sum_i a_i (f_ba - f_aa)(x_i) through the last extrapolation only."""
    xs = last["xs"].clone().requires_grad_(True)
    ys, old, masks, eps = last["ys"], last["old"], last["masks"], last["eps"]
    cost = lambda p, q: 0.5 * torch.cdist(p, q) ** 2  # noqa: E731
    f_ba = _softmin(eps, cost(xs, ys), last["lb"], old[1], masks[0])
    f_aa = _softmin(eps, cost(xs, last["xs"]), last["la"], old[2], masks[2])
    (gx,) = torch.autograd.grad((a.double()[torch.argsort(last["inv"][0])] * (f_ba - f_aa)).sum(), xs)
    return gx[last["inv"][0]]


@pytest.mark.parametrize("d,truncate,scale,tol", [CASES[1], CASES[3]])
def test_direction_is_the_last_extrapolations_gradient(d, truncate, scale, tol):
    from torch_api.multiscale.gradient import direction
    (x, y, a, b), out, (_, _, masks, last), _ = _solve(d + 10, 64, 48, d, truncate, scale, tol)
    assert not bool(masks[0].all())
    mine = a[:, None] * direction(out, 0)
    ref = _grad_x_reference(last, a)
    err = float((mine.double() - ref).norm() / ref.norm())
    assert err < 1e-4, err
    # the means came from the last sweep's fused pass (anneal's default means=(True, True)), whose
    # product with the points runs on the tensor cores from an FP16 plan (TGT_MEAN: each P_ij
    # rounded, relative 2^-12, so each softmin mean within 2^-11 of the points' spread around it);
    # the same rows from direction()'s own float32 apply passes
    extra = out.state[4]
    assert all(m is not None for m in extra["means"])
    out.state = out.state[:4] + ({**extra, "means": (None,) * 4},)
    passes = a[:, None] * direction(out, 0)
    pts = torch.cat([x, y]).double()
    spread = float(torch.cdist(pts, pts).max())
    bound = a.double()[:, None] * 2 * 2.0 ** -11 * spread  # two means: f_ba's and f_aa's
    assert ((passes.double() - mine.double()).abs() <= bound).all()
    assert float((passes - mine).norm() / passes.norm()) < 1e-3


def test_samples_loss_multiscale_value_gradient_and_errors():
    from torch_api import SamplesLoss
    d, truncate, scale, tol = CASES[3]
    x, y, a, b = _problem(21, 60, 50, d)
    both = torch.cat([x, y])
    blur, diam = 0.3, float((both.max(0).values - both.min(0).values).norm())
    loss = SamplesLoss("sinkhorn", blur=blur, scaling=0.5, backend="multiscale", cluster_scale=scale,
                       truncate=truncate, tol=tol)
    xg, ag = x.clone().requires_grad_(True), a.clone().requires_grad_(True)
    value = loss(ag, xg, b, y)
    trace = []
    out = anneal(x, y, a, b, blur, 0.5, diam, cluster_scale=scale, truncate=truncate, tol=tol, trace=trace)
    block_m = multiscale_plans.blocksparse_block_m(d, "float32", runtime.on_gpu())
    ref, _, masks, last = _reference(x, y, a, b, blur, 0.5, diam, scale, trace, block_m, out.coarse_finish_sweeps)
    f_ba, g_ab, f_aa, g_bb = ref
    ref_value = float((a.double() * (f_ba - f_aa)).sum() + (b.double() * (g_ab - g_bb)).sum())
    assert abs(float(value) - ref_value) <= 1e-5 * abs(ref_value)
    res = loss.last_multiscale
    assert not bool(masks[0].all()) and 0.0 < res.kept < 1.0 and res.converged and res.marginal_error <= tol
    gx, ga = torch.autograd.grad(value, (xg, ag), create_graph=True)
    ref_gx = _grad_x_reference(last, a)
    assert float((gx.double() - ref_gx).norm() / ref_gx.norm()) < 1e-4
    # the weights' gradient is F = f_ba - f_aa (the envelope rule, as the dense backend)
    assert float((ga.double() - (f_ba - f_aa)).norm() / (f_ba - f_aa).norm()) < 1e-5
    with pytest.raises(ValueError, match="d <= 3"):
        loss(torch.rand(10, 4), torch.rand(12, 4))
    with pytest.raises(NotImplementedError, match="one problem at a time"):
        loss(torch.rand(2, 10, 2), torch.rand(2, 12, 2))
    with pytest.raises(ValueError, match="only has a meaning with backend='multiscale'"):
        SamplesLoss("sinkhorn", cluster_scale=0.1)
    with pytest.raises(ValueError, match="tol=0.001 only has a meaning with backend='multiscale'"):
        SamplesLoss("sinkhorn", tol=1e-3)
    with pytest.raises(ValueError, match="truncate"):
        SamplesLoss("sinkhorn", backend="multiscale", truncate=-1.0)
    with pytest.raises(ValueError, match="tol"):
        SamplesLoss("sinkhorn", backend="multiscale", tol=0.0)


def test_update_and_mean_accepts_only_sums_in_the_fp16_range():
    """update_and_mean's pass (the tensor-core mean, TGT_MEAN) is used when every row sum at the old
    potential is in [2^-8, 3.9] (P_ij <= P 1 < 4 fits FP16 after its 2^14 scale): with the old
    potential eps / 2 above the update (P 1 = e^0.5) it returns the update and the softmin mean,
    with 2 eps above (P 1 = e^2 > 3.9) or 6 eps below (e^-6 < 2^-8) its flag declines it."""
    from torch_api.kernel_ops import clouds, lse_blocksparse, params
    from torch_api.multiscale.fine import update_and_mean
    x, y, a, b = _problem(31, 45, 37, 3)
    eps = 0.3
    X, Y = clouds(x, y)
    bm = multiscale_plans.blocksparse_block_m(3, "float32", runtime.on_gpu())
    rng = mc.column_ranges(torch.ones(-(-45 // bm), 1, dtype=torch.int8), torch.tensor([0, 37], dtype=torch.int32))
    g = 0.05 * torch.randn(37, generator=torch.Generator().manual_seed(3))
    lb = b.log()
    prm = params(eps, 0.5, "cpu")
    f, _ = lse_blocksparse(X, Y, g, prm, rng, "float32", logw_in=lb)
    (f_new, err), mean, ok = update_and_mean(X, Y, g, lb, f + 0.5 * eps, prm, rng, "float32")
    assert bool(ok)
    assert float((f_new - f).abs().max()) <= 1e-5 * float(f.abs().max()) + 1e-6
    assert float((err - (torch.exp(torch.tensor(0.5)) - 1.0)).abs().max()) <= 1e-5
    w = torch.softmax((g + eps * lb)[None, :] / eps - 0.5 * torch.cdist(X.x.double(), Y.x.double()) ** 2 / eps, dim=1)
    ref = w @ Y.x.double()
    spread = float(torch.cdist(Y.x.double(), Y.x.double()).max())
    assert float((mean.double() - ref).abs().max()) <= 2.0 ** -11 * spread
    assert not bool(update_and_mean(X, Y, g, lb, f + 2.0 * eps, prm, rng, "float32")[2])
    assert not bool(update_and_mean(X, Y, g, lb, f - 6.0 * eps, prm, rng, "float32")[2])


@pytest.mark.parametrize("d,truncate,scale,tol", [CASES[1], CASES[3]])
def test_declined_fused_pass_falls_back_to_the_same_result(monkeypatch, d, truncate, scale, tol):
    """When the fused pass declines (row sums outside its range), the sweep takes the shifted LSE
    kernel and direction() its own float32 passes: same potentials, same gradient rows (up to the
    fused mean's FP16 rounding)."""
    from torch_api.multiscale import fine
    from torch_api.multiscale.gradient import direction
    x, y, a, b = _problem(d + 40, 50, 40, d)
    both = torch.cat([x, y])
    diam = float((both.max(0).values - both.min(0).values).norm())
    run = lambda: anneal(x, y, a, b, 0.3, 0.5, diam, cluster_scale=scale, truncate=truncate, tol=tol)  # noqa: E731
    fused = run()
    assert all(m is not None for m in fused.state[4]["means"])
    orig = fine.update_and_mean
    monkeypatch.setattr(fine, "update_and_mean", lambda *args: orig(*args)[:2] + (torch.tensor(False),))
    fallback = run()
    assert all(m is None for m in fallback.state[4]["means"])
    for p, q in zip(fused.new, fallback.new):
        assert float((p - q).abs().max()) <= 1e-5 * float(q.abs().max()) + 1e-6
    rows_f, rows_b = direction(fused, 0), direction(fallback, 0)
    spread = float(torch.cdist(both, both).max())
    assert float((rows_f - rows_b).abs().max()) <= 2 * 2.0 ** -11 * spread
