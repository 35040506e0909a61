"""Kernel call descriptions of the multiscale solve (:mod:`.kernel_calls` states the format and the
array names): the block-sparse LSE and plan-apply passes, the cluster-pair bounds (keep masks,
fix-ups, dropped mass), the masks' pair lists and per-row-block column runs, the gathered
coarse-to-fine lift and the Taylor pass (monomials, moments, evaluation). Nothing here imports a
framework."""

from __future__ import annotations

import functools

from . import launch_plans, multiscale_plans
from .kernel_calls import CallSequence, KernelCall, Output, _cross_inputs, scratch
from .kernels import (apply_plan_blocksparse_kernel, block_runs_kernel, lift_gathered_kernel, lse_blocksparse_kernel, mask_row_counts_kernel, mask_row_lists_kernel, pair_dropped_kernel, pair_fixup_kernel, pair_keep_kernel, taylor_evaluate_kernel, taylor_moments_kernel, taylor_monomials_kernel)
from .launch_plans import LaunchPlan


def lse_blocksparse(n: int, m: int, d: int, r: int, precision: str, on_gpu: bool, has_logw_in: bool,
                    has_logw_out: bool, compute_err: bool, fold: bool, relax_at: int = 0) -> CallSequence:
    """:func:`lse_update` restricted to the tgt column ranges of each src row block
    (kernels/lse_blocksparse.py; ``ranges`` above, r per row block): results (out, err).
    ``relax_at``: 0 (strict) or a KL-relaxed side's (tau, 1/rho) index in PARAMS
    (``unbalanced.RELAX_AT``): the damped update and the relaxed marginal's error, as lse_update's.

    The reduction of row i runs over its row block's ranges only; a row block whose
    ranges are empty gets out = eps logw_out (0 without it). ``pold`` is read, and must be
    supplied, when ``compute_err`` or ``fold``; ``err`` is a 1-element scratch unless
    ``compute_err``. One launch (no column split).
    """
    plan = multiscale_plans.lse_blocksparse_plan(n, d, precision, on_gpu, fold=fold)
    flags = launch_plans.lse_constexprs(plan, has_logw_in=has_logw_in, has_logw_out=has_logw_out,
                                        compute_err=compute_err)
    if relax_at:
        flags = {**flags, "RELAX_AT": relax_at}
    scales, dtypes = _cross_inputs(d)
    inputs = ("x_hi", "x_lo", "y_hi", "y_lo", "x_sq", "y_sq", "pot", "logw_in" if has_logw_in else "params",
              "logw_out" if has_logw_out else "params", "pold" if compute_err or fold else "params", "params",
              *scales, "ranges", n, m, r)
    outs = (Output("out", (n,)), Output("err", (n,)) if compute_err else scratch("err"))
    return CallSequence((KernelCall(lse_blocksparse_kernel, plan, inputs, outs, flags, dtypes),),
                        ("out", "err"))


@functools.lru_cache(maxsize=1024)
def apply_plan_blocksparse(n: int, m: int, d: int, r: int, p: int, precision: str, on_gpu: bool,
                           target_mean: bool = False) -> CallSequence:
    """:func:`apply_plan` restricted to each row block's column ranges (kernels/apply_blocksparse.py):
    results (pv, rowsum) of P restricted to the kept (row block, column) pairs; ``pv`` is
    (n, p), or a 1-element scratch when p == 0 (row sums only, ``v`` = ``params``).
    ``target_mean``: V is the target cloud's centred points (p = d, not an input: its packed
    parts; TGT_MEAN), pv / rowsum their softmin mean to FP16 rounding of P per entry."""
    plan = multiscale_plans.apply_blocksparse_plan(n, d, p, precision, on_gpu, target_mean)
    scales, dtypes = _cross_inputs(d)
    args = ("x_hi", "x_lo", "y_hi", "y_lo", "x_sq", "y_sq", "f", "g", "v" if p and not target_mean else "params",
            "params", *scales,
            "ranges", n, m, r)
    outs = (Output("pv", (n, p)) if p else scratch("pv"), Output("rowsum", (n,)))
    call = KernelCall(apply_plan_blocksparse_kernel, plan, args, outs, dtypes=dtypes)
    return CallSequence((call,), ("pv", "rowsum"))



