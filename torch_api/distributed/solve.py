"""``torch_api.distributed.sinkhorn``: OTT-convention Sinkhorn with the clouds sharded over processes.

Every rank of a ``torch.distributed`` process group (NCCL on GPUs, Gloo on CPUs) holds a shard
of each cloud: rows x_r (n_r, d) with weights a_r, and y_r (m_r, d) with b_r; the global problem
is x = concat_r x_r, y = concat_r y_r in rank order (shards of any sizes >= 1; the
``numpy.array_split`` split, ``ot_triton_jax.core.sharding.split_sizes``, is the usual one). The
result is :func:`torch_api.sinkhorn`'s on the global problem, to float32 rounding (the kernels
run on fewer rows per launch, so their launch plans, hence their summation orders, may differ):
the same conventions (C = |x - y|^2 / scale_cost, absolute epsilon,
P_ij = exp((f_i + g_j - C_ij)/eps), f carrying eps log a), OTT's alternating loop (g then f),
the same stopping rule (``core.options.LoopOptions``: the marginal error ||P^T 1 - b||_1 measured
after the iterations that close a block of ``inner_iterations`` once ``min_iterations`` are done,
read off the next g-update, and after the last iteration; stop at the first measurement below
``threshold`` or at a non-finite one), the same ``errors`` / ``n_iters`` / ``converged`` and
``reg_ot_cost``. Every rank takes the same stop decision and returns the same global numbers.

Communication (``ot_triton_jax.core.sharding`` states it in full): one all-gather of the ranks'
sizes and options, one all-gather of the points with their weights per side (every rank then
centres the full clouds exactly as the single-device solve, ``kernel_ops.clouds``, and keeps its
own rows), then per half-step one all-gather of the new potential pieces (O(n) or O(m)
numbers), one all-reduce of the marginal error per measurement, and one all-reduce of the
cost's partial sums at the end. Nothing n x m is communicated; each rank's kernels stream its
own rows against the full other cloud (O(n_r m + m_r n) work per iteration). With
``exchange="ring"`` the points are never gathered: each pass streams the other side's shards
around the ring of ranks (:mod:`torch_api.distributed.ring`; O((n_r + max m_r) d) memory per rank).

``sinkhorn_divergence`` combines three such solves as :func:`torch_api.sinkhorn_divergence` does
(its self terms by OTT's symmetric solve, sharded the same way). The loops, costs and autograd
Functions live in :mod:`torch_api.distributed.ops`.

Scope: balanced problems only (equal masses; tau_a = tau_b = 1), no label cost, no warm start.
Derivatives: ``reg_ot_cost`` is differentiable in this rank's shards x, y, a, b (envelope
theorem, potentials fixed: d cost / d x_i = 2 s (r_i x_i - (P y)_i), r = P 1, s = 1 / scale_cost,
likewise in y with P^T x; d cost / d a_i = f_i - eps log a_i - eps + eps sum b where a_i > 0,
eps sum b where a_i = 0, likewise in b with g and sum a, the masses global); each rank's backward
gives the gradient of the global cost in its own entries and runs no collective (its rows of P
come from its points and the full potentials, the masses from the forward's all-reduce).
In ``epsilon`` and ``scale_cost`` (replicated tensors) the derivatives are the global cost's, from
two plan passes and one all-reduce of five partial sums in the backward (``ops.eps_scale_grads``;
every rank runs the backward). Those of f and g, and second derivatives
(``torch_api.distributed.hvp`` gives HVPs in the points), raise when asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from ot_triton_jax.core import unbalanced
from ot_triton_jax.core.options import LoopOptions
from ot_triton_jax.core.sharding import ShardLayout, check_agreement

from .. import checks as check
from .ops import Comm, EnvelopeCost, ShardSum, Side, alternating, reg_ot_cost, symmetric
from .ring import EXCHANGES, check_exchange, local_clouds, sharded_problem, use_ring
from ..no_derivative import NoDerivative
from ..kernel_ops import clouds, kernel_params
from ..sinkhorn_loops import f32
from ..sinkhorn_solver import prepare

__all__ = ["sinkhorn", "sinkhorn_divergence", "DistributedSinkhornOutput", "DistributedDivergenceOutput"]

F32 = torch.float32
_NO_POTENTIALS = ("derivatives of the potentials of torch_api.distributed's solves are not implemented; "
                  "reg_ot_cost (and the divergence) are differentiable in the points and weights")
_PRECISIONS = ("float32", "tf32")
_AGREED = ("x dimension d", "y dimension d", "epsilon", "scale_cost", "threshold", "inner_iterations",
           "min_iterations", "max_iterations", "precision", "choice of a (given or None)",
           "choice of b (given or None)")


@dataclass(eq=False)
class DistributedSinkhornOutput:
    """Result of :func:`sinkhorn` on one rank.

    f (n_r,), g (m_r,): this rank's pieces of the potentials (float32, OTT convention, -inf where
    the weight is 0), rows ``x_rows`` = (start, stop) of the global x and ``y_rows`` of y.
    reg_ot_cost (0-d float32), n_iters (0-d int32), converged (0-d bool), errors (float32,
    ceil(max_iterations / inner_iterations)): global, equal on every rank, as
    :class:`torch_api.SinkhornOutput`'s (errors: +inf run but not measured, -1 not run)."""

    f: Tensor
    g: Tensor
    reg_ot_cost: Tensor
    n_iters: Tensor
    converged: Tensor
    errors: Tensor
    x_rows: tuple[int, int]
    y_rows: tuple[int, int]


