"""``torch_api.sinkhorn_batch``: B OTT-convention problems of any sizes, one launch per half-step.

The problems are packed by :mod:`ot_triton_jax.core.batch_layout` (each problem's rows on
row-block boundaries, zero-weight padding) and every half-step is one launch of the block-sparse
LSE kernel in which the row blocks of problem k stream only problem k's columns. Each problem
runs OTT's alternating loop with its own stopping rule, exactly as :func:`torch_api.sinkhorn`
(``core.options.LoopOptions``: the marginal error ||P^T 1 - b||_1 measured after the iterations
that close a block of ``inner_iterations`` once ``min_iterations`` are done, and after the last
one; a problem stops at the first measurement below ``threshold``, or at a non-finite one). A
stopped problem's potentials are frozen while the others go on (its blocks still run: their
results are discarded), so each problem's f, g, iterations and cost are those of its single
solve to float32 rounding. One host read per measurement for the whole batch.

Balanced problems (equal masses per problem), squared Euclidean cost s |x - y|^2 with s =
1 / scale_cost, one epsilon for the batch. Values only: derivatives of the batched solve are not
implemented (inputs that require grad raise NotImplementedError).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from torch import Tensor

from ot_triton_jax.core import batch_layout, multiscale_plans, runtime
from ot_triton_jax.core.unbalanced import ott_marginal_term

from .kernel_ops import clouds, kernel_params, lse_blocksparse
from .sinkhorn_loops import _initial, masked_log
from .sinkhorn_solver import prepare

__all__ = ["sinkhorn_batch", "BatchedSinkhornOutput"]


@dataclass
class BatchedSinkhornOutput:
    """Result of :func:`sinkhorn_batch`: per problem k, ``f[k]`` (n_k,), ``g[k]`` (m_k,) float32
    (OTT convention, as :class:`torch_api.SinkhornOutput`), and (B,) tensors ``reg_ot_cost``
    (float32), ``n_iters`` (int32), ``converged`` (bool), ``errors`` (the last measured marginal
    error of each problem, float32)."""

    f: list[Tensor]
    g: list[Tensor]
    reg_ot_cost: Tensor
    n_iters: Tensor
    converged: Tensor
    errors: Tensor


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


def _segment_sum(values: Tensor, segment: Tensor, count: int) -> Tensor:
    valid = segment >= 0
    return torch.zeros(count, dtype=values.dtype, device=values.device).index_add_(
        0, torch.where(valid, segment, 0), torch.where(valid, values, 0.0))


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
) -> BatchedSinkhornOutput:
    """Solve the B problems (xs[k], ys[k], as_[k], bs[k]) of :func:`torch_api.sinkhorn`'s
    convention in one batched loop (module docstring). ``xs``: a (B, n, d) tensor or a sequence
    of (n_k, d) tensors (ragged sizes, a problem of one point included); ``ys`` likewise with the
    same d; weights per problem (default uniform; zeros allowed; masses equal per problem).
    Options as :func:`torch_api.sinkhorn`'s (one epsilon and scale_cost for the batch)."""
    xs, ys = _listed("xs", xs), _listed("ys", ys)
    B = len(xs)
    if len(ys) != B:
        raise ValueError(f"xs and ys must hold the same number of problems; got {B} and {len(ys)}")
    as_ = [None] * B if as_ is None else list(as_)  # a (B, n) tensor iterates over its rows
    bs = [None] * B if bs is None else list(bs)
    if len(as_) != B or len(bs) != B:
        raise ValueError(f"as_ and bs must give one weight vector (or None) per problem ({B})")
    checked = [prepare(x, y, a, b, epsilon, scale_cost, threshold, inner_iterations, min_iterations,
                       max_iterations, precision) for x, y, a, b in zip(xs, ys, as_, bs)]
    if any(t.requires_grad for t in (*xs, *ys) + tuple(c[0] for c in checked) + tuple(c[1] for c in checked)):
        raise NotImplementedError("derivatives of sinkhorn_batch are not implemented: detach the inputs, or "
                                  "use torch_api.sinkhorn per problem for gradients")
    wa, wb = [c[0] for c in checked], [c[1] for c in checked]
    for k, (a, b) in enumerate(zip(wa, wb)):
        if abs(float(a.double().sum()) - float(b.double().sum())) > 1e-5 * max(float(a.double().sum()), 1e-30):
            raise ValueError(f"problem {k}: a and b must have the same total mass (balanced OT)")
    _, _, eps, scale, thr, opts = checked[0]
    d = xs[0].shape[1]
    block = multiscale_plans.blocksparse_block_m(d, opts.precision, runtime.on_gpu())
    lx = batch_layout.cloud_layout([x.shape[0] for x in xs], block)
    ly = batch_layout.cloud_layout([y.shape[0] for y in ys], block)
    dev = xs[0].device
    X, Y = clouds(_pack(xs, lx, d), _pack(ys, ly, d))
    la, lb = masked_log(_pack(wa, lx, None)), masked_log(_pack(wb, ly, None))
    rx = torch.as_tensor(batch_layout.column_ranges(lx, ly), device=dev)
    ry = torch.as_tensor(batch_layout.column_ranges(ly, lx), device=dev)
    seg_x = torch.as_tensor(lx.segment, device=dev, dtype=torch.int64)
    seg_y = torch.as_tensor(ly.segment, device=dev, dtype=torch.int64)
    prm = kernel_params(eps, scale, dev)
    kw = dict(precision=opts.precision)

    f, g = _initial(la), _initial(lb)  # the single loop's start: 0, -inf where the weight is zero
    done = torch.zeros(B, dtype=torch.bool, device=dev)
    n_iters = torch.zeros(B, dtype=torch.int32, device=dev)
    errors = torch.full((B,), float("inf"), dtype=torch.float32, device=dev)
    pending = None  # a g-update already computed by the last measurement
    for it in range(opts.max_iterations):
        g_new = pending if pending is not None else lse_blocksparse(Y, X, f, prm, ry, logw_out=lb, **kw)[0]
        g = torch.where(done[seg_y.clamp_min(0)] & (seg_y >= 0), g, g_new)
        f_new = lse_blocksparse(X, Y, g, prm, rx, logw_out=la, **kw)[0]
        f = torch.where(done[seg_x.clamp_min(0)] & (seg_x >= 0), f, f_new)
        pending = None
        if not opts.measured(it):
            continue
        pending, err_rows = lse_blocksparse(Y, X, f, prm, ry, logw_out=lb, pold=g, compute_err=True, **kw)
        err = _segment_sum(err_rows, seg_y, B)
        stop = ~done & ((err < thr) | ~torch.isfinite(err) | torch.tensor(it == opts.max_iterations - 1, device=dev))
        errors = torch.where(done, errors, err)
        n_iters = torch.where(stop, torch.full_like(n_iters, it + 1), n_iters)
        done = done | stop
        if bool(done.all()):  # the batch's one host read per measurement
            break
    converged = errors < thr
    fs = [f[o:o + s] for o, s in zip(lx.offsets, lx.sizes)]
    gs = [g[o:o + s] for o, s in zip(ly.offsets, ly.sizes)]
    # OTT's reg_ot_cost; after an f-update the plan's mass is sum(a)
    e = eps.float()
    cost = torch.stack([ott_marginal_term(torch, fk, a.float(), e, 1.0) + ott_marginal_term(torch, gk, b.float(), e, 1.0)
                        + e * (a.float().sum() * b.float().sum() - a.float().sum())
                        for fk, gk, a, b in zip(fs, gs, wa, wb)])
    return BatchedSinkhornOutput(fs, gs, cost, n_iters, converged, errors)
