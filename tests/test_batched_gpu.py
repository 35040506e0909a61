"""GPU checks of torch_api.sinkhorn_batch: the CUDA-graph replays (from a batch shape's second call)
give the eager first call's numbers bit for bit, and every problem equals its single solve
(iterations exactly, potentials and cost to float32 rounding). Run by bench/run_gpu.sh (-m gpu)."""

import pytest
import torch

pytestmark = pytest.mark.gpu


def rel(u, v) -> float:
    fin = torch.isfinite(v)
    assert torch.equal(fin, torch.isfinite(u))
    return float((u[fin] - v[fin]).norm() / v[fin].norm())


def _problems(gen, B: int, n: int, m: int, d: int) -> tuple:
    """B problems on the GPU: x (B, n, d) at scales 0.5..1.5, y (B, m, d) shifted by 0.3, non-uniform
    weights with zeros (the first 5 of a, the last 3 of b), each normalized to mass 1."""
    x = (torch.randn(B, n, d, generator=gen) * torch.linspace(0.5, 1.5, B)[:, None, None]).cuda()
    y = (torch.randn(B, m, d, generator=gen) + 0.3).cuda()
    a, b = torch.rand(B, n, generator=gen) + 0.1, torch.rand(B, m, generator=gen) + 0.1
    a[:, :5], b[:, -3:] = 0.0, 0.0
    return x, y, (a / a.sum(1, keepdim=True)).cuda(), (b / b.sum(1, keepdim=True)).cuda()


@pytest.mark.parametrize("d", [3, 64])
def test_batched_graph_replays_equal_eager_and_single_solves(d):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import torch_api
    from torch_api import cuda_graphs

    cuda_graphs.clear()
    gen = torch.Generator().manual_seed(d)
    sizes = [(700, 1300), (2048, 900), (1, 64), (1500, 1500), (333, 2100)]
    xs = [(torch.randn(n, d, generator=gen) * (0.5 + k / 4)).cuda() for k, (n, _) in enumerate(sizes)]
    ys = [(torch.randn(m, d, generator=gen) * (0.5 + k / 4) + 0.3).cuda() for k, (_, m) in enumerate(sizes)]
    kw = dict(epsilon=0.1, threshold=1e-3, max_iterations=500)
    runs = [torch_api.sinkhorn_batch(xs, ys, **kw) for _ in range(3)]  # eager, capture, replay
    for out in runs[1:]:
        assert torch.equal(out.n_iters, runs[0].n_iters) and torch.equal(out.reg_ot_cost, runs[0].reg_ot_cost)
        for u, v in zip(out.f + out.g, runs[0].f + runs[0].g):
            assert torch.equal(u, v)
    out = runs[-1]
    assert len(set(out.n_iters.tolist())) > 1
    for k, (x, y) in enumerate(zip(xs, ys)):
        one = torch_api.sinkhorn(x, y, **kw)
        assert int(out.n_iters[k]) == int(one.n_iters), (k, out.n_iters, one.n_iters)
        assert bool(out.converged[k]) == bool(one.converged)
        scale = max(float(one.f[torch.isfinite(one.f)].abs().max()), float(one.g[torch.isfinite(one.g)].abs().max()))
        for u, v in ((out.f[k], one.f), (out.g[k], one.g)):  # to float32 rounding of the potentials' scale
            assert torch.equal(torch.isfinite(u), torch.isfinite(v))
            assert float((u - v)[torch.isfinite(v)].abs().max()) <= 1e-5 * scale, (k, u, v)
        assert abs(float(out.reg_ot_cost[k]) - float(one.reg_ot_cost)) <= 1e-5 * abs(float(one.reg_ot_cost))
    # the gradient in the points after a replayed solve
    xg = [x.clone().requires_grad_() for x in xs]
    torch_api.sinkhorn_batch(xg, ys, **kw).reg_ot_cost.sum().backward()
    for k in (0, 3):
        xk = xs[k].clone().requires_grad_()
        torch_api.sinkhorn(xk, ys[k], **kw).reg_ot_cost.backward()
        assert rel(xg[k].grad, xk.grad) < 1e-4


def test_large_uniform_batch_replays_its_graphs():
    """The graphs' size limit counts the batch's own pairs (sum n_k m_k), not the packed clouds'
    product: 64 problems of 1024 points (6.7e7 pairs, packed product 4.3e9) replay."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import torch_api
    from torch_api import cuda_graphs

    cuda_graphs.clear()
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(64, 1024, 3, generator=gen).cuda(), torch.randn(64, 1024, 3, generator=gen).cuda()
    runs = [torch_api.sinkhorn_batch(x, y, epsilon=0.1, min_iterations=20, max_iterations=20) for _ in range(3)]
    assert len(cuda_graphs._sets) == 1
    for out in runs[1:]:
        assert torch.equal(out.reg_ot_cost, runs[0].reg_ot_cost)


@pytest.mark.parametrize("d", [3, 16])
def test_batched_hvp_equals_single_hvps(d):
    """torch_api.hvp on (B, n, d): the packed CG (one block-sparse launch per plan pass for the
    batch; d = 16: the weighted pass per problem) gives each problem's single HVP, x and y sides."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import torch_api

    gen = torch.Generator().manual_seed(d)
    B, n, m = 6, 900, 700
    x, y, a, b = _problems(gen, B, n, m, d)
    kw = dict(epsilon=0.5, threshold=1e-6)
    for wrt, cloud in (("x", x), ("y", y)):
        v = torch.randn(cloud.shape, generator=gen).cuda()
        got, info = torch_api.hvp(x, y, v, a=a, b=b, wrt=wrt, **kw)
        assert bool(info.cg_converged.all()) and bool(info.solve_converged.all())
        for k in range(B):
            want, one = torch_api.hvp(x[k], y[k], v[k], a=a[k], b=b[k], wrt=wrt, **kw)
            assert rel(got[k], want) < 1e-4, (wrt, k, rel(got[k], want))
            assert abs(int(info.cg_iterations[k]) - int(one.cg_iterations)) <= 2, (wrt, k, info, one)


