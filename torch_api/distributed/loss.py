"""``torch_api.distributed.SamplesLoss``: GeomLoss's debiased Sinkhorn divergence with the clouds
sharded over the ranks of a ``torch.distributed`` process group (NCCL on GPUs, Gloo on CPUs).

Every rank holds a shard of each cloud: rows x_r (n_r, D) with weights a_r, y_r (m_r, D) with
b_r; the global problem is x = concat_r x_r, y = concat_r y_r in rank order (shards of any sizes
>= 1). The result is :class:`torch_api.SamplesLoss`'s on the global problem, to float32 rounding
(the kernels run on fewer rows per launch, so their summation orders may differ), with its
conventions (``torch_api.samples_loss`` states them in full):

* cost C(x, y) = |x - y|^2 / 2, eps = blur^2, softmin_i(h) = -eps log sum_j exp(h_j - C_ij / eps)
  with h = log b + g / eps (zero weights drop out exactly);
* the eps-schedule ``core.schedules.epsilon_schedule(2, diameter, blur, scaling)``, ``diameter``
  by default the diagonal of the bounding box of all points of x and y (computed on the gathered
  clouds, hence equal on every rank and to the single-device one);
* symmetric averaged updates of f_ba, g_ab (and f_aa, g_bb with ``debias``) at every eps, then the
  last extrapolation at blur^2; value <a, F> + <b, G> with (F, G) = (f_ba - f_aa, g_ab - g_bb)
  (debias) or (f_ba, g_ab); with ``reach`` (both marginals relaxed, rho = reach^2) every softmin
  is damped by 1 / (1 + eps / rho) and F, G are GeomLoss's per-point terms
  (rho + eps/2)(1 - exp(-f / rho)) - ... (``samples_loss_relaxed.outputs``).

Communication: one all-gather of the ranks' sizes and options (all ranks must agree), one
all-gather of the points with their weights per side (O((n + m) D) numbers; every rank then
centres the full clouds exactly as the single-device solve does). The anneal is the
single-device one (``samples_loss_anneal.anneal``) with the softmin provider
:class:`~torch_api.distributed.loss_ops.ShardedSoftmin`: a softmin of one side is the
single-device kernel on (this rank's rows, full other cloud), O(n_r m) work, then one all-gather
of the new pieces, so each update of (f_ba, g_ab) communicates n + m numbers (one collective),
each update of f_aa (g_bb) n (m) numbers; the potentials are replicated full vectors and every
rank computes the identical loss. Nothing n x m is communicated. With ``exchange="ring"`` the
points are never gathered: each softmin and each gradient pass streams the other side's shards
around the ring of ranks (:mod:`torch_api.distributed.ring`), the diameter coming from one
all-reduce of the shards' bounding boxes.

Derivatives: the loss is differentiable in this rank's x and y shards with GeomLoss's rule (the
last extrapolation differentiated, its inputs detached: F_i depends on x_i only), so each rank
computes the gradient of ITS points from its rows of the last plans against the full other cloud
(dx_i = a_i ((Q x)_i - (P y)_i) with debias, a_i (x_i - (P y)_i) without; the relaxed factors of
``torch_api.samples_loss`` with ``reach``); the backward runs no collective. Every rank must call
backward on the same loss value (the one this call returned to it); each then holds the gradient
of its own shards. The loss is also differentiable in this rank's weights a_r, b_r (d/da = F, the
rank's rows). ``potentials=True`` returns this rank's pieces of F and G (n_r,), (m_r,),
differentiable in x, y by the same rule. Second derivatives raise.

Scope: loss="sinkhorn", p=2, the dense streaming solve (backend "auto", "tensorized" or
"online"), unbatched points (N, D), balanced or ``reach`` (reach_x = reach_y). backend="multiscale",
unequal reach_x / reach_y, label costs, ``cost``/``kernel`` and cluster labels raise naming the
argument. Bad input raises on every rank (no rank is left waiting in a collective): a rank's own
structural error there and an error naming that rank on the others; disagreeing options or
dimensions, and value errors (non-finite points, negative or all-zero weights, unequal masses
when balanced, checked on the gathered problem), everywhere with the same message.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ot_triton_jax.core import checks as rules
from ot_triton_jax.core.checks import PRECISIONS
from ot_triton_jax.core.geomloss_options import reject_unsupported, relaxation, schedule_numbers
from ot_triton_jax.core.schedules import epsilon_schedule
from ot_triton_jax.core.sharding import ShardLayout, check_agreement
from ot_triton_jax.core.unbalanced import damping

from .. import checks as check
from ..kernel_ops import clouds
from ..samples_loss_anneal import anneal
from ..samples_loss_ops import S, diameter as default_diameter
from ..samples_loss_relaxed import outputs
from .ops import Comm, Side
from .loss_ops import ShardedPotentials, ShardedSoftmin, Solved
from .ring import EXCHANGES, bounding_box_diameter, check_exchange, local_clouds, shape_only, sharded_problem, use_ring
from .solve import _gather_side, _require_group

__all__ = ["SamplesLoss", "samples_loss"]

F32 = torch.float32
_NAME = "torch_api.distributed.SamplesLoss"
_DENSE = ("auto", "tensorized", "online")
_AGREED = ("x dimension d", "y dimension d", "blur", "scaling", "diameter", "debias", "potentials", "precision",
           "reach", "choice of a (given or None)", "choice of b (given or None)", "exchange")


def _options(loss, p, blur, reach, diameter, scaling, cost, kernel, cluster_scale, backend, precision, reach_x,
             reach_y, labelled: bool) -> tuple[float, float, float | None, float | None]:
    """(blur, scaling, diameter, rho) checked with the single-device rules; what the sharded solve
    does not do raises NotImplementedError naming the argument."""
    if backend == "multiscale":
        raise NotImplementedError(f"{_NAME} runs the dense streaming solve only: backend='multiscale' is not "
                                  f"implemented sharded; pass backend in {_DENSE}, or use torch_api.SamplesLoss "
                                  "on one device")
    reject_unsupported(loss, p, cost, kernel, cluster_scale, backend)
    if backend not in _DENSE:
        raise ValueError(f"backend must be one of {_DENSE} ('multiscale' is not implemented sharded); got {backend!r}")
    if labelled:
        raise NotImplementedError(f"{_NAME} has no label cost: label_x, label_y, label_cost are not implemented "
                                  "sharded; use torch_api.SamplesLoss on one device")
    blur, scaling, diam = schedule_numbers(blur, scaling, diameter)
    check.precision(precision)
    rho_x, rho_y = relaxation(reach, reach_x, reach_y, 2, backend)
    if rho_x != rho_y:
        raise NotImplementedError(f"{_NAME} relaxes both marginals alike (reach=...): reach_x={reach_x!r}, "
                                  f"reach_y={reach_y!r} (one relaxed marginal, or two different reaches) are not "
                                  "implemented sharded; use torch_api.SamplesLoss on one device")
    return blur, scaling, diam, rho_x


def _local_weights(name: str, w, pts: Tensor, pname: str):
    """Shape, dtype and device of a rank's weight shard ((n_r,) or (n_r, 1)); the values are
    checked on the gathered weights (a shard may hold only zeros)."""
    if w is None:
        return None
    if rules.weights(check.READER, name, w, pts, pname, trailing_one=True):
        w = w[..., 0]
    return w


def _local_inputs(x, y, a, b) -> tuple:
    """This rank's structural checks of its shards (no value read)."""
    for name, pts in (("x", x), ("y", y)):
        if isinstance(pts, Tensor) and pts.ndim == 3:
            raise NotImplementedError(f"{_NAME} takes unbatched points (N, D): got {name} of shape "
                                      f"{tuple(pts.shape)}; call it once per problem of the batch")
        check.points(name, pts)
    check.pair(x, y)
    a, b = _local_weights("a", a, x, "x"), _local_weights("b", b, y, "y")
    if a is not None and b is not None:
        check.same_weight_dtype(a, b)
    return a, b