@dataclass(eq=False)
class DistributedDivergenceOutput:
    """Details of :func:`sinkhorn_divergence` on one rank, fields as
    :class:`torch_api.SinkhornDivergenceOutput`'s: triples for the (x, y), (x, x) and (y, y)
    problems (the last None with ``static_b``, except ``costs``, whose last entry is then
    ``offset_static_b``). ``potentials`` holds this rank's pieces ((f, g); a symmetric self
    term's f and g are the same h); ``costs``, ``errors``, ``converged``, ``n_iters`` are global."""

    divergence: Tensor
    potentials: tuple
    errors: tuple
    converged: tuple
    n_iters: tuple
    costs: tuple
    x_rows: tuple[int, int]
    y_rows: tuple[int, int]


def _require_group(group, name: str) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"torch_api.distributed.{name} needs an initialized torch.distributed process group: call "
                           "torch.distributed.init_process_group(backend='nccl' (GPUs) or 'gloo' (CPUs), ...) in every "
                           f"process first, or launch the script with torchrun; on one process use torch_api.{name}")
    return dist.get_rank(group), dist.get_world_size(group)


@dataclass
class _Setup:
    """What :func:`_agreed_inputs` establishes: the group, the layouts, the checked options."""

    comm: Comm
    lx: ShardLayout
    ly: ShardLayout
    eps: Tensor
    scale: Tensor
    thr32: float
    opts: LoopOptions
    diff: tuple = (None, None)  # the caller's epsilon, scale_cost where they require a gradient, else None


def _local_row(name, x, y, a, b, options: dict, unsupported: dict, extra: tuple):
    """This rank's structural checks (``sinkhorn_solver.prepare``, no value read) and its row of
    the agreement table (:data:`_AGREED` then ``extra``)."""
    if unsupported:
        raise NotImplementedError(f"torch_api.distributed.{name} does not support {sorted(unsupported)}: it solves "
                                  "balanced problems (tau_a = tau_b = 1) without label cost, warm start or "
                                  f"implicit / multiscale options; use torch_api.{name} on one device for those")
    _, _, eps, scale, thr, opts = prepare(x, y, a, b, *options.values())
    vals = (eps.detach().double().item(), scale.detach().double().item(), thr.detach().double().item())
    row = (x.shape[1], y.shape[1], *vals, opts.inner_iterations, opts.min_iterations, opts.max_iterations,
           _PRECISIONS.index(opts.precision), a is not None, b is not None, *extra)
    return (eps, scale, thr, opts), row


