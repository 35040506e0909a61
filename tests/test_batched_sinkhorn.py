"""``torch_api.sinkhorn_batch`` (one launch per half-step for the whole batch) against a loop of
single solves ``torch_api.sinkhorn``: same iterations per problem, potentials and costs to float32
rounding. Ragged sizes (a problem of one point included), n != m, non-uniform weights with zeros,
problems that stop at different iterations; the packed layout's rules."""

import math

import numpy as np
import pytest
import torch

import torch_api
from ot_triton_jax.core import batch_layout


def _problems(sizes, d=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k, (n, m) in enumerate(sizes):
        x = torch.randn(n, d, generator=g)
        y = torch.randn(m, d, generator=g) * (1.0 + 0.5 * k) + 0.3 * k  # different conditioning: different stops
        a, b = torch.rand(n, generator=g) + 0.1, torch.rand(m, generator=g) + 0.1
        if n > 2:
            a[1] = 0.0
        if m > 2:
            b[-1] = 0.0
        out.append((x, y, a / a.sum(), b / b.sum()))
    return out


def _rel(u, ref, scale=None):
    """Relative distance on the finite entries (the same ones in both), to ``scale`` (default the
    reference's norm: a one-point problem's f is ~0 and is measured against g's scale)."""
    s = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(u), s)
    scale = ref[s].double().norm() if scale is None else scale
    return float((u[s].double() - ref[s].double()).norm() / max(float(scale), 1e-30))


@pytest.mark.parametrize("threshold,max_iterations", [(1e-3, 300), (1e-12, 25)])
def test_batch_equals_a_loop_of_single_solves(threshold, max_iterations):
    probs = _problems([(37, 29), (1, 5), (70, 64), (16, 41)])
    kw = dict(epsilon=0.6, threshold=threshold, inner_iterations=5, max_iterations=max_iterations)
    out = torch_api.sinkhorn_batch([p[0] for p in probs], [p[1] for p in probs],
                                   [p[2] for p in probs], [p[3] for p in probs], **kw)
    iters = []
    for k, (x, y, a, b) in enumerate(probs):
        ref = torch_api.sinkhorn(x, y, a, b, **kw)
        iters.append(int(ref.n_iters))
        assert int(out.n_iters[k]) == int(ref.n_iters), k
        assert bool(out.converged[k]) == bool(ref.converged), k
        scale = torch.cat([ref.f[torch.isfinite(ref.f)], ref.g[torch.isfinite(ref.g)]]).double().norm()
        assert _rel(out.f[k], ref.f, scale) < 1e-5 and _rel(out.g[k], ref.g, scale) < 1e-5, k
        assert abs(float(out.reg_ot_cost[k]) - float(ref.reg_ot_cost)) <= 1e-5 * abs(float(ref.reg_ot_cost)) + 1e-6
    if threshold == 1e-3:
        assert len(set(iters)) > 1, "the problems should stop at different iterations"
    else:
        assert not bool(out.converged.any()) and set(iters) == {max_iterations}


def test_equal_sizes_as_one_tensor():
    probs = _problems([(20, 24)] * 3, seed=1)
    shift = 40.0 * torch.arange(3.0)[:, None, None]  # far-apart problems: each is packed around its own centre
    x, y = torch.stack([p[0] for p in probs]) + shift, torch.stack([p[1] for p in probs]) + shift
    out = torch_api.sinkhorn_batch(x, y, epsilon=0.5)
    for k in range(3):
        ref = torch_api.sinkhorn(x[k], y[k], epsilon=0.5)
        assert int(out.n_iters[k]) == int(ref.n_iters) and _rel(out.f[k], ref.f) < 1e-5
    # torch_api.sinkhorn on the (B, n, d) tensors is the batch; what the batch lacks raises, naming it
    same = torch_api.sinkhorn(x, y, epsilon=0.5)
    assert torch.equal(same.reg_ot_cost, out.reg_ot_cost) and all(torch.equal(u, v) for u, v in zip(same.g, out.g))
    with pytest.raises(NotImplementedError, match="takes no init"):
        torch_api.sinkhorn(x, y, epsilon=0.5, init=(out.f[0], out.g[0]))
    with pytest.raises(ValueError, match=r"b must be a \(3, 24\) tensor"):
        torch_api.sinkhorn(x, y, torch.stack([p[2] for p in probs]), torch.stack([p[3][1:] for p in probs]),
                           epsilon=0.5)
    with pytest.raises(ValueError, match="same B"):
        torch_api.sinkhorn(x, y[:2], epsilon=0.5)
    with pytest.raises(ValueError, match="A batch of problems goes through"):
        torch_api.sinkhorn(x[None], y[None], epsilon=0.5)