def _agree(comm: Comm, local_error, sizes: tuple[int, int], row: tuple) -> tuple[ShardLayout, ShardLayout]:
    """One all-gather of (ok, sizes, options) (a rank whose checks failed raises its own error,
    the others an error naming it), then the agreement check on every rank; the layouts."""
    table = comm.gather_rows(torch.tensor([[local_error is None, *sizes, *row]], dtype=torch.float64,
                                          device=comm.device), ShardLayout((1,) * comm.world)).tolist()
    if local_error is not None:
        raise local_error
    failed = [r for r, t in enumerate(table) if not t[0]]
    if failed:
        raise ValueError(f"{_NAME}: the inputs of rank(s) {failed} failed their checks (the error is raised "
                         "there); fix them on every rank")
    check_agreement(_AGREED, [t[3:] for t in table], _NAME)
    return ShardLayout(tuple(int(t[1]) for t in table)), ShardLayout(tuple(int(t[2]) for t in table))


def _schedule(diam: float, blur: float, scaling: float, rho, device) -> tuple[list, Tensor]:
    """The eps-schedule and its (L, 4) PARAMS rows [eps, S, damping, damping], as
    ``torch_api.samples_loss_ops.solve`` builds them (``diam`` 0: all points coincide, the
    schedule [blur^2, blur^2])."""
    eps_list = epsilon_schedule(2, diam or blur, blur, scaling)
    rows = [[e, S, damping(e, rho), damping(e, rho)] if rho is not None else [e, S, 0.0, 0.0] for e in eps_list]
    return eps_list, torch.tensor(rows, dtype=F32).to(device)


