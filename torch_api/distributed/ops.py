"""The sharded loops behind :mod:`torch_api.distributed`: collectives, local rows, costs, derivatives.

Each loop is the single-device loop of :mod:`torch_api.sinkhorn_loops` written on
:mod:`torch_api.kernel_ops` with a communication step: a rank updates the potential of its own
rows (the single-device kernel on (local rows, full other cloud)) and one all-gather assembles
the full potential; a measured error is a float64 all-reduce of the ranks' partial sums.
``ot_triton_jax.core.sharding`` states the scheme.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ot_triton_jax.core.options import LoopOptions
from ot_triton_jax.core.sharding import ShardLayout

from ..kernel_ops import Cloud, apply_plan, exact_row_mass, lse_update
from .ring import RingPass
from ..no_derivative import NoDerivative
from ..sinkhorn_loops import _initial, f32, loop_record, masked_log

F32 = torch.float32
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Comm:
    """The collectives of one solve on ``group``: padded all-gathers of shards
    (``core.sharding.ShardLayout``) and float64 all-reduces."""

    def __init__(self, group, rank: int, world: int, device):
        self.group, self.rank, self.world, self.device = group, rank, world, device

    def gather_rows(self, local: Tensor, layout: ShardLayout, index: Tensor | None = None) -> Tensor:
        """The global rows of a sharded array (local (n_r, ...) -> (n, ...)), by one all-gather of
        pieces padded to ``layout.width`` rows. ``index``: ``layout.gather_index()`` on the device."""
        width, n_r = layout.width, local.shape[0]
        piece = local.contiguous() if n_r == width else torch.cat(
            [local, local.new_zeros((width - n_r,) + tuple(local.shape[1:]))])
        out = local.new_empty((self.world * width,) + tuple(local.shape[1:]))
        _ALL_GATHER(out, piece, group=self.group)
        if index is None:
            index = torch.as_tensor(layout.gather_index(), device=local.device)
        return out.index_select(0, index)

    def sum(self, v: Tensor) -> Tensor:
        """The float64 sum of ``v`` over the ranks (one all-reduce)."""
        out = v.double().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=self.group)
        return out


@dataclass
class Side:
    """One sharded cloud of a problem: its full centred cloud ``full`` and this rank's rows
    ``local`` (:func:`local_rows`), the layout, the rows [start, stop), the gather index on the
    device, the full float32 weights ``w`` and log weights ``logw_full`` (``masked_log``, as the
    single loop takes them) and the local ones. With the ring exchange (:mod:`.ring`) ``full``
    is None and ``ring`` streams the shards; the passes over a side (:func:`softmin`,
    :func:`plan`, :func:`row_mass`) read whichever the side has."""

    full: Cloud | None
    local: Cloud
    layout: ShardLayout
    start: int
    stop: int
    index: Tensor
    w: Tensor
    logw_full: Tensor
    ring: RingPass | None = None

    @classmethod
    def make(cls, full: Cloud, layout: ShardLayout, rank: int, w: Tensor) -> "Side":
        start, stop = layout.rows(rank)
        w32 = w.to(F32)
        return cls(full, local_rows(full, start, stop), layout, start, stop,
                   torch.as_tensor(layout.gather_index(), device=full.x.device), w32, masked_log(w32))

    @classmethod
    def make_ring(cls, comm: "Comm", local: Cloud, layout: ShardLayout, w: Tensor) -> "Side":
        """A side whose cloud stays sharded: ``local`` is this rank's rows (``ring.local_clouds``)."""
        start, stop = layout.rows(comm.rank)
        w32 = w.to(F32)
        ring = RingPass(comm.group, comm.rank, comm.world, layout, local, w32)
        return cls(None, local, layout, start, stop, torch.as_tensor(layout.gather_index(), device=local.x.device),
                   w32, masked_log(w32), ring)

    @property
    def w_local(self) -> Tensor:
        return self.w[self.start:self.stop]

    @property
    def logw(self) -> Tensor:
        return self.logw_full[self.start:self.stop]


def local_rows(c: Cloud, start: int, stop: int) -> Cloud:
    """Rows [start, stop) of a centred cloud: points, parts and squared norms are per-row (the
    scale 1 / S and the centre stay the full problem's); copies, so every kernel input starts at
    an aligned address."""
    return Cloud(c.x[start:stop].clone(), c.hi[start:stop].clone(), c.lo[start:stop].clone(),
                 c.sqnorm[start:stop].clone(), c.scale)