_PAIR_X = ("cx", "ax", "bx", "rx", "hx")
_PAIR_Y = ("cy", "ay", "by", "ry", "hy")


@functools.lru_cache(maxsize=256)
def pair_keep(kx: int, ky: int, d: int, on_gpu: bool, transposed: bool = False) -> CallSequence:
    """The cluster pairs whose bound is above the threshold params[1] (kernels/pair_bound.py):
    results keep, int8 (kx, ky), with ``transposed`` keep_t, int8 (ky, kx), its transpose, then
    the per-tile row and column maxima of the bound, rowmax (tiles_l, kx) and colmax (tiles_k, ky)
    (the caller takes the max over tiles for :func:`pair_fixup`)."""
    plan = multiscale_plans.pair_bound_plan(kx, ky, d, on_gpu)
    tk, tl_ = plan.grid
    outs = (Output("keep", (kx, ky), "int8"), Output("keep_t", (ky, kx), "int8") if transposed else scratch("keep_t"),
            Output("rowmax", (tl_, kx)), Output("colmax", (tk, ky)))
    call = KernelCall(pair_keep_kernel, plan, _PAIR_X + _PAIR_Y + ("params", kx, ky), outs, {"TRANSPOSED": transposed})
    return CallSequence((call,), ("keep", "keep_t", "rowmax", "colmax") if transposed else ("keep", "rowmax", "colmax"))


@functools.lru_cache(maxsize=256)
def pair_fixup(kx: int, ky: int, d: int, on_gpu: bool, transposed: bool) -> CallSequence:
    """Keeps the best pair of every row, then of every column, of the ``keep`` mask (and of
    ``keep_t`` when ``transposed``) that :func:`pair_keep` left empty (kernels/pair_bound.py;
    inputs rowbest (kx,), colbest (ky,)). Two launches that write into ``keep`` / ``keep_t`` in
    place: no outputs, no results (the masks are passed as inputs)."""
    args = _PAIR_X + _PAIR_Y + ("params", "rowbest", "colbest", kx, ky, "keep", "keep_t" if transposed else "params")
    dtypes = {"keep": "int8", "keep_t": "int8"}
    calls = tuple(KernelCall(pair_fixup_kernel, multiscale_plans.pair_fixup_plan(kx if rows else ky, d, on_gpu), args, (),
                             {"TRANSPOSED": transposed, "ROWS": rows}, dtypes) for rows in (True, False))
    return CallSequence(calls, ())


@functools.lru_cache(maxsize=256)
def mask_row_counts(kr: int, kc: int, on_gpu: bool) -> CallSequence:
    """The kept pairs per row of a cluster mask ``keep`` int8 (kr, kc) (kernels/mask_lists.py):
    result counts, int32 (kr,)."""
    plan = multiscale_plans.mask_lists_plan(kr, on_gpu)
    call = KernelCall(mask_row_counts_kernel, plan, ("keep", kc), (Output("counts", (kr,), "int32"),))
    return CallSequence((call,), ("counts",))


@functools.lru_cache(maxsize=256)
def mask_row_lists(kr: int, kc: int, on_gpu: bool, with_rows: bool) -> CallSequence:
    """The k-major pair list of ``keep`` (kernels/mask_lists.py): inputs ``lptr`` int64 (kr + 1,),
    the exclusive prefix sums of :func:`mask_row_counts`, and the buffers it fills in place,
    ``lidx`` int32 (pairs,) (the kept columns) and ``rowid`` int32 (pairs,) (their rows; without
    ``with_rows`` never written: any int32 array stands in): their size is the mask's count, known
    after the counts, so the frontend allocates them (no outputs, no results)."""
    plan = multiscale_plans.mask_lists_plan(kr, on_gpu)
    call = KernelCall(mask_row_lists_kernel, plan, ("keep", kc, "lptr", "lidx", "rowid"), (),
                      {"WITH_ROWS": with_rows}, {"lptr": "int64", "lidx": "int32", "rowid": "int32"})
    return CallSequence((call,), ())


