"""The dense prewarm names every kernel call description a first solve launches.

A solve, its ``reg_ot_cost`` and its gradient in x and y run on the CPU with every
``kernel_calls`` builder recorded; each recorded description, built for the GPU, must be one of
``dense_prewarm``'s (a missing one would compile at its first launch, one at a time)."""

import functools

import pytest
import torch

import torch_api
from ot_triton_jax.core import kernel_calls
from torch_api import dense_prewarm, kernel_ops

BUILDERS = ("center", "absmax", "split_centered", "lse_update", "exact_row_mass", "apply_plan")


@pytest.mark.parametrize("n,m,d", [(37, 23, 3), (19, 30, 7)])
def test_prewarm_covers_a_solve_its_cost_and_its_gradient(monkeypatch, n, m, d):
    seen = []
    for name in BUILDERS:
        real = getattr(kernel_calls, name)

        def record(*args, _real=real, _name=name):
            seen.append((_name, args))
            return _real(*args)
        monkeypatch.setattr(kernel_ops.kernel_calls, name, record)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen).requires_grad_(True)
    y = torch.randn(m, d, generator=gen).requires_grad_(True)
    a = torch.rand(n, generator=gen)
    a[3] = 0.0
    a = a / a.sum()
    out = torch_api.sinkhorn(x, y, a, epsilon=0.5, threshold=1e-4)
    out.reg_ot_cost.backward()
    assert out.converged and torch.isfinite(x.grad).all() and torch.isfinite(y.grad).all()
    monkeypatch.undo()
    planned = set(dense_prewarm.alternating_calls(n, m, d, "float32"))
    launched = {(name, tuple(True if k == _on_gpu_index(name) else v for k, v in enumerate(args)))
                for name, args in seen}
    assert {name for name, _ in seen} >= {"center", "split_centered", "lse_update", "exact_row_mass", "apply_plan"}
    assert not launched - planned, sorted(launched - planned)
    for precision in ("float32", "tf32"):  # every planned description builds for the GPU
        assert all(seq.calls for seq in dense_prewarm._alternating_sequences(n, m, d, precision))


@functools.lru_cache(maxsize=None)
def _on_gpu_index(name: str) -> int:
    import inspect
    return list(inspect.signature(getattr(kernel_calls, name)).parameters).index("on_gpu")
