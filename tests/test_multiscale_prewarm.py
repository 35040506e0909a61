"""The multiscale solve's kernel list (multiscale.prewarm.kernel_descriptions, which its first call
compiles in parallel) against the launches real solves make (CPU: Triton interpreter). A kernel the
list misses would still run, compiled at its first launch; this keeps the list honest."""

import dataclasses

import pytest
import torch

from ot_triton_jax.core import kernels
from torch_api import kernel_ops
from torch_api.multiscale import lift as ms_lift, prewarm, solve as ms

_RUNS_PER_BLOCK = (kernels.lse_blocksparse_kernel, kernels.apply_plan_blocksparse_kernel, kernels.block_runs_kernel)


def _normal(seq):
    """The description as the compiled kernel sees it: the block-sparse kernels' runs per row
    block (last integer argument; the ranges kernel's output holds as many) are not specialized on."""
    calls = tuple(dataclasses.replace(c, args=c.args[:-1] + (2,), outputs=tuple(
        dataclasses.replace(o, shape=(o.shape[0], 2, 2)) if len(o.shape) == 3 else o for o in c.outputs))
                  if c.kernel in _RUNS_PER_BLOCK else c for c in seq.calls)
    return repr(dataclasses.replace(seq, calls=calls))


@pytest.mark.parametrize("d, debias, tol, truncate, means, lift", [
    (2, True, 5e-3, 5.0, (True, False), "auto"),
    (3, True, 5e-3, 5.0, (True, True), "always"),
    (1, False, None, None, (False, False), "always"),
    (2, False, None, 5.0, (False, True), "auto"),
    (1, False, 5e-3, 5.0, (True, False), "always"),
])
def test_every_launch_of_a_solve_is_in_the_list(monkeypatch, d, debias, tol, truncate, means, lift):
    monkeypatch.setattr(ms_lift, "LIFT", lift)
    g = torch.Generator().manual_seed(d)
    n, m = 70, 53
    x, y = torch.rand(n, d, generator=g), torch.rand(m, d, generator=g) * 0.8 + 0.1
    a, b = torch.full((n,), 1.0 / n), torch.full((m,), 1.0 / m)
    ran, dtypes = [], []
    steps, launch = kernel_ops._steps, kernel_ops.launch
    monkeypatch.setattr(kernel_ops, "_steps", lambda seq: ran.append(seq) or steps(seq))
    monkeypatch.setattr(kernel_ops, "launch", lambda kernel, grid, args, *rest, **kw: dtypes.append(
        tuple(a.dtype for a in args if isinstance(a, torch.Tensor))) or launch(kernel, grid, args, *rest, **kw))
    res = ms.anneal(x, y, a, b, blur=0.1, scaling=0.5, diameter=1.5, cluster_scale=0.25, truncate=truncate,
                    debias=debias, tol=tol, means=means)
    kx, ky = res.clusters
    listed = {_normal(s) for s in prewarm.kernel_descriptions(n, m, kx, ky, d, "float32", debias, tol is not None,
                                                           means, truncate is not None)}
    assert ran and {_normal(s) for s in ran} <= listed
    # every array a launch got has the dtype its description declares: the prewarm's stand-ins (a
    # pointer of another dtype would compile again at the first launch)
    calls = [c for s in ran for c in s.calls]
    assert len(calls) == len(dtypes)
    for c, got in zip(calls, dtypes):
        declared = tuple(kernel_ops.input_dtype(c, a) for a in c.args if isinstance(a, str))
        declared += tuple(kernel_ops._DTYPES[o.dtype] for o in c.outputs)
        assert got == declared, c.kernel
    if truncate is not None:
        assert any(s.calls[0].kernel is kernels.lse_blocksparse_kernel for s in ran)  # the fine stage ran
    lifted = any(s.calls[0].kernel is kernels.lift_gathered_kernel for s in ran)
    assert lifted == (lift == "always" and truncate is not None and tol is not None)  # at these sizes "auto" lifts densely