def softmin(src: Side, tgt: Side, pot_full: Tensor, prm: Tensor, precision: str, *, pold: Tensor | None = None,
            compute_err: bool = False, fold: bool = False) -> tuple[Tensor, Tensor | None]:
    """The new potential eps log w - eps LSE_j((pot_j - C_ij)/eps) of ``src``'s local rows against
    all of ``tgt``, and with ``compute_err`` the marginal error at ``pold`` (kernels/lse.py)."""
    if tgt.ring is None:
        return lse_update(src.local, tgt.full, pot_full, prm, precision, logw_out=src.logw, pold=pold,
                          compute_err=compute_err, fold=fold)
    return tgt.ring.softmin(src.local, pot_full, prm, precision, src.logw, src.w_local, pold, compute_err)


def plan(src: Side, tgt: Side, f: Tensor, g_full: Tensor, prm: Tensor, precision: str,
         with_points: bool = False) -> tuple[Tensor | None, Tensor]:
    """(P y or None, P 1) for ``src``'s local rows against all of ``tgt``."""
    if tgt.ring is None:
        return apply_plan(src.local, tgt.full, f, g_full, prm, precision, tgt.full.x if with_points else None)
    return tgt.ring.plan(src.local, f, g_full, prm, precision, with_points)


def row_mass(src: Side, tgt: Side, f: Tensor, g_full: Tensor, prm: Tensor) -> Tensor:
    """P 1 for ``src``'s local rows, unbiased ("fixed4"; ``kernel_ops.exact_row_mass``)."""
    if tgt.ring is None:
        return exact_row_mass(src.local, tgt.full, f, g_full, prm)
    return tgt.ring.row_mass(src.local, f, g_full, prm)


