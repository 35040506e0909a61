"""The multiscale solve's Taylor pass (torch_api/multiscale/taylor.py, kernels/taylor_blocksparse.py)
on the CPU (Triton interpreter): against float64 over the same kept cluster pairs, chunked or not,
its declining, the expansion's rules, and inside a solve against the direct pass."""

import math

import pytest
import torch

import torch_api
from ot_triton_jax.core import kernels, multiscale_rules as rules
from torch_api import kernel_ops
from torch_api.multiscale import taylor
from torch_api.multiscale import prewarm as ms
from torch_api.kernel_ops import params

EPS = 0.05 ** 2


def _sorted_cloud(p, side):
    d = p.shape[1]
    ids = (p / side).floor().long()
    key = ids[:, 0]
    for c in range(1, d):
        key = key * 64 + ids[:, c]
    uniq, lab = torch.unique(key, return_inverse=True)
    perm = torch.argsort(lab, stable=True)
    start = torch.zeros(uniq.numel() + 1, dtype=torch.int32)
    start[1:] = torch.cumsum(torch.bincount(lab, minlength=uniq.numel()), 0)
    return p[perm].contiguous(), lab[perm], start


def _problem(d, seed=0, n=70, m=60, side=0.06):
    g = torch.Generator().manual_seed(seed)
    xs, lx, sx = _sorted_cloud(torch.rand(n, d, generator=g) * 0.25, side)
    ys, ly, sy = _sorted_cloud(torch.rand(m, d, generator=g) * 0.25, side)
    keep = torch.rand(sx.numel() - 1, sy.numel() - 1, generator=g) < 0.6
    keep[torch.arange(keep.shape[0]), torch.randint(0, keep.shape[1], (keep.shape[0],), generator=g)] = True
    f, pot = torch.randn(n, generator=g) * 0.01, torch.randn(m, generator=g) * 0.01
    logw = torch.full((m,), -math.log(m))
    return taylor.TaylorSide(xs, lx, sx), taylor.TaylorSide(ys, ly, sy), keep, f, pot, logw


def _float64(src, tgt, keep, f, pot, logw):
    """f_i - eps log sum over the kept clusters' points of exp((f_i + pot_j + eps logw_j - C_ij) / eps)."""
    out, lab, start = [], src.labels.long(), tgt.start.long()
    for i in range(src.pts.shape[0]):
        cols = torch.cat([torch.arange(int(start[l]), int(start[l + 1])) for l in keep[lab[i]].nonzero()[:, 0]])
        z = (f[i].double() + pot[cols].double() + EPS * logw[cols].double()
             - 0.5 * ((src.pts[i].double() - tgt.pts[cols].double()) ** 2).sum(1)) / EPS
        out.append(f[i].double() - EPS * torch.logsumexp(z, 0))
    return torch.stack(out)


ORDERS = [(1, 5), (2, 5), (3, 5), (3, 7)]  # (d, order): both ranks at d = 3 (64 and 128)


@pytest.mark.parametrize("d, p", ORDERS)
def test_taylor_pass_matches_float64_chunked_or_not(monkeypatch, d, p):
    src, tgt, keep, f, pot, logw = _problem(d)
    # the centres are the clusters' box midpoints: every radius within half a voxel's diagonal
    assert 0.0 < max(src.max_radius, tgt.max_radius) <= 0.06 * math.sqrt(d) / 2 * (1 + 1e-6)
    bound = rules.taylor_bound(src.max_radius * tgt.max_radius / EPS, p)
    assert bound < 1e-3  # the test's geometry is within the expansion's reach
    prm = params(EPS, 0.5, f.device)
    out, err = taylor.lse(src, tgt, pot, logw, f, prm, taylor.pair_orders(keep, keep.T.contiguous())[0], True, p=p)
    ref = _float64(src, tgt, keep, f, pot, logw)
    # per pair a relative error <= bound: the potential within eps * bound (+ float32 rounding)
    assert float((out.double() - ref).abs().max()) <= EPS * (1.01 * bound + 4e-6)
    # err = |r - 1|, r the row sums at the old potential: r = exp((f - out) / eps)
    assert torch.allclose(err.double(), (torch.exp((f.double() - ref) / EPS) - 1.0).abs(), atol=2e-5)
    monkeypatch.setattr(taylor, "CHUNK_BYTES", 7 * 4 * rules.taylor_rank(d, p))  # many chunks of 7 pairs
    out_c, none = taylor.lse(src, tgt, pot, logw, f, prm, taylor.pair_orders(keep, keep.T.contiguous())[0], False, p=p)
    assert none is None and float((out_c - out).abs().max()) <= 2e-6 * EPS