@pytest.mark.parametrize("n,m", [(16, 11), (13, 32)])  # a row block of 16 on the CPU: unpadded and padded
def test_dense_batch_with_weights_equals_the_single_solves(n, m):
    """A (B, n, d) batch with (B, n), (B, m) weights (zeros included) is packed on the device;
    each problem's iterations, f, g, cost and gradients in the 3-D points are its single solve's."""
    probs = _problems([(n, m)] * 3, seed=5)
    x = torch.stack([p[0] for p in probs]).requires_grad_()
    y = torch.stack([p[1] for p in probs]).requires_grad_()
    a, b = torch.stack([p[2] for p in probs]), torch.stack([p[3] for p in probs])
    kw = dict(epsilon=0.4, threshold=1e-5)
    out = torch_api.sinkhorn_batch(x, y, a, b, **kw)
    w = torch.tensor([1.0, -0.5, 2.0])
    gx, gy = torch.autograd.grad((w * out.reg_ot_cost).sum(), (x, y))
    assert gx.shape == x.shape and gy.shape == y.shape
    for k in range(3):
        xr, yr = x[k].detach().clone().requires_grad_(), y[k].detach().clone().requires_grad_()
        ref = torch_api.sinkhorn(xr, yr, a[k], b[k], **kw)
        rx, ry = torch.autograd.grad(ref.reg_ot_cost, (xr, yr))
        assert int(out.n_iters[k]) == int(ref.n_iters) and bool(out.converged[k]), k
        assert out.f[k].shape == (n,) and out.g[k].shape == (m,)
        scale = torch.cat([ref.f[torch.isfinite(ref.f)], ref.g[torch.isfinite(ref.g)]]).double().norm()
        assert _rel(out.f[k], ref.f, scale) < 1e-5 and _rel(out.g[k], ref.g, scale) < 1e-5, k
        assert abs(float(out.reg_ot_cost[k]) - float(ref.reg_ot_cost)) <= 1e-5 * abs(float(ref.reg_ot_cost)), k
        assert _rel(gx[k], w[k] * rx) < 1e-5 and _rel(gy[k], w[k] * ry) < 1e-5, k
    with pytest.raises(ValueError, match="problem 1: a and b must have the same total mass"):
        torch_api.sinkhorn_batch(x.detach(), y.detach(), a, b * torch.tensor([[1.0], [2.0], [1.0]]), **kw)
    with pytest.raises(ValueError, match=r"bs must be a \(3, %d\) tensor" % m):
        torch_api.sinkhorn_batch(x.detach(), y.detach(), a, b[:, 1:], **kw)
    bad = x.detach().clone()
    bad[2, 3, 1] = float("nan")
    with pytest.raises(ValueError, match="xs contains NaN"):
        torch_api.sinkhorn_batch(bad, y.detach(), **kw)
    with pytest.raises(ValueError, match="as_ .*negative"):
        torch_api.sinkhorn_batch(x.detach(), y.detach(), a - 0.5 * a.max(), b, **kw)


def test_layout_rules():
    lay = batch_layout.cloud_layout([5, 1, 9], 4)
    assert lay.offsets == (0, 8, 12) and lay.rows == 24
    assert list(lay.segment[:9]) == [0] * 5 + [-1] * 3 + [1]
    other = batch_layout.cloud_layout([2, 3, 4], 4)
    r = batch_layout.column_ranges(lay, other)
    assert r.shape == (6, 1, 2) and r[0, 0].tolist() == [0, 2] and r[2, 0].tolist() == [4, 7] and r[5, 0].tolist() == [8, 12]
    with pytest.raises(ValueError, match="at least one point"):
        batch_layout.cloud_layout([3, 0], 4)
    with pytest.raises(ValueError, match="different numbers of problems"):
        batch_layout.column_ranges(lay, batch_layout.cloud_layout([1], 4))
    owners = batch_layout.block_problems(lay)
    assert owners.tolist() == [0, 0, 1, 2, 2, 2]
    done = np.array([False, True, False])
    for xp, cast in ((np, np.asarray), (torch, torch.as_tensor)):
        act = np.asarray(batch_layout.active_ranges(xp, cast(r), cast(owners), cast(done)))
        assert act[2, 0].tolist() == [4, 4]  # problem 1's block: an empty range
        assert np.array_equal(np.delete(act, 2, 0), np.delete(r, 2, 0))