def _agreed_inputs(name, group, x, y, a, b, options: dict, unsupported: dict, extra: dict | None = None,
                   precheck=None) -> _Setup:
    """Local checks on every rank, then one all-gather of (ok, sizes, dimensions, options): a
    rank whose checks failed raises its own error, the others an error naming it (no rank is left
    waiting in a collective); then every rank checks that all agree. ``precheck``: more local
    checks (a callable raising ValueError / TypeError)."""
    extra = extra or {}
    rank, world = _require_group(group, name)
    comm = Comm(group, rank, world, x.device if isinstance(x, Tensor) else torch.device("cpu"))
    local_error, row = None, (math.nan,) * (len(_AGREED) + len(extra))
    try:
        if precheck is not None:
            precheck()
        (eps, scale, thr, opts), row = _local_row(name, x, y, a, b, options, unsupported, tuple(extra.values()))
    except (ValueError, TypeError, NotImplementedError) as err:
        local_error = err
    sizes = (x.shape[0], y.shape[0]) if local_error is None else (0, 0)
    table = comm.gather_rows(torch.tensor([[local_error is None, *sizes, *row]], dtype=torch.float64,
                                          device=comm.device), ShardLayout((1,) * world)).tolist()
    if local_error is not None:
        raise local_error
    failed = [r for r, t in enumerate(table) if not t[0]]
    if failed:
        raise ValueError(f"torch_api.distributed.{name}: the inputs of rank(s) {failed} failed their checks (the "
                         "error is raised there); fix them on every rank")
    check_agreement(_AGREED + tuple(extra), [t[3:] for t in table], f"torch_api.distributed.{name}")
    lx, ly = ShardLayout(tuple(int(t[1]) for t in table)), ShardLayout(tuple(int(t[2]) for t in table))
    given = tuple(v if isinstance(v, Tensor) and v.requires_grad else None
                  for v in (options["epsilon"], options["scale_cost"]))
    return _Setup(comm, lx, ly, eps.detach(), scale.detach(), f32(thr.item()), opts, given)


def _gather_side(comm: Comm, layout: ShardLayout, pts: Tensor, w: Tensor | None) -> tuple[Tensor, Tensor]:
    """The full cloud (float32, as the single solve reads it) and its weights (float64, exact for
    any floating input; the library's default 1/n when None), from one all-gather of the
    (n_r, d + 1) float64 rows [points, weight]."""
    p32 = pts.detach().to(F32)
    wcol = p32.new_zeros((p32.shape[0], 1), dtype=torch.float64) if w is None else w.detach().double()[:, None]
    full = comm.gather_rows(torch.cat([p32.double(), wcol], dim=1), layout)
    weights = check.uniform_weights(layout.total, comm.device) if w is None else full[:, -1].contiguous()
    return full[:, :-1].to(F32).contiguous(), weights


def _gathered(st: _Setup, x: Tensor, y: Tensor, a, b) -> tuple:
    """The gathered problem (x, y, a, b), value-checked with the single solve's rules (every
    rank reaches the same verdict on the same data)."""
    x_full, a_full = _gather_side(st.comm, st.lx, x, a)
    y_full, b_full = _gather_side(st.comm, st.ly, y, b)
    default = check.is_uniform_default(a_full) and check.is_uniform_default(b_full)
    weights = {} if default else {"a": a_full, "b": b_full}
    check.DeferredValues({"x": x_full, "y": y_full}, weights, balanced_pair=None if default else ("a", "b"),
                         numbers={"epsilon": st.eps, "scale_cost": st.scale, "threshold": st.thr32}).finish()
    return x_full, y_full, a_full, b_full