def _float64_mean(src, tgt, keep, f, pot, logw):
    """sum_j P_ij y_j / sum_j P_ij over the kept clusters' points (float64)."""
    out, lab, start = [], src.labels.long(), tgt.start.long()
    for i in range(src.pts.shape[0]):
        cols = torch.cat([torch.arange(int(start[l]), int(start[l + 1])) for l in keep[lab[i]].nonzero()[:, 0]])
        z = (pot[cols].double() + EPS * logw[cols].double()
             - 0.5 * ((src.pts[i].double() - tgt.pts[cols].double()) ** 2).sum(1)) / EPS
        out.append(torch.softmax(z, 0) @ tgt.pts[cols].double())
    return torch.stack(out)


@pytest.mark.parametrize("d, p", ORDERS)
def test_taylor_mean_matches_float64(monkeypatch, d, p):
    """The evaluation's softmin mean (G > 1): the derivative of the truncated series, of order P - 1,
    so within t^P / P! e^t of the pairs' radius (plus float32 rounding), chunked or not; the
    update and error it returns are the plain pass's."""
    src, tgt, keep, f, pot, logw = _problem(d, seed=d)
    t = src.max_radius * tgt.max_radius / EPS
    prm = params(EPS, 0.5, f.device)
    order = taylor.pair_orders(keep, keep.T.contiguous())[0]
    out, err, mean = taylor.lse(src, tgt, pot, logw, f, prm, order, True, mean=True, p=p)
    plain, plain_err = taylor.lse(src, tgt, pot, logw, f, prm, order, True, p=p)
    # the same sums, taken in other steps (float32 rounding apart)
    assert float((out - plain).abs().max()) <= 4e-6 * EPS
    assert torch.allclose(err, plain_err, rtol=1e-5, atol=1e-6)  # |r - 1|, r up to ~600 here
    ref = _float64_mean(src, tgt, keep, f, pot, logw)
    assert mean.shape == (src.pts.shape[0], d)
    tol = tgt.max_radius * 1.01 * rules.taylor_bound(t, p - 1) + 1e-7  # + float32 rounding
    assert float((mean.double() - ref).abs().max()) <= tol
    monkeypatch.setattr(taylor, "CHUNK_BYTES", 5 * 4 * rules.taylor_rank(d, p))
    mean_c = taylor.lse(src, tgt, pot, logw, f, prm, order, False, mean=True, p=p)[2]
    assert float((mean_c - mean).abs().max()) <= 1e-6