def test_a_stopped_problems_blocks_stream_nothing(monkeypatch):
    """Every launch after a problem's stop streams no column for its row blocks: in the last
    launch exactly the blocks of the problems that ran to the last measurement keep their ranges."""
    from torch_api import batched_loop
    probs = _problems([(37, 29), (1, 5), (70, 64), (16, 41)])
    launches, real = [], batched_loop.lse_blocksparse

    def spy(src, tgt, pot, prm, ranges, *args, **kw):
        launches.append(ranges.clone())
        return real(src, tgt, pot, prm, ranges, *args, **kw)

    monkeypatch.setattr(batched_loop, "lse_blocksparse", spy)
    out = torch_api.sinkhorn_batch(*([p[i] for p in probs] for i in range(4)), epsilon=0.6, threshold=1e-3,
                                   inner_iterations=5, max_iterations=300)
    iters = out.n_iters.tolist()
    assert len(set(iters)) > 1

    def running(ranges):  # a block's range starts at its problem's columns: the problems by start
        starts = sorted(set(ranges[:, 0, 0].tolist()))
        return {starts.index(int(s)) for s, e in ranges[:, 0].tolist() if e > s}

    assert running(launches[0]) == set(range(4))
    assert running(launches[-1]) == {k for k, it in enumerate(iters) if it == max(iters)}


def test_bad_input_raises():
    probs = _problems([(6, 5), (4, 7)])
    xs, ys = [p[0] for p in probs], [p[1] for p in probs]
    with pytest.raises(ValueError, match="same number of problems"):
        torch_api.sinkhorn_batch(xs, ys[:1], epsilon=0.5)
    with pytest.raises(ValueError, match="same dimension on the same device"):
        torch_api.sinkhorn_batch([xs[0], torch.randn(4, 2)], [ys[0], torch.randn(7, 2)], epsilon=0.5)
    with pytest.raises(ValueError, match="same total mass"):
        torch_api.sinkhorn_batch(xs, ys, [p[2] for p in probs], [2 * p[3] for p in probs], epsilon=0.5)


def _potentials_loss(f, g, uf, ug):
    fin_f, fin_g = torch.isfinite(f), torch.isfinite(g)
    return torch.where(fin_f, uf * f, 0.0).sum() + torch.where(fin_g, ug * g, 0.0).sum()


@pytest.mark.parametrize("dense,taus", [(False, (1.0, 1.0)), (True, (1.0, 1.0)), (False, (0.8, 0.9))])
def test_potentials_and_weight_derivatives_equal_the_single_solves(dense, taus):
    """The VJPs of f, g and reg_ot_cost of a packed batch in the points and weights are each problem's
    single call's (a problem of one point and one without cotangent included: its gradient is zero)."""
    sizes = [(20, 24)] * 3 if dense else [(19, 11), (1, 6), (14, 23)]
    probs = _problems(sizes, seed=7)
    gen = torch.Generator().manual_seed(8)
    cts = [(torch.randn(n, generator=gen), torch.randn(m, generator=gen)) for n, m in sizes]
    kw = dict(epsilon=0.5, threshold=1e-6, tau_a=taus[0], tau_b=taus[1])
    if taus != (1.0, 1.0):  # relaxed: masses differ
        probs = [(x, y, a, (1.5 + k) * b) for k, (x, y, a, b) in enumerate(probs)]
    leaves = [[p[i].clone().requires_grad_() for p in probs] for i in range(4)]
    if dense:
        out = torch_api.sinkhorn_batch(*(torch.stack(v) for v in leaves), **kw)
    else:
        out = torch_api.sinkhorn_batch(*leaves, **kw)
    for what in ("potentials", "cost"):
        if what == "potentials":
            loss = sum(_potentials_loss(out.f[k], out.g[k], *cts[k]) for k in (0, 2))
        else:
            loss = 0.7 * out.reg_ot_cost[0] - 1.3 * out.reg_ot_cost[2]
        grads = torch.autograd.grad(loss, sum(leaves, []), retain_graph=True)
        for k in range(len(probs)):
            mine = grads[k::len(probs)]  # x_k, y_k, a_k, b_k
            if k == 1:
                assert all(float(t.abs().max()) == 0.0 for t in mine)
                continue
            ref_in = [t[k].detach().clone().requires_grad_() for t in leaves]
            ref = torch_api.sinkhorn(*ref_in, **kw)
            ref_loss = (_potentials_loss(ref.f, ref.g, *cts[k]) if what == "potentials"
                        else (0.7 if k == 0 else -1.3) * ref.reg_ot_cost)
            want = torch.autograd.grad(ref_loss, ref_in)
            # the VJP's CG amplifies the float32 rounding of f, g; the weights' cost gradient f - eps log a + ...
            # cancels to a fraction of f's scale (float32 rounding of f relative to that: ~1e-5)
            tol = 1e-5 if what == "cost" and i < 2 else 1e-4
            for i, (u, v) in enumerate(zip(mine, want)):
                assert float(v.abs().max()) > 0, (what, k, i)
                assert _rel(u, v) < tol, (what, k, i, _rel(u, v))