def _inputs(st: _Setup, x: Tensor, y: Tensor, a, b, exchange: str) -> tuple:
    """(ring, xs, ys, a_full, b_full): the exchange taken and the problem it solves on
    (:func:`_gathered`, or ``ring.sharded_problem``)."""
    if not use_ring(st.comm, exchange, st.lx.total + st.ly.total, x.shape[1]):
        return (False,) + _gathered(st, x, y, a, b)
    return (True,) + sharded_problem(st.comm, st.lx, st.ly, x, y, a, b, True,
                                     {"epsilon": st.eps, "scale_cost": st.scale, "threshold": st.thr32})


def _sides(st: _Setup, pts: tuple, layouts: tuple, weights: tuple, ring: bool) -> tuple:
    """The Sides of one problem's clouds (one or two), centred together as the single solve does:
    ``pts`` are the full clouds (gathered) or this rank's shards (ring)."""
    if ring:
        cl = local_clouds(st.comm.group, st.comm.rank, pts, layouts)
        return tuple(Side.make_ring(st.comm, c, lay, w) for c, lay, w in zip(cl, layouts, weights))
    return tuple(Side.make(c, lay, st.comm.rank, w) for c, lay, w in zip(clouds(*pts), layouts, weights))


def _leaves(*inputs) -> list:
    return [t for t in inputs if isinstance(t, Tensor) and t.requires_grad]


def _pair_term(st: _Setup, x, y, a, b, xs, ys, ws_x, ws_y, prm, lx: ShardLayout, ly: ShardLayout,
               ring: bool) -> tuple:
    """The alternating solve of (xs, ys) (full float32 clouds, or this rank's shards with the
    ring exchange) and its reg_ot_cost, differentiable in this rank's shards x, y, a, b (a, b:
    the caller's weights or None)."""
    sx, sy = _sides(st, (xs, ys), (lx, ly), (ws_x, ws_y), ring)
    f, g, f_full, g_full, errs, n_it, conv = alternating(st.comm, sx, sy, prm, st.thr32, st.opts)
    cost, masses = reg_ot_cost(st.comm, sx, sy, f, g, g_full, st.eps, prm, st.opts.precision, False)
    leaves = _leaves(x, y, a, b, *st.diff)
    if leaves:
        state = (st.comm, sx, sy, f, g, f_full, g_full, prm, st.opts.precision, masses, False)
        cost = EnvelopeCost.apply(x, y, a, b, *st.diff, cost, state)
        f, g = NoDerivative.apply(_NO_POTENTIALS, f, *leaves), NoDerivative.apply(_NO_POTENTIALS, g, *leaves)
    return (f, g), cost, errs, n_it, conv


def _self_term(st: _Setup, x, w, xs, ws, prm, lay: ShardLayout, symmetric_sinkhorn: bool, ring: bool) -> tuple:
    """The (x, x, w, w) problem as :mod:`torch_api.divergence` solves it: OTT's symmetric solve
    (clouds(x) alone; x and w are both sides, so their gradients are twice one side's), or the
    alternating one (clouds(x, x))."""
    if not symmetric_sinkhorn:
        return _pair_term(st, x, x, w, w, xs, xs, ws, ws, prm, lay, lay, ring)
    (sx,) = _sides(st, (xs,), (lay,), (ws,), ring)
    h, h_full, errs, n_it, conv = symmetric(st.comm, sx, prm, st.thr32, st.opts)
    cost, masses = reg_ot_cost(st.comm, sx, sx, h, h, h_full, st.eps, prm, st.opts.precision, True)
    leaves = _leaves(x, w, *st.diff)
    if leaves:
        state = (st.comm, sx, sx, h, h, h_full, h_full, prm, st.opts.precision, masses, True)
        cost = EnvelopeCost.apply(x, x.detach(), w, None, *st.diff, cost, state)
        h = NoDerivative.apply(_NO_POTENTIALS, h, *leaves)
    return (h, h), cost, errs, n_it, conv