def _sides(comm: Comm, lx: ShardLayout, ly: ShardLayout, x, y, a, b, rho, diam, ring: bool) -> tuple:
    """(diameter, Sides x and y, the clouds the anneal reads, the float64 weights a, b): from the
    gathered clouds, or with the ring exchange from this rank's shards (checks, diameter and
    centre from the same numbers; ``ring.sharded_problem``)."""
    if ring:
        xs, ys, a_full, b_full = sharded_problem(comm, lx, ly, x, y, a, b, rho is None, {})
        diam = bounding_box_diameter(comm, xs, ys) if diam is None else diam
        cx, cy = local_clouds(comm.group, comm.rank, (xs, ys), (lx, ly))
        sx, sy = Side.make_ring(comm, cx, lx, a_full), Side.make_ring(comm, cy, ly, b_full)
        X, Y = shape_only(lx.total, cx.d, comm.device), shape_only(ly.total, cy.d, comm.device)
        return diam, sx, sy, X, Y, a_full, b_full
    x_full, a_full = _gather_side(comm, lx, x, a)
    y_full, b_full = _gather_side(comm, ly, y, b)
    check.values({"x": x_full, "y": y_full}, {"a": a_full, "b": b_full},
                 balanced_pair=("a", "b") if rho is None else None)
    diam = default_diameter(x_full, y_full) if diam is None else diam
    X, Y = clouds(x_full, y_full)
    return diam, Side.make(X, lx, comm.rank, a_full), Side.make(Y, ly, comm.rank, b_full), X, Y, a_full, b_full


def _with_local(full: Tensor, local: Tensor | None, s: Side, dtype) -> Tensor:
    """The full weights in ``dtype`` with this rank's rows taken from its own (differentiable) shard."""
    full = full.to(dtype)
    if local is None or not local.requires_grad:
        return full
    return torch.cat((full[:s.start], local.to(dtype), full[s.stop:]))