@pytest.mark.parametrize("taus", [(1.0, 1.0), (0.8, 0.9)])
def test_epsilon_and_scale_cost_gradients_are_the_single_calls(taus):
    """The batch shares epsilon and scale_cost: the gradient of sum_k w_k reg_ot_cost_k in them is
    the sum of the single calls'; those of the potentials and second derivatives in them raise."""
    probs = _problems([(19, 11), (1, 6), (14, 23)], seed=7)
    if taus != (1.0, 1.0):
        probs = [(x, y, a, (1.5 + k) * b) for k, (x, y, a, b) in enumerate(probs)]
    kw = dict(threshold=1e-6, tau_a=taus[0], tau_b=taus[1])
    w = torch.tensor([0.7, 0.2, -1.3])
    eps, sc = torch.tensor(0.5, requires_grad=True), torch.tensor(2.0, requires_grad=True)
    out = torch_api.sinkhorn_batch(*([p[i] for p in probs] for i in range(4)), epsilon=eps, scale_cost=sc, **kw)
    ge, gs = torch.autograd.grad((w * out.reg_ot_cost).sum(), (eps, sc), retain_graph=True)
    want = torch.zeros(2, dtype=torch.float64)
    for k, p in enumerate(probs):
        e1, s1 = torch.tensor(0.5, requires_grad=True), torch.tensor(2.0, requires_grad=True)
        one = torch_api.sinkhorn(*p, epsilon=e1, scale_cost=s1, **kw)
        want += torch.stack(torch.autograd.grad(w[k] * one.reg_ot_cost, (e1, s1))).double()
    assert abs(float(ge) - float(want[0])) <= 1e-5 * abs(float(want[0])) and float(want[0]) != 0.0
    assert abs(float(gs) - float(want[1])) <= 1e-5 * abs(float(want[1])) and float(want[1]) != 0.0
    with pytest.raises(NotImplementedError, match="epsilon or scale_cost"):
        torch.autograd.grad(out.f[0].sum(), eps)
    xs = [p[0].clone().requires_grad_() for p in probs]
    out = torch_api.sinkhorn_batch(xs, [p[1] for p in probs], [p[2] for p in probs], [p[3] for p in probs],
                                   epsilon=eps, scale_cost=2.0, **kw)
    gx = torch.autograd.grad(out.reg_ot_cost.sum(), xs[0], create_graph=True)[0]
    with pytest.raises(NotImplementedError, match="epsilon or scale_cost"):
        torch.autograd.grad(gx.sum(), eps)


def test_relaxed_marginals_equal_the_single_solves():
    """tau_a, tau_b < 1 for the batch: unequal masses, each problem's f, g, iterations, relaxed
    reg_ot_cost and its first and second derivatives in the points (a problem of one point
    included) are its single solve's."""
    probs = _problems([(21, 13), (1, 6), (17, 25)], seed=4)
    xs = [p[0].clone().requires_grad_() for p in probs]
    ys = [p[1].clone().requires_grad_() for p in probs]
    as_ = [p[2] for p in probs]
    bs = [(1.5 + k) * p[3] for k, p in enumerate(probs)]  # masses differ from a's
    kw = dict(epsilon=0.5, threshold=1e-5, tau_a=0.8, tau_b=0.95)
    out = torch_api.sinkhorn_batch(xs, ys, as_, bs, **kw)
    grads = torch.autograd.grad(out.reg_ot_cost.sum(), xs + ys, create_graph=True)
    gen = torch.Generator().manual_seed(7)
    vs = [torch.randn(t.shape, generator=gen) for t in xs + ys]
    hess = torch.autograd.grad(sum((g * v).sum() for g, v in zip(grads, vs)), xs + ys)
    for k in range(3):
        xr, yr = xs[k].detach().clone().requires_grad_(), ys[k].detach().clone().requires_grad_()
        ref = torch_api.sinkhorn(xr, yr, as_[k], bs[k], **kw)
        gx, gy = torch.autograd.grad(ref.reg_ot_cost, (xr, yr), create_graph=True)
        hx, hy = torch.autograd.grad((gx * vs[k]).sum() + (gy * vs[3 + k]).sum(), (xr, yr))
        assert _rel(hess[k], hx) < 1e-4 and _rel(hess[3 + k], hy) < 1e-4, k
        gx, gy = gx.detach(), gy.detach()
        assert int(out.n_iters[k]) == int(ref.n_iters) and bool(ref.converged), k
        scale = torch.cat([ref.f[torch.isfinite(ref.f)], ref.g[torch.isfinite(ref.g)]]).double().norm()
        assert _rel(out.f[k], ref.f, scale) < 1e-5 and _rel(out.g[k], ref.g, scale) < 1e-5, k
        assert abs(float(out.reg_ot_cost[k]) - float(ref.reg_ot_cost)) <= 1e-5 * abs(float(ref.reg_ot_cost)), k
        assert _rel(grads[k].detach(), gx) < 1e-5 and _rel(grads[3 + k].detach(), gy) < 1e-5, k
    with pytest.raises(ValueError, match="tau_a"):
        torch_api.sinkhorn_batch(xs, ys, as_, bs, epsilon=0.5, tau_a=1.5)


