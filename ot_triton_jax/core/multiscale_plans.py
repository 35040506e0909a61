"""Launch plans of the multiscale solve's kernels: the block-sparse LSE and plan-apply passes
(kernels/lse_blocksparse.py), the cluster-pair bounds and masks (pair_bound.py, mask_lists.py,
block_ranges.py), the gathered coarse-to-fine lift (lift_gathered.py) and the Taylor pass
(taylor_blocksparse.py). Same rules as :mod:`.launch_plans` (one source for both frontends, no
framework imports)."""

from __future__ import annotations

from .launch_plans import (FOLD_PATHS, PACKED_WIDTH, LaunchPlan, _cdiv, _cross_term, _v_blocks, cached_plan,
                           packed_operands, size_hints)
from .multiscale_rules import taylor_mean_groups, taylor_rank


# Block-sparse kernels (multiscale solves, d <= 3; kernels/lse_blocksparse.py): one program per
# row block, no column split. BLOCK_M is fixed per (path, precision) because the caller builds
# the ranges per row block (blocksparse_block_m). "k16" (every d <= 3) swept; the others (the
# kernels run there only when called directly) are the dense tables' choices.
GPU_BLOCKSPARSE = {
    # d <= 3: an H100 sweep at 2^20 (the solve's own masks): LSE pass 104 -> 64 ms, apply pass
    # 143 -> 92 ms against (64, 64, 4, 2)
    "k16": dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=1),
    "resident": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    "looped": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}
# the LSE pass of the resident path (16 < d <= 64: packed batches), an H200 sweep at B = 256 problems of
# n = 1024, d = 64 (50 iterations of sinkhorn_batch): BLOCK_N 64 -> 128 takes 45.9 -> 32.5 ms (same
# BLOCK_M, warps, stages; 128-row blocks 34-38 ms, 8 warps 64-86 ms). The apply pass keeps 64 (not swept).
GPU_BLOCKSPARSE_LSE = {"resident": dict(BLOCK_N=128)}
# the interpreter pays per op: row blocks small enough that the CPU tests see several
INTERPRETER_BLOCKSPARSE = dict(BLOCK_M=16, BLOCK_N=32)


def blocksparse_block_m(d: int, precision: str, on_gpu: bool) -> int:
    """BLOCK_M of the block-sparse kernels: the rows of one KEEP mask row (row block b holds
    the rows [b * BLOCK_M, (b + 1) * BLOCK_M)). A fixed choice per (d, precision, device),
    so the caller builds the (cdiv(n, BLOCK_M), K) mask before asking for a launch."""
    _, path = _cross_term(d, precision)
    return GPU_BLOCKSPARSE[path]["BLOCK_M"] if on_gpu else INTERPRETER_BLOCKSPARSE["BLOCK_M"]


def _blocksparse_tiles(d: int, precision: str, on_gpu: bool) -> tuple[dict, dict, str, int, int]:
    """(tile constexprs, cross-term constexprs, path, warps, stages) of the block-sparse kernels."""
    cross, path = _cross_term(d, precision)
    if on_gpu:
        cfg = dict(GPU_BLOCKSPARSE[path])
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    else:
        cfg, warps, stages = dict(INTERPRETER_BLOCKSPARSE), 4, 1
    return cfg, cross, path, warps, stages


@cached_plan
def lse_blocksparse_plan(n: int, d: int, precision: str, on_gpu: bool, fold: bool = False) -> LaunchPlan:
    """Plan for ``lse_blocksparse_kernel``: grid (cdiv(n, BLOCK_M),), BLOCK_M =
    :func:`blocksparse_block_m`. ``constexprs["FOLD"]``: the fixed-shift loop, when asked
    for (``fold``, the caller passes POLD) and d <= 64 (FOLD_PATHS; no column split here, so
    the resident path folds too)."""
    cfg, cross, path, warps, stages = _blocksparse_tiles(d, precision, on_gpu)
    if on_gpu:
        cfg.update(GPU_BLOCKSPARSE_LSE.get(path, {}))
    return LaunchPlan(grid=(_cdiv(n, cfg["BLOCK_M"]),), num_warps=warps, num_stages=stages,
                      constexprs={**cfg, **cross, "FOLD": bool(fold) and path in FOLD_PATHS,
                                  **size_hints(n=n)})


@cached_plan
def apply_blocksparse_plan(n: int, d: int, p: int, precision: str, on_gpu: bool,
                           target_mean: bool = False) -> LaunchPlan:
    """Plan for ``apply_plan_blocksparse_kernel``: grid (cdiv(n, BLOCK_M), cdiv(p, BLOCK_P)),
    BLOCK_M = :func:`blocksparse_block_m`; p = 0 for row sums only. ``target_mean``: V is the
    target cloud itself (p = d), its product on the tensor cores from the packed parts
    (TGT_MEAN; only where :func:`packed_operands`)."""
    cfg, cross, _, warps, stages = _blocksparse_tiles(d, precision, on_gpu)
    if target_mean and not (packed_operands(d) and p == d):
        raise ValueError(f"target_mean needs packed operands (d <= {PACKED_WIDTH // 3}) and p = d; got d={d}, p={p}")
    block_p, p_fma = _v_blocks(p)
    grid = (_cdiv(n, cfg["BLOCK_M"]), max(1, _cdiv(p, block_p)))
    mean = {"TGT_MEAN": True} if target_mean else {}
    return LaunchPlan(grid=grid, num_warps=warps, num_stages=stages,
                      constexprs={**cfg, **cross, "BLOCK_P": block_p, "P_FMA": p_fma, "HAS_V": p > 0,
                                  "P": p, **mean, **size_hints(n=n)})

