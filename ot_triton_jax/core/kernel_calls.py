"""One description per kernel call, read by both frontends.

A :class:`KernelCall` says everything a frontend needs to run one launch: the
kernel, its launch plan, the positional arguments in kernel order (named arrays
the frontend supplies, or integer sizes), the outputs it allocates (name, shape,
dtype), and the extra compile-time flags. A :class:`CallSequence` chains calls
(the split LSE update and its combine step) and names its results; its
``row_partials`` field, when set, says that a result holds SPLIT partial row sums
laid out (SPLIT, n) that the frontend adds up.

Array names the frontends supply (``src`` = the rows being reduced, ``tgt`` = the
streamed columns; clouds as prepared by the split kernels):

    x, y                      raw clouds (center, split_centered; x also split_fixed)
    center                    their common centre (split_centered)
    amax                      partial maxima of |x - c| over all clouds of the problem (FP16 parts:
                              :func:`absmax` over :func:`absmax_pairs`, concatenated; split_centered)
    x_hi, x_lo, x_sq          the centred src cloud's head and tail (float16 parts of the scaled
                              cloud, row stride launch_plans.operand_stride(d); TF32 parts of stride
                              d where launch_plans.fp16_operands says no), its squared norms
    x_scale                   FP16 parts: the src cloud's 1 / S (1 element; split_centered's ``sc``)
    y_hi, y_lo, y_sq, y_scale the same for the tgt cloud
    pot                       the tgt potential (lse_update)
    f, g, logw_x, logw_y      lse_pair: the potentials of the x and y clouds and their log-weights
    f, g                      the potentials of the plan (apply_plan, exact_row_mass)
    v                         the (m, p) matrix applied to the plan
    w, wa, wb                 apply_weighted's W (n, da), A (m, da), B (m, p)
    logw_in, logw_out, pold   optional inputs of lse_update (and lse_blocksparse)
    x_lab, y_lab              label cost (the dense calls built with ``labels``; kernels/label_tiles.py):
                              the int32 labels (n,) of the src cloud and (m,) of the tgt cloud
    y_ltab                    the tgt cloud's class table, float32 (K_tgt, K_src) row-major: the cost
                              is C_ij = s (|x_i - y_j|^2 + y_ltab[y_lab_j, x_lab_i]) (the x cloud of a
                              problem holds W, the y cloud W^T, so that both sides read W[lx, ly];
                              x_ltab: the src cloud's, for the calls that swap the clouds, lse_pair).
                              Without labels ``params`` stands in and the shape is passed as 0, 0
    ranges                    block-sparse calls: int32 (cdiv(n, BLOCK_M), r, 2), row-major; row block b
                              (rows [b*BLOCK_M, (b+1)*BLOCK_M), BLOCK_M from
                              multiscale_plans.blocksparse_block_m) streams the tgt columns
                              [ranges[b, q, 0], ranges[b, q, 1]) for q < r (empty ranges are padding;
                              the ranges of one block do not overlap)
    cx, ax, bx, rx, hx, wx    pair-bound calls: the X clusters' centres (kx, d), fit alphas, betas (kx, d),
                              radii, fit residuals, weights (kx,), float32 (kernels/pair_bound.py);
    cy, ay, by, ry, hy, wy    the same for Y; rowbest (kx,), colbest (ky,): the bound's row / column
                              maxima; keep: int8 (kx, ky) kept cluster pairs
    keep, span, col_start     block-run calls: a keep mask int8 (K_r, K_c), the first and last cluster
                              of every row block int32 (blocks, 2), the first sorted column of every
                              column cluster and the column count int32 (K_c + 1,)
    params                    PARAMS = [eps, s] (float32); it also stands in for every
                              optional input a launch does not read (x_scale, y_scale for TF32 parts)

Inputs are float32, except ``ranges``, ``span``, ``col_start`` (int32), ``keep`` (int8) and those a call's
``KernelCall.dtypes`` names (the float16 parts, the int32 labels).

Outputs are fresh, uninitialized buffers; a kernel writes every element of the
outputs it declares, except ``scratch`` outputs (1 element, never written: a frontend
may share one buffer among them; an ordinary output of shape (1,), e.g. a potential of
a one-point cloud, is never shared). The builders
are cached: the same arguments return the same (read-only) description, which the
frontends may key their own caches on. Nothing here imports a framework. This module holds
the description records and the calls of the cloud preparation and the dense passes; the
multiscale solve's calls (block-sparse, bounds, masks, lift, Taylor) are in ``multiscale_calls``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

from . import cloud_plans, launch_plans, pair_plans
from .kernels import (absmax_kernel, apply_plan_kernel, apply_weighted_kernel, center_kernel,
                      column_bias_kernel, label_block_order_kernel, lse_combine_kernel, lse_pair_finish_kernel,
                      lse_pair_kernel, lse_update_kernel, pair_prep_kernel, split_centered_kernel,
                      split_fixed_kernel, split_scaled_kernel)
from .launch_plans import LaunchPlan


@dataclass(frozen=True)
class Output:
    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"
    scratch: bool = False  # a 1-element buffer the kernel never writes (a frontend may share one)


def scratch(name: str) -> Output:
    return Output(name, (1,), scratch=True)


@dataclass(frozen=True)
class KernelCall:
    kernel: object
    plan: LaunchPlan
    args: tuple[str | int, ...]  # kernel order: array names or integer sizes
    outputs: tuple[Output, ...]  # kernel order, after ``args``
    flags: dict = field(default_factory=dict)  # compile-time flags merged over plan.constexprs
    dtypes: dict = field(default_factory=dict)  # input name -> dtype, where not float32

    @property
    def constexprs(self) -> dict:
        return {**self.plan.constexprs, **self.flags}


@dataclass(frozen=True)
class CallSequence:
    calls: tuple[KernelCall, ...]
    results: tuple[str, ...]  # output names the frontend returns, in order
    row_partials: tuple[str, int, int] | None = None  # (result name, SPLIT, n): add the (SPLIT, n) partials


_FP16_PARTS = {"x_hi": "float16", "x_lo": "float16", "y_hi": "float16", "y_lo": "float16"}


_LABELS = ("x_lab", "y_lab", "y_ltab")
_LABEL_DTYPES = {"x_lab": "int32", "y_lab": "int32"}


def _label_inputs(labels: tuple[int, int] | None) -> tuple[tuple, tuple[int, int], dict, dict]:
    """(the label arrays, the table's shape, the flags, the input dtypes) of a dense call:
    ``labels`` None (no label cost: ``params`` stands in, shape 0, 0) or (K_src, K_tgt). The
    kernels' LABELS is KP, K_src padded to a power of two >= 16 (kernels/label_tiles.py)."""
    if labels is None:
        return ("params",) * 3, (0, 0), {}, {}
    k_src, k_tgt = (int(k) for k in labels)
    if k_src < 1 or k_tgt < 1:
        raise ValueError(f"labels: the label table's shape (K_src, K_tgt) must be positive, got {labels}")
    return _LABELS, (k_src, k_tgt), {"LABELS": max(16, 1 << (k_src - 1).bit_length())}, _LABEL_DTYPES


def _cross_inputs(d: int) -> tuple[tuple[str, str], dict]:
    """(the names of the clouds' 1 / S arrays, or params stand-ins; the input dtypes) of a
    cross-term call at dimension d."""
    if launch_plans.fp16_operands(d):
        return ("x_scale", "y_scale"), _FP16_PARTS
    return ("params", "params"), {}


@functools.lru_cache(maxsize=1024)
def center(n: int, m: int, d: int, on_gpu: bool) -> CallSequence:
    """The common centre (d,) of the clouds ``x`` (n, d) and ``y`` (m, d) (kernels/split.py;
    pass x as y for one cloud): result (center,)."""
    plan = cloud_plans.center_plan(d, on_gpu)
    return CallSequence((KernelCall(center_kernel, plan, ("x", "y", n, m), (Output("center", (d,)),)),), ("center",))


def absmax_pairs(count: int) -> tuple[tuple[int, int], ...]:
    """The (x, y) cloud indices :func:`absmax` runs on so that ``count`` clouds of one problem are
    all covered (FP16 parts: their partial maxima, concatenated, give split_centered's ``amax``)."""
    return tuple((i, min(i + 1, count - 1)) for i in range(0, count, 2))


@functools.lru_cache(maxsize=1024)
def absmax(n: int, m: int, d: int, on_gpu: bool) -> CallSequence:
    """Partial maxima of |x - center| over the clouds ``x`` (n, d) and ``y`` (m, d)
    (kernels/split.py, absmax_kernel): result ``amax`` (cloud_plans.absmax_plan's grid)."""
    plan = cloud_plans.absmax_plan(n, m, d, on_gpu)
    return CallSequence((KernelCall(absmax_kernel, plan, ("x", "y", "center", n, m), (Output("amax", plan.grid),)),),
                        ("amax",))


@functools.lru_cache(maxsize=1024)
def split_centered(n: int, d: int, on_gpu: bool, n_amax: int = 0) -> CallSequence:
    """``x`` (n, d) minus ``center`` (d,), its head and tail and its squared norms: results
    (xc, hi, lo, sq). With FP16 parts (launch_plans.fp16_operands) the head and tail are float16
    parts of the cloud scaled by S, from the ``amax`` (n_amax,) of :func:`absmax`, of shape
    (n, launch_plans.operand_stride(d)) (zero columns after d), and a fifth result ``sc``
    (1,) holds 1 / S."""
    outs = (Output("xc", (n, d)), Output("hi", (n, d)), Output("lo", (n, d)), Output("sq", (n,)))
    if not launch_plans.fp16_operands(d):
        plan = cloud_plans.split_plan(n, d, on_gpu)
        return CallSequence((KernelCall(split_centered_kernel, plan, ("x", "center", n), outs),),
                            ("xc", "hi", "lo", "sq"))
    if n_amax < 1:
        raise ValueError("split_centered: FP16 parts (launch_plans.fp16_operands) need n_amax, the size of the absmax() partials")
    plan = cloud_plans.split_scaled_plan(n, d, n_amax, on_gpu)
    dp = launch_plans.operand_stride(d)
    outs = (Output("xc", (n, d)), Output("hi", (n, dp), "float16"), Output("lo", (n, dp), "float16"),
            Output("sq", (n,)), Output("sc", (1,)))
    call = KernelCall(split_scaled_kernel, plan, ("x", "center", "amax", n, n_amax), outs)
    return CallSequence((call,), ("xc", "hi", "lo", "sq", "sc"))


@functools.lru_cache(maxsize=1024)
def split_fixed(n: int, d: int, on_gpu: bool) -> CallSequence:
    """Fixed-point heads and TF32 tails of ``x`` (n, d) for the "fixed4" cross term: (hi, lo)."""
    plan = cloud_plans.fixed_split_plan(n, d, on_gpu)
    call = KernelCall(split_fixed_kernel, plan, ("x", n), (Output("hi", (n, d)), Output("lo", (n, d))))
    return CallSequence((call,), ("hi", "lo"))


@functools.lru_cache(maxsize=1024)
def lse_update(n: int, m: int, d: int, precision: str, on_gpu: bool, has_logw_in: bool,
               has_logw_out: bool, has_pold: bool, compute_err: bool, fold: bool, relax_at: int = 0,
               labels: tuple[int, int] | None = None, grouped: bool = False) -> CallSequence:
    """One half-step on the src side (kernels/lse.py): results (out, err).

    ``out`` (n,) is the new potential; ``err`` (n,) the per-point marginal error of the
    plan built from ``pold`` when ``compute_err`` (else a 1-element scratch). ``fold``
    asks for the fixed-shift loop (the plan decides; it needs ``pold``). When the plan
    splits the columns (SPLIT > 1) the update writes partial (max, sum) pairs into a
    scratch ``part`` and ``lse_combine_kernel`` finishes them. ``relax_at``: 0 for a
    balanced side, else the index in ``params`` of this side's (tau, 1/rho)
    (``unbalanced.RELAX_AT``): the damped update and the relaxed marginal's error.
    ``labels``: None, or the class counts (K_src, K_tgt): the label cost (inputs ``x_lab``,
    ``y_lab`` and the table ``y_ltab`` (K_tgt, K_src); module docstring). ``grouped``: src rows sorted by
    label: one unlabelled pass per label of a block where the plan says (kernels/lse_update.py).
    """
    if (compute_err or fold) and not has_pold:
        raise ValueError("lse_update: compute_err and fold need pold (the previous potential)")
    plan = launch_plans.lse_plan(n, m, d, precision, on_gpu, fold=fold)
    split = plan.constexprs["SPLIT"]
    flags = launch_plans.lse_constexprs(plan, has_logw_in=has_logw_in, has_logw_out=has_logw_out,
                                        compute_err=compute_err)
    relax = {"RELAX_AT": relax_at} if relax_at else {}
    labs, ks, lflags, ldtypes = _label_inputs(labels)
    flags.update(relax, **lflags)
    logw_in = "logw_in" if has_logw_in else "params"
    logw_out = "logw_out" if has_logw_out else "params"
    pold = "pold" if has_pold else "params"
    scales, dtypes = _cross_inputs(d)
    dtypes = {**dtypes, **ldtypes}
    prep = ()
    pot = "pot"
    rows = 1 if labels is None else launch_plans.label_bias_rows(ks[0], m)
    if rows is None:  # too many labels for per-label biases: the one-hot products everywhere
        flags["COL_BIAS"] = False
    elif plan.constexprs["COL_BIAS"]:  # the column biases once, not in every row block's tiles
        bplan = launch_plans.column_bias_plan(m, on_gpu, rows)
        prep = (KernelCall(column_bias_kernel, bplan, ("pot", "y_sq", logw_in, "params", *labs[1:], m, *ks),
                           (Output("col_bias", (rows * m,)),), {"HAS_LOGW_IN": has_logw_in, **lflags}, ldtypes),)
        pot = "col_bias"
    order, big_d = "params", d > launch_plans.LABEL_GROUPED_MIN_D or not on_gpu
    flags.update({"GROUPED": True} if grouped and rows is not None and plan.constexprs["COL_BIAS"] and big_d else {})
    oplan = None if labels is None else launch_plans.label_order_plan(n, plan.constexprs["BLOCK_M"], on_gpu)
    if oplan is not None:  # mixed-label row blocks first (kernels/label_tiles.py)
        prep += (KernelCall(label_block_order_kernel, oplan, ("x_lab", n, ks[0]),
                            (Output("row_order", (plan.grid[0],), "int32"),), dtypes=_LABEL_DTYPES),)
        flags["ORDERED"] = True
        order = "row_order"
        dtypes = {**dtypes, "row_order": "int32"}
    inputs = ("x_hi", "x_lo", "y_hi", "y_lo", "x_sq", "y_sq", pot, logw_in, logw_out, pold, "params", *scales, *labs,
              order, n, m, *ks)
    if split == 1:
        outs = (Output("out", (n,)), Output("err", (n,)) if compute_err else scratch("err"), scratch("part"))
        return CallSequence(prep + (KernelCall(lse_update_kernel, plan, inputs, outs, flags, dtypes),), ("out", "err"))
    first = KernelCall(lse_update_kernel, plan, inputs,
                       (scratch("unused_out"), scratch("unused_err"), Output("part", (2 * split * n,))),
                       flags, dtypes)
    cplan = launch_plans.lse_combine_plan(n, split, on_gpu)
    combine = KernelCall(lse_combine_kernel, cplan, ("part", "x_sq", logw_out, pold, "params", n),
                         (Output("out", (n,)), Output("err", (n,)) if compute_err else scratch("err")),
                         {"HAS_LOGW_OUT": has_logw_out, "COMPUTE_ERR": compute_err, **relax, **lflags})
    return CallSequence(prep + (first, combine), ("out", "err"))


def _renamed(seq: CallSequence, names: dict) -> tuple[KernelCall, ...]:
    """The calls of ``seq`` with their array names (inputs and outputs) mapped by ``names``."""
    return tuple(replace(c, args=tuple(names.get(a, a) if isinstance(a, str) else a for a in c.args),
                         outputs=tuple(replace(o, name=names.get(o.name, o.name)) for o in c.outputs),
                         dtypes={names.get(k, k): v for k, v in c.dtypes.items()}) for c in seq.calls)


_SWAP = {f"{u}{s}": f"{v}{s}" for u, v in (("x", "y"), ("y", "x"))
         for s in ("_hi", "_lo", "_sq", "_scale", "_lab", "_ltab")}


@functools.lru_cache(maxsize=1024)
def lse_pair(n: int, m: int, d: int, precision: str, on_gpu: bool,
             labels: tuple[int, int] | None = None) -> CallSequence:
    """Both half-steps of a symmetric update from the same potentials: results (f_out, g_out),

        f_out = -eps LSE_j((g_j - C_ij)/eps + logw_y_j),   g_out = -eps LSE_i((f_i - C_ij)/eps + logw_x_i),

    the ``x`` cloud (n points) with potential ``f``, the ``y`` cloud (m) with ``g``: GeomLoss's
    softmin of each side, lse_update with logw_in and no logw_out. By pair_plans.pair_mode:
    the shifts and weights of both clouds, one sweep of the exponentials for both sides and
    two finishing launches (kernels/lse_pair.py), or two lse_update half-steps (fixed shift
    from f and g, or online). ``labels`` (K_x, K_y): the label cost (``x_lab``, ``y_lab``, the
    tables ``x_ltab`` = W (K_x, K_y) and ``y_ltab`` = W^T); the fused sweep has none, so a
    "fused" mode takes the two fixed-shift half-steps.
    """
    mode = pair_plans.pair_mode(n, m, d, precision)
    if labels is not None and mode == "fused":
        mode = "fold"
    if mode != "fused":
        fold = mode == "fold"
        rows = lse_update(n, m, d, precision, on_gpu, True, False, fold, False, fold, labels=labels)
        cols = lse_update(m, n, d, precision, on_gpu, True, False, fold, False, fold,
                          labels=None if labels is None else (labels[1], labels[0]))
        side = ("out", "err", "part", "unused_out", "unused_err")
        calls = (_renamed(rows, {"pot": "g", "logw_in": "logw_y", "pold": "f", **{o: f"f_{o}" for o in side}})
                 + _renamed(cols, {**_SWAP, "pot": "f", "logw_in": "logw_x", "pold": "g",
                                   **{o: f"g_{o}" for o in side}}))
        return CallSequence(calls, ("f_out", "g_out"))
    prep = KernelCall(pair_prep_kernel, pair_plans.pair_prep_plan(n, m, on_gpu),
                      ("x_sq", "f", "logw_x", "y_sq", "g", "logw_y", "params", n, m),
                      (Output("ux", (n,)), Output("wx", (n,)), Output("uy", (m,)), Output("wy", (m,))))
    plan = pair_plans.pair_plan(n, m, d, precision, on_gpu)
    groups, col_groups = plan.grid
    scales, dtypes = _cross_inputs(d)
    sweep = KernelCall(lse_pair_kernel, plan, ("x_hi", "x_lo", "y_hi", "y_lo", "ux", "wx", "uy", "wy", "params",
                                               *scales, n, m),
                       (Output("part", (col_groups * n + groups * m,)),), dtypes=dtypes)
    rows = KernelCall(lse_pair_finish_kernel, pair_plans.pair_finish_plan(n, m, d, precision, on_gpu),
                      ("x_hi", "x_lo", "y_hi", "y_lo", "x_sq", "y_sq", "g", "logw_y", "ux", "params", *scales,
                       "part", n, m, 0, col_groups), (Output("f_out", (n,)),), dtypes=dtypes)
    cols = KernelCall(lse_pair_finish_kernel, pair_plans.pair_finish_plan(m, n, d, precision, on_gpu),
                      ("y_hi", "y_lo", "x_hi", "x_lo", "y_sq", "x_sq", "f", "logw_x", "uy", "params",
                       *(_SWAP.get(a, a) for a in scales), "part", m, n, col_groups * n, groups),
                      (Output("g_out", (m,)),), dtypes=dtypes)
    return CallSequence((prep, sweep, rows, cols), ("f_out", "g_out"))


@functools.lru_cache(maxsize=1024)
def lse_self(n: int, d: int, precision: str, on_gpu: bool, labels: tuple[int, int] | None = None) -> CallSequence:
    """The symmetric update of the ``x`` cloud against itself: result (f_out,), f_out =
    -eps LSE_j((f_j - C_ij)/eps + logw_x_j) (GeomLoss's debiasing terms). By
    pair_plans.self_mode: one sweep of the pairs j >= i (kernels/lse_pair.py, SELF: half the
    exponentials) and a finishing launch, or lse_update with the fixed shift from ``f`` or the
    online max. ``labels`` (K, K): the label cost x_ltab[x_lab_j, x_lab_i] (the square table
    ``x_ltab`` = T^T for the cost T[l_i, l_j]); the triangle sweep has none, so it takes the online update."""
    mode = pair_plans.self_mode(d, precision)
    if labels is not None:
        if labels[0] != labels[1]:
            raise ValueError(f"lse_self: the label table of a self problem must be square, got shape {labels}")
        if mode == "triangle":
            mode = "online"
    if mode != "triangle":
        fold = mode == "fold"
        seq = lse_update(n, n, d, precision, on_gpu, True, False, fold, False, fold, labels=labels)
        names = {"y_hi": "x_hi", "y_lo": "x_lo", "y_sq": "x_sq", "y_scale": "x_scale", "pot": "f",
                 "logw_in": "logw_x", "pold": "f", "out": "f_out", "y_lab": "x_lab",
                 "y_ltab": "x_ltab"}
        return CallSequence(_renamed(seq, names), ("f_out",))
    prep = KernelCall(pair_prep_kernel, pair_plans.pair_prep_plan(n, n, on_gpu),
                      ("x_sq", "f", "logw_x", "x_sq", "f", "logw_x", "params", n, n),
                      (Output("ux", (n,)), Output("wx", (n,)), scratch("uy"), scratch("wy")), {"TWO": False})
    plan = pair_plans.pair_plan(n, n, d, precision, on_gpu, self_=True)
    parts = 2 * pair_plans.self_groups(plan, n)
    scales, dtypes = _cross_inputs(d)
    xs = scales[0]
    sweep = KernelCall(lse_pair_kernel, plan, ("x_hi", "x_lo", "x_hi", "x_lo", "ux", "wx", "ux", "wx", "params",
                                               xs, xs, n, n),
                       (Output("part", (parts * n,)),), {"SELF": True}, dtypes=dtypes)
    finish = KernelCall(lse_pair_finish_kernel, pair_plans.pair_finish_plan(n, n, d, precision, on_gpu),
                        ("x_hi", "x_lo", "x_hi", "x_lo", "x_sq", "x_sq", "f", "logw_x", "ux", "params", xs, xs,
                         "part", n, n, 0, parts), (Output("f_out", (n,)),), dtypes=dtypes)
    return CallSequence((prep, sweep, finish), ("f_out",))


@functools.lru_cache(maxsize=1024)
def apply_plan(n: int, m: int, d: int, p: int, precision: str, on_gpu: bool,
               labels: tuple[int, int] | None = None) -> CallSequence:
    """(P v, P 1) with P_ij = exp((f_i + g_j - C_ij)/eps): results (pv, rowsum); ``pv`` is
    (n, p), or a 1-element scratch when p == 0 (row sums only, ``v`` = ``params``).
    ``labels`` (K_src, K_tgt): the label cost (as in :func:`lse_update`)."""
    plan = launch_plans.apply_plan(n, m, d, p, precision, on_gpu)
    scales, dtypes = _cross_inputs(d)
    labs, ks, lflags, ldtypes = _label_inputs(labels)
    args = ("x_hi", "x_lo", "y_hi", "y_lo", "x_sq", "y_sq", "f", "g", "v" if p else "params", "params", *scales,
            *labs, n, m, *ks)
    outs = (Output("pv", (n, p)) if p else scratch("pv"), Output("rowsum", (n,)))
    return CallSequence((KernelCall(apply_plan_kernel, plan, args, outs, lflags, {**dtypes, **ldtypes}),),
                        ("pv", "rowsum"))


@functools.lru_cache(maxsize=1024)
@functools.lru_cache(maxsize=1024)
def apply_weighted(n: int, m: int, d: int, da: int, p: int, precision: str, on_gpu: bool,
                   labels: tuple[int, int] | None = None) -> CallSequence:
    """sum_j P_ij <w_i, wa_j> wb_j (n, p) for w (n, da), wa (m, da), wb (m, p): result ``out``
    (kernels/apply_weighted.py; the HVP's second-moment pass). ``labels``: as in :func:`apply_plan`."""
    plan = launch_plans.weighted_plan(n, m, d, da, p, precision, on_gpu)
    scales, dtypes = _cross_inputs(d)
    labs, ks, lflags, ldtypes = _label_inputs(labels)
    args = ("x_hi", "x_lo", "y_hi", "y_lo", "x_sq", "y_sq", "f", "g", "w", "wa", "wb", "params", *scales, *labs,
            n, m, *ks)
    return CallSequence((KernelCall(apply_weighted_kernel, plan, args, (Output("out", (n, p)),), lflags,
                                    {**dtypes, **ldtypes}),), ("out",))


@functools.lru_cache(maxsize=1024)
def exact_row_mass(n: int, m: int, d: int, on_gpu: bool, labels: tuple[int, int] | None = None) -> CallSequence:
    """P 1 with the unbiased "fixed4" cross term (reg_ot_cost's mass term): result ``rowsum``.

    The clouds enter as their fixed-point splits (:func:`split_fixed`) in x_hi/x_lo,
    y_hi/y_lo. The TF32 tensor cores truncate while they accumulate, which shrinks the
    solver's <x, y> by a relative ~1e-7 (d = 64) and biases every P_ij alike; the cost
    is the dual objective, stationary in (f, g), so its mass term taken with an
    unbiased cross term removes that bias to first order (launch_plans.exact_mass_plan).
    With SPLIT > 1 the kernel writes (SPLIT, n) partial row sums. ``labels``: as in :func:`apply_plan`.
    """
    plan = launch_plans.exact_mass_plan(n, m, d, on_gpu)
    split = plan.constexprs["SPLIT"]
    labs, ks, lflags, ldtypes = _label_inputs(labels)
    # TF32 fixed-point parts from split_fixed at every d: the 1 / S inputs are not read
    args = ("x_hi", "x_lo", "y_hi", "y_lo", "x_sq", "y_sq", "f", "g", "params", "params", "params", "params", *labs,
            n, m, *ks)
    outs = (scratch("unused"), Output("rowsum", (split * n,)))
    return CallSequence((KernelCall(apply_plan_kernel, plan, args, outs, lflags, ldtypes),), ("rowsum",),
                        row_partials=("rowsum", split, n) if split > 1 else None)
