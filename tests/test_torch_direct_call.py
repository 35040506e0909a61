"""torch_api.direct_call: the solve ops' implementations are called directly only where the
dispatcher would add nothing, and the results are the op's results."""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import torch_api
from torch_api import direct_call, sinkhorn_ops


def test_plain_only_without_grad_transform_or_mode():
    x = torch.randn(5, 2)
    assert direct_call.plain([x, None])
    assert not direct_call.plain([x.clone().requires_grad_(True)])
    with torch.no_grad():
        assert direct_call.plain([x.clone().requires_grad_(True)])
    with fwAD.dual_level():
        assert not direct_call.plain([x])
    seen = []
    torch.func.vmap(lambda t: seen.append(direct_call.plain([t])) or t)(x)
    assert seen == [False]

    class Sub(torch.Tensor):
        pass

    assert not direct_call.plain([x.as_subclass(Sub)])


@pytest.mark.parametrize("grad", [False, True])
def test_solve_goes_direct_only_without_grad_and_gives_the_ops_numbers(grad, monkeypatch):
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randn(40, 3, generator=gen), torch.randn(30, 3, generator=gen)
    calls = []
    impl = sinkhorn_ops._sinkhorn_solve
    monkeypatch.setattr(sinkhorn_ops, "_sinkhorn_solve", lambda *a: calls.append(1) or impl(*a))
    xs = x.clone().requires_grad_(grad)
    out = torch_api.sinkhorn(xs, y, epsilon=0.5, max_iterations=20)
    assert calls == ([] if grad else [1])
    assert (out.f.grad_fn is not None) == grad
    monkeypatch.setattr(sinkhorn_ops, "_sinkhorn_solve", impl)
    ref = sinkhorn_ops.sinkhorn_solve(x, y, out._a, out._b, out._eps, out._scale,
                                      torch.tensor(1e-3), 10, 0, 20, "float32", None, None, out._implicit)
    for got, want in zip((out.f, out.g, out.errors, out.n_iters, out.converged), ref):
        assert torch.equal(got.detach(), want), (got, want)
