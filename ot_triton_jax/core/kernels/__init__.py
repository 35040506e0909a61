"""Triton kernels. Pure ``@triton.jit`` code: no torch, no jax imports.

Argument order convention (shared by both frontends, and the one
``jax_triton.triton_call`` uses): input pointers and integer sizes first, then
output pointers, then compile-time constants as keywords. Run-time floating
point scalars (epsilon, cost scale) travel in a small float32 ``PARAMS`` array
so that changing them never recompiles a kernel.

Import :mod:`ot_triton_jax.core.runtime` and call ``configure`` before importing
this package: it decides whether the kernels are compiled for the GPU or run
by the Triton interpreter.
"""

from .lse import column_bias_kernel, lse_combine_kernel
from .lse_update import lse_update_kernel
from .lse_pair import lse_pair_finish_kernel, lse_pair_kernel, pair_prep_kernel
from .apply import apply_plan_kernel
from .apply_weighted import apply_weighted_kernel
from .lse_blocksparse import lse_blocksparse_kernel
from .apply_blocksparse import apply_plan_blocksparse_kernel
from .split import absmax_kernel, center_kernel, split_centered_kernel, split_fixed_kernel, split_scaled_kernel
from .pair_bound import pair_dropped_kernel, pair_fixup_kernel, pair_keep_kernel
from .block_ranges import block_runs_kernel
from .label_tiles import label_block_order_kernel
from .mask_lists import mask_row_counts_kernel, mask_row_lists_kernel
from .lift_gathered import lift_gathered_kernel
from .taylor_blocksparse import taylor_evaluate_kernel, taylor_moments_kernel, taylor_monomials_kernel
from . import mhc  # noqa: F401  (its kernels' cache keys are settled below with the others)

__all__ = [
    "lse_update_kernel", "lse_combine_kernel", "column_bias_kernel", "lse_pair_kernel", "lse_pair_finish_kernel", "pair_prep_kernel", "apply_plan_kernel", "apply_weighted_kernel", "center_kernel", "split_centered_kernel", "split_fixed_kernel",
    "absmax_kernel", "split_scaled_kernel",
    "lse_blocksparse_kernel", "apply_plan_blocksparse_kernel", "pair_keep_kernel", "pair_fixup_kernel",
    "pair_dropped_kernel", "block_runs_kernel", "mask_row_counts_kernel", "mask_row_lists_kernel", "lift_gathered_kernel", "taylor_monomials_kernel", "taylor_moments_kernel",
    "taylor_evaluate_kernel", "label_block_order_kernel",
]


def _settle_cache_keys() -> None:
    """Give every kernel here the on-disk cache key it gets in any process.

    Triton 3.6 hashes a jitted function differently depending on whether its jitted callees
    were hashed before it (``DependenciesFinder._update_hash`` merges a callee's used globals
    before computing the callee's key), so processes that first use the kernels in different
    orders name the same compile differently: a warm on-disk cache misses, and the parallel
    prewarm's worker processes (compile_worker) would compile in vain. Recomputing every key
    until none changes gives the keys of "every callee hashed before its caller", whatever ran
    first. Nothing to do under the interpreter (no JITFunctions)."""
    import sys

    from triton.runtime.jit import JITFunction

    prefix = __name__ + "."
    functions = list({id(v): v for name, module in list(sys.modules.items()) if name.startswith(prefix)
                      for v in vars(module).values() if isinstance(v, JITFunction)}.values())
    if not functions or not all(hasattr(f, "hash") for f in functions):
        return
    before = None
    for _ in range(8):
        for f in functions:
            f.hash = None
        keys = [f.cache_key for f in functions]
        if keys == before:
            return
        before = keys


_settle_cache_keys()