def test_cost_derivatives_in_the_points_and_weights_equal_the_single_solves():
    """First and second derivatives (a double backward) of a ragged batch's reg_ot_cost, each
    problem weighted: every problem's gradient and HVP in x, y, a and b (mixed blocks included) are
    its single call's."""
    probs = _problems([(23, 17), (9, 30)], seed=2)
    leaves = [[p[i].clone().requires_grad_() for p in probs] for i in range(4)]
    kw = dict(epsilon=0.5, threshold=1e-6, scale_cost=2.0, implicit=torch_api.ImplicitOptions(rtol=1e-6))
    out = torch_api.sinkhorn_batch(*leaves, **kw)
    flat = sum(leaves, [])  # x_0, x_1, y_0, y_1, a_0, a_1, b_0, b_1
    w = torch.tensor([0.7, -1.3])
    grads = torch.autograd.grad((w * out.reg_ot_cost).sum(), flat, create_graph=True)
    gen = torch.Generator().manual_seed(6)
    vs = [torch.randn(t.shape, generator=gen) for t in flat]
    vs = [torch.where(t > 0, v, 0.0) if i >= 4 else v for i, (t, v) in enumerate(zip(flat, vs))]  # keep the support
    hess = torch.autograd.grad(sum((g * v).sum() for g, v in zip(grads, vs)), flat)
    for k, prob in enumerate(probs):
        ref_in = [t.clone().requires_grad_() for t in prob]
        ref = torch.autograd.grad(torch_api.sinkhorn(*ref_in, **kw).reg_ot_cost, ref_in, create_graph=True)
        ref_h = torch.autograd.grad(sum((g * vs[2 * i + k]).sum() for i, g in enumerate(ref)), ref_in)
        for i in range(4):
            assert _rel(grads[2 * i + k].detach(), w[k] * ref[i].detach()) < 1e-5, (k, i)
            assert _rel(hess[2 * i + k], w[k] * ref_h[i]) < 1e-4, (k, i, _rel(hess[2 * i + k], w[k] * ref_h[i]))