def test_pair_orders_serve_the_plan_and_its_transpose():
    """pair_orders(keep, keep.T): the second list is the transposed plan's, so one build serves the
    x-y and y-x updates; each list's k-major and l-major views name the same pairs."""
    src, tgt, keep, f, pot, logw = _problem(2, seed=4)
    keep_t = keep.T.contiguous()
    order, order_t = taylor.pair_orders(keep, keep_t)
    for o, mask in ((order, keep), (order_t, keep_t)):
        kr = mask.shape[0]
        rows = torch.repeat_interleave(torch.arange(kr), o.lptr[1:] - o.lptr[:-1])
        assert torch.equal(torch.stack([rows, o.lidx.long()], 1), mask.nonzero())
        # the l-major pair p is (kidx[p], key // K_r) and sits at k-major position slot[p]
        lcol, krow = torch.div(o.key, kr, rounding_mode="floor"), o.key % kr
        assert torch.equal(krow, o.kidx.long()) and bool((o.key[1:] > o.key[:-1]).all())
        assert torch.equal(rows[o.slot.long()], krow) and torch.equal(o.lidx[o.slot.long()].long(), lcol)
    prm = params(EPS, 0.5, f.device)
    pot_x = torch.randn(src.pts.shape[0], generator=torch.Generator().manual_seed(9)) * 0.01
    logw_x = torch.full((src.pts.shape[0],), -math.log(src.pts.shape[0]))
    out = taylor.lse(tgt, src, pot_x, logw_x, pot, prm, order_t, False, p=5)[0]
    ref = _float64(tgt, src, keep_t, pot, pot_x, logw_x)
    bound = rules.taylor_bound(src.max_radius * tgt.max_radius / EPS, 5)
    assert float((out.double() - ref).abs().max()) <= EPS * (1.01 * bound + 4e-6)
    k = min(keep.shape)
    sym = keep[:k, :k] | keep_t[:k, :k]
    a, b = taylor.pair_orders(sym, sym)  # a self plan's symmetric mask: one list for both roles
    assert a is b and torch.equal(a.lidx, a.kidx)
    # several plans' lists built together (one host read) are each plan's own
    many = taylor.pair_orders_many([(keep, keep_t, False), (sym, sym, True), (keep, keep_t, True)])
    assert many[0][1] is None and many[1][0] is many[1][1]
    for got, want in ((many[0][0], order), (many[1][0], a), (many[2][0], order), (many[2][1], order_t)):
        for name in ("lptr", "lidx", "kidx", "key", "slot", "lptr_host"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name


def test_taylor_pass_declines_when_the_old_potential_is_far_off():
    src, tgt, keep, f, pot, logw = _problem(2)
    prm = params(EPS, 0.5, f.device)
    assert taylor.lse(src, tgt, pot, logw, f - 60.0 * EPS, prm, taylor.pair_orders(keep, keep.T.contiguous())[0], True) is None
    assert taylor.lse(src, tgt, pot, logw, f, prm, taylor.pair_orders(keep, keep.T.contiguous())[0], True) is not None


@pytest.mark.parametrize("p", rules.TAYLOR_ORDERS)
def test_taylor_rules(p):
    for d in (1, 2, 3):
        alphas = rules.taylor_alphas(d, p)
        assert len(alphas) == math.comb(p + d, d) == len(set(alphas))
        assert all(sum(a) <= p and all(x == 0 for x in a[d:]) for a in alphas)
        table, rank = rules.taylor_alpha_table(d, p), rules.taylor_rank(d, p)
        assert len(table) == rank >= len(alphas) and rank & (rank - 1) == 0 and rank < 2 * len(alphas) + 16
        # sum_alpha phi_alpha(u) phi_alpha(v) is the degree-p Taylor polynomial of exp(<u, v>)
        g = torch.Generator().manual_seed(d)
        u, v = torch.randn(d, generator=g).double() * 0.5, torch.randn(d, generator=g).double() * 0.5
        series = sum(row[3] ** 2 * math.prod(float(u[c] * v[c]) ** int(row[c]) for c in range(d)) for row in table)
        z = float(u @ v)
        assert series == pytest.approx(sum(z ** k / math.factorial(k) for k in range(p + 1)), rel=1e-12)
        assert abs(series - math.exp(z)) <= rules.taylor_bound(float(u.norm() * v.norm()), p) * math.exp(z) + 1e-14
    assert rules.taylor_bound(0.3, p) < rules.taylor_bound(0.6, p) < rules.TAYLOR_MAX_BOUND
    for d in (1, 2, 3):  # the mean's derivative monomials: v_c exp(<u, v>) = sum_alpha psi^c_alpha(u) phi_alpha(v)
        alphas, rank = rules.taylor_alphas(d, p), rules.taylor_rank(d, p)
        groups = rules.taylor_derivative_table(d, p)
        assert len(groups) == rules.taylor_mean_groups(d) > d and groups[0] == rules.taylor_alpha_table(d, p)
        assert all(len(gr) == rank for gr in groups)
        g = torch.Generator().manual_seed(10 + d)
        u, v = (torch.randn(3, generator=g).double() * 0.5 for _ in range(2))
        u[d:], v[d:] = 0.0, 0.0

        def mono(row, w):
            return row[3] * math.prod(float(w[c]) ** int(row[c]) for c in range(3))
        phi_v = [mono(row, v) for row in groups[0]]
        for c in range(rules.taylor_mean_groups(d) - 1):
            series = sum(mono(row, u) * q for row, q in zip(groups[c + 1], phi_v))
            if c >= d:
                assert series == 0.0
                continue
            # the derivative in u_c of the degree-p series of exp(<u, v>): v_c times its degree p - 1 part
            z = float(u @ v)
            want = float(v[c]) * sum(z ** k / math.factorial(k) for k in range(p))
            assert series == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert not rules.taylor_worthwhile(17, 200) and rules.taylor_worthwhile(67, 67)


def test_taylor_order_follows_the_tolerance():
    """The cheapest order whose worst-case relative error per pair weight is within a quarter of the
    tolerance (capped at TAYLOR_MAX_BOUND); with the mean the series' derivative, one degree lower,
    decides; None where no order reaches it (the direct pass)."""
    t = 0.53  # r_k r_l / eps <= (0.84 sqrt(3) / 2)^2 at the default cell side (0.84 blur), box centres
    assert rules.taylor_limit(5e-3) == rules.taylor_limit(None) == rules.TAYLOR_MAX_BOUND == 0.25 * 5e-3
    assert rules.taylor_limit(1e-4) == 0.25 * 1e-4
    assert rules.taylor_order(t, 5e-3) == 5 and rules.taylor_order(t, 5e-3, mean=True) == 5
    assert rules.taylor_order(t, 1e-4) == 7 and rules.taylor_order(t, 1e-4, mean=True) == 7
    assert rules.taylor_order(t, 1e-7) is None and rules.taylor_order(2.0, 5e-3) is None
    for tol in (None, 5e-3, 1e-3, 1e-4, 1e-5):
        for mean in (False, True):
            for tt in (0.1, 0.3, 0.56, 0.7, 1.0):
                p = rules.taylor_order(tt, tol, mean)
                if p is not None:  # its bound is within the limit, and no cheaper order's is
                    assert rules.taylor_bound(tt, p - mean) <= rules.taylor_limit(tol)
                    assert all(rules.taylor_bound(tt, q - mean) > rules.taylor_limit(tol)
                               for q in rules.TAYLOR_ORDERS if q < p)
                else:
                    assert all(rules.taylor_bound(tt, q - mean) > rules.taylor_limit(tol) for q in rules.TAYLOR_ORDERS)


def test_mode_is_checked(monkeypatch):
    monkeypatch.setattr(taylor, "MODE", "off")
    with pytest.raises(ValueError, match="MODE must be 'auto', 'always' or 'never'"):
        taylor.wanted(100.0, 100.0)
    monkeypatch.setattr(taylor, "MODE", "auto")
    assert not taylor.wanted(100.0, 100.0)  # the CPU takes the direct pass


def test_self_masks_are_symmetric():
    """The solve passes a self plan's mask as its own transpose to the Taylor pass."""
    from torch_api.multiscale import bounds as mb
    from torch_api.multiscale.clusters import cluster_pair
    g = torch.Generator().manual_seed(3)
    x = torch.rand(90, 2, generator=g)
    a = torch.full((90,), 1.0 / 90)
    cx, _ = cluster_pair(x, a, x, a, 0.15)
    geo = mb.geometry(x[cx.perm].double(), a[cx.perm], cx)
    pot = torch.randn(90, generator=g).double() * 0.01
    fit = mb.fit(geo, pot)
    keep = mb.keep_pairs(geo, fit, geo, fit, 0.01, 5.0)
    assert 0 < int(keep.sum()) < keep.numel() and torch.equal(keep, keep.T)


def solve_in_modes(monkeypatch, x, y, blur, modes) -> dict:
    """Per multiscale.taylor.MODE: (value, gradient in x, the solve's report, the descriptions it
    launched) of SamplesLoss(backend="multiscale") at ``blur`` (scaling 0.5)."""
    out = {}
    for mode in modes:
        monkeypatch.setattr(taylor, "MODE", mode)
        ran = []
        steps = kernel_ops._steps
        monkeypatch.setattr(kernel_ops, "_steps", lambda seq: ran.append(seq) or steps(seq))
        loss = torch_api.SamplesLoss("sinkhorn", blur=blur, scaling=0.5, backend="multiscale")
        xg = x.clone().requires_grad_(True)
        value = loss(xg, y)
        (grad,) = torch.autograd.grad(value, xg)
        monkeypatch.setattr(kernel_ops, "_steps", steps)
        out[mode] = (float(value), grad, loss.last_multiscale, ran)
    return out


def test_solve_with_the_taylor_pass_matches_the_direct_one(monkeypatch):
    """MODE "always" (on the CPU "auto" never takes it) against "never": the same solve to within the
    truncation's reach (the Taylor pass keeps the cluster pairs, the direct pass a row block's union),
    with the Taylor passes reported, and every kernel the solve launched in its prewarm list."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.rand(90, 2, generator=g), torch.rand(80, 2, generator=g) * 0.9 + 0.05
    out = solve_in_modes(monkeypatch, x, y, 0.1, ("never", "always"))
    (v0, g0, r0, _), (v1, g1, r1, ran) = out["never"], out["always"]
    assert r0.taylor_passes == 0 and r1.taylor_passes == 4 * r1.sweeps  # the x side's with its means too
    assert r1.converged and r1.marginal_error <= 5e-3
    eps = 0.1 ** 2
    assert abs(v1 - v0) <= eps * (r0.dropped_mass_bound + r1.dropped_mass_bound) + 1e-6 * abs(v0)
    assert torch.isfinite(g1).all() and float((g1 - g0).norm()) <= 1e-2 * float(g0.norm())
    kx, ky = r1.clusters
    listed = {(s.calls[0].kernel, tuple(sorted(s.calls[0].constexprs.items())))
              for s in ms.kernel_descriptions(90, 80, kx, ky, 2, "float32", True, True, (True, False), True)}
    taylor_kernels = (kernels.taylor_monomials_kernel, kernels.taylor_moments_kernel, kernels.taylor_evaluate_kernel)
    launched = {(s.calls[0].kernel, tuple(sorted(s.calls[0].constexprs.items()))) for s in ran
                if s.calls[0].kernel in taylor_kernels}
    assert len(launched) == 5 and launched <= listed  # moments and evaluation with and without the mean


def test_every_plan_takes_the_taylor_pass_without_gradients(monkeypatch):
    """No gradient asked: all four plans' updates (x-y with the y-x mask as its transpose, the self
    plans with their own symmetric masks) go through the Taylor pass, and the value stays the direct
    solve's to within the truncation's reach."""
    g = torch.Generator().manual_seed(7)
    x, y = torch.rand(80, 2, generator=g), torch.rand(70, 2, generator=g) * 0.9 + 0.05
    values, reports = {}, {}
    for mode in ("never", "always"):
        monkeypatch.setattr(taylor, "MODE", mode)
        loss = torch_api.SamplesLoss("sinkhorn", blur=0.1, scaling=0.5, backend="multiscale")
        with torch.no_grad():
            values[mode] = float(loss(x, y))
        reports[mode] = loss.last_multiscale
    r = reports["always"]
    assert reports["never"].taylor_passes == 0 and r.taylor_passes == 4 * r.sweeps
    assert r.converged
    bound = reports["never"].dropped_mass_bound + r.dropped_mass_bound
    assert abs(values["always"] - values["never"]) <= 0.1 ** 2 * bound + 1e-6 * abs(values["never"])


def test_a_declined_taylor_pass_in_the_solve_falls_back_to_the_direct_one(monkeypatch):
    """The solve reads the Taylor passes' range checks together with the marginal error (deferred):
    a pass whose check fails is redone by the direct one (with the mean where the gradient asks),
    so forcing every check to fail gives the direct solve ("never") and no Taylor pass reported."""
    g = torch.Generator().manual_seed(5)
    x, y = torch.rand(90, 2, generator=g), torch.rand(80, 2, generator=g) * 0.9 + 0.05
    ref = solve_in_modes(monkeypatch, x, y, 0.1, ("never",))["never"]
    lse = taylor.lse
    monkeypatch.setattr(taylor, "lse", lambda *a, **k: lse(*a, **k)[:-1] + (torch.tensor(False),))
    out = solve_in_modes(monkeypatch, x, y, 0.1, ("always",))["always"]
    assert out[2].taylor_passes == 0 and all(m is not None for m in out[2].state[4]["means"][::2])
    assert out[0] == ref[0] and torch.equal(out[1], ref[1])


def test_prewarm_orders_are_the_orders_the_passes_take(monkeypatch):
    """multiscale.prewarm.taylor_orders (the prewarm's key, read once after the clustering) names the
    orders multiscale.taylor.order gives each plan from the Taylor sides: the same box centres and
    radii; per tolerance, with and without the gradient's mean; nothing where no plan asks for it."""
    from torch_api.multiscale.clusters import cluster_pair
    monkeypatch.setattr(taylor, "MODE", "always")
    g = torch.Generator().manual_seed(11)
    x, y = torch.rand(300, 3, generator=g), torch.rand(250, 3, generator=g) * 0.8 + 0.1
    a, b = torch.full((300,), 1.0 / 300), torch.full((250,), 1.0 / 250)
    cx, cy = cluster_pair(x, a, y, b, 0.2)
    xs, ys = x[cx.perm], y[cy.perm]
    sides = (taylor.TaylorSide(xs, cx.label, cx.start), taylor.TaylorSide(ys, cy.label, cy.start))
    per = (300 / cx.k, 250 / cy.k)
    plans = [(0, 1), (1, 0), (0, 0), (1, 1)]
    for eps in (0.01, 0.02, 0.05):
        for tol in (5e-3, 1e-4, 1e-7):
            plain, mean = ms.taylor_orders(xs, ys, cx, cy, per, [eps], tol, True, (True, False), True)
            want_plain = {taylor.order(sides[s], sides[t], eps, tol) for s, t in plans} - {None}
            want_mean = {taylor.order(sides[0], sides[t], eps, tol, True) for s, t in plans if s == 0} - {None}
            assert set(plain) == want_plain and set(mean) == want_mean, (eps, tol)
    assert ms.taylor_orders(xs, ys, cx, cy, per, [0.02], 5e-3, True, (True, False), False) == ((), ())
    monkeypatch.setattr(taylor, "MODE", "never")
    assert ms.taylor_orders(xs, ys, cx, cy, per, [0.02], 5e-3, True, (True, False), True) == ((), ())