@functools.lru_cache(maxsize=256)
def block_run_counts(blocks: int, kc: int, on_gpu: bool) -> CallSequence:
    """The number of column runs of every row block (kernels/block_ranges.py; inputs ``keep``
    int8 (K_r, kc), ``span`` int32 (blocks, 2), ``col_start`` int32 (kc + 1,)): result runs,
    int32 (blocks,)."""
    plan = multiscale_plans.block_runs_plan(blocks, on_gpu)
    call = KernelCall(block_runs_kernel, plan, ("keep", "span", "col_start", kc, 1), (Output("runs", (blocks,), "int32"),),
                      {"FILL": False})
    return CallSequence((call,), ("runs",))


@functools.lru_cache(maxsize=1024)
def block_run_ranges(blocks: int, kc: int, r: int, on_gpu: bool) -> CallSequence:
    """The column ranges of every row block, padded to ``r`` runs (kernels/block_ranges.py; the
    inputs of :func:`block_run_counts`, r at least its largest count): result ranges, int32
    (blocks, r, 2), the ``ranges`` of the block-sparse calls."""
    plan = multiscale_plans.block_runs_plan(blocks, on_gpu)
    call = KernelCall(block_runs_kernel, plan, ("keep", "span", "col_start", kc, r),
                      (Output("ranges", (blocks, r, 2), "int32"),), {"FILL": True})
    return CallSequence((call,), ("ranges",))


@functools.lru_cache(maxsize=256)
def pair_dropped(kx: int, ky: int, d: int, on_gpu: bool) -> CallSequence:
    """Per-tile bounds on the plan mass of the pairs ``keep`` drops (kernels/pair_bound.py;
    eps in params[0]): result dropped (tiles_k, tiles_l), to be summed."""
    plan = multiscale_plans.pair_bound_plan(kx, ky, d, on_gpu)
    call = KernelCall(pair_dropped_kernel, plan, _PAIR_X + ("wx",) + _PAIR_Y + ("wy", "params", "keep", kx, ky),
                      (Output("dropped", plan.grid),))
    return CallSequence((call,), ("dropped",))


@functools.lru_cache(maxsize=1024)
def lift_gathered(n: int, k_rows: int, d: int, on_gpu: bool) -> CallSequence:
    """The coarse-to-fine lift of a sorted cloud of n points in ``k_rows`` clusters over a mask's
    kept pairs (kernels/lift_gathered.py; inputs ``x`` (n, d), ``start`` int32 (k_rows + 1,),
    ``lptr`` int32 (k_rows + 1,), ``lidx`` int32, ``c`` (K_c, d), ``g``, ``logw`` (K_c,), ``shift``
    (n,) a prediction of the result, ``params``): result out (n,)."""
    call = KernelCall(lift_gathered_kernel, multiscale_plans.lift_plan(k_rows, d, on_gpu),
                      ("x", "start", "lptr", "lidx", "c", "g", "logw", "shift", "params"), (Output("out", (n,)),),
                      dtypes={"start": "int32", "lptr": "int32", "lidx": "int32"})
    return CallSequence((call,), ("out",))


_TAYLOR_INT = {"labels": "int32", "start_x": "int32", "start_y": "int32", "klo": "int32", "khi": "int32", "kidx": "int32",
               "slot": "int32", "lptr": "int32", "lidx": "int32", "first_k": "int32"}
_TAYLOR_F16 = {"phi_hi": "float16", "phi_lo": "float16", "psi_hi": "float16", "psi_lo": "float16", "m_hi": "float16",
               "m_lo": "float16"}


def _taylor_plan(spec: dict, grid: tuple[int, ...]) -> LaunchPlan:
    return LaunchPlan(grid=grid, num_warps=spec["num_warps"], num_stages=spec["num_stages"], constexprs=spec["constexprs"])