def _options(epsilon, scale_cost, threshold, inner_iterations, min_iterations, max_iterations, precision) -> dict:
    return dict(epsilon=epsilon, scale_cost=scale_cost, threshold=threshold, inner_iterations=inner_iterations,
                min_iterations=min_iterations, max_iterations=max_iterations, precision=precision)


def sinkhorn(
    x: Tensor,
    y: Tensor,
    a: Tensor | None = None,
    b: Tensor | None = None,
    *,
    epsilon: float | Tensor,
    scale_cost: float | Tensor = 1.0,
    threshold: float | Tensor = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    group=None,
    exchange: str = "auto",
    tau_a: float = 1.0,
    tau_b: float = 1.0,
    **unsupported,
) -> DistributedSinkhornOutput:
    """OTT-convention Sinkhorn on a cloud pair sharded over the ranks of ``group`` (module docstring).

    Called by every rank of ``group`` (default: the default process group) with its shards
    ``x`` (n_r, d), ``y`` (m_r, d) (n_r, m_r >= 1) and their weights ``a`` (n_r,), ``b`` (m_r,);
    None means the uniform weights 1/n, 1/m of the GLOBAL sizes (n = sum_r n_r), and every rank
    must then pass None. ``epsilon``, ``scale_cost``, ``threshold``, the iteration options and
    ``precision`` are :func:`torch_api.sinkhorn`'s and must be equal on every rank (checked).
    The points and weights are on this rank's device (CUDA for NCCL, CPU for Gloo). ``tau_a``,
    ``tau_b`` must be 1 (balanced only); any other option of :func:`torch_api.sinkhorn` raises.
    ``exchange`` (equal on every rank): "gather" (every rank holds both full clouds: the
    fastest), "ring" (each keeps its shards; the other side's shards stream around the ring in
    every pass, :mod:`torch_api.distributed.ring`: for clouds that do not fit one device), or
    "auto" (the ring when the gathered clouds would take more than half of some rank's free GPU
    memory; gather otherwise). Returns this rank's :class:`DistributedSinkhornOutput`.

    Bad input raises on every rank (no rank is left waiting in a collective): a rank's own
    structural error there, and on the others an error naming that rank; disagreeing dimensions
    or options, non-finite points, negative or all-zero weights, unequal masses (checked on the
    gathered problem) everywhere with the same message.
    """
    if tau_a != 1.0 or tau_b != 1.0:
        unsupported.update(tau_a=tau_a, tau_b=tau_b)
    opts = _options(epsilon, scale_cost, threshold, inner_iterations, min_iterations, max_iterations, precision)
    st = _agreed_inputs("sinkhorn", group, x, y, a, b, opts, unsupported, {"exchange": EXCHANGES.index(exchange)
                        if exchange in EXCHANGES else -1}, lambda: check_exchange(exchange))
    ring, xs, ys, a_full, b_full = _inputs(st, x, y, a, b, exchange)
    prm = kernel_params(st.eps, st.scale, st.comm.device)
    (f, g), cost, errs, n_it, conv = _pair_term(st, x, y, a, b, xs, ys, a_full, b_full, prm, st.lx, st.ly, ring)
    r = st.comm.rank
    return DistributedSinkhornOutput(f, g, cost, n_it, conv, errs, st.lx.rows(r), st.ly.rows(r))


