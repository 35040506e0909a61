"""Compile a dense solve's kernels in parallel before its first launch.

Triton compiles a kernel at its first launch, one at a time (~0.3-0.8 s each on the H100 host,
frontend, LLVM, ptxas and a C build of its launcher). The first ``sinkhorn`` of a new dimension
and precision launches about sixteen distinct kernels: the centring and FP16 splits of the
clouds, the half-step variants of the alternating loop (first update, folded updates, the
measured ones, the split-column combine), the plan mass of ``reg_ot_cost`` and the plan
products of the gradient. :func:`alternating` names them from the sizes alone
(``ot_triton_jax.core.kernel_calls``) and hands them to :func:`torch_api.kernel_ops.prewarm`,
which compiles them in worker processes at once. Its result is only Triton's cache: a list
that misses a kernel costs that kernel's compile at its launch, nothing else.

A new shape of the same dimension and precision reuses the compiled kernels (the kernels do
not specialize on the sizes), so only a changed launch plan compiles again; the prewarm of a
family already seen costs one in-process cache lookup per kernel.
"""

from __future__ import annotations

import functools

from ot_triton_jax.core import kernel_calls, launch_plans, runtime

from .kernel_ops import prewarm


def alternating_calls(n: int, m: int, d: int, precision: str) -> tuple[tuple[str, tuple], ...]:
    """(``kernel_calls`` builder, its arguments) of every description the solve, its cost and its
    gradient launch on the GPU."""
    calls = [("center", (n, m, d, True))]
    n_amax = 0
    if launch_plans.fp16_operands(d):
        pairs = kernel_calls.absmax_pairs(2)
        sizes = (n, m)
        calls += [("absmax", (sizes[i], sizes[j], d, True)) for i, j in pairs]
        n_amax = len(pairs)
    calls += [("split_centered", (k, d, True, n_amax)) for k in (n, m)]
    # the half-steps of the alternating loop: (src, tgt) sizes, compute_err, fold (the first f-update
    # from the zero start runs online: unbalanced.folds); balanced (relax_at 0), unlabelled (labels
    # None, not grouped), as torch_api.kernel_ops passes them
    for src, tgt, err, fold in ((m, n, False, False), (m, n, True, False), (m, n, False, True),
                                (m, n, True, True), (n, m, False, True), (n, m, False, False)):
        calls.append(("lse_update", (src, tgt, d, precision, True, False, True, True, err, fold, 0, None, False)))
    if precision == "float32":
        calls.append(("exact_row_mass", (n, m, d, True, None)))
    # the gradient's plan products P y, P^T x (and the row sums alone)
    calls += [("apply_plan", (n, m, d, d, precision, True, None)), ("apply_plan", (m, n, d, d, precision, True, None)),
              ("apply_plan", (m, n, d, 0, precision, True, None))]
    return tuple(calls)


@functools.lru_cache(maxsize=256)
def _alternating_sequences(n: int, m: int, d: int, precision: str) -> tuple:
    return tuple(getattr(kernel_calls, name)(*args) for name, args in alternating_calls(n, m, d, precision))


def alternating(n: int, m: int, d: int, precision: str, device) -> int:
    """Compile what an alternating solve of x (n, d), y (m, d), its ``reg_ot_cost`` and its
    gradient launch, in parallel; returns the kernels compiled or loaded (0 off the GPU)."""
    key = (n, m, d, precision, str(device))
    if not runtime.on_gpu() or key in _done:
        return 0
    _done.add(key)
    return prewarm(_alternating_sequences(n, m, d, precision), device)


_done: set = set()