def test_segment_sinkhorn_is_the_batch_of_its_segments():
    """OTT's segment form: concatenated clouds with sizes or sorted ids, weights per point."""
    probs = _problems([(12, 7), (1, 9), (15, 15)], seed=3)
    x, y = torch.cat([p[0] for p in probs]), torch.cat([p[1] for p in probs])
    wx, wy = torch.cat([p[2] for p in probs]), torch.cat([p[3] for p in probs])
    kw = dict(epsilon=0.5, threshold=1e-4)
    ids_y = torch.repeat_interleave(torch.arange(3), torch.tensor([7, 9, 15]))
    cost = torch_api.segment_sinkhorn(x, y, num_per_segment_x=[12, 1, 15], segment_ids_y=ids_y,
                                      weights_x=wx, weights_y=wy, **kw)
    for k, (xk, yk, a, b) in enumerate(probs):
        ref = float(torch_api.sinkhorn(xk, yk, a, b, **kw).reg_ot_cost)
        assert abs(float(cost[k]) - ref) <= 1e-5 * abs(ref) + 1e-6, k
    # default weights: uniform within each segment; the gradient in the concatenated points
    xg = x.clone().requires_grad_()
    cost = torch_api.segment_sinkhorn(xg, y, num_per_segment_x=[12, 1, 15], num_per_segment_y=[7, 9, 15], **kw)
    (gx,) = torch.autograd.grad((torch.tensor([1.0, 2.0, -1.0]) * cost).sum(), xg)
    for k, (xk, yk, _, _), lo, hi in zip(range(3), probs, (0, 12, 13), (12, 13, 28)):
        xr = xk.clone().requires_grad_()
        ref = torch_api.sinkhorn(xr, yk, **kw).reg_ot_cost
        (rx,) = torch.autograd.grad(ref, xr)
        assert abs(float(cost[k]) - float(ref)) <= 1e-5 * abs(float(ref)) + 1e-6, k
        assert _rel(gx[lo:hi], (1.0, 2.0, -1.0)[k] * rx, float(rx.norm()) + 1e-6) < 1e-5, k
    bad = x.clone()
    bad[3, 0] = float("nan")
    with pytest.raises(ValueError, match="x contains NaN"):
        torch_api.segment_sinkhorn(bad, y, num_per_segment_x=[12, 1, 15], num_per_segment_y=[7, 9, 15], **kw)
    with pytest.raises(ValueError, match="weights_y has negative"):
        torch_api.segment_sinkhorn(x, y, num_per_segment_x=[12, 1, 15], num_per_segment_y=[7, 9, 15], weights_x=wx,
                                   weights_y=wy - 0.05, **kw)
    with pytest.raises(ValueError, match="exactly one of num_per_segment_x and segment_ids_x"):
        torch_api.segment_sinkhorn(x, y, num_per_segment_y=[7, 9, 15], epsilon=0.5)
    # ids in any order (OTT's default indices_are_sorted=False): the same costs, the gradient follows the points
    perm = torch.randperm(y.shape[0], generator=torch.Generator().manual_seed(5))
    yp = y[perm].clone().requires_grad_()
    cost_p = torch_api.segment_sinkhorn(x, yp, num_per_segment_x=[12, 1, 15], segment_ids_y=ids_y[perm],
                                        weights_y=wy[perm], weights_x=wx, max_measure_size=15, **kw)
    yg = y.clone().requires_grad_()
    cost_s = torch_api.segment_sinkhorn(x, yg, num_per_segment_x=[12, 1, 15], segment_ids_y=ids_y, weights_x=wx,
                                        weights_y=wy, **kw)
    (gp,), (gs,) = torch.autograd.grad(cost_p.sum(), yp), torch.autograd.grad(cost_s.sum(), yg)
    # another packing (padded to max_measure_size, another centre): float32 rounding of the plan passes
    assert _rel(cost_p.detach(), cost_s.detach()) < 1e-6 and _rel(gp, gs[perm]) < 1e-5
    with pytest.raises(ValueError, match="max_measure_size .14. must be at least the largest segment .15"):
        torch_api.segment_sinkhorn(x, y, num_per_segment_x=[12, 1, 15], segment_ids_y=ids_y, max_measure_size=14,
                                   epsilon=0.5)
    with pytest.raises(ValueError, match="hold 27 points"):
        torch_api.segment_sinkhorn(x, y, num_per_segment_x=[12, 15], num_per_segment_y=[7, 9, 15], epsilon=0.5)