def sinkhorn_divergence(
    x: Tensor,
    y: Tensor,
    a: Tensor | None = None,
    b: Tensor | None = None,
    *,
    epsilon: float | Tensor,
    scale_cost: float | Tensor = 1.0,
    threshold: float | Tensor = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    static_b: bool = False,
    offset_static_b: float | None = None,
    symmetric_sinkhorn: bool = True,
    group=None,
    exchange: str = "auto",
    tau_a: float = 1.0,
    tau_b: float = 1.0,
    **unsupported,
) -> tuple[Tensor, DistributedDivergenceOutput]:
    """OTT's Sinkhorn divergence on clouds sharded over the ranks of ``group``, as
    :func:`torch_api.sinkhorn_divergence` computes it on one device (to float32 rounding):

        div = R(x, y) - 1/2 R(x, x) - 1/2 R(y, y) + 1/2 eps (sum a - sum b)^2

    R = reg_ot_cost of :func:`sinkhorn` (shards, defaults, checks and options as there). The
    (x, y) term is the sharded alternating solve; with ``symmetric_sinkhorn=True`` (OTT's
    default) the (x, x) and (y, y) terms run OTT's symmetric solve (momentum 0.5, error
    ||P 1 - a||_1 + ||P^T 1 - a||_1, sum P from a pass over the plan), sharded the same way (one
    all-gather of h per iteration, one all-reduce per measurement), each on its own cloud centred
    alone as the single-device solve centres it; with False they are alternating solves of
    (x, x, a, a). ``static_b=True`` skips R(y, y) and uses ``offset_static_b`` (default 0).
    ``exchange``: as in :func:`sinkhorn`, for all three terms. Balanced only. Returns ``(divergence, DistributedDivergenceOutput)``; the divergence (0-d
    float32, equal on every rank) is differentiable in this rank's shards x, y, a, b (envelope
    gradients of the three terms, a symmetric self term's twice one side's, and the mass term's
    eps (sum a - sum b); no collective in the backward) and in epsilon and scale_cost (global
    derivatives: one all-reduce per term in the backward)."""
    if tau_a != 1.0 or tau_b != 1.0:
        unsupported.update(tau_a=tau_a, tau_b=tau_b)

    def precheck():
        check_exchange(exchange)
        if offset_static_b is not None and not static_b:
            raise ValueError("offset_static_b is only used with static_b=True; pass static_b=True or drop it")
    opts = _options(epsilon, scale_cost, threshold, inner_iterations, min_iterations, max_iterations, precision)
    offset = 0.0 if offset_static_b is None else float(offset_static_b)
    extra = {"static_b": bool(static_b), "offset_static_b": offset, "symmetric_sinkhorn": bool(symmetric_sinkhorn),
             "exchange": EXCHANGES.index(exchange) if exchange in EXCHANGES else -1}
    st = _agreed_inputs("sinkhorn_divergence", group, x, y, a, b, opts, unsupported, extra, precheck)
    ring, xs, ys, a_full, b_full = _inputs(st, x, y, a, b, exchange)
    prm = kernel_params(st.eps, st.scale, st.comm.device)
    xy = _pair_term(st, x, y, a, b, xs, ys, a_full, b_full, prm, st.lx, st.ly, ring)
    xx = _self_term(st, x, a, xs, a_full, prm, st.lx, bool(symmetric_sinkhorn), ring)
    yy = None if static_b else _self_term(st, y, b, ys, b_full, prm, st.ly, bool(symmetric_sinkhorn), ring)
    cost_yy = torch.tensor(offset, dtype=F32, device=st.comm.device) if yy is None else yy[1]
    eps_in = st.eps if st.diff[0] is None else st.diff[0]  # the mass term's eps derivative: (sum a - sum b)^2 / 2
    e32 = eps_in.reshape(()).to(device=st.comm.device, dtype=F32)
    sa, sb = (ShardSum.apply(w_full.to(F32).sum(), w) if w is not None and w.requires_grad else w_full.to(F32).sum()
              for w, w_full in ((a, a_full), (b, b_full)))
    mass = unbalanced.divergence_mass_term(sa, sb, e32)
    div = xy[1] - 0.5 * (xx[1] + cost_yy) + mass

    def triple(k):
        return xy[k], xx[k], (None if yy is None else yy[k])

    r = st.comm.rank
    out = DistributedDivergenceOutput(div, triple(0), triple(2), triple(4), triple(3), (xy[1], xx[1], cost_yy),
                                      st.lx.rows(r), st.ly.rows(r))
    return div, out
