"""Launch plans of the symmetric update (both half-steps from the same potentials, kernels/lse_pair.py).

How ``kernel_calls.lse_pair`` runs a symmetric update is :data:`PAIR_MODE`:

* ``"fused"`` (default): one sweep of the exponentials for both sides (``lse_pair_kernel``) and
  one finishing launch per side (``lse_pair_finish_kernel``); on every path with a resident x
  block (d <= 64), else ``"fold"``; on the K = 16 path (d <= 16) only up to
  :data:`FUSED_K16_PAIRS` pairs, ``"fold"`` beyond (:func:`pair_mode` says why).
* ``"fold"``: two fixed-shift half-steps (lse.py's FOLD where its plan offers it).
* ``"online"``: two online-max half-steps (kept for A/B runs against the fused pass).

The debiasing terms (``kernel_calls.lse_self``): :data:`SELF_MODE`, by the same rule.
"""

from __future__ import annotations

import functools

from .launch_plans import (FOLD_PATHS, GPU_LSE, SM_TARGET, LaunchPlan, _cdiv, _cross_term, _pow2_at_least,
                           size_hints)

PAIR_MODE = "fused"
PAIR_MODES = ("fused", "fold", "online")
# The largest n m at which the K = 16 path (d <= 16) runs the fused sweep. SamplesLoss() at
# d = 3 on an H200, whole call, fused against two fold half-steps: 73.2 / 72.0 ms at 2^16 points
# per side, 1.11 / 1.06 s at 2^18, 5.21 / 4.13 s at 2^19, 20.95 / 16.61 s at 2^20 (and 331 s
# against about 4 x 70 s at 2^22, docs/performance.md).
FUSED_K16_PAIRS = 2 ** 32
# kernel_calls.lse_self (the debiasing terms x-x, y-y): "online" (lse.py's online max), "triangle"
# (one sweep of the pairs j >= i, lse_pair_kernel's SELF on a grid of the block pairs g <= k) or
# "fold" (lse.py's fixed shift). H100, one update:
# "triangle" 1.90 against 2.47 ms at 65536 x 3, but 4.42 against 2.56 at 65536 x 16, 6.46 against
# 4.64 at 65536 x 64 and slower at 8192 (0.125 / 0.464 against 0.077 / 0.093 ms at d = 3 / 64);
# SamplesLoss loss + grad 3.71 against 3.69 ms at 8192 x 3, 7.94 against 9.11 at 16384 x 16. Not
# understood yet (the d = 16 and d = 64 sweeps lose where the pair sweep gains), so not the default.
# "fold" is slower than "online" in SamplesLoss (4.56 against 4.05 ms at 8192 x 3, H100;
# docs/performance.md): the annealed self-updates leave FOLD's window often.
SELF_MODE = "online"
SELF_MODES = ("triangle", "fold", "online")
# GPU tiles of lse_pair_kernel by (path, precision). Tall tiles: the column sums are reduced
# across the tile's rows at every tile (shuffles, shared memory), the row sums only once per row
# block; SASS of the sweep loop at d = 3 (sm_90, FP16 parts): 8.6 instructions per pair at
# 256 x 32 (4 warps) against 10.3 at 128 x 64 (lse.py's FOLD loop: 7.6 for one side)
GPU_PAIR = {
    ("k16", "float32"): dict(BLOCK_M=256, BLOCK_N=32, num_warps=4, num_stages=2),
    ("k16", "tf32"): dict(BLOCK_M=256, BLOCK_N=32, num_warps=4, num_stages=2),
    ("resident", "float32"): dict(BLOCK_M=256, BLOCK_N=32, num_warps=4, num_stages=2),
    ("resident", "tf32"): dict(BLOCK_M=256, BLOCK_N=32, num_warps=4, num_stages=2),
}
# GPU tiles of the SELF sweep (lse_pair_kernel, SELF); BLOCK_M a multiple of BLOCK_N
GPU_SELF = {
    ("k16", "float32"): dict(BLOCK_M=256, BLOCK_N=32, num_warps=4, num_stages=2),
    ("k16", "tf32"): dict(BLOCK_M=256, BLOCK_N=32, num_warps=4, num_stages=2),
    ("resident", "float32"): dict(BLOCK_M=256, BLOCK_N=32, num_warps=4, num_stages=2),
    ("resident", "tf32"): dict(BLOCK_M=256, BLOCK_N=32, num_warps=4, num_stages=2),
}
GPU_GROUPS = 16  # row groups (and about as many column groups) on the GPU: G K ~ SM_TARGET
GPU_SELF_GROUPS = 22  # SELF: G (G + 1) / 2 ~ SM_TARGET block pairs
INTERPRETER_PAIR = dict(BLOCK_M=32, BLOCK_N=32)  # small enough that the CPU tests see several groups


def _mode(name: str, value: str, modes: tuple[str, ...], fused: str, d: int, precision: str) -> str:
    if value not in modes:
        raise ValueError(f"pair_plans.{name} must be one of {modes}, got {value!r}")
    if value == fused and _cross_term(d, precision)[1] not in FOLD_PATHS:
        return "fold"  # no resident x block (d > 64): two fixed-shift half-steps
    return value


