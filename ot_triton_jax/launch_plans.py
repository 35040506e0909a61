"""Launch plans: (sizes, precision, device) -> grid, block sizes, warps, stages.

The single source of launch parameters for both frontends (torch_api and the
JAX ops call these functions and nothing else), so a kernel runs with identical
configuration whichever framework launched it. No framework imports.

Precision names (public API):
  "float32": float32-accurate. Cross term by exact FMAs for d <= 8, otherwise
             3xTF32 tensor-core dots (input_precision="tf32x3").
  "tf32":    one TF32 dot (~1e-3 relative error in the LSE at eps=0.1); exact
             FMAs still used for d <= 8 (they are as fast there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

PRECISIONS = ("float32", "tf32")
_TRITON_PRECISION = {"float32": "tf32x3", "tf32": "tf32"}
FMA_MAX_D = 8

# GPU tile table, keyed by path. Chosen from the sweep in bench/sweep_plans.py
# (results in bench/results/); BLOCK_K for the dot path is derived from d.
GPU_LSE = {
    "fma": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    "dot": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "dot_wide": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}
GPU_APPLY = {
    "fma": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=2),
    "dot": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a frontend needs to launch one kernel."""

    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    constexprs: dict = field(default_factory=dict)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(v: int, lo: int) -> int:
    p = lo
    while p < v:
        p *= 2
    return p


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def _cross_term(d: int, precision: str, on_gpu: bool) -> tuple[dict, str]:
    """Constexprs describing how the <x, y> tile is computed, and the table key."""
    check_precision(precision)
    if d <= FMA_MAX_D:
        return dict(BLOCK_K=16, D_FMA=d, SINGLE_K=False, PRECISION=_TRITON_PRECISION[precision]), "fma"
    if d <= 64 or not on_gpu:
        block_k = _pow2_at_least(d, 16) if d <= 64 else 64
        return dict(BLOCK_K=block_k, D_FMA=0, SINGLE_K=d <= block_k,
                    PRECISION=_TRITON_PRECISION[precision]), "dot"
    return dict(BLOCK_K=64, D_FMA=0, SINGLE_K=False, PRECISION=_TRITON_PRECISION[precision]), "dot_wide"


def _interpreter_blocks(n: int, m: int) -> dict:
    # The interpreter pays per op, not per element: few, large tiles.
    return dict(BLOCK_M=_pow2_at_least(min(n, 64), 16), BLOCK_N=_pow2_at_least(min(m, 64), 16))


def lse_plan(n: int, m: int, d: int, precision: str, on_gpu: bool) -> LaunchPlan:
    """Plan for ``lse_update_kernel`` updating n rows against m columns in dimension d."""
    cross, key = _cross_term(d, precision, on_gpu)
    if on_gpu:
        cfg = dict(GPU_LSE[key])
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    else:
        cfg, warps, stages = _interpreter_blocks(n, m), 4, 1
    return LaunchPlan(grid=(_cdiv(n, cfg["BLOCK_M"]),), num_warps=warps, num_stages=stages,
                      constexprs={**cfg, **cross})


def apply_plan(n: int, m: int, d: int, p: int, precision: str, on_gpu: bool) -> LaunchPlan:
    """Plan for ``apply_plan_kernel``: (n x m plan) @ (m x p matrix); p = 0 for row sums only."""
    cross, key = _cross_term(d, precision, on_gpu)
    if on_gpu:
        cfg = dict(GPU_APPLY["fma" if key == "fma" else "dot"])
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    else:
        cfg, warps, stages = _interpreter_blocks(n, m), 4, 1
    if p <= FMA_MAX_D:
        block_p, p_fma = 8, p
    else:
        block_p, p_fma = min(_pow2_at_least(p, 16), 128), 0
    grid = (_cdiv(n, cfg["BLOCK_M"]), max(1, _cdiv(p, block_p)))
    return LaunchPlan(grid=grid, num_warps=warps, num_stages=stages,
                      constexprs={**cfg, **cross, "BLOCK_P": block_p, "P_FMA": p_fma, "HAS_V": p > 0})
