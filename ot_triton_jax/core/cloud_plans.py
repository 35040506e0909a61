"""Launch plans of the cloud preparation kernels (kernels/split.py): the common centre, the
partial maxima, the split of a cloud into float16 / TF32 parts and squared norms, and the
fixed-point split of reg_ot_cost's mass term. Same rules as :mod:`.launch_plans`."""

from __future__ import annotations

from .launch_plans import LaunchPlan, _cdiv, _pow2_at_least, cached_plan, operand_stride, packed_operands


def fixed_point_bits(d: int) -> int:
    """Bits of the fixed-point heads of split_fixed_kernel: 2 P + ceil(log2 d) <= 24 keeps
    every partial sum of head products exact in float32; at most 10 (TF32 holds 11 bits)."""
    return min(10, (24 - max(0, (d - 1).bit_length())) // 2)


def _row_blocks(n: int, d: int, gpu_block_d: int, on_gpu: bool) -> tuple[int, int]:
    """(BLOCK_R, BLOCK_D) of the row-wise split kernels: D in chunks of at most ``gpu_block_d``
    columns on the GPU, about 2048 elements per program."""
    block_d = _pow2_at_least(min(d, gpu_block_d if on_gpu else 4096), 16)
    block_r = max(1, (2048 if on_gpu else 4096) // block_d)
    return min(block_r, _pow2_at_least(n, 1)), block_d


@cached_plan
def fixed_split_plan(n: int, d: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``split_fixed_kernel`` over the rows of an (n, d) float32 array."""
    block_r, block_d = _row_blocks(n, d, 128, on_gpu)
    return LaunchPlan(grid=(_cdiv(n, block_r),), num_warps=4, num_stages=1,
                      constexprs={"D": d, "P_BITS": fixed_point_bits(d), "BLOCK_R": block_r, "BLOCK_D": block_d})


@cached_plan
def center_plan(d: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``center_kernel``: one program, SAMPLE rows of each cloud, D in chunks."""
    block_d = _pow2_at_least(min(d, 32 if on_gpu else 4096), 16)
    return LaunchPlan(grid=(1,), num_warps=4, num_stages=1, constexprs={"D": d, "SAMPLE": 256, "BLOCK_D": block_d})


@cached_plan
def split_plan(n: int, d: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``split_centered_kernel`` over the rows of an (n, d) float32 array."""
    block_r, block_d = _row_blocks(n, d, 64, on_gpu)
    return LaunchPlan(grid=(_cdiv(n, block_r),), num_warps=4, num_stages=1,
                      constexprs={"D": d, "BLOCK_R": block_r, "BLOCK_D": block_d})


@cached_plan
def absmax_plan(n: int, m: int, d: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``absmax_kernel``: grid[0] partial maxima over both clouds (at most 128 on the
    GPU, 2 under the interpreter; every split_scaled_kernel program reduces them all)."""
    block_r, block_d = _row_blocks(max(n, m), d, 64, on_gpu)
    programs = min(_cdiv(max(n, m), block_r), 128 if on_gpu else 2)
    return LaunchPlan(grid=(programs,), num_warps=4, num_stages=1,
                      constexprs={"D": d, "BLOCK_R": block_r, "BLOCK_D": block_d})


@cached_plan
def split_scaled_plan(n: int, d: int, n_amax: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``split_scaled_kernel`` over the rows of an (n, d) float32 array, reducing
    n_amax partial maxima from :func:`absmax_plan`; its FP16 parts have row stride DP =
    :func:`operand_stride`."""
    block_r, block_d = _row_blocks(n, operand_stride(d), 64, on_gpu)
    return LaunchPlan(grid=(_cdiv(n, block_r),), num_warps=4, num_stages=1,
                      constexprs={"D": d, "DP": operand_stride(d), "BLOCK_R": block_r, "BLOCK_D": block_d,
                                  "BLOCK_A": _pow2_at_least(n_amax, 16), "PACKED": packed_operands(d)})
