"""Launch plans of the mHC Sinkhorn-Knopp kernels (``kernels/mhc.py``).

The one source of grid, matrices per program, warps, stages and constexprs
for ``torch_api.mhc_sinkhorn`` and ``ot_triton_jax.mhc_sinkhorn``: both call
:func:`mhc_plan` and nothing else, so both run identical kernels. No
framework imports.

Layout (constexpr ``SOA``), the same on the GPU and under the interpreter:
one matrix per thread for the forward up to n = 8 and for the backward
kernels up to n = 4 (beyond that the fully unrolled per-entry code needs too
many registers and takes minutes to compile), a [BLOCK_B, NP, NP] tile
otherwise.

GPU: SOA programs hold 32 * num_warps matrices; tile programs about
``tile`` float32 values. The unrolled backward keeps ``SEG`` iterations of
scaling vectors in registers and replays the rest from the logits, so
``SEG`` shrinks as n grows (and when eps > 0). The values come from register/spill and
instruction counts of sm_90 compiles, not from a timing sweep; the ``mhc``
area of the benchmark suite (bench/areas/mhc.py) times them on the H100. Divisions use
``div.approx`` / ``rcp.approx`` on the GPU (``FAST``).

Interpreter (no GPU): few, large programs (the interpreter pays per
operation, not per element), exact divisions, and ``SEG = 8`` so that the
segmented replay (several segments plus a partial one) is what the CPU tests
exercise at the default 20 iterations.
"""

from __future__ import annotations

import functools

from .launch_plans import LaunchPlan

KINDS = ("forward", "unrolled", "implicit")
N_MIN, N_MAX = 2, 64
# GPU table: kind -> NP -> layout. "soa": one matrix per thread, 32 * warps matrices per
# program; otherwise "tile" float32 values per program. "seg": SEG of the unrolled backward
# ("seg_eps" when eps > 0: the eps terms need more registers). From sm_90 compiles (no spills
# anywhere; registers: unrolled n=4 214 (eps=0, SEG 20) / 168 (eps>0, SEG 10), tiles <= 187).
_GPU = {
    "forward": {
        2: dict(soa=True, warps=4), 4: dict(soa=True, warps=4), 8: dict(soa=True, warps=4),
        16: dict(tile=4096, warps=4), 32: dict(tile=4096, warps=4), 64: dict(tile=8192, warps=8),
    },
    "unrolled": {
        2: dict(soa=True, warps=4, seg=20, seg_eps=20),
        4: dict(soa=True, warps=4, seg=20, seg_eps=10),
        8: dict(tile=2048, warps=4, seg=5), 16: dict(tile=2048, warps=4, seg=5),
        32: dict(tile=4096, warps=4, seg=4), 64: dict(tile=8192, warps=8, seg=2),
    },
    "implicit": {
        2: dict(soa=True, warps=4), 4: dict(soa=True, warps=4),
        8: dict(tile=1024, warps=4), 16: dict(tile=2048, warps=4),
        32: dict(tile=2048, warps=4), 64: dict(tile=4096, warps=8),
    },
}

_INTERP_TILE = 1 << 14      # elements per program under the interpreter
_INTERP_SEG = 8


def next_pow2(v: int) -> int:
    p = 1
    while p < v:
        p *= 2
    return p


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.lru_cache(maxsize=1024)
def mhc_plan(kind: str, batch: int, n: int, iters: int, rows_first: bool, has_eps: bool,
             on_gpu: bool, *, block_b: int | None = None, num_warps: int | None = None,
             seg: int | None = None, soa: bool | None = None) -> LaunchPlan:
    """Plan for one mHC kernel over ``batch`` matrices of size n x n.

    Args:
      kind: "forward" (``mhc_forward_kernel``), "unrolled"
        (``mhc_backward_unrolled_kernel``) or "implicit"
        (``mhc_backward_implicit_kernel``).
      batch: number of matrices (all leading dims flattened).
      n: matrix size, 2 <= n <= 64.
      iters: Sinkhorn iterations T >= 1 (a compile-time constant).
      rows_first: start with the row normalization (kernel flag ROWS_FIRST).
      has_eps: eps > 0 (kernel flag HAS_EPS; the value itself is a run-time
        PARAMS entry, so changing it never recompiles).
      on_gpu: GPU table, or the interpreter plan.
      block_b, num_warps, seg, soa: overrides, for tuning sweeps (bench/) and tests.

    Plans are cached: treat the returned plan (and its ``constexprs``) as read-only.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    if not (N_MIN <= n <= N_MAX):
        raise ValueError(f"n must be in [{N_MIN}, {N_MAX}], got {n}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, got {iters}")
    batch = max(int(batch), 1)
    np_ = next_pow2(n)
    entry = _GPU[kind][np_]
    use_soa = entry.get("soa", False) if soa is None else bool(soa)
    if use_soa and np_ > 8:
        raise ValueError("soa=True supports n <= 8 only")
    seg_default = entry.get("seg_eps" if has_eps else "seg", entry.get("seg", 5))
    if on_gpu:
        warps = entry["warps"] if num_warps is None else num_warps
        stages = 1
        if use_soa:
            bb = 32 * warps
        else:
            tile = entry.get("tile", 32 * 4 * np_ * np_)
            bb = max(1, tile // (np_ * np_))
    else:
        warps, stages, seg_default = 4, 1, _INTERP_SEG
        bb = max(1, _INTERP_TILE // (np_ * np_))
        bb = min(bb, next_pow2(batch))
    if block_b is not None:
        bb = block_b
    if num_warps is not None:
        warps = num_warps
    constexprs = dict(N=n, NP=np_, BLOCK_B=bb, ITERS=int(iters), ROWS_FIRST=bool(rows_first),
                      HAS_EPS=bool(has_eps), SOA=use_soa, FAST=bool(on_gpu))
    if kind == "unrolled":
        constexprs["SEG"] = max(1, min(int(seg if seg is not None else seg_default), int(iters)))
    return LaunchPlan(grid=(_cdiv(batch, bb),), num_warps=warps, num_stages=stages,
                      constexprs=constexprs)
