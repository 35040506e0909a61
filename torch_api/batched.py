"""``torch_api.sinkhorn_batch``: B OTT-convention problems of any sizes, one launch per half-step.

The problems are packed by :mod:`ot_triton_jax.core.batch_layout` (each problem's rows on
row-block boundaries, zero-weight padding) and every half-step is one launch of the block-sparse
LSE kernel in which the row blocks of problem k stream only problem k's columns. Each problem
runs OTT's alternating loop with its own stopping rule, exactly as :func:`torch_api.sinkhorn`
(``core.options.LoopOptions``: the marginal error ||P^T 1 - b||_1 measured after the iterations
that close a block of ``inner_iterations`` once ``min_iterations`` are done, and after the last
one; a problem stops at the first measurement below ``threshold``, or at a non-finite one). A
stopped problem's state is kept from its stop while the others go on (its row blocks stream no
column from then on, ``batch_layout.active_ranges``; their outputs are discarded), so each problem's f, g, iterations and cost are those of its
single solve to float32 rounding. One host read per measurement for the whole batch.

Balanced problems (equal masses per problem), or OTT's KL-relaxed marginals (``tau_a``,
``tau_b`` < 1, shared by the batch: every update damped as in :func:`torch_api.sinkhorn`, any
masses, OTT's relaxed ``reg_ot_cost`` per problem), squared Euclidean cost s |x - y|^2 with s =
1 / scale_cost, one epsilon for the batch. ``reg_ot_cost`` is differentiable in the points and
the weights (the envelope gradient of each problem, as :func:`torch_api.sinkhorn`'s), twice (a
double backward: each problem's single-call Hessian, :mod:`torch_api.batched_implicit`; with a
tau < 1 those involving the weights raise, as for a single call). The potentials f, g have each
problem's single-call implicit VJP in the points and weights (:mod:`torch_api.batched_implicit`).
epsilon and scale_cost, shared by the batch, take the sum of the problems' single-call partials of
reg_ot_cost (two plan passes per problem, run only when asked for); derivatives of the potentials
in them, and second derivatives through them, raise NotImplementedError as for a single call.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ot_triton_jax.core import batch_layout, unbalanced
from ot_triton_jax.core import checks as rules
from ot_triton_jax.core.implicit_solve import ImplicitOptions, implicit_options, options_key

from .batched_loop import batched_loop
from .batched_implicit import join_points, pair_potentials, problem_gradients, split_points
from .implicit_ops import required
from .no_derivative import NoDerivative
from .sinkhorn_ops import sinkhorn_cost_grads
from .batch_packing import pack_concat, pack_dense
from .kernel_ops import apply_plan_blocksparse, clouds, kernel_params
from . import checks as check
from .call_args import prepare, weights_shape
from .unbalanced_ops import relaxed_params

__all__ = ["sinkhorn_batch", "segment_sinkhorn", "BatchedSinkhornOutput"]


@dataclass
class BatchedSinkhornOutput:
    """Result of :func:`sinkhorn_batch`: per problem k, ``f[k]`` (n_k,), ``g[k]`` (m_k,) float32
    (OTT convention, as :class:`torch_api.SinkhornOutput`), and (B,) tensors ``reg_ot_cost``
    (float32, differentiable in the points and weights), ``n_iters`` (int32), ``converged`` (bool), and
    (B, n_blocks) ``errors``: each problem's record as :class:`torch_api.SinkhornOutput`'s (OTT's:
    the error after block k, +inf for a block run but not measured, -1 for one not run)."""

    f: list[Tensor]
    g: list[Tensor]
    reg_ot_cost: Tensor
    n_iters: Tensor
    converged: Tensor
    errors: Tensor

    @property
    def last_error(self) -> Tensor:
        """(B,) the last measured marginal error of each problem (+inf if none was measured)."""
        e = self.errors
        measured = (e != -1.0) & (e != torch.inf)
        cols = torch.arange(e.shape[1], device=e.device)
        last = torch.where(measured, cols, -1).max(1).values
        return torch.where(last >= 0, e.gather(1, last.clamp_min(0)[:, None])[:, 0], torch.inf)


def _listed(name: str, pts) -> list[Tensor]:
    if isinstance(pts, Tensor):
        if pts.dim() != 3:
            raise ValueError(f"{name} must be a (B, n, d) tensor or a sequence of (n_k, d) tensors; "
                             f"got shape {tuple(pts.shape)}")
        return list(pts.unbind(0))
    return list(pts)


def _all_none(w) -> bool:
    return w is None or (not isinstance(w, Tensor) and all(v is None for v in w))


def _is_dense(xs, ys, as_, bs) -> bool:
    """x (B, n, d), y (B, m, d) tensors with weights as (B, n), (B, m) tensors or None."""
    return (all(isinstance(p, Tensor) and p.dim() == 3 for p in (xs, ys))
            and all(w is None or isinstance(w, Tensor) for w in (as_, bs)))


def _checked_dense(xs: Tensor, ys: Tensor, as_, bs) -> tuple:
    """The structural checks of a dense batch, on the whole tensors (no work per problem);
    returns the weights (a, b), None where not given."""
    check.points("xs", xs, batched=True)
    check.points("ys", ys, batched=True)
    check.pair(xs, ys, ("xs", "ys"))
    rules.batch_shapes(xs.shape, ys.shape, {n: (None if w is None else tuple(w.shape), side)
                                            for n, w, side in (("as_", as_, "x"), ("bs", bs, "y"))})
    return tuple(None if w is None else weights_shape(name, w, pts, pname)
                 for name, w, pts, pname in (("as_", as_, xs, "xs"), ("bs", bs, ys, "ys")))


def _checked_ragged(xs, ys, as_, bs) -> tuple[list, list, list, list]:
    """The structural checks of a sequence of problems, one by one (no host read); returns the
    problems as lists and their weights (None: uniform)."""
    xs, ys = _listed("xs", xs), _listed("ys", ys)
    B = len(xs)
    if len(ys) != B:
        raise ValueError(f"xs and ys must hold the same number of problems; got {B} and {len(ys)}")
    as_ = [None] * B if as_ is None else list(as_)  # a (B, n) tensor iterates over its rows
    bs = [None] * B if bs is None else list(bs)
    if len(as_) != B or len(bs) != B:
        raise ValueError(f"as_ and bs must give one weight vector (or None) per problem ({B})")
    wa, wb = [], []
    for k, (x, y, a, b) in enumerate(zip(xs, ys, as_, bs)):
        check.points(f"xs[{k}]", x)
        check.points(f"ys[{k}]", y)
        check.pair(x, y)
        if x.shape[1] != xs[0].shape[1] or x.device != xs[0].device:
            raise ValueError(f"every problem needs points of the same dimension on the same device: xs[{k}] is "
                             f"{tuple(x.shape)} on {x.device}, xs[0] {tuple(xs[0].shape)} on {xs[0].device}")
        wa.append(weights_shape(f"as_[{k}]", a, x, f"xs[{k}]"))
        wb.append(weights_shape(f"bs[{k}]", b, y, f"ys[{k}]"))
    return xs, ys, wa, wb


def sinkhorn_batch(
    xs: Tensor | Sequence[Tensor],
    ys: Tensor | Sequence[Tensor],
    as_: Tensor | Sequence[Tensor | None] | None = None,
    bs: Tensor | Sequence[Tensor | None] | None = None,
    *,
    epsilon: float,
    scale_cost: float = 1.0,
    threshold: float = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    tau_a: float = 1.0,
    tau_b: float = 1.0,
    implicit: ImplicitOptions | None = None,
) -> BatchedSinkhornOutput:
    """Solve the B problems (xs[k], ys[k], as_[k], bs[k]) of :func:`torch_api.sinkhorn`'s
    convention in one batched loop (module docstring). ``xs``: a (B, n, d) tensor or a sequence
    of (n_k, d) tensors (ragged sizes, a problem of one point included); ``ys`` likewise with the
    same d; weights per problem (default uniform; zeros allowed; masses equal per problem unless a
    tau < 1), as (B, n), (B, m) tensors with tensor points or one vector (or None) per problem.
    Options as :func:`torch_api.sinkhorn`'s (one epsilon, scale_cost, tau_a and tau_b for the
    batch; ``implicit``: the CG options of second derivatives, as :func:`torch_api.sinkhorn`'s). A
    (B, n, d) batch is packed on the device with no work per problem on the host."""
    options = dict(epsilon=epsilon, scale_cost=scale_cost, threshold=threshold, inner_iterations=inner_iterations,
                   min_iterations=min_iterations, max_iterations=max_iterations, precision=precision, tau_a=tau_a,
                   tau_b=tau_b, implicit=implicit)
    if _is_dense(xs, ys, as_, bs):
        weights = _checked_dense(xs, ys, as_, bs)
        return _solve(lambda prec: pack_dense(xs, ys, as_, bs, prec), xs, ys, weights, True, **options)
    xs, ys, wa, wb = _checked_ragged(xs, ys, as_, bs)
    uniform = _all_none(as_) and _all_none(bs)
    xcat, ycat = torch.cat(xs), torch.cat(ys)  # the points' order of the packing and of the gradients
    acat, bcat = (None, None) if uniform else (torch.cat(wa), torch.cat(wb))

    def pack(prec):
        return pack_concat(xcat, ycat, acat, bcat, [x.shape[0] for x in xs], [y.shape[0] for y in ys], prec)

    return _solve(pack, xcat, ycat, (acat, bcat), False, **options)


@torch.compiler.disable  # a packed loop with host reads: eager under torch.compile (a graph break)
def _solve(pack, xin: Tensor, yin: Tensor, weights: tuple, dense: bool, *, epsilon, scale_cost, threshold,
           inner_iterations, min_iterations, max_iterations, precision, tau_a, tau_b, implicit,
           names: tuple = ("xs", "ys", "as_", "bs")) -> BatchedSinkhornOutput:
    """The packed solve of :func:`sinkhorn_batch` once the problems' structure is checked: ``pack``
    (precision -> ``batch_packing.Packed``), the points as autograd sees them (``xin``, ``yin``: the
    (B, n, d) tensors or the concatenated clouds, in the packing's point order), the weights as
    autograd sees them (a, b: (B, n), (B, m) or concatenated; None: not given); ``names``: the arguments' names in the value rules' messages."""
    x0, y0 = (xin[0], yin[0]) if dense else (xin, yin)
    _, _, eps, scale, thr, opts = prepare(x0, y0, None, None, epsilon, scale_cost, threshold,
                                          inner_iterations, min_iterations, max_iterations, precision)
    tau_a, tau_b = unbalanced.check_tau("tau_a", tau_a), unbalanced.check_tau("tau_b", tau_b)
    balanced = unbalanced.is_balanced(tau_a, tau_b)
    key = options_key(implicit_options(implicit))
    P = pack(opts.precision)
    lay, B, d, dev = P.lay, P.lay.B, x0.shape[-1], x0.device
    # the value rules are read after the loop's first segment is launched (one read for the batch)
    checks = check.DeferredValues({names[0]: P.x, names[1]: P.y}, {} if P.uniform else {names[2]: P.a, names[3]: P.b})
    mass_a, mass_b = P.sums(P.a.double(), 0), P.sums(P.b.double(), 1)
    if balanced and not P.uniform:  # the default weights' masses are equal: no host read
        checks.finish()
        unequal = (mass_a - mass_b).abs() > 1e-5 * mass_a.clamp_min(1e-30)
        if bool(unequal.any()):
            k = int(unequal.nonzero()[0, 0])
            raise ValueError(f"problem {k}: a and b must have the same total mass (balanced OT); got "
                             f"{float(mass_a[k]):.8g} and {float(mass_b[k]):.8g}")
    eps_in, scale_in = eps, scale  # as autograd sees them
    eps, scale = eps.detach(), scale.detach()
    prm = relaxed_params(kernel_params(eps, scale, dev), tau_a, tau_b)
    inputs = {"x": P.x, "y": P.y, "la": P.la, "lb": P.lb, "f0": P.f0, "g0": P.g0, "prm": prm, "rx": lay.rx,
              "ry": lay.ry, "bx": lay.bx, "by": lay.by, "seg_y": lay.seg_y, "rows_x": lay.rows_x, "rows_y": lay.rows_y,
              "thr": thr.detach().to(device=dev, dtype=torch.float32),
              "done0": torch.zeros(B, dtype=torch.bool, device=dev)}
    relax = (unbalanced.relax_at("a", tau_a), unbalanced.relax_at("b", tau_b))
    f, g, n_iters, _, errors = batched_loop(inputs, opts, (lay.lx.sizes, lay.ly.sizes, d), relax, checks)
    converged = record_converged(errors, thr)
    fs, gs = P.unpack(f, 0), P.unpack(g, 1)
    ain, bin_ = weights
    leaves = [t for t in (xin, yin, ain, bin_, eps_in, scale_in) if t is not None and t.requires_grad]
    X, Y = clouds(P.x, P.y) if leaves or not balanced else (None, None)  # the loop's clouds, for the passes
    # OTT's reg_ot_cost per problem (sums per problem); after a balanced f-update the plan's mass
    # is sum(a), a relaxed plan's mass is summed from one pass
    e = eps.float()
    if balanced:
        mass = mass_a
    else:
        rows = apply_plan_blocksparse(X, Y, f, g, prm, lay.rx, opts.precision)[1]
        mass = P.sums(torch.where(lay.seg_x >= 0, rows, 0.0).double(), 0)
    terms = [unbalanced.ott_marginal_entries(torch, p.double(), w.double(), e.double(), tau)
             for p, w, tau in ((f, P.a, tau_a), (g, P.b, tau_b))]
    cost = (P.sums(terms[0], 0) + P.sums(terms[1], 1) + e.double() * (mass_a * mass_b - mass)).float()
    if leaves:
        second = (eps, scale, key, (tau_a, tau_b))  # a double backward's per-problem gradients
        inputs = (xin, yin, ain, bin_, eps_in, scale_in)
        cost = _EnvelopeCost.apply(*inputs, cost, (X, Y, f, g, prm, P, opts.precision, second))
        fo, go = pair_potentials(inputs, f, g, P, (eps, scale, opts.precision, key, (tau_a, tau_b)))
        fs, gs = P.unpack(fo, 0), P.unpack(go, 1)
    return BatchedSinkhornOutput(fs, gs, cost, n_iters, converged, errors)


class _EnvelopeCost(torch.autograd.Function):
    """reg_ot_cost (B,) with the envelope gradient of each problem in its own points:
    d cost_k / d x_i = 2 s (r_i x_i - (P y)_i), d cost_k / d y_j = 2 s (c_j y_j - (P^T x)_j), P the
    problem's plan exp((f_i + g_j - C_ij) / eps), r, c its row and column sums (one block-sparse
    pass per side for the whole batch; the common centre of the packed clouds cancels), and in its
    weights the single call's partials at fixed potentials (``core.unbalanced.ott_marginal_partials``
    plus eps times the other side's mass, from OTT's eps (sum a sum b - sum P))."""

    @staticmethod
    def forward(ctx, xin, yin, ain, bin_, eps, scale, cost, state):
        ctx.state = state
        ctx.inputs = tuple(None if t is None else (t.dtype, t.shape) for t in (xin, yin, ain, bin_, eps, scale))
        ctx.save_for_backward(xin, yin, ain, bin_, eps, scale)
        ctx.tensor_pos = [i for i, t in enumerate((xin, yin, ain, bin_, eps, scale, cost)) if isinstance(t, Tensor)]
        return cost.clone()

    @staticmethod
    def backward(ctx, u):
        X, Y, f, g, prm, P, precision, second = ctx.state
        if torch.is_grad_enabled():  # a double backward will follow: differentiable per-problem gradients
            grads = _second_order_ready(ctx, u, f, g, P, precision, second)
            with torch.no_grad():
                es = _eps_scale_grads(ctx, u, f, g, P, precision, second)
            es = tuple(None if t is None else NoDerivative.apply(NO_SECOND_EPS, t, *ctx.saved_tensors[:4])
                       for t in es)
            return grads + es + (None, None)
        lay, out, need = P.lay, [], ctx.needs_input_grad
        for side, (S, T, fs, ft, ranges, seg) in enumerate(((X, Y, f, g, lay.rx, lay.seg_x),
                                                            (Y, X, g, f, lay.ry, lay.seg_y))):
            if not need[side]:
                out.append(None)
                continue
            pt, r = apply_plan_blocksparse(S, T, fs, ft, prm, ranges, precision, v=T.x)
            rows = 2.0 * prm[1] * (r[:, None] * S.x - pt) * u.float()[seg.clamp_min(0)][:, None]
            dtype, shape = ctx.inputs[side]
            out.append(P.gather(rows, side, shape).to(dtype))
        e = second[0].double()
        masses = (P.sums(P.a.double(), 0), P.sums(P.b.double(), 1))
        for side, (pot, w, seg, tau) in enumerate(((f, P.a, lay.seg_x, second[3][0]), (g, P.b, lay.seg_y, second[3][1]))):
            if not need[2 + side]:
                out.append(None)
                continue
            idx = seg.clamp_min(0)
            part = unbalanced.ott_marginal_partials(torch, pot.double(), w.double(), e, tau)[0]
            rows = (part + e * masses[1 - side][idx]) * u.double()[idx]
            dtype, shape = ctx.inputs[2 + side]
            out.append(P.gather(rows, side, shape).to(dtype))
        return tuple(out) + _eps_scale_grads(ctx, u, f, g, P, precision, second) + (None, None)


def _second_order_ready(ctx, u, f, g, P, precision: str, second) -> tuple:
    """The x, y, a, b gradients of :class:`_EnvelopeCost` problem by problem, differentiable once
    more (:mod:`torch_api.batched_implicit`)."""
    _, _, key, taus = second
    xin, yin, ain, bin_, eps, scale = ctx.saved_tensors  # eps, scale attached: their tangents raise
    need = tuple(ctx.needs_input_grad[:4])
    lx, ly = P.lay.lx.sizes, P.lay.ly.sizes
    xs, ys = split_points(xin, P.dense, lx), split_points(yin, P.dense, ly)
    as_ = P.unpack(P.a, 0) if ain is None else split_points(ain, P.dense, lx)
    bs = P.unpack(P.b, 1) if bin_ is None else split_points(bin_, P.dense, ly)
    problems = zip(xs, ys, as_, bs, P.unpack(f, 0), P.unpack(g, 1))
    grads = problem_gradients(problems, u, eps, scale, precision, key, taus, need)
    return tuple(join_points(gs, P.dense) if n else None for gs, n in zip(grads, need))


NO_SECOND_EPS = rules.second_order_message("a second derivative of sinkhorn_batch's reg_ot_cost")


def _eps_scale_grads(ctx, u, f, g, P, precision: str, second) -> tuple:
    """The epsilon and scale_cost gradients of :class:`_EnvelopeCost` (None where not needed): the
    sum over the problems of u_k times the single call's partials (``sinkhorn_cost_grads``: two
    plan passes per problem, only when asked for); d/d scale_cost = -(d/d s) / scale_cost^2."""
    need_e, need_s = required(ctx, 4), required(ctx, 5)
    if not (need_e or need_s):
        return None, None
    eps, scale, key, taus = second
    xin, yin, ain, bin_ = (t.detach() if t is not None else None for t in ctx.saved_tensors[:4])
    lx, ly = P.lay.lx.sizes, P.lay.ly.sizes
    as_ = P.unpack(P.a, 0) if ain is None else split_points(ain, P.dense, lx)
    bs = P.unpack(P.b, 1) if bin_ is None else split_points(bin_, P.dense, ly)
    rows = zip(split_points(xin, P.dense, lx), split_points(yin, P.dense, ly), as_, bs, P.unpack(f, 0),
               P.unpack(g, 1))
    ge = gs = torch.zeros((), dtype=torch.float64, device=u.device)
    for k, (x, y, a, b, fk, gk) in enumerate(rows):
        _, _, _, _, de, ds = sinkhorn_cost_grads(x, y, a, b, eps, scale, fk, gk, precision, False, False, True, key,
                                                 *taus)
        ge, gs = ge + u[k].double() * de.double(), gs + u[k].double() * ds.double()
    out_e = ge.to(ctx.inputs[4][0]) if need_e else None
    out_s = (-gs / (scale.double() ** 2)).to(ctx.inputs[5][0]) if need_s else None
    return out_e, out_s


def record_converged(errors: Tensor, thr: Tensor) -> Tensor:
    """(B,) OTT's ``converged`` of each problem's error record (B, n_blocks): no NaN, last entry below
    the threshold (-1 there: stopped before the last block)."""
    return ~errors.isnan().any(1) & (errors[:, -1] < thr)


def _host(v):
    return v.detach().cpu().numpy() if isinstance(v, Tensor) else v


def segment_sinkhorn(
    x: Tensor,
    y: Tensor,
    num_segments: int | None = None,
    *,
    segment_ids_x: Tensor | None = None,
    segment_ids_y: Tensor | None = None,
    num_per_segment_x: Sequence[int] | Tensor | None = None,
    num_per_segment_y: Sequence[int] | Tensor | None = None,
    weights_x: Tensor | None = None,
    weights_y: Tensor | None = None,
    max_measure_size: int | None = None,
    indices_are_sorted: bool = False,
    **kwargs,
) -> Tensor:
    """OTT's ``segment_sinkhorn``: the ``reg_ot_cost`` of each segment pair (num_segments,), the
    clouds given concatenated, x (N, d) and y (M, d), with their segments as sizes of consecutive
    segments (``num_per_segment_x / _y``) or ids in any order (``segment_ids_x / _y``; OTT's
    ``indices_are_sorted`` and ``max_measure_size`` are accepted, the latter checked to hold the largest
    segment: the ids are read on the host and the batch packed without padding), optional concatenated
    weights (default uniform per segment). Solved in one batch as :func:`sinkhorn_batch` (whose
    keyword options ``kwargs`` takes: ``epsilon``, ``threshold``, ...), packed from the
    concatenated clouds with no work per segment on the host; differentiable in x, y and the weights. Every
    segment needs at least one point on each side."""
    sx = batch_layout.segment_sizes("x", x.shape[0], _host(num_per_segment_x), _host(segment_ids_x), num_segments)
    sy = batch_layout.segment_sizes("y", y.shape[0], _host(num_per_segment_y), _host(segment_ids_y), num_segments)
    if len(sx) != len(sy):
        raise ValueError(f"x and y have different numbers of segments: {len(sx)} and {len(sy)}")
    check.points("x", x)
    check.points("y", y)
    check.pair(x, y)
    batch_layout.check_measure_size(max_measure_size, sx, sy)
    wx = None if weights_x is None else weights_shape("weights_x", weights_x, x, "x")
    wy = None if weights_y is None else weights_shape("weights_y", weights_y, y, "y")
    ox, oy = (batch_layout.segment_order(_host(ids)) for ids in (segment_ids_x, segment_ids_y))
    if ox is not None:  # the points of each segment made consecutive (no cost depends on their order)
        ox = torch.from_numpy(ox).to(x.device)
        x, wx = x[ox], None if wx is None else wx[ox]
    if oy is not None:
        oy = torch.from_numpy(oy).to(y.device)
        y, wy = y[oy], None if wy is None else wy[oy]
    options = {**_DEFAULTS, **kwargs}
    return _solve(lambda prec: pack_concat(x, y, wx, wy, sx, sy, prec), x, y, (wx, wy),
                  False, names=("x", "y", "weights_x", "weights_y"), **options).reg_ot_cost


# sinkhorn_batch's keyword defaults, for segment_sinkhorn's options
_DEFAULTS = {k: v.default for k, v in inspect.signature(sinkhorn_batch).parameters.items()
             if v.kind is v.KEYWORD_ONLY and v.default is not v.empty}