def test_packed_divergence_replays_and_equals_single_calls():
    """sinkhorn_divergence on (B, n, d) (packed: the (x, y) loop and the 2B self problems' symmetric
    loop): the CUDA-graph replays give the eager call's numbers bit for bit, and every problem its
    single call (iterations of the three terms exactly, divergence and x, y gradients to float32
    rounding), non-uniform weights with zeros, n != m."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import torch_api
    from torch_api import cuda_graphs

    cuda_graphs.clear()
    gen = torch.Generator().manual_seed(7)
    B, n, m, d = 5, 900, 700, 3
    x, y, a, b = _problems(gen, B, n, m, d)
    kw = dict(epsilon=0.1, threshold=1e-4)
    runs = []
    for _ in range(3):  # eager, capture, replay
        xg, yg = x.clone().requires_grad_(), y.clone().requires_grad_()
        div, out = torch_api.sinkhorn_divergence(xg, yg, a, b, **kw)
        runs.append((div.detach(), *torch.autograd.grad(div.sum(), (xg, yg)), out))
    for div, gx, gy, out in runs[1:]:
        assert torch.equal(div, runs[0][0]) and torch.equal(gx, runs[0][1]) and torch.equal(gy, runs[0][2])
    div, gx, gy, out = runs[-1]
    for k in range(B):
        xk, yk = x[k].clone().requires_grad_(), y[k].clone().requires_grad_()
        want, one = torch_api.sinkhorn_divergence(xk, yk, a[k], b[k], **kw)
        wx, wy = torch.autograd.grad(want, (xk, yk))
        assert abs(float(div[k]) - float(want)) <= 1e-4 * abs(float(want)) + 1e-6, (k, float(div[k]), float(want))
        assert rel(gx[k], wx) < 1e-3 and rel(gy[k], wy) < 1e-3, (k, rel(gx[k], wx), rel(gy[k], wy))
        assert [int(t[k]) for t in out.n_iters] == [int(t) for t in one.n_iters], (k, out.n_iters, one.n_iters)


def test_packed_potentials_vjps_equal_single_calls():
    """The derivatives of a packed batch on the GPU are each problem's single call's: sinkhorn_batch's
    f, g and reg_ot_cost in the points and weights, the packed divergence's self-term h in the
    points; a problem without cotangent gets a zero gradient. Non-uniform weights with zeros, n != m."""
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    import torch_api

    gen = torch.Generator().manual_seed(11)
    B, n, m, d = 3, 600, 400, 3
    x, y, a, b = _problems(gen, B, n, m, d)
    uf, ug = torch.randn(B, n, generator=gen).cuda(), torch.randn(B, m, generator=gen).cuda()
    uf[0], ug[0] = 0.0, 0.0
    wc = torch.tensor([0.0, 0.7, -1.3], device="cuda")

    def loss(f, g, k):
        return (torch.where(torch.isfinite(f), uf[k] * f, 0.0).sum()
                + torch.where(torch.isfinite(g), ug[k] * g, 0.0).sum())

    kw = dict(epsilon=0.1, threshold=1e-5)
    leaves = [t.clone().requires_grad_() for t in (x, y, a, b)]
    out = torch_api.sinkhorn_batch(*leaves, **kw)
    gp = torch.autograd.grad(sum(loss(out.f[k], out.g[k], k) for k in range(B)), leaves, retain_graph=True)
    gc = torch.autograd.grad((wc * out.reg_ot_cost).sum(), leaves)
    xg, yg = leaves[0], leaves[1]
    _, dout = torch_api.sinkhorn_divergence(xg, yg, a, b, **kw)
    hx, hy = dout.potentials[1][0], dout.potentials[2][0]
    sx, sy = torch.autograd.grad(sum(loss(hx[k], hy[k], k) for k in range(B)), (xg, yg))
    assert all(float(t[0].abs().max()) == 0.0 for t in gp + gc + (sx, sy))
    for k in range(1, B):
        ref_in = [t[k].clone().requires_grad_() for t in (x, y, a, b)]
        one = torch_api.sinkhorn(*ref_in, **kw)
        wp = torch.autograd.grad(loss(one.f, one.g, k), ref_in, retain_graph=True)
        wcost = torch.autograd.grad(wc[k] * one.reg_ot_cost, ref_in)
        for i in range(4):
            assert rel(gp[i][k], wp[i]) < 1e-4, ("potentials", k, i, rel(gp[i][k], wp[i]))
            assert rel(gc[i][k], wcost[i]) < 1e-4, ("cost", k, i, rel(gc[i][k], wcost[i]))
        _, dk = torch_api.sinkhorn_divergence(ref_in[0], ref_in[1], a[k], b[k], **kw)
        vx, vy = torch.autograd.grad(loss(dk.potentials[1][0], dk.potentials[2][0], k), ref_in[:2])
        assert rel(sx[k], vx) < 1e-4 and rel(sy[k], vy) < 1e-4, (k, rel(sx[k], vx), rel(sy[k], vy))
