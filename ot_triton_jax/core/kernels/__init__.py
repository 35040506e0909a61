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

from .lse import lse_combine_kernel, lse_update_kernel
from .apply import apply_plan_kernel
from .apply_weighted import apply_weighted_kernel
from .lse_blocksparse import lse_blocksparse_kernel
from .apply_blocksparse import apply_plan_blocksparse_kernel
from .split import center_kernel, split_centered_kernel, split_fixed_kernel
from .pair_bound import pair_best_kernel, pair_dropped_kernel, pair_keep_kernel

__all__ = [
    "lse_update_kernel", "lse_combine_kernel", "apply_plan_kernel", "apply_weighted_kernel", "center_kernel", "split_centered_kernel", "split_fixed_kernel",
    "lse_blocksparse_kernel", "apply_plan_blocksparse_kernel", "pair_best_kernel", "pair_keep_kernel",
    "pair_dropped_kernel",
]