def pair_mode(n: int, m: int, d: int, precision: str) -> str:
    """The mode ``kernel_calls.lse_pair`` runs for n x m points of dimension d (module
    docstring). The fused sweep halves the exponentials but runs one 4-warp program per SM that
    keeps per-program column partials; at d <= 16 that gains nothing at 2^16 x 2^16 and loses
    about a fifth from 2^19 x 2^19 on (:data:`FUSED_K16_PAIRS`), where two fold half-steps with
    the LSE kernel's occupancy win. At d > 16 the halved cross-term flops keep it ahead (65536 x
    64: 5.22 against 6.46 ms, H100)."""
    mode = _mode("PAIR_MODE", PAIR_MODE, PAIR_MODES, "fused", d, precision)
    if mode == "fused" and _cross_term(d, precision)[1] == "k16" and n * m > FUSED_K16_PAIRS:
        return "fold"
    return mode


def self_mode(d: int, precision: str) -> str:
    """The mode ``kernel_calls.lse_self`` runs at dimension d (:data:`SELF_MODE`)."""
    return _mode("SELF_MODE", SELF_MODE, SELF_MODES, "triangle", d, precision)


def _cross(d: int, precision: str) -> tuple[dict, str]:
    cross, path = _cross_term(d, precision)
    cross.pop("SINGLE_K")  # the pair kernels always keep the x block resident
    return cross, path


@functools.lru_cache(maxsize=512)
def pair_plan(n: int, m: int, d: int, precision: str, on_gpu: bool, self_: bool = False) -> LaunchPlan:
    """Plan for ``lse_pair_kernel`` (rows x of n points, columns y of m): grid (G, K) = (row
    groups of GROUP_ROWS row blocks, column groups); its scratch is ROWPART (K, n) and
    COLPART (G, m). About GPU_GROUPS row groups and SM_TARGET / G column groups on the GPU;
    under the interpreter 2 row blocks per group and 2 column groups where there are as many
    (so the CPU tests run every path of the kernel). ``self_``: the sweep of a cloud against
    itself (SELF): column groups = row groups, grid (G (G + 1) / 2, 1), one program per block
    pair g <= k (:func:`self_groups`); its diagonal needs BLOCK_M to be a multiple of BLOCK_N."""
    cross, path = _cross(d, precision)
    if on_gpu:
        cfg = dict((GPU_SELF if self_ else GPU_PAIR)[(path, precision)])
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], _pow2_at_least(n, 32))
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
        groups, col_groups = GPU_GROUPS, None
    else:
        cfg = {k: min(v, _pow2_at_least(size, 16)) for (k, v), size in zip(INTERPRETER_PAIR.items(), (n, m))}
        warps, stages, groups, col_groups = 4, 1, None, 2
    rows, tiles = _cdiv(n, cfg["BLOCK_M"]), _cdiv(m, cfg["BLOCK_N"])
    if self_:  # G (G + 1) / 2 programs, one per block pair g <= k: about SM_TARGET of them
        if cfg["BLOCK_M"] % cfg["BLOCK_N"]:
            raise ValueError(f"pair_plan: SELF needs BLOCK_M a multiple of BLOCK_N, got {cfg}")
        groups = GPU_SELF_GROUPS if on_gpu else None
    group_rows = _cdiv(rows, min(rows, groups)) if groups else min(rows, 2)
    g = _cdiv(rows, group_rows)
    k = min(tiles, col_groups if col_groups else max(1, _cdiv(SM_TARGET, g)))
    grid = (g * (g + 1) // 2, 1) if self_ else (g, k)
    return LaunchPlan(grid=grid, num_warps=warps, num_stages=stages,
                      constexprs={**cfg, **cross, "GROUP_ROWS": group_rows, **size_hints(n=n, m=m)})


def self_groups(plan: LaunchPlan, n: int) -> int:
    """G of a SELF sweep's plan (:func:`pair_plan` with ``self_``): its PART holds 2 G partials
    per point."""
    return _cdiv(_cdiv(n, plan.constexprs["BLOCK_M"]), plan.constexprs["GROUP_ROWS"])


@functools.lru_cache(maxsize=512)
def pair_finish_plan(n: int, m: int, d: int, precision: str, on_gpu: bool) -> LaunchPlan:
    """Plan for ``lse_pair_finish_kernel`` finishing the n rows (their fallback streams the m
    columns with lse.py's online loop, at its tiles): grid (cdiv(n, BLOCK_M),)."""
    cross, path = _cross(d, precision)
    if on_gpu:
        cfg = dict(GPU_LSE[(path, precision)])
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], _pow2_at_least(n, 32))
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    else:
        cfg = {k: min(v, _pow2_at_least(size, 16)) for (k, v), size in zip(INTERPRETER_PAIR.items(), (n, m))}
        warps, stages = 4, 1
    return LaunchPlan(grid=(_cdiv(n, cfg["BLOCK_M"]),), num_warps=warps, num_stages=stages,
                      constexprs={**cfg, **cross, **size_hints(n=n, m=m)})


@functools.lru_cache(maxsize=512)
def pair_prep_plan(n: int, m: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``pair_prep_kernel`` (elementwise over both clouds)."""
    block = 1024 if on_gpu else _pow2_at_least(min(max(n, m), 1024), 16)
    return LaunchPlan(grid=(_cdiv(max(n, m), block),), num_warps=4, num_stages=1, constexprs={"BLOCK": block})


def clear_cache() -> None:
    """Forget cached plans (after editing GPU_PAIR, as a sweep does)."""
    for fn in (pair_plan, pair_finish_plan, pair_prep_plan):
        fn.cache_clear()
