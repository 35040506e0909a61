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
