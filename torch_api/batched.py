"""``torch_api.sinkhorn_batch``: B OTT-convention problems of any sizes, one launch per half-step.

The problems are packed by :mod:`ot_triton_jax.core.batch_layout` (each problem's rows on
row-block boundaries, zero-weight padding) and every half-step is one launch of the block-sparse
LSE kernel in which the row blocks of problem k stream only problem k's columns. Each problem
runs OTT's alternating loop with its own stopping rule, exactly as :func:`torch_api.sinkhorn`
(``core.options.LoopOptions``: the marginal error ||P^T 1 - b||_1 measured after the iterations
that close a block of ``inner_iterations`` once ``min_iterations`` are done, and after the last
one; a problem stops at the first measurement below ``threshold``, or at a non-finite one). A
stopped problem's state is kept from its stop while the others go on (its blocks still run:
their results are discarded), so each problem's f, g, iterations and cost are those of its
single solve to float32 rounding. One host read per measurement for the whole batch.

Balanced problems (equal masses per problem), or OTT's KL-relaxed marginals (``tau_a``,
``tau_b`` < 1, shared by the batch: every update damped as in :func:`torch_api.sinkhorn`, any
masses, OTT's relaxed ``reg_ot_cost`` per problem), squared Euclidean cost s |x - y|^2 with s =
1 / scale_cost, one epsilon for the batch. ``reg_ot_cost`` is differentiable in the points (the
envelope gradient of each problem, as :func:`torch_api.sinkhorn`'s); derivatives in the weights
raise at the call, those of f, g when asked for (NotImplementedError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ot_triton_jax.core import batch_layout, multiscale_plans, runtime, unbalanced

from .batched_loop import batched_loop, segment_sum
from .kernel_ops import apply_plan_blocksparse, clouds, kernel_params
from .sinkhorn_loops import _initial, masked_log
from . import checks as check
from .no_derivative import NoDerivative
from .call_args import prepare, weights_shape
from .unbalanced_ops import relaxed_params

__all__ = ["sinkhorn_batch", "segment_sinkhorn", "BatchedSinkhornOutput"]


@dataclass
class BatchedSinkhornOutput:
    """Result of :func:`sinkhorn_batch`: per problem k, ``f[k]`` (n_k,), ``g[k]`` (m_k,) float32
    (OTT convention, as :class:`torch_api.SinkhornOutput`), and (B,) tensors ``reg_ot_cost``
    (float32, differentiable in the points), ``n_iters`` (int32), ``converged`` (bool), ``errors``
    (the last measured marginal error of each problem, float32)."""

    f: list[Tensor]
    g: list[Tensor]
    reg_ot_cost: Tensor
    n_iters: Tensor
    converged: Tensor
    errors: Tensor


_NO_POTENTIALS = "derivatives of sinkhorn_batch's f, g are not implemented; reg_ot_cost is differentiable in the points"


def _listed(name: str, pts) -> list[Tensor]:
    if isinstance(pts, Tensor):
        if pts.dim() != 3:
            raise ValueError(f"{name} must be a (B, n, d) tensor or a sequence of (n_k, d) tensors; "
                             f"got shape {tuple(pts.shape)}")
        return list(pts.unbind(0))
    return list(pts)


def _pack(parts: list[Tensor], layout, width: int | None, fill: float = 0.0) -> Tensor:
    shape = (layout.rows,) if width is None else (layout.rows, width)
    out = torch.full(shape, fill, dtype=torch.float32, device=parts[0].device)
    out[torch.as_tensor(layout.index, device=out.device)] = torch.cat([p.detach().float() for p in parts])
    return out


def _own_centred(xs: list[Tensor], ys: list[Tensor]) -> tuple[Tensor, Tensor]:
    """The problems' points concatenated, each problem shifted by the mean of its own x and y.
    The sums per problem are differences of float64 prefix sums: deterministic (an atomic
    scatter-add is not, and a CUDA-graph replay must repeat the eager call bit for bit)."""
    dev = xs[0].device
    pts, sums, seg = [], 0.0, []
    for ps in (xs, ys):
        sizes = torch.as_tensor([p.shape[0] for p in ps], device=dev)
        cat = torch.cat([p.detach().to(torch.float32) for p in ps])
        # scanned along the inner axis of the (d, points) transpose: a scan along dim 0 of a tall
        # (points, d) tensor runs one sequential thread per column on CUDA (~1 us per point)
        scan = cat.double().t().cumsum(1)
        prefix = torch.cat((scan.new_zeros((scan.shape[0], 1)), scan), 1)
        ends = sizes.cumsum(0)
        sums = sums + (prefix[:, ends] - prefix[:, ends - sizes]).t()
        pts.append(cat)
        seg.append(torch.repeat_interleave(torch.arange(len(ps), device=dev), sizes))
    counts = torch.as_tensor([x.shape[0] + y.shape[0] for x, y in zip(xs, ys)], device=dev, dtype=torch.float64)
    c = (sums / counts[:, None]).to(torch.float32)
    return pts[0] - c[seg[0]], pts[1] - c[seg[1]]


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
) -> BatchedSinkhornOutput:
    """Solve the B problems (xs[k], ys[k], as_[k], bs[k]) of :func:`torch_api.sinkhorn`'s
    convention in one batched loop (module docstring). ``xs``: a (B, n, d) tensor or a sequence
    of (n_k, d) tensors (ragged sizes, a problem of one point included); ``ys`` likewise with the
    same d; weights per problem (default uniform; zeros allowed; masses equal per problem unless a
    tau < 1). Options as :func:`torch_api.sinkhorn`'s (one epsilon, scale_cost, tau_a and tau_b for
    the batch)."""
    xs, ys = _listed("xs", xs), _listed("ys", ys)
    B = len(xs)
    if len(ys) != B:
        raise ValueError(f"xs and ys must hold the same number of problems; got {B} and {len(ys)}")
    as_ = [None] * B if as_ is None else list(as_)  # a (B, n) tensor iterates over its rows
    bs = [None] * B if bs is None else list(bs)
    if len(as_) != B or len(bs) != B:
        raise ValueError(f"as_ and bs must give one weight vector (or None) per problem ({B})")
    _, _, eps, scale, thr, opts = prepare(xs[0], ys[0], as_[0], bs[0], epsilon, scale_cost, threshold,
                                          inner_iterations, min_iterations, max_iterations, precision)
    tau_a, tau_b = unbalanced.check_tau("tau_a", tau_a), unbalanced.check_tau("tau_b", tau_b)
    balanced = unbalanced.is_balanced(tau_a, tau_b)
    wa, wb = [], []
    for k, (x, y, a, b) in enumerate(zip(xs, ys, as_, bs)):  # structural checks only: no host read
        check.points(f"xs[{k}]", x)
        check.points(f"ys[{k}]", y)
        check.pair(x, y)
        if x.shape[1] != xs[0].shape[1] or x.device != xs[0].device:
            raise ValueError(f"every problem needs points of the same dimension on the same device: xs[{k}] is "
                             f"{tuple(x.shape)} on {x.device}, xs[0] {tuple(xs[0].shape)} on {xs[0].device}")
        wa.append(weights_shape(f"as_[{k}]", a, x, f"xs[{k}]"))
        wb.append(weights_shape(f"bs[{k}]", b, y, f"ys[{k}]"))
    if any(isinstance(v, Tensor) and v.requires_grad for v in (epsilon, scale_cost)):
        raise NotImplementedError("derivatives of sinkhorn_batch in epsilon or scale_cost are not implemented: "
                                  "pass numbers (or detached tensors)")
    if any(t.requires_grad for t in (*wa, *wb)):
        raise NotImplementedError("derivatives of sinkhorn_batch in the weights are not implemented (those in the "
                                  "points are): detach as_ and bs, or use torch_api.sinkhorn per problem")
    d = xs[0].shape[1]
    block = multiscale_plans.blocksparse_block_m(d, opts.precision, runtime.on_gpu())
    lx = batch_layout.cloud_layout([x.shape[0] for x in xs], block)
    ly = batch_layout.cloud_layout([y.shape[0] for y in ys], block)
    dev = xs[0].device
    # each problem shifted by its own centre (its cost is unchanged): a shared centre would leave
    # far-apart problems' points large and cost float32 digits in |x|^2 + |y|^2 - 2 x.y
    X, Y = clouds(*(_pack([p], lay, d) for p, lay in zip(_own_centred(xs, ys), (lx, ly))))
    seg_x = torch.as_tensor(lx.segment, device=dev, dtype=torch.int64)
    seg_y = torch.as_tensor(ly.segment, device=dev, dtype=torch.int64)
    pa, pb = _pack(wa, lx, None), _pack(wb, ly, None)
    check.values({"xs": X.x, "ys": Y.x}, {"as_": pa, "bs": pb})  # one read for the batch
    mass_a, mass_b = segment_sum(pa.double(), seg_x, B), segment_sum(pb.double(), seg_y, B)
    unequal = (mass_a - mass_b).abs() > 1e-5 * mass_a.clamp_min(1e-30)
    if balanced and bool(unequal.any()):
        k = int(unequal.nonzero()[0, 0])
        raise ValueError(f"problem {k}: a and b must have the same total mass (balanced OT); got "
                         f"{float(mass_a[k]):.8g} and {float(mass_b[k]):.8g}")
    la, lb = masked_log(pa), masked_log(pb)
    rx = torch.as_tensor(batch_layout.column_ranges(lx, ly), device=dev)
    ry = torch.as_tensor(batch_layout.column_ranges(ly, lx), device=dev)
    eps, scale = eps.detach(), scale.detach()
    prm = relaxed_params(kernel_params(eps, scale, dev), tau_a, tau_b)

    f0, g0 = _initial(la), _initial(lb)  # the single loop's start: 0, -inf where the weight is zero
    inputs = {"x": X.x, "y": Y.x, "la": la, "lb": lb, "f0": f0, "g0": g0, "prm": prm, "rx": rx, "ry": ry,
              "seg_y": seg_y, "rows_x": seg_x.clamp_min(0), "rows_y": seg_y.clamp_min(0),
              "thr": thr.detach().to(device=dev, dtype=torch.float32),
              "done0": torch.zeros(B, dtype=torch.bool, device=dev)}
    relax = (unbalanced.relax_at("a", tau_a), unbalanced.relax_at("b", tau_b))
    f, g, n_iters, errors = batched_loop(inputs, opts, (lx.sizes, ly.sizes, d), relax)
    converged = errors < thr
    fs = [f[o:o + s] for o, s in zip(lx.offsets, lx.sizes)]
    gs = [g[o:o + s] for o, s in zip(ly.offsets, ly.sizes)]
    # OTT's reg_ot_cost per problem (segment sums); after a balanced f-update the plan's mass is
    # sum(a), a relaxed plan's mass is summed from one pass
    e = eps.float()
    if balanced:
        mass = mass_a
    else:
        rows = apply_plan_blocksparse(X, Y, f, g, prm, rx, opts.precision)[1]
        mass = segment_sum(torch.where(seg_x >= 0, rows, 0.0).double(), seg_x, B)
    terms = [unbalanced.ott_marginal_entries(torch, p.double(), w.double(), e.double(), tau)
             for p, w, tau in ((f, pa, tau_a), (g, pb, tau_b))]
    cost = (segment_sum(terms[0], seg_x, B) + segment_sum(terms[1], seg_y, B)
            + e.double() * (mass_a * mass_b - mass)).float()
    leaves = [t for t in (*xs, *ys) if t.requires_grad]
    if leaves:
        state = (X, Y, f, g, prm, rx, ry, seg_x, seg_y, lx, ly, opts.precision)
        cost = _EnvelopeCost.apply(torch.cat(xs), torch.cat(ys), cost, state)
        fs = [NoDerivative.apply(_NO_POTENTIALS, t, *leaves) for t in fs]
        gs = [NoDerivative.apply(_NO_POTENTIALS, t, *leaves) for t in gs]
    return BatchedSinkhornOutput(fs, gs, cost, n_iters, converged, errors)


class _EnvelopeCost(torch.autograd.Function):
    """reg_ot_cost (B,) with the envelope gradient of each problem in its own points:
    d cost_k / d x_i = 2 s (r_i x_i - (P y)_i), d cost_k / d y_j = 2 s (c_j y_j - (P^T x)_j), P the
    problem's plan exp((f_i + g_j - C_ij) / eps), r, c its row and column sums (one block-sparse
    pass per side for the whole batch; the common centre of the packed clouds cancels)."""

    @staticmethod
    def forward(ctx, xcat, ycat, cost, state):
        ctx.state, ctx.dtypes = state, (xcat.dtype, ycat.dtype)
        return cost.clone()

    @staticmethod
    def backward(ctx, u):
        X, Y, f, g, prm, rx, ry, seg_x, seg_y, lx, ly, precision = ctx.state
        out = []
        for S, T, fs, ft, ranges, seg, lay, dt in ((X, Y, f, g, rx, seg_x, lx, ctx.dtypes[0]),
                                                   (Y, X, g, f, ry, seg_y, ly, ctx.dtypes[1])):
            pt, r = apply_plan_blocksparse(S, T, fs, ft, prm, ranges, precision, v=T.x)
            rows = 2.0 * prm[1] * (r[:, None] * S.x - pt) * u.float()[seg.clamp_min(0)][:, None]
            out.append(rows[torch.as_tensor(lay.index, device=rows.device)].to(dt))
        return out[0], out[1], None, None


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
    **kwargs,
) -> Tensor:
    """OTT's ``segment_sinkhorn``: the ``reg_ot_cost`` of each segment pair (num_segments,), the
    clouds given concatenated, x (N, d) and y (M, d), with their segments as sizes
    (``num_per_segment_x / _y``) or sorted ids (``segment_ids_x / _y``), optional concatenated
    weights (default uniform per segment). Solved in one batch (:func:`sinkhorn_batch`, whose
    keyword options ``kwargs`` takes: ``epsilon``, ``threshold``, ...); differentiable in x, y.
    Every segment needs at least one point on each side."""
    sx = batch_layout.segment_sizes("x", x.shape[0], _host(num_per_segment_x), _host(segment_ids_x), num_segments)
    sy = batch_layout.segment_sizes("y", y.shape[0], _host(num_per_segment_y), _host(segment_ids_y), num_segments)
    if len(sx) != len(sy):
        raise ValueError(f"x and y have different numbers of segments: {len(sx)} and {len(sy)}")
    split = lambda t, sizes: None if t is None else list(torch.split(t, sizes))  # noqa: E731
    return sinkhorn_batch(split(x, sx), split(y, sy), split(weights_x, sx), split(weights_y, sy),
                          **kwargs).reg_ot_cost