@cached_plan
def block_runs_plan(blocks: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``kernels/block_ranges.py``: one program per row block, BLOCK_C column clusters
    at a time (byte loads of a few mask rows: memory-bound, one warp's worth of work per chunk)."""
    return LaunchPlan(grid=(max(blocks, 1),), num_warps=4 if on_gpu else 1, num_stages=1,
                      constexprs={"BLOCK_C": 1024 if on_gpu else 64})


@cached_plan
def pair_bound_plan(kx: int, ky: int, d: int, on_gpu: bool) -> LaunchPlan:
    """Plan for the kernels of ``kernels/pair_bound.py``: (BLOCK_K x BLOCK_L) tiles of the
    cluster-pair grid (elementwise work: a few dozen flops per pair). 32 x 32 on the GPU: 1.3 /
    2.0 ms for the dropped-mass and keep passes at 15 625^2 pairs against 2.6 / 3.2 at 64 x 64 (measured
    on the H100)."""
    blk = 32 if on_gpu else 16
    return LaunchPlan(grid=(_cdiv(kx, blk), _cdiv(ky, blk)), num_warps=4, num_stages=1,
                      constexprs={"BLOCK_K": blk, "BLOCK_L": blk, "D": d})


@cached_plan
def mask_lists_plan(rows: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``kernels/mask_lists.py``: one program per mask row, BLOCK byte entries at a time
    (memory-bound: a K_c-byte row per program)."""
    return LaunchPlan(grid=(max(rows, 1),), num_warps=4 if on_gpu else 1, num_stages=1,
                      constexprs={"BLOCK": 1024 if on_gpu else 64})


@cached_plan
def pair_fixup_plan(programs: int, d: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``pair_fixup_kernel``: one program per row (or column) of the cluster-pair grid,
    nearly all returning at once; the rare empty one streams its line BLOCK pairs at a time."""
    return LaunchPlan(grid=(max(programs, 1),), num_warps=4 if on_gpu else 1, num_stages=1,
                      constexprs={"BLOCK": 1024 if on_gpu else 64, "D": d})


@cached_plan
def lift_plan(k_rows: int, d: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``kernels/lift_gathered.py``: one program per row cluster, BLOCK_I points by BLOCK_L
    gathered columns per step (elementwise work; 16 rows pad a 67-point cluster to 80). H100 sweep,
    the four lifts at 2^20 / 2^22:
    16 x 128, 4 warps 4.3 / 15.3 ms; 32 x 64 6.8 / 18.1; 64 x 128, 8 warps 9.6 / 23.8."""
    return LaunchPlan(grid=(max(k_rows, 1),), num_warps=4 if on_gpu else 1, num_stages=1,
                      constexprs={"BLOCK_I": 16, "BLOCK_L": 128 if on_gpu else 16, "D": d})


@cached_plan
def taylor_plans(d: int, on_gpu: bool, p: int) -> tuple[dict, dict, dict, dict]:
    """Constexprs and launch settings of the Taylor pass's kernels (kernels/taylor_blocksparse.py):
    (monomials, moments, evaluation, evaluation with the mean), each {"constexprs", "num_warps",
    "num_stages"}; p: the order, R the padded rank (multiscale_rules.taylor_rank). GPU tiles from
    H100 sweeps:
    - moments over chunks of 32 points, 4 warps, 1 stage; kept row clusters per step: 128 at R = 128
      (equal to 64 at 2^20, -13% at 2^22), 64 at R <= 64 (-23% / -10% against 128);
    - evaluation over 128 rows and 32 kept column clusters per step, 3 stages; 8 warps at R = 128, 4 at
      R <= 64 (the plain pass -15% at 2^20 and 2^22). With the mean: 128 / G rows of G stacked monomial
      groups, 32 column clusters per step, 8 warps at R = 128; at R <= 64 64 column clusters, 4 warps
      (the pass -8% / -6%);
    - monomials 32 rows x 8 warps (64 x 4 compiled in 3.9 s against 0.3, the first call's critical path)."""
    r, g = taylor_rank(d, p), taylor_mean_groups(d)
    if on_gpu:
        small = r <= 64
        return ({"constexprs": {"BLOCK": 32, "R": r, "P": p, "D": d}, "num_warps": 8, "num_stages": 1},
                {"constexprs": {"BLOCK_J": 32, "BLOCK_K": 64 if small else 128, "R": r, "D": d}, "num_warps": 4,
                 "num_stages": 1},
                {"constexprs": {"BLOCK_I": 128, "BLOCK_L": 32, "R": r, "D": d, "G": 1}, "num_warps": 4 if small else 8,
                 "num_stages": 3},
                {"constexprs": {"BLOCK_I": 128 // g, "BLOCK_L": 64 if small else 32, "R": r, "D": d, "G": g},
                 "num_warps": 4 if small else 8, "num_stages": 3})
    return ({"constexprs": {"BLOCK": 16, "R": r, "P": p, "D": d}, "num_warps": 1, "num_stages": 1},
            {"constexprs": {"BLOCK_J": 16, "BLOCK_K": 16, "R": r, "D": d}, "num_warps": 1, "num_stages": 1},
            {"constexprs": {"BLOCK_I": 16, "BLOCK_L": 16, "R": r, "D": d, "G": 1}, "num_warps": 1, "num_stages": 1},
            {"constexprs": {"BLOCK_I": 16 // g, "BLOCK_L": 16, "R": r, "D": d, "G": g}, "num_warps": 1, "num_stages": 1})
