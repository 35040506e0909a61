"""core.implicit_solve.symmetric_solve, the system of a self term moved as one cloud, on an explicit
float64 self plan that is nearly diagonal (eps small against the points' spacing): it solves the
pair system H [u; u] = [rhs; rhs] in a few iterations, where the Schur solve of the same system
needs many times more (the antisymmetric part diag(r) - P is nearly singular). The frontends'
divergence and SamplesLoss HVPs run it for their self terms (tests/test_torch_second_order.py,
tests/test_jax_second_order.py check those against float64 references)."""

import types

import pytest
import torch

from ot_triton_jax.core.implicit_solve import ImplicitOptions, schur_solve, symmetric_solve


def self_plan(n: int, eps: float, seed: int, zero: int | None):
    """(P, a): the float64 plan of the symmetric self problem of n random points in 2-D."""
    g = torch.Generator().manual_seed(seed)
    x = torch.rand(n, 2, generator=g, dtype=torch.float64)
    a = torch.rand(n, generator=g, dtype=torch.float64) + 0.2
    if zero is not None:
        a[zero] = 0.0
    a = a / a.sum()
    K = torch.exp(-torch.cdist(x, x) ** 2 / eps)
    la = torch.where(a > 0, a.log(), -torch.inf)
    h = torch.zeros(n, dtype=torch.float64)
    for _ in range(5000):  # symmetric averaged updates: h = eps log a - eps log K e^{h/eps} at the fixed point
        new = -eps * torch.logsumexp((h + eps * la)[None, :] / eps + K.log(), dim=1)
        h = 0.5 * (h + new)
    f = torch.where(a > 0, h + eps * la, -torch.inf)
    P = torch.exp((f[:, None] + f[None, :]) / eps) * K
    return P, a


def dense_ops(P: torch.Tensor):
    def while_loop(cond, body, state):
        while bool(cond(state)):
            state = body(state)
        return state

    ops = types.SimpleNamespace(xp=torch, while_loop=while_loop, n=P.shape[0], m=P.shape[1])
    ops.apply = lambda V: (P @ V, P.sum(1))
    ops.apply_t = lambda U: (P.T @ U, P.sum(0))
    ops.transposed = lambda: dense_ops(P.T)
    return ops


@pytest.mark.parametrize("zero", [None, 5])
def test_symmetric_solve_is_fast_where_the_schur_solve_crawls(zero):
    P, a = self_plan(60, 0.002, seed=3, zero=zero)
    r = P.sum(1)
    assert float((r - a).abs().max()) < 1e-10  # the fixed point is reached
    off = P - torch.diag(torch.diag(P))
    assert float(off.sum() / P.sum()) < 0.2  # nearly diagonal
    mask = a > 0
    g = torch.Generator().manual_seed(1)
    rhs = torch.where(mask, torch.randn(60, generator=g, dtype=torch.float64), 0.0)
    opts = ImplicitOptions(rtol=1e-9, max_iter=1000)
    u, (k, rel, ok) = symmetric_solve(dense_ops(P), rhs, r, mask, opts)
    H = torch.cat([torch.cat([torch.diag(r), P], 1), torch.cat([P.T, torch.diag(r)], 1)])
    res = H @ torch.cat([u, u]) - torch.cat([rhs, rhs])
    assert bool(ok) and int(k) <= 20  # 14 here; the Schur solve takes 314
    assert float(res.norm() / rhs.norm()) < 1e-7
    assert float(u[~mask].abs().sum()) == 0.0
    _, _, (k_schur, _, _) = schur_solve(dense_ops(P), rhs, rhs, r, r, mask, mask, opts)
    assert int(k_schur) >= 5 * int(k)


def test_relaxed_symmetric_solve():
    """tau < 1: (diag(r / tau) + P) u = rhs, the relaxed pair system's symmetric part."""
    P, a = self_plan(30, 0.01, seed=4, zero=None)
    r, tau = P.sum(1), 0.7
    rhs = torch.randn(30, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    u, (k, _, ok) = symmetric_solve(dense_ops(P), rhs, r, a > 0, ImplicitOptions(rtol=1e-9), tau)
    assert bool(ok) and float(((r / tau) * u + P @ u - rhs).norm() / rhs.norm()) < 1e-7