@pytest.mark.parametrize("taus,scale_b,static_b", [(1.0, 1.0, False), (0.8, 1.5, False), (1.0, 1.0, True)])
def test_divergence_of_a_batch_is_each_problems_divergence(taus, scale_b, static_b):
    """torch_api.sinkhorn_divergence on (B, n, d), packed (one loop for the (x, y) problems, one for
    the 2B symmetric self solves), equals each problem's single call to float32 rounding: the
    divergence and its x, y gradients, and every problem's potentials, iterations, error records and
    costs (balanced; relaxed with unequal masses; static_b). Non-uniform weights with zeros, n != m,
    problems that stop at different iterations; a double backward gives each problem's HVP."""
    probs = [(x, y * (1.0 + 0.5 * k), a, b) for k, (x, y, a, b) in enumerate(_problems([(14, 10)] * 3, d=2, seed=3))]
    x, y, a, b = (torch.stack([p[i] for p in probs]) for i in range(4))
    kw = dict(epsilon=0.5, threshold=1e-5, tau_a=taus, tau_b=taus, static_b=static_b)
    xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
    div, out = torch_api.sinkhorn_divergence(xg, yg, a, scale_b * b, **kw)
    assert div.shape == (3,) and out.n_iters[0].shape == (3,) and out.potentials[1][0].shape == (3, 14)
    gx, gy = torch.autograd.grad(div.sum(), (xg, yg), create_graph=True)
    gen = torch.Generator().manual_seed(4)
    vx, vy = torch.randn(x.shape, generator=gen), torch.randn(y.shape, generator=gen)
    hx, hy = torch.autograd.grad((gx * vx).sum() + (gy * vy).sum(), (xg, yg))
    iters = set()
    for k in range(3):
        xk, yk = x[k].clone().requires_grad_(), y[k].clone().requires_grad_()
        want, one = torch_api.sinkhorn_divergence(xk, yk, a[k], scale_b * b[k], **kw)
        wx, wy = torch.autograd.grad(want, (xk, yk), create_graph=True)
        rx, ry = torch.autograd.grad((wx * vx[k]).sum() + (wy * vy[k]).sum(), (xk, yk))
        assert abs(float(div[k]) - float(want)) <= 1e-5 * abs(float(want)) + 1e-6, k
        assert _rel(gx[k].detach(), wx.detach()) < 1e-4 and (static_b or _rel(gy[k].detach(), wy.detach()) < 1e-4), k
        assert _rel(hx[k], rx) < 1e-4 and _rel(hy[k], ry) < 1e-4, k  # the single call's HVP (mixed block included)
        for t in range(3 - static_b):
            # the premise of an exact iteration match: no measured error within float32 drift of the threshold
            r = one.errors[t][(one.errors[t] > 0) & torch.isfinite(one.errors[t])]
            assert float((r.log() - math.log(kw["threshold"])).abs().min()) > 0.05, (k, t, r)
            assert int(out.n_iters[t][k]) == int(one.n_iters[t]) and bool(out.converged[t][k]) == bool(one.converged[t])
            e, r = out.errors[t][k], one.errors[t]
            assert torch.equal(e == -1, r == -1) and torch.equal(torch.isinf(e), torch.isinf(r)), (k, t, e, r)
            ok = (r > 0) & torch.isfinite(r)
            # float32 sums of the marginals: long solves drift by a fraction of the threshold
            assert torch.allclose(e[ok], r[ok], rtol=1e-3, atol=0.5 * kw["threshold"]), (k, t)
            assert abs(float(out.costs[t][k]) - float(one.costs[t])) <= 1e-5 * abs(float(one.costs[t])) + 1e-6
            for u, v in zip(out.potentials[t], one.potentials[t]):  # rounding carried over 100-250 iterations
                assert _rel(u[k].detach(), v, float(v[torch.isfinite(v)].abs().max())) < 5e-5, (k, t)
            iters.add(int(one.n_iters[t]))
    assert len(iters) > 1, iters  # the problems stop at different iterations


@pytest.mark.parametrize("d,sizes,eps,cases", [
    (2, [(20, 16)] * 3, 0.5, (("y", "reg_ot_cost"), ("y", "sinkhorn_divergence"))),
    (9, [(13, 9)] * 2, 4.0, (("x", "reg_ot_cost"),))])
def test_hvp_of_a_batch_is_each_problems_hvp(d, sizes, eps, cases):
    """``torch_api.hvp`` on (B, n, d) batches equals the single calls, problem by problem: reg_ot_cost
    through the packed forward and one CG loop of packed passes (each problem its own CG stop, the
    iterations of its single call; d = 2, y side: the weighted pass in its outer-product form; d = 9,
    x side: per problem), the divergence problem by problem; shape errors name the argument."""
    probs, B = _problems(sizes, d=d, seed=2), len(sizes)
    x, y, a, b = (torch.stack([p[i] for p in probs]) for i in range(4))
    g = torch.Generator().manual_seed(5)
    vx, vy = torch.randn(x.shape, generator=g), torch.randn(y.shape, generator=g)
    kw = dict(epsilon=eps, threshold=1e-6, max_iterations=5000)
    for wrt, loss in cases:
        v = vx if wrt == "x" else vy
        got, info = torch_api.hvp(x, y, v, a=a, b=b, wrt=wrt, loss=loss, **kw)
        assert got.shape == v.shape and info.cg_iterations.shape == (B,) and bool(info.solve_converged.all())
        assert bool(info.cg_converged.all())
        iters = []
        for k in range(B):
            want, one = torch_api.hvp(x[k], y[k], v[k], a=a[k], b=b[k], wrt=wrt, loss=loss, **kw)
            assert float(want.abs().max()) > 1e-3
            assert _rel(got[k], want) < 1e-4, (wrt, loss, k, _rel(got[k], want))
            iters.append((int(info.cg_iterations[k]), int(one.cg_iterations)))
        assert all(abs(i - j) <= 1 for i, j in iters), iters  # a stop test at the edge may round either way
        if loss == "reg_ot_cost" and B > 2:
            assert len({i for i, _ in iters}) > 1, iters  # the problems stop at different iterations
    if d != 2:
        return
    with pytest.raises(ValueError, match="a must be a"):
        torch_api.hvp(x, y, vx, a=a[0], b=b, **kw)


