"""Launch plans: (sizes, precision, device) -> grid, block sizes, warps, stages.

The single source of launch parameters for both frontends (torch_api and the
JAX ops call these functions and nothing else), so a kernel runs with identical
configuration whichever framework launched it. No framework imports. This module holds the
shared rules (precision, operands, the :class:`LaunchPlan` record) and the plans of the dense
passes (LSE half-steps, plan-apply, weighted apply, reg_ot_cost's mass); the other families
are in ``cloud_plans`` (cloud preparation), ``pair_plans`` (the symmetric update),
``multiscale_plans`` (block-sparse, bounds, lift, Taylor) and ``mhc_plans``.

Precision names (public API):
  "float32": float32-accurate: the cross term <x, y> by three tensor-core products
             on hand-split operands (kernels/tiles.py), any d: FP16 parts of the clouds
             scaled by a power of two ("fp16x3", twice the TF32 rate, same significand;
             :func:`fp16_operands`; TF32 parts "tf32x3" where it says no).
  "tf32":    one product (~1e-3 relative error in the LSE at eps=0.1): "fp16" ("tf32"
             on TF32 parts).
For d <= 5 both run "fp16p": the three products of "fp16x3" as one product over packed
operands (:func:`packed_operands`), float32-accurate at the cost of one.
The mass term of reg_ot_cost uses its own unbiased cross term ("fixed4", exact_mass_plan).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

PRECISIONS = ("float32", "tf32")
_TRITON_PRECISION = {"float32": "tf32x3", "tf32": "tf32"}
_TRITON_PRECISION_FP16 = {"float32": "fp16x3", "tf32": "fp16"}
# From this d on the cross term's operands are FP16 (split_scaled_kernel): FP16 runs at twice the
# TF32 rate with the same significand. Solve level on the H100 against TF32 parts, 10 iterations at
# n = 65536, float32, same f error (docs/performance.md):
# d = 64 131.6 -> 103.5 ms, d = 16 50.1 -> 43.4 ms, d = 3 53.9 -> 40.9 ms once the rows are
# 16-byte aligned (operand_stride; with 6-byte rows d = 3 is slower, 66.3 ms). So every d.
# To time the TF32 parts, raise it in a process of its own before any plan is built.
FP16_MIN_D = 1
COL_BIAS_MIN_M = 0  # from this many columns the half-step reads precomputed column biases (lse_plan)
PACKED_WIDTH = 16  # row width of packed FP16 parts (packed_operands): one HGMMA k16
FMA_MAX_P = 8  # plan-apply: at most this many columns of V use CUDA-core FMAs
SM_TARGET = 256  # programs wanted to fill an H100 (132 SMs, about 2 resident programs each)

# GPU tile table by (path, precision). "k16": d <= 16 (one zero-padded chunk of 16
# columns); "resident": 16 < d <= 64, the x block stays in registers; "looped": d > 64,
# x and y stream in chunks of 64 columns. From an H100 sweep
# (d = 3 for "k16", d = 64 for "resident").
GPU_LSE = {
    # online half-steps (a solve's first g-update, no previous potential to fold): 64 x 128, 4 warps,
    # 3 stages 1.51 ms against 1.86 for (256, 64, 8, 2) at 65536 x 3 with packed operands and
    # precomputed column biases (an H100 sweep)
    ("k16", "float32"): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    ("k16", "tf32"): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=2),
    # the fixed-shift loop (FOLD) prefers other tiles. With packed operands and precomputed column
    # biases (an H100 sweep, FOLD half-step): 64 x 128, 4 warps, 3
    # stages 1.35 ms against 1.55 for (128, 64, 4, 2) at 65536 x 3, 20.3 / 22.5 ms at 262144 x 3,
    # 1.52 / 1.78 ms at 65536 x 16 (same f error)
    ("k16", "float32", "fold"): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    # tf32 at d <= 5 runs the same packed product (1.33 ms at 65536 x 3); 6 <= d <= 16 not measured
    ("k16", "tf32", "fold"): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    # 256 x 64, 8 warps, 3 stages: 8.19 -> 7.18 ms per online half-step at n = 65536, d = 64, same f
    # error (an H100 sweep);
    # with precomputed column biases 2 stages: 3.21 ms against 3.37 (an H100 sweep)
    ("resident", "float32"): dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=2),
    # n too small to fill the GPU with row blocks (the column split is on): from the n = 8192 sweep
    ("resident", "float32", "small"): dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
    ("resident", "tf32"): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    # FOLD on the resident path: the whole column range in one program (SPLIT = 1; a partial
    # column range's sum can fall under FOLD_LO and force the fallback), so only when the
    # row blocks alone fill the GPU; "small": fewer rows than SM_TARGET big blocks
    # (measured on the H100)
    # FOLD with precomputed column biases: 64 x 64, 4 warps, 2 stages 3.40 ms per half-step against
    # 3.81 for (256, 64, 8, 3) (the choice before them) at n = 65536, d = 64, same f error
    # (an H100 sweep)
    # 128 x 64, 4 warps, 2 stages with two column tiles per loop step (lse.py PAIRED): 3.23 ms
    # against 3.39 without PAIRED and 3.42-3.44 for (64, 64, 4, 2) (an H100 sweep;
    # PAIRED slows every other tile there, and tf32 and d = 3 at every tile)
    ("resident", "float32", "fold"): dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, PAIRED=True),
    ("resident", "float32", "fold", "small"): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    ("resident", "tf32", "fold"): dict(BLOCK_M=64, BLOCK_N=128, num_warps=4, num_stages=3),
    ("looped", "float32"): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    ("looped", "tf32"): dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}
# paths on which lse_plan(fold=True) turns FOLD on (docs/performance.md)
FOLD_PATHS = ("k16", "resident")
GPU_APPLY = {
    "k16": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "resident": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "looped": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}


# reg_ot_cost's mass pass (exact_mass_plan: "fixed4", row sums only, column split when the row
# blocks do not fill the GPU); docs/performance.md
GPU_MASS = {
    "k16": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "resident": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    "looped": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
}


# every cached plan builder, here and in cloud_plans / multiscale_plans (clear_cache)
_CACHED: list = []


def cached_plan(fn):
    """``functools.lru_cache(maxsize=512)``, registered so that :func:`clear_cache` forgets it."""
    cached = functools.lru_cache(maxsize=512)(fn)
    _CACHED.append(cached)
    return cached


@dataclass(frozen=True)
class LaunchPlan:
    """Everything a frontend needs to launch one kernel. Plans are cached and shared:
    treat them (and their ``constexprs``) as read-only."""

    grid: tuple[int, ...]
    num_warps: int
    num_stages: int
    constexprs: dict = field(default_factory=dict)


def size_hints(**sizes: int) -> dict:
    """Constexprs N16 / M16 (for sizes n / m): the size is a multiple of 16.

    Triton's own launcher (torch) specializes integer arguments on divisibility by
    16; jax_triton does not, and without it the masked loads of G and |y|^2 in
    the LSE loop compile to scalar loads outside the cp.async pipeline (64 LDG
    per iteration at n = 8192, d = 64; 34% slower half-steps under JAX). The
    kernels restate such a size as (n // 16) * 16, which the compiler can see.
    """
    return {f"{k.upper()}16": v % 16 == 0 for k, v in sizes.items()}


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _pow2_at_least(v: int, lo: int) -> int:
    p = lo
    while p < v:
        p *= 2
    return p


def fp16_operands(d: int) -> bool:
    """Whether clouds of dimension d are split into scaled FP16 parts (kernels/split.py,
    split_scaled_kernel) rather than TF32 ones; the cross-term kernels then run "fp16x3" /
    "fp16" and read each cloud's 1 / S."""
    return d >= FP16_MIN_D


def packed_operands(d: int) -> bool:
    """Whether the three FP16 products of the float32 cross term run as ONE tensor-core product
    over packed rows (kernels/split.py, PACKED): 3 d < PACKED_WIDTH, so that

        rows:    [x_lo, x_hi, x_hi, 0...]     (the ``hi`` array, read as X by the kernels)
        columns: [y_hi, y_lo, y_hi, 0..., 1]  (the ``lo`` array, read as YLO; the last column
                                               meets the rows' 0, and gives TGT_MEAN's row sum)

    give x_lo.y_hi + x_hi.y_lo + x_hi.y_hi (the same products in the same order along K) in one
    HGMMA k16 with one wait, where "fp16x3" issues three and waits for each (H100:
    FOLD half-step 65536 x 3 1.88 -> 1.63 ms, 262144 x 3 27.6 -> 23.9 ms, f error unchanged; at
    d = 16, K = 64 instead of 3 x 16 is 4% slower; docs/performance.md). The one product costs
    what "fp16"'s single product costs, so both public precisions run it (PRECISION "fp16p"): at
    these d "tf32" is float32-accurate."""
    return fp16_operands(d) and 3 * d < PACKED_WIDTH


def operand_stride(d: int) -> int:
    """Row stride (elements) of the clouds' head and tail arrays: d for TF32 parts; for FP16
    parts d rounded up to a multiple of 8 (zero columns after d), so that every row starts on
    16 bytes and the tiles load with 16-byte copies (cp.async; SASS: LDGSTS.E.BYPASS.128): a
    6-byte row (d = 3) can only be read 2 bytes at a time, through registers (LDG.E.U16,
    STS.U16; docs/performance.md). The kernels' D constexpr is this stride; the centred cloud
    ``xc`` keeps stride d. Packed parts (:func:`packed_operands`): PACKED_WIDTH."""
    if packed_operands(d):
        return PACKED_WIDTH
    return -(-d // 8) * 8 if fp16_operands(d) else d


def kernel_precision(precision: str, d: int) -> str:
    """The cross term's PRECISION constexpr (kernels/tiles.py) for a public precision at d."""
    check_precision(precision)
    if packed_operands(d):
        return "fp16p"
    return (_TRITON_PRECISION_FP16 if fp16_operands(d) else _TRITON_PRECISION)[precision]


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return precision


def _cross_term(d: int, precision: str, stride: int | None = None) -> tuple[dict, str]:
    # d and p are compile-time constants of the kernels (D, P): row strides known to the
    # compiler give vectorized loads under either launcher (jax_triton does not specialize
    # integer arguments on divisibility as Triton's own launcher does).
    """Constexprs describing how the <x, y> tile is computed (D: the operands' row stride,
    :func:`operand_stride` unless ``stride`` says otherwise), and the table path."""
    check_precision(precision)
    stride = operand_stride(d) if stride is None else stride
    block_k = _pow2_at_least(min(stride, 64), 16)
    path = "looped" if stride > block_k else ("k16" if block_k == 16 else "resident")
    return dict(BLOCK_K=block_k, SINGLE_K=path != "looped", PRECISION=kernel_precision(precision, d), D=stride), path


def _interpreter_blocks(n: int, m: int) -> dict:
    # The interpreter pays per op, not per element: few, large tiles.
    return dict(BLOCK_M=_pow2_at_least(min(n, 64), 16), BLOCK_N=_pow2_at_least(min(m, 64), 16))


def _fill_gpu(cfg: dict, n: int) -> dict:
    """Shrink BLOCK_M (not below 32) until there are programs for every SM."""
    while cfg["BLOCK_M"] > 32 and _cdiv(n, cfg["BLOCK_M"]) < SM_TARGET:
        cfg["BLOCK_M"] //= 2
        cfg["num_warps"] = max(4, cfg["num_warps"] // 2)
    return cfg


def _column_split(n: int, m: int, block_m: int, block_n: int, on_gpu: bool) -> int:
    """How many column ranges one row block is cut into (lse_update_kernel's SPLIT).

    On the GPU: enough programs to fill it when n is small, each range keeping at
    least 4 column tiles. Under the interpreter: 2 as soon as there are 2 column
    tiles, so that the CPU tests exercise the split path and lse_combine_kernel.
    """
    tiles = _cdiv(m, block_n)
    if not on_gpu:
        return 2 if tiles >= 2 else 1
    rows = _cdiv(n, block_m)
    if rows >= SM_TARGET:
        return 1
    return max(1, min(16, _cdiv(SM_TARGET, rows), tiles // 4))


@cached_plan
def lse_plan(n: int, m: int, d: int, precision: str, on_gpu: bool, fold: bool = False) -> LaunchPlan:
    """Plan for ``lse_update_kernel`` updating n rows against m columns in dimension d.

    Grid (row blocks, SPLIT); when ``constexprs["SPLIT"] > 1`` the frontend also
    launches ``lse_combine_kernel`` with :func:`lse_combine_plan` and passes a
    float32 scratch ``PART`` of 2 * SPLIT * n entries.

    ``fold``: the caller passes POLD (the previous potential of the updated side)
    and wants the fixed-shift loop; ``constexprs["FOLD"]`` says whether the plan
    uses it: for d <= 16 (10-20% per half-step on the H200)
    and for 16 < d <= 64 with one column range per program when the row
    blocks fill the GPU (7-16% at d = 64 on the H100); not for d > 64.
    """
    cross, path = _cross_term(d, precision)
    use_fold = bool(fold) and path in FOLD_PATHS
    # the resident path folds with the whole column range per program (see GPU_LSE)
    whole_rows = use_fold and path == "resident"
    if on_gpu:
        cfg = dict(GPU_LSE[(path, precision)])
        small = GPU_LSE.get((path, precision, "small"))
        if small is not None and _cdiv(n, cfg["BLOCK_M"]) < SM_TARGET:
            cfg = dict(small)
        fold_cfg = GPU_LSE.get((path, precision, "fold")) if use_fold else None
        if whole_rows:
            if fold_cfg is not None and _cdiv(n, fold_cfg["BLOCK_M"]) < SM_TARGET:
                fold_cfg = GPU_LSE.get((path, precision, "fold", "small"))
            if fold_cfg is None or _cdiv(n, fold_cfg["BLOCK_M"]) < SM_TARGET // 2:
                use_fold = whole_rows = False  # too few rows: the online loop with the column split
                fold_cfg = None
        if fold_cfg is not None:
            cfg = dict(fold_cfg)
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], _pow2_at_least(n, 32))
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    else:
        cfg, warps, stages = _interpreter_blocks(n, m), 4, 1
    split = 1 if whole_rows else _column_split(n, m, cfg["BLOCK_M"], cfg["BLOCK_N"], on_gpu)
    return LaunchPlan(grid=(_cdiv(n, cfg["BLOCK_M"]), split), num_warps=warps, num_stages=stages,
                      constexprs={**cfg, **cross, "SPLIT": split, "FOLD": use_fold,
                                  "COL_BIAS": (not on_gpu) or m >= COL_BIAS_MIN_M, **size_hints(n=n, m=m)})


@cached_plan
def label_order_plan(n: int, block_m: int, on_gpu: bool) -> LaunchPlan | None:
    """Plan for ``label_block_order_kernel`` (kernels/label_tiles.py: the labelled LSE kernel's row
    blocks, mixed labels first), or None where the order does not matter: on the GPU with at most
    one wave of row blocks (SM_TARGET programs), where no block waits for another. Always under the
    interpreter, so that the CPU tests run it."""
    if on_gpu and _cdiv(n, block_m) <= SM_TARGET:
        return None
    return LaunchPlan(grid=(1,), num_warps=4, num_stages=1,
                      constexprs={"BLOCK_M": block_m, "CHUNK": 64 if on_gpu else 16})


@cached_plan
def column_bias_plan(m: int, on_gpu: bool, rows: int = 1) -> LaunchPlan:
    """Plan for ``column_bias_kernel`` (the m column biases of one half-step), which runs before
    ``lse_update_kernel`` when its plan says ``COL_BIAS`` (m >= COL_BIAS_MIN_M on the GPU;
    always under the interpreter, so that the CPU tests run it). ``rows``: with a label cost,
    K_src + 1 rows of biases (:func:`label_bias_rows`)."""
    block = 1024 if on_gpu else _pow2_at_least(min(m, 1024), 16)
    return LaunchPlan(grid=(_cdiv(m, block), rows), num_warps=4, num_stages=1, constexprs={"BLOCK": block})


LABEL_BIAS_MAX = 1 << 25  # float32 entries (128 MiB) of the per-label column biases of one half-step
# above this d a half-step on rows sorted by label runs GROUPED (kernels/lse_update.py; always under the
# interpreter): at d = 64 the one-hot products spill (H200), at d = 3 the label loop costs more registers
LABEL_GROUPED_MIN_D = 16


def label_bias_rows(k_src: int, m: int) -> int | None:
    """The rows of column biases a labelled half-step precomputes (kernels/lse.py: one per source
    label, plus the plain row), or None when (k_src + 1) m exceeds LABEL_BIAS_MAX: every row block
    then takes the one-hot products."""
    rows = k_src + 1
    return rows if rows * m <= LABEL_BIAS_MAX else None


def lse_constexprs(plan: LaunchPlan, *, has_logw_in: bool, has_logw_out: bool, compute_err: bool) -> dict:
    """The flags of one ``lse_update_kernel`` launch, merged over ``plan.constexprs``."""
    return dict(HAS_LOGW_IN=has_logw_in, HAS_LOGW_OUT=has_logw_out, COMPUTE_ERR=compute_err)


@cached_plan
def lse_combine_plan(n: int, split: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``lse_combine_kernel`` (merging SPLIT partial reductions of n rows)."""
    block = 256 if on_gpu else _pow2_at_least(min(n, 1024), 16)
    return LaunchPlan(grid=(_cdiv(n, block),), num_warps=4, num_stages=1,
                      constexprs={"SPLIT": split, "BLOCK_M": block, **size_hints(n=n)})


def _v_blocks(p: int) -> tuple[int, int]:
    """(BLOCK_P, P_FMA) of the plan-apply kernels for a V of p columns."""
    if p <= FMA_MAX_P:
        return 8, p
    # at most 64 columns of V per program: 128 needed 296 KB of shared memory with the
    # GPU_APPLY tiles (n = 65536, d = 64); wider V runs more programs along the grid's p axis
    return min(_pow2_at_least(p, 16), 64), 0


@cached_plan
def apply_plan(n: int, m: int, d: int, p: int, precision: str, on_gpu: bool) -> LaunchPlan:
    """Plan for ``apply_plan_kernel``: (n x m plan) @ (m x p matrix); p = 0 for row sums only."""
    cross, path = _cross_term(d, precision)
    if on_gpu:
        cfg = _fill_gpu(dict(GPU_APPLY[path]), n)
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    else:
        cfg, warps, stages = _interpreter_blocks(n, m), 4, 1
    block_p, p_fma = _v_blocks(p)
    grid = (_cdiv(n, cfg["BLOCK_M"]), max(1, _cdiv(p, block_p)))
    return LaunchPlan(grid=grid, num_warps=warps, num_stages=stages,
                      constexprs={**cfg, **cross, "BLOCK_P": block_p, "P_FMA": p_fma, "HAS_V": p > 0,
                                  "P": p, "SPLIT": 1, **size_hints(n=n, m=m)})


@cached_plan
def weighted_plan(n: int, m: int, d: int, da: int, p: int, precision: str, on_gpu: bool) -> LaunchPlan:
    """Plan for ``apply_weighted_kernel``: sum_j P_ij <W_i, A_j> B_j with W (n, da), B (m, p).
    Three tiles live beside the plan tile (W, A, B chunks): smaller tiles than apply_plan's.
    Not swept yet (the HVP's passes)."""
    cross, path = _cross_term(d, precision)
    if on_gpu:
        # one stage: with d = 64 two stages of (x, y, W, A, B) tiles need 296 KB of shared memory
        cfg = _fill_gpu(dict(BLOCK_M=64, BLOCK_N=32, num_warps=4, num_stages=1), n)
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    else:
        cfg, warps, stages = _interpreter_blocks(n, m), 4, 1
    block_a = min(_pow2_at_least(da, 16), 64)
    block_p = min(_pow2_at_least(p, 16), 64)
    return LaunchPlan(grid=(_cdiv(n, cfg["BLOCK_M"]), _cdiv(p, block_p)), num_warps=warps, num_stages=stages,
                      constexprs={**cfg, **cross, "BLOCK_A": block_a, "BLOCK_P": block_p, "DA": da, "P": p,
                                  **size_hints(n=n, m=m)})


@cached_plan
def exact_mass_plan(n: int, m: int, d: int, on_gpu: bool) -> LaunchPlan:
    """Plan for ``apply_plan_kernel`` computing only the row sums P 1 with the unbiased
    "fixed4" cross term (kernels/tiles.py) on operands from ``split_fixed_kernel``
    (:func:`fixed_split_plan`): the mass term of reg_ot_cost, one pass per solve.

    Grid (row blocks, SPLIT): with ``constexprs["SPLIT"] > 1`` the kernel writes SPLIT
    partial row sums (SPLIT * n floats, range-major) for the caller to add."""
    cross, path = _cross_term(d, "float32", stride=d)  # split_fixed's parts: float32, stride d
    if on_gpu:
        cfg = dict(GPU_MASS[path])
        cfg["BLOCK_M"] = min(cfg["BLOCK_M"], _pow2_at_least(n, 32))
        warps, stages = cfg.pop("num_warps"), cfg.pop("num_stages")
    else:
        cfg, warps, stages = _interpreter_blocks(n, m), 4, 1
    split = _column_split(n, m, cfg["BLOCK_M"], cfg["BLOCK_N"], on_gpu)
    return LaunchPlan(grid=(_cdiv(n, cfg["BLOCK_M"]), split), num_warps=warps, num_stages=stages,
                      constexprs={**cfg, **cross, "PRECISION": "fixed4", "BLOCK_P": 8, "P_FMA": 0, "HAS_V": False,
                                  "D": d, "P": 0, "SPLIT": split, **size_hints(n=n, m=m)})


def clear_cache() -> None:
    """Forget cached plans (after editing the GPU tables): every
    :func:`cached_plan` builder of the modules imported so far."""
    for fn in _CACHED:
        fn.cache_clear()