def samples_loss(
    x: Tensor,
    y: Tensor,
    a: Tensor | None = None,
    b: Tensor | None = None,
    *,
    loss: str = "sinkhorn",
    p: int = 2,
    blur: float = 0.05,
    reach: float | None = None,
    diameter: float | None = None,
    scaling: float = 0.5,
    truncate=5,
    cost=None,
    kernel=None,
    cluster_scale=None,
    debias: bool = True,
    potentials: bool = False,
    verbose: bool = False,
    backend: str = "auto",
    precision: str = "float32",
    reach_x: float | None = None,
    reach_y: float | None = None,
    label_x: Tensor | None = None,
    label_y: Tensor | None = None,
    label_cost: Tensor | None = None,
    group=None,
    exchange: str = "auto",
) -> Tensor | tuple[Tensor, Tensor]:
    """GeomLoss's Sinkhorn divergence of clouds sharded over the ranks of ``group`` (module docstring).

    Called by every rank of ``group`` (default: the default process group) with its shards
    ``x`` (n_r, D), ``y`` (m_r, D) (n_r, m_r >= 1) and their weights ``a`` (n_r,) / (n_r, 1),
    ``b`` (m_r,) / (m_r, 1); None means the uniform weights 1/n, 1/m of the GLOBAL sizes, and
    every rank must then pass None. The options are :class:`torch_api.SamplesLoss`'s and must be
    equal on every rank (checked); ``truncate`` and ``verbose`` are accepted and ignored.
    ``exchange``: :func:`torch_api.distributed.sinkhorn`'s ("ring" keeps the clouds sharded).

    Returns the loss (0-d, equal on every rank), differentiable in this rank's x, y, a, b; with
    ``potentials=True`` this rank's pieces (F_r (n_r,), G_r (m_r,)), differentiable in x, y.
    Dtype ``promote_types(x.dtype, a.dtype, float32)``. Every rank must call backward on the loss
    it got (the backward itself runs no collective); each gets the gradient of its own shards.
    """
    del truncate, verbose
    rank, world = _require_group(group, "SamplesLoss")
    comm = Comm(group, rank, world, x.device if isinstance(x, Tensor) else torch.device("cpu"))
    local_error, row, sizes = None, (math.nan,) * len(_AGREED), (0, 0)
    try:
        labelled = not (label_x is None and label_y is None and label_cost is None)
        blur, scaling, diam, rho = _options(loss, p, blur, reach, diameter, scaling, cost, kernel, cluster_scale,
                                            backend, precision, reach_x, reach_y, labelled)
        a, b = _local_inputs(x, y, a, b)
        check_exchange(exchange)
        row = (x.shape[1], y.shape[1], blur, scaling, math.nan if diam is None else diam, bool(debias),
               bool(potentials), PRECISIONS.index(precision), math.nan if rho is None else rho, a is not None,
               b is not None, EXCHANGES.index(exchange))
        sizes = (x.shape[0], y.shape[0])
    except (ValueError, TypeError, NotImplementedError) as err:
        local_error = err
    lx, ly = _agree(comm, local_error, sizes, row)

    ring = use_ring(comm, exchange, lx.total + ly.total, x.shape[1])
    diam, sx, sy, X, Y, a_full, b_full = _sides(comm, lx, ly, x, y, a, b, rho, diam, ring)
    eps_list, prms = _schedule(diam, blur, scaling, rho, comm.device)
    debias = bool(debias)
    old, new = anneal(X, Y, sx.logw_full, sy.logw_full, prms, debias, precision, (rho, rho),
                      ShardedSoftmin(comm, sx, sy, precision))
    terms = not potentials and rho is not None
    F, G = outputs(new, debias, rho, rho, eps_list[-1], terms)
    if x.requires_grad or y.requires_grad:
        solved = Solved(sx, sy, tuple(new), tuple(old), prms[-1, 0].clone(), prms[-1, :2].contiguous(), debias,
                        precision, rho, terms)
        F, G = ShardedPotentials.apply(x, y, F, G, solved)
    out_dtype = torch.promote_types(torch.promote_types(x.dtype, x.dtype if a is None else a.dtype), F32)
    F, G = F.to(out_dtype), G.to(out_dtype)
    if potentials:
        return F[sx.start:sx.stop], G[sy.start:sy.stop]
    return (_with_local(a_full, a, sx, out_dtype) * F).sum() + (_with_local(b_full, b, sy, out_dtype) * G).sum()