@functools.lru_cache(maxsize=256)
def taylor_monomials(n: int, d: int, on_gpu: bool, p: int, mean: bool = False, row0: int = 0) -> CallSequence:
    """The Taylor pass's monomials of the ``n`` rows from ``row0`` of a sorted cloud
    (kernels/taylor_blocksparse.py; inputs ``pts``, ``centers`` (K, d), ``labels`` int32,
    ``taylor_alpha`` (G, R, 4), ``params``): results phi_hi, phi_lo, float16 (n, G R), G = 1 (phi;
    multiscale_rules.taylor_alpha_table) or with ``mean`` multiscale_rules.taylor_mean_groups(d)
    (phi and its derivatives; taylor_derivative_table), of order ``p``."""
    spec = multiscale_plans.taylor_plans(d, on_gpu, p)[0]
    r, block = spec["constexprs"]["R"], spec["constexprs"]["BLOCK"]
    groups = multiscale_plans.taylor_plans(d, on_gpu, p)[3]["constexprs"]["G"] if mean else 1
    call = KernelCall(taylor_monomials_kernel, _taylor_plan(spec, (max(1, -(-n // block)),)),
                      ("pts", "centers", "labels", "taylor_alpha", "params", row0, n),
                      (Output("phi_hi", (max(1, n), groups * r), "float16"), Output("phi_lo", (max(1, n), groups * r), "float16")),
                      flags={"GROUPS": groups}, dtypes=_TAYLOR_INT)
    return CallSequence((call,), ("phi_hi", "phi_lo"))


@functools.lru_cache(maxsize=1024)
def taylor_moments(pairs: int, k_cols: int, chunk: int, d: int, on_gpu: bool, p: int) -> CallSequence:
    """Moments of the ``pairs`` kept pairs of chunk ``chunk``, one program per column cluster (inputs
    ``y``, ``cy``, ``g``, ``logw``, ``start_y``, ``klo``, ``khi``, ``kidx``, ``slot``, ``cx``,
    ``psi_hi``, ``psi_lo``, ``params``, ``lptr``, ``first_k``): results m_hi, m_lo (pairs, R) float16
    (the moments' FP16 head and tail), sig (pairs,); R the padded rank of order ``p``."""
    spec = multiscale_plans.taylor_plans(d, on_gpu, p)[1]
    r = spec["constexprs"]["R"]
    call = KernelCall(taylor_moments_kernel, _taylor_plan(spec, (max(1, k_cols),)),
                      ("y", "cy", "g", "logw", "start_y", "klo", "khi", "kidx", "slot", "cx", "psi_hi", "psi_lo", "params",
                       "lptr", "first_k", chunk),
                      (Output("m_hi", (max(1, pairs), r), "float16"), Output("m_lo", (max(1, pairs), r), "float16"),
                       Output("sig", (max(1, pairs),))),
                      dtypes={**_TAYLOR_INT, **_TAYLOR_F16})
    return CallSequence((call,), ("m_hi", "m_lo", "sig"))


@functools.lru_cache(maxsize=1024)
def taylor_evaluate(k_rows: int, chunk: int, d: int, on_gpu: bool, p: int, mean: bool = False, row0: int = 0) -> CallSequence:
    """r_i into ``acc`` (n,) for the ``k_rows`` row clusters of chunk ``chunk`` (from first_k[chunk]),
    in place (inputs ``x``, ``cx``, ``f``, ``start_x``, ``lptr``, ``lidx``, ``cy``, ``phi_hi``,
    ``phi_lo`` (taylor_monomials with the same ``mean``, its rows from ``row0``), ``m_hi``, ``m_lo``,
    ``sig`` (taylor_moments), ``params``, ``first_k``, ``acc``, ``mean_out`` (n, d)): no results. ``mean``:
    the softmin mean of the columns' points into ``mean_out`` too (else it is not touched). ``p``: the
    order of the monomials and moments."""
    spec = multiscale_plans.taylor_plans(d, on_gpu, p)[3 if mean else 2]
    call = KernelCall(taylor_evaluate_kernel, _taylor_plan(spec, (max(1, k_rows),)),
                      ("x", "cx", "f", "start_x", "lptr", "lidx", "cy", "phi_hi", "phi_lo", "m_hi", "m_lo", "sig", "params",
                       "first_k", chunk, row0, "acc", "mean_out"), (), dtypes={**_TAYLOR_INT, **_TAYLOR_F16})
    return CallSequence((call,), ())