def alternating(comm: Comm, sx: Side, sy: Side, prm: Tensor, thr32: float, opts: LoopOptions) -> tuple:
    """OTT's alternating loop (``sinkhorn_loops.alternating_loop``, balanced) on the shards:
    returns (f, g, f_full, g_full, errors, n_iters, converged), f and g this rank's pieces."""
    precision, inner = opts.precision, opts.inner_iterations
    f_full, g_full = _initial(sx.logw_full), _initial(sy.logw_full)
    f, g = f_full[sx.start:sx.stop].clone(), g_full[sy.start:sy.stop].clone()
    la, lb = sx.logw, sy.logw
    errors = [-1.0] * opts.n_blocks
    n_iters = opts.max_iterations
    for it in range(opts.max_iterations):
        # iteration it's g-update also measures the state after it - 1 when that one is measured
        meas = it > 0 and opts.measured(it - 1)
        g_new, err = softmin(sy, sx, f_full, prm, precision, pold=g, compute_err=meas, fold=it > 0)
        if meas:
            e = f32(float(comm.sum(err.double().sum())))
            errors[(it - 1) // inner] = e
            if not math.isfinite(e) or e < thr32:
                n_iters = it
                break
        g, g_new = g_new, None
        g_full = comm.gather_rows(g, sy.layout, sy.index)
        f = softmin(sx, sy, g_full, prm, precision, pold=f, fold=True)[0]
        f_full = comm.gather_rows(f, sx.layout, sx.index)
        errors[it // inner] = math.inf
    else:  # max_iterations reached: one more g-update measures the final state
        _, err = softmin(sy, sx, f_full, prm, precision, pold=g, compute_err=True, fold=True)
        errors[-1] = f32(float(comm.sum(err.double().sum())))
    return (f, g, f_full, g_full) + loop_record(errors, n_iters, thr32, comm.device)


def symmetric(comm: Comm, sx: Side, prm: Tensor, thr32: float, opts: LoopOptions) -> tuple:
    """OTT's symmetric solve of (x, x, a, a) (``sinkhorn_loops.symmetric_loop``, balanced):
    h <- 0.5 h + 0.5 (eps log a - eps LSE_j((h_j - C_ij)/eps)), non-finite old entries counted
    as 0, error 2 ||P 1 - a||_1 read off the next update. One all-gather of h per iteration.
    Returns (h, h_full, errors, n_iters, converged)."""
    precision, inner = opts.precision, opts.inner_iterations
    h_full = _initial(sx.logw_full)
    h = h_full[sx.start:sx.stop].clone()
    u, _ = softmin(sx, sx, h_full, prm, precision, pold=h)
    errors = [-1.0] * opts.n_blocks
    n_iters = opts.max_iterations
    for it in range(opts.max_iterations):
        h = 0.5 * torch.where(torch.isfinite(h), h, 0.0) + 0.5 * u
        h_full = comm.gather_rows(h, sx.layout, sx.index)
        meas = opts.measured(it)
        u, err = softmin(sx, sx, h_full, prm, precision, pold=h, compute_err=meas)
        errors[it // inner] = math.inf
        if meas:
            e = f32(float(2.0 * comm.sum(err.double().sum())))
            errors[it // inner] = e
            if it < opts.max_iterations - 1 and (not math.isfinite(e) or e < thr32):
                n_iters = it + 1
                break
    return (h, h_full) + loop_record(errors, n_iters, thr32, comm.device)


def reg_ot_cost(comm: Comm, sx: Side, sy: Side, f: Tensor, g: Tensor, g_full: Tensor, eps: Tensor, prm: Tensor,
                precision: str, mass_from_plan: bool) -> tuple[Tensor, Tensor]:
    """OTT's reg_ot_cost (``sinkhorn_ops.sinkhorn_reg_ot_cost``, balanced) from the local pieces:
    sum_{a>0} a (f - eps log a) + sum_{b>0} b (g - eps log b) + eps (sum a sum b - sum P), the
    partial sums of every rank added by one all-reduce. sum P: the unbiased "fixed4" pass over
    the local rows ("float32"), the plan's rows ("tf32" with ``mass_from_plan``, as the
    symmetric self terms take it) or sum a ("tf32": the mass right after an f-update).
    Returns (cost, the global masses (sum a, sum b) in float64), the masses for the backward."""
    a32, b32 = sx.w_local, sy.w_local
    e32 = eps.reshape(()).to(device=comm.device, dtype=F32)
    fa = torch.where(a32 > 0, a32 * (f - e32 * sx.logw), 0.0).double().sum()
    gb = torch.where(b32 > 0, b32 * (g - e32 * sy.logw), 0.0).double().sum()
    sa, sb = a32.double().sum(), b32.double().sum()
    if precision == "float32":
        mass = row_mass(sx, sy, f, g_full, prm).double().sum()
    elif mass_from_plan:
        mass = plan(sx, sy, f, g_full, prm, precision)[1].double().sum()
    else:
        mass = sa
    fa, gb, sa, sb, mass = comm.sum(torch.stack([fa, gb, sa, sb, mass])).unbind()
    return (fa + gb + e32.double() * (sa * sb - mass)).to(F32), torch.stack([sa, sb])


def weight_grad(side: Side, pot: Tensor, eps: Tensor, other_mass: Tensor) -> Tensor:
    """d reg_ot_cost / d w_i for this rank's entries of one side's weights w (OTT's balanced
    envelope derivative, ``sinkhorn_ops.sinkhorn_cost_grads``): pot_i - eps log w_i - eps
    + eps M where w_i > 0, eps M where w_i = 0; ``pot`` this rank's rows of that side's potential,
    M the GLOBAL mass of the other side (float64, kept from the forward). Float32."""
    w = side.w_local.double()
    e = eps.double()
    logw = torch.where(w > 0, w.clamp_min(torch.finfo(w.dtype).tiny).log(), 0.0)
    return torch.where(w > 0, pot.double() - e * logw - e + e * other_mass, e * other_mass).to(F32)


_SECOND = ("second derivatives of torch_api.distributed's reg_ot_cost and sinkhorn_divergence are not implemented "
           "(their gradients in the points and weights are); torch_api.distributed.hvp gives Hessian-vector "
           "products in the points")


class EnvelopeCost(torch.autograd.Function):
    """A reg_ot_cost with its envelope gradient in this rank's points and weights, no collective
    in the backward (the full potentials and the global masses are kept from the forward):

        d cost / d x_i = 2 s (r_i x_i - (P y)_i)     (local rows i of P: local f, full g and y)
        d cost / d y_j = 2 s (c_j y_j - (P^T x)_j)
        d cost / d a_i = f_i - eps log a_i - eps + eps sum b   (eps sum b where a_i = 0)
        d cost / d b_j = g_j - eps log b_j - eps + eps sum a   (eps sum a where b_j = 0)

    sum a, sum b the global masses; one streaming pass per point side (the common centre of the
    clouds cancels in r_i x_i - (P y)_i), none for the weights. In ``epsilon`` and ``scale_cost``
    (replicated on every rank) the derivatives are global: :func:`eps_scale_grads`, whose partial
    sums are all-reduced in the backward (so every rank must run it, as with any collective).
    ``apply(x, y, a, b, eps, scale, cost, state)``, ``state`` = (comm, sx, sy, f, g, f_full, g_full,
    prm, precision, masses, self_term), a, b, eps, scale None when not given / not differentiated:
    with ``self_term`` (a symmetric (x, x, a, a) solve, f = g = h) x and a are both sides, and
    their gradients are twice the x side's, as the single-device cost's two equal terms add up.
    Differentiating the gradients again raises NotImplementedError."""

    @staticmethod
    def forward(ctx, x, y, a, b, eps, scale, cost, state):
        ctx.state = state
        ctx.dtypes = tuple(None if t is None else t.dtype for t in (x, y, a, b, eps, scale))
        ctx.save_for_backward(x, y, a, b, eps, scale)
        return cost.clone()

    @staticmethod
    def backward(ctx, u):
        comm, sx, sy, f, g, f_full, g_full, prm, precision, masses, self_term = ctx.state
        u32, twice = u.to(F32), 2.0 if self_term else 1.0
        out = [None] * 6
        for k, (S, T, fs, ft) in enumerate(((sx, sy, f, g_full), (sy, sx, g, f_full))):
            if ctx.needs_input_grad[k]:
                pt, r = plan(S, T, fs, ft, prm, precision, with_points=True)
                out[k] = (r[:, None] * S.local.x - pt).mul_(2.0 * prm[1]) * u32
        for k, (S, pot, other) in enumerate(((sx, f, masses[1]), (sy, g, masses[0])), start=2):
            if ctx.needs_input_grad[k]:
                out[k] = weight_grad(S, pot, prm[0], other) * u32
        out = [None if v is None else twice * v for v in out]
        if ctx.needs_input_grad[4] or ctx.needs_input_grad[5]:  # the whole cost's: no factor 2 for a self term
            geps, gs = eps_scale_grads(comm, sx, sy, f, g, f_full, g_full, prm, precision, masses)
            # s = 1 / scale_cost: dR/dscale = -s^2 dR/ds
            for k, v in ((4, geps), (5, -(prm[1].double() ** 2) * gs)):
                if ctx.needs_input_grad[k]:
                    out[k] = (v * u.double()).reshape(ctx.saved_tensors[k].shape)
        out = [None if v is None else v.to(ctx.dtypes[k]) for k, v in enumerate(out)]
        if torch.is_grad_enabled():  # create_graph: a second derivative raises instead of vanishing
            ins = [t for t in (*ctx.saved_tensors, u) if t is not None and t.requires_grad]
            out = [None if v is None or not ins else NoDerivative.apply(_SECOND, v, *ins) for v in out]
        return (*out, None, None)


def eps_scale_grads(comm: Comm, sx: Side, sy: Side, f: Tensor, g: Tensor, f_full: Tensor, g_full: Tensor,
                    prm: Tensor, precision: str, masses: Tensor) -> tuple[Tensor, Tensor]:
    """(dR/deps, dR/ds) of the global reg_ot_cost at fixed potentials (float64, equal on every rank),
    s = 1 / scale_cost, by the single-device formulas (``sinkhorn_ops.sinkhorn_cost_grads``):

        dR/deps = -sum a log a - sum b log b + sum a sum b - sum P + (<r, f> + <c, g> - <P, C>) / eps
        dR/ds   = <P, C> / s,   <P, C> = s (sum r |x|^2 + sum c |y|^2 - 2 sum <x_i, (P y)_i>)

    with r = P 1 over this rank's rows of x, c = P^T 1 over its rows of y (two plan passes); the
    five partial sums of every rank are added by one all-reduce. For a symmetric self term (sy is
    sx, g is f) both sides' pieces are the same rows: the formula counts each twice, as it must."""
    py, r = plan(sx, sy, f, g_full, prm, precision, with_points=True)
    _, c = plan(sy, sx, g, f_full, prm, precision)
    X, Y = sx.local, sy.local
    r64, c64 = r.double(), c.double()
    a, b = sx.w_local.double(), sy.w_local.double()
    ent = sum(torch.where(w > 0, w * torch.log(torch.where(w > 0, w, 1.0)), 0.0).sum() for w in (a, b))
    parts = torch.stack([
        (r64 * X.sqnorm.double()).sum() + (c64 * Y.sqnorm.double()).sum() - 2.0 * (X.x.double() * py.double()).sum(),
        torch.where(r64 > 0, r64 * f.double(), 0.0).sum() + torch.where(c64 > 0, c64 * g.double(), 0.0).sum(),
        ent, r64.sum()])
    raw, rfcg, ent, total = comm.sum(parts).unbind()
    eps, s = prm[0].double(), prm[1].double()
    pc = s * raw
    return -ent + masses[0] * masses[1] - total + (rfcg - pc) / eps, pc / s


class ShardSum(torch.autograd.Function):
    """``ShardSum.apply(total, local)``: ``total``, the sum of the entries of every rank's shard
    (all-reduced in the forward), whose derivative in each entry of this rank's shard ``local``
    is 1 (its backward broadcasts the incoming gradient; no collective)."""

    @staticmethod
    def forward(ctx, total, local):
        ctx.shape, ctx.dtype = local.shape, local.dtype
        return total.clone()

    @staticmethod
    def backward(ctx, u):
        return None, u.expand(ctx.shape).to(ctx.dtype)