def _parse(args) -> tuple:
    """(a or None, x, b or None, y) from forward's positional arguments."""
    if len(args) == 2:
        return None, args[0], None, args[1]
    if len(args) == 4:
        return args
    if len(args) == 6:
        raise NotImplementedError("cluster labels (the six-argument call l_x, a, x, l_y, b, y) belong to GeomLoss's "
                                  f"multiscale backend, which {_NAME} does not implement")
    raise TypeError(f"{_NAME} expects (x, y) or (a, x, b, y); got {len(args)} arguments")


class SamplesLoss(torch.nn.Module):
    """Debiased Sinkhorn divergence between sampled measures sharded over ``group``, GeomLoss
    conventions (module docstring).

    ``SamplesLoss(loss="sinkhorn", p=2, blur=0.05, reach=None, diameter=None, scaling=0.5,
    debias=True, potentials=False, backend="auto", precision="float32", group=None, exchange="auto")``
    (the constructor of :class:`torch_api.SamplesLoss`, plus ``group`` and ``exchange``), then, on every rank,
    ``loss(x_r, y_r)`` or ``loss(a_r, x_r, b_r, y_r)`` with this rank's shards: see
    :func:`samples_loss` for shapes, results and derivatives. The options are checked here (on
    this rank) and again at the call, where every rank must agree on them.
    """

    def __init__(self, loss="sinkhorn", p=2, blur=0.05, reach=None, diameter=None, scaling=0.5, truncate=5,
                 cost=None, kernel=None, cluster_scale=None, debias=True, potentials=False, verbose=False,
                 backend="auto", precision="float32", reach_x=None, reach_y=None, label_cost=None, group=None,
                 exchange="auto"):
        super().__init__()
        self.loss, self.p, self.blur, self.reach, self.diameter = loss, p, blur, reach, diameter
        self.scaling, self.truncate, self.cost, self.kernel = scaling, truncate, cost, kernel
        self.cluster_scale, self.debias, self.potentials, self.verbose = cluster_scale, debias, potentials, verbose
        self.backend, self.precision, self.reach_x, self.reach_y = backend, precision, reach_x, reach_y
        self.label_cost, self.group, self.exchange = label_cost, group, exchange
        check_exchange(exchange)
        _options(loss, p, blur, reach, diameter, scaling, cost, kernel, cluster_scale, backend, precision, reach_x,
                 reach_y, label_cost is not None)

    def extra_repr(self) -> str:
        return (f"loss={self.loss!r}, p={self.p}, blur={self.blur}, reach={self.reach}, diameter={self.diameter}, "
                f"scaling={self.scaling}, debias={self.debias}, potentials={self.potentials}, "
                f"precision={self.precision!r}")

    def forward(self, *args, label_x=None, label_y=None, label_cost=None):
        a, x, b, y = _parse(args)
        return samples_loss(
            x, y, a, b, loss=self.loss, p=self.p, blur=self.blur, reach=self.reach, diameter=self.diameter,
            scaling=self.scaling, truncate=self.truncate, cost=self.cost, kernel=self.kernel,
            cluster_scale=self.cluster_scale, debias=self.debias, potentials=self.potentials, verbose=self.verbose,
            backend=self.backend, precision=self.precision, reach_x=self.reach_x, reach_y=self.reach_y,
            label_x=label_x, label_y=label_y, label_cost=self.label_cost if label_cost is None else label_cost,
            group=self.group, exchange=self.exchange)
