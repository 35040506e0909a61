"""core.implicit_solve.cg on explicit small matrices (torch as the array module): the
projected solve, the restart after a breakdown, and honest failure reports."""

import types

import pytest
import torch

from ot_triton_jax.core.implicit_solve import ImplicitOptions, cg, project


def _ops():
    def while_loop(cond, body, state):
        while bool(cond(state)):
            state = body(state)
        return state
    return types.SimpleNamespace(xp=torch, while_loop=while_loop)


def _spd(n, seed):
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
    lam = torch.logspace(-3, 0, n, dtype=torch.float64)
    return (q * lam) @ q.T, g


def _rhs(n, g, mask):
    return project(torch, torch.randn(n, generator=g, dtype=torch.float64), mask)


def _faulty(n, seed, corrupt):
    """An SPD system whose k-th product (1-based) passes through ``corrupt(out, k)``:
    (A, mask, rhs, matvec, call counter)."""
    A, g = _spd(n, seed)
    mask = torch.ones(n, dtype=torch.bool)
    rhs = _rhs(n, g, mask)
    calls = {"n": 0}

    def matvec(p):
        calls["n"] += 1
        return corrupt(project(torch, A @ p, mask), calls["n"])

    return A, mask, rhs, matvec, calls


def test_cg_solves_on_the_projected_space():
    n = 12
    A, g = _spd(n, 0)
    mask = torch.ones(n, dtype=torch.bool)
    mask[3] = False
    proj = lambda v: project(torch, v, mask)  # noqa: E731
    rhs = _rhs(n, g, mask)
    z, k, rel, ok = cg(_ops(), lambda p: proj(A @ proj(p)), rhs, lambda v: v, mask, ImplicitOptions(rtol=1e-10))
    assert bool(ok) and float(rel) <= 1e-10 and 0 < int(k) <= 200
    assert float((proj(A @ z) - rhs).norm() / rhs.norm()) < 1e-9
    assert float(z[mask].sum()).__abs__() < 1e-12 and float(z[3]) == 0.0


def test_cg_stops_at_a_breakdown_without_stepping():
    """One corrupted product (p^T S p <= 0, as float32 rounding gives near the attainable
    accuracy): CG stops there, keeps its last iterate and reports it unconverged."""
    A, mask, rhs, matvec, calls = _faulty(10, 1, lambda out, k: -out if k == 4 else out)
    z, k, rel, ok = cg(_ops(), matvec, rhs, lambda v: v, mask, ImplicitOptions(rtol=1e-9))
    assert not bool(ok) and calls["n"] == 4 and int(k) == 4
    # the iterate after three good steps: its true residual is the reported one
    true_rel = float((project(torch, A @ z, mask) - rhs).norm() / rhs.norm())
    assert 0 < true_rel < 1 and abs(true_rel - float(rel)) < 1e-9


def test_cg_stops_unconverged_on_an_indefinite_system():
    n = 8
    A, g = _spd(n, 2)
    A = A - 0.5 * torch.eye(n, dtype=torch.float64)  # indefinite: CG must not claim success
    mask = torch.ones(n, dtype=torch.bool)
    rhs = _rhs(n, g, mask)
    z, k, rel, ok = cg(_ops(), lambda p: project(torch, A @ p, mask), rhs, lambda v: v, mask,
                       ImplicitOptions(rtol=1e-10, max_iter=500))
    assert not bool(ok) and int(k) < 500 and torch.isfinite(z).all()


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_cg_reports_non_finite_products_as_unconverged(bad):
    n = 6
    A, g = _spd(n, 3)
    mask = torch.ones(n, dtype=torch.bool)
    rhs = _rhs(n, g, mask)
    z, k, rel, ok = cg(_ops(), lambda p: torch.full_like(p, bad), rhs, lambda v: v, mask, ImplicitOptions())
    assert not bool(ok)


def test_defaults():
    opts = ImplicitOptions()
    assert (opts.rtol, opts.atol, opts.max_iter, opts.preconditioner) == (1e-4, 0.0, 1000, "none")


def test_cg_keeps_the_last_finite_iterate():
    """A product that overflows mid-solve: CG stops, returns the last finite iterate and reports
    it unconverged (never NaN)."""
    A, mask, rhs, matvec, _ = _faulty(10, 4, lambda out, k: out * float("inf") if k >= 3 else out)
    z, k, rel, ok = cg(_ops(), matvec, rhs, lambda v: v, mask, ImplicitOptions(rtol=1e-12))
    assert not bool(ok) and torch.isfinite(z).all() and bool(torch.isfinite(rel))
    assert float(z.norm()) > 0 and float(rel) < 1.0