def test_labelled_batch_is_its_single_labelled_solves():
    """sinkhorn on (B, n, d) with label_x (B, n), label_y (B, m) and one W: each problem is its
    single labelled call (values, iterations, last error, gradient of the cost in x and y)."""
    probs = _problems([(14, 9)] * 2, seed=6)
    x = torch.stack([p[0] for p in probs]).requires_grad_()
    y = torch.stack([p[1] for p in probs]).requires_grad_()
    a = torch.stack([p[2] for p in probs])
    g = torch.Generator().manual_seed(6)
    lx, ly = torch.randint(0, 3, (2, 14), generator=g), torch.randint(0, 2, (2, 9), generator=g)
    W = torch.rand(3, 2, generator=g) * 2.0
    kw = dict(epsilon=0.5, threshold=1e-5)
    out = torch_api.sinkhorn(x, y, a, None, label_x=lx, label_y=ly, label_cost=W, **kw)
    gx, gy = torch.autograd.grad(out.reg_ot_cost.sum(), (x, y))
    for k in range(2):
        xr, yr = x[k].detach().clone().requires_grad_(), y[k].detach().clone().requires_grad_()
        ref = torch_api.sinkhorn(xr, yr, a[k], label_x=lx[k], label_y=ly[k], label_cost=W, **kw)
        rx, ry = torch.autograd.grad(ref.reg_ot_cost, (xr, yr))
        plain = torch_api.sinkhorn(x[k].detach(), y[k].detach(), a[k], **kw)
        assert abs(float(ref.reg_ot_cost) - float(plain.reg_ot_cost)) > 1e-2, "the label cost should matter"
        assert torch.equal(out.f[k], ref.f) and torch.equal(out.g[k], ref.g) and int(out.n_iters[k]) == int(ref.n_iters)
        assert float(out.reg_ot_cost[k]) == float(ref.reg_ot_cost) and bool(out.converged[k])
        assert 0.0 <= float(out.last_error[k]) < 1e-5
        assert torch.equal(gx[k], rx) and torch.equal(gy[k], ry)
    with pytest.raises(ValueError, match=r"label_y must be a \(2, 9\) tensor"):
        torch_api.sinkhorn(x.detach(), y.detach(), label_x=lx, label_y=ly[:, 1:], label_cost=W, **kw)
    with pytest.raises(ValueError, match="needs label_x"):
        torch_api.sinkhorn(x.detach(), y.detach(), label_x=lx, label_cost=W, **kw)


def test_padding_problem_has_nothing_to_transport():
    """A problem whose weights are all zero on both sides (batch padding): reg_ot_cost 0, zero
    gradients, converged at the first measurement; the other problems (one with zero-weight
    padding points) are their single solves."""
    probs = _problems([(12, 9)] * 3, seed=7)
    x = torch.stack([p[0] for p in probs]).requires_grad_()
    y = torch.stack([p[1] for p in probs]).requires_grad_()
    a, b = torch.stack([p[2] for p in probs]), torch.stack([p[3] for p in probs])
    a[1, 6:] = 0.0
    a[1] /= a[1].sum()
    a[2], b[2] = 0.0, 0.0
    kw = dict(epsilon=0.5, threshold=1e-5)
    out = torch_api.sinkhorn(x, y, a, b, **kw)
    gx, gy = torch.autograd.grad(out.reg_ot_cost.sum(), (x, y))
    assert float(out.reg_ot_cost[2]) == 0.0 and bool(out.converged[2]) and int(out.n_iters[2]) == 10
    assert bool((out.f[2] == -torch.inf).all()) and not gx[2].any() and not gy[2].any()
    for k in range(2):
        ref = torch_api.sinkhorn(x[k].detach(), y[k].detach(), a[k], b[k], **kw)
        assert int(out.n_iters[k]) == int(ref.n_iters), k
        assert abs(float(out.reg_ot_cost[k]) - float(ref.reg_ot_cost)) <= 1e-5 * abs(float(ref.reg_ot_cost)), k
    assert torch.isfinite(gx).all() and torch.isfinite(gy).all()


def test_packed_batches_run_under_torch_compile():
    """torch.compile of a function calling the packed batches (sinkhorn and sinkhorn_divergence on
    (B, n, d)): they run eagerly behind a graph break and give the eager call's numbers."""
    g = torch.Generator().manual_seed(11)
    x, y = torch.randn(2, 6, 2, generator=g), torch.randn(2, 5, 2, generator=g)

    def fn(x, y):
        return torch_api.sinkhorn_divergence(x, y, epsilon=1.0)[0] + torch_api.sinkhorn(x, y, epsilon=1.0).reg_ot_cost

    assert torch.equal(torch.compile(fn, backend="aot_eager")(x, y), fn(x, y))
