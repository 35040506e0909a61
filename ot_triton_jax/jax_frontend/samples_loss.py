"""``ot_triton_jax.samples_loss``: the GeomLoss twin.

``samples_loss`` is the twin of ``torch_api.SamplesLoss`` / ``geomloss.SamplesLoss(
"sinkhorn", p=2)`` (see torch_api/samples_loss.py for the full statement):

* C = |x - y|^2 / 2, eps = blur^2, softmin_i = -eps log sum_j b_j exp((g_j - C_ij)/eps);
* eps-schedule ``schedules.epsilon_schedule(2, diameter, blur, scaling)``, the
  diameter defaulting to the diagonal of the joint bounding box of all points;
* initialisation at the first eps from zero potentials, symmetric averaged updates
  of f_ba, g_ab (and f_aa, g_bb with ``debias``) for every eps, then one last
  non-averaged extrapolation at blur^2;
* value <a, f_ba - f_aa> + <b, g_ab - g_bb> (debias) or <a, f_ba> + <b, g_ab>;
  ``potentials=True`` returns (F, G);
* gradients: GeomLoss's rule (only the last extrapolation is differentiated, its
  inputs detached): dF_i/dx_i = (Q x)_i - (P y)_i with the row-normalised plans
  of the last extrapolation (x_i - (P y)_i without debias), grad_a = F,
  grad_b = G; (F, G) themselves are differentiable in x, y (not a, b);
* KL-relaxed marginals: ``reach`` (GeomLoss: both, rho = reach^2), ``reach_x`` / ``reach_y``
  (flash-sinkhorn 0.4.1: the marginal of x, resp. y; either or both), never ``reach`` with
  either. The definition is flash-sinkhorn's: S = OT(a, b) - OT(a, a)/2 - OT(b, b)/2, each
  problem solved by the damped loop with rho_x on its first and rho_y on its second marginal
  (so with rho_x != rho_y the self problems have two potentials), translated along
  (f + c, g - c) after every update when exactly one marginal is relaxed, each value GeomLoss's
  (rho + eps/2)(1 - exp(-f / rho)) terms on a relaxed side; for ``reach`` it is GeomLoss's loss
  (GeomLoss has no one-sided reach). Gradients by GeomLoss's rule (``geomloss_unbalanced``;
  torch_api/samples_loss.py states it all in full, including the differences from flash-
  sinkhorn's potentials and gradients). Unequal masses are allowed then; the loss is twice
  differentiable in x, y (the Jacobian of its gradient field at the fixed point,
  ``core.unbalanced.geomloss_hessian_sides``: c times the Hessian of OTT's relaxed divergence with
  ``reach``; ``jax.jvp(jax.grad(...))`` applies it, not its transpose, which differs with
  reach_x != reach_y), the potentials' second derivatives raise NotImplementedError;
  ``backend="multiscale"`` takes ``reach`` (not reach_x / reach_y).

Argument order is (x, y, a, b) as everywhere in this package (GeomLoss's module
takes (a, x, b, y)). Points are (N, D) or (B, N, D) (a batch shares one schedule, as
GeomLoss's; below, "Batching"). ``backend``
is the kernel launcher ("triton_call", "callback", "auto"/None); GeomLoss's
names "tensorized" and "online" mean "auto" (one exact streaming solver);
"multiscale" (d <= 3, one problem, eager only: not under ``jax.jit`` / ``jax.vmap``) is
torch_api's multiscale solve run on these arrays (``samples_loss_multiscale``), with the options
``cluster_scale``, ``truncate`` and ``tol`` (as ``torch_api.SamplesLoss``).

jit: blur, scaling, diameter, debias, potentials, precision and backend are
static. When the points are concrete (eager call) the eps-schedule is computed
in float64 on the host exactly as torch_api does; inside ``jax.jit`` with traced
points and ``diameter=None`` it is computed on the device in float32 (same
formula; its length is then a run-time loop bound, so new data never
retraces).

Label costs (``label_x``, ``label_y``, ``label_cost``): the cost is ``(|x_i - y_j|^2 + W[lx_i, ly_j]) / 2``
and, with ``debias``, the self problems' ``(|x_i - x_k|^2 + W[lx_i, lx_k]) / 2``, likewise for y (W then
square and symmetric), as ``torch_api.SamplesLoss`` (flash-sinkhorn's ``half_cost=True`` label cost);
gradients by the same rule with the labelled plans, none in W; reach composes; a (B, N, D) batch
takes labels (B, N), (B, M) and one W (one solve per problem, on the batch's eps schedule); second
derivatives raise NotImplementedError. Under ``jax.jit`` an out-of-range label or a non-finite
(or, with debias, non-symmetric) W gives a NaN loss.

Bad input under ``jax.jit`` (traced points or weights): NaN/Inf points, negative
weights, an all-zero weight vector or unequal masses (with both marginals strict) give a NaN loss (and NaN
potentials) instead of an error.

Batching: the (B, N, D) layout with both marginals strict, or both relaxed alike (``reach``, or
``reach_x == reach_y``), runs ``jax.vmap`` of the single solve,
which packs the B problems (``geomloss_packed``: each problem's rows on row-block boundaries) and
runs the annealed loop once for the batch, every softmin one block-sparse launch (2 per eps, 4 with
``debias``); each problem's numbers are its single solve's to float32 rounding. ``jax.vmap`` of
``samples_loss`` folds the same way when the schedule is shared (``diameter`` given, or concrete
points: a host schedule of the whole batch); with ``diameter=None`` and traced points each problem
has its own device schedule and the vmap runs one annealed loop per problem
(``batching.loop_over_batch``). The gradients' plan products fold under ``vmap`` too
(``kernel_ops.apply_plan``). With one marginal relaxed, or reach_x != reach_y, a (B, N, D) batch is
solved one problem after the other (``lax.map``) and ``jax.vmap`` runs one loop per problem (each
problem's translation or split self problems are its own).
"""

from __future__ import annotations

from typing import Any

import functools

import jax
import jax.numpy as jnp

from ..core import checks as core_checks
from ..core import multiscale_rules as rules
from ..core.geomloss_options import reject_unsupported, relaxation, schedule_numbers
from ..core.checks import precision as check_precision
from .checks import (
    check_backend, check_balanced, check_pair, check_points, check_same_weight_dtype, check_weights, inputs_ok,
    is_traced,
)
from .derivatives import GeomLossConfig, geomloss_potentials
from .geomloss_schedule import device_schedule, host_schedule
from .geomloss_unbalanced import RelaxedConfig, relaxed_outputs
from .interop import concrete_value
from .kernel_ops import F32
from .label_inputs import checked, values_ok
from .samples_loss_multiscale import multiscale_samples_loss

__all__ = ["samples_loss"]

_GEOMLOSS_BACKENDS = ("tensorized", "online")
_UNSET = object()  # tol not given: the multiscale default (rules.DEFAULT_TOL)


def _check_options(loss, p, blur, reach, diameter, scaling, cost, kernel, cluster_scale, backend, precision,
                   reach_x=None, reach_y=None):
    reject_unsupported(loss, p, cost, kernel, cluster_scale, backend)
    rhos = relaxation(reach, reach_x, reach_y, 2, backend)
    if backend in _GEOMLOSS_BACKENDS:
        backend = None
    if backend != "multiscale":
        check_backend(backend)
    for name, v in (("blur", blur), ("scaling", scaling)) + ((("diameter", diameter),) if diameter is not None else ()):
        if is_traced(v):
            raise TypeError(f"{name} must be a Python number (it shapes the eps-schedule, static under jit); "
                            f"got a traced value. Mark it static (jax.jit(..., static_argnames=...))")
    blur, scaling, diameter = schedule_numbers(blur, scaling, diameter)
    check_precision(precision)
    return blur, diameter, scaling, backend, rhos


@functools.partial(jax.jit, static_argnames=("cfg", "potentials", "blur", "scaling", "out_dtype"))
def _samples_loss_jit(x, y, a, b, sched, cfg, potentials, blur, scaling, out_dtype, labels=None):
    if sched is None:
        sched = device_schedule(x, y, blur, scaling)
    batched = x.ndim == 3
    xs, ys, as_, bs = (x, y, a, b) if batched else (x[None], y[None], a[None], b[None])
    relaxed = isinstance(cfg, RelaxedConfig)
    ok = inputs_ok(xs, ys, as_, bs, nonneg=(as_, bs), balanced=() if relaxed else ((as_, bs),))
    ok &= values_ok(labels, cfg.debias)
    solve = relaxed_outputs if relaxed else geomloss_potentials

    # labels per problem: rows (B, N), (B, M) of a batch, one table W
    rows = () if labels is None else tuple(v if batched else v[None] for v in labels[:2])

    def one(args):
        xk, yk, ak, bk, *lk = args
        return solve(cfg, xk.astype(F32), yk.astype(F32), ak.astype(F32), bk.astype(F32), sched,
                     None if labels is None else (*lk, labels[2]))

    if xs.shape[0] == 1:
        F, G = one((xs[0], ys[0], as_[0], bs[0], *(r[0] for r in rows)))
        F, G = F[None], G[None]
    elif relaxed and cfg.rho_x != cfg.rho_y:  # one problem after the other
        F, G = jax.lax.map(one, (xs, ys, as_, bs, *rows))
    else:  # the shared schedule: one packed annealed loop for the batch (geomloss_packed), or one
        F, G = jax.vmap(one)((xs, ys, as_, bs, *rows))  # solve per problem with labels
    nan = jnp.asarray(jnp.nan, out_dtype)
    F, G = jnp.where(ok, F.astype(out_dtype), nan), jnp.where(ok, G.astype(out_dtype), nan)
    if potentials:
        return (F, G) if batched else (F[0], G[0])
    values = jnp.sum(as_.astype(out_dtype) * F, -1) + jnp.sum(bs.astype(out_dtype) * G, -1)
    return values if batched else values[0]


def _checked_labels(x, y, label_x, label_y, label_cost, square: bool):
    """(label_x, label_y, W) checked (:func:`.label_inputs.checked`); a (B, N, D) batch takes labels
    (B, N), (B, M), one row per problem, and one table W."""
    if x.ndim == 2:
        return checked(label_x, label_y, label_cost, x.shape[0], y.shape[0], square=square)
    shape = lambda v: None if v is None else tuple(jnp.shape(v))  # noqa: E731
    core_checks.batch_shapes(x.shape, y.shape, {"label_x": (shape(label_x), "x"), "label_y": (shape(label_y), "y")},
                             kind="array")
    flat = lambda v: None if v is None else jnp.reshape(v, (-1,))  # noqa: E731
    lab = checked(flat(label_x), flat(label_y), label_cost, x.shape[0] * x.shape[1], y.shape[0] * y.shape[1],
                  square=square)
    return jnp.reshape(lab[0], x.shape[:2]), jnp.reshape(lab[1], y.shape[:2]), lab[2]


def samples_loss(
    x: jax.Array,
    y: jax.Array,
    a: jax.Array | None = None,
    b: jax.Array | None = None,
    *,
    loss: str = "sinkhorn",
    p: int = 2,
    blur: float = 0.05,
    reach: Any = None,
    diameter: float | None = None,
    scaling: float = 0.5,
    truncate: Any = 5,
    cost: Any = None,
    kernel: Any = None,
    cluster_scale: Any = None,
    debias: bool = True,
    potentials: bool = False,
    verbose: bool = False,
    backend: str | None = None,
    precision: str = "float32",
    tol: Any = _UNSET,
    reach_x: Any = None,
    reach_y: Any = None,
    label_x: jax.Array | None = None,
    label_y: jax.Array | None = None,
    label_cost: jax.Array | None = None,
):
    """Debiased Sinkhorn divergence between sampled measures, GeomLoss conventions.

    The functional twin of ``torch_api.SamplesLoss(...)(a, x, b, y)`` (module
    docstring). Points (N, D) or (B, N, D); weights (N,) / (N, 1) or (B, N) /
    (B, N, 1), default uniform 1/N, non-negative with equal total masses unless ``reach``
    (both marginals, rho = reach^2), ``reach_x`` (only that of x) or ``reach_y`` (only that
    of y) relaxes a marginal (module docstring).
    Returns a 0-d array (or (B,)), differentiable in x, y, a, b; with
    ``potentials=True`` the pair (F, G), differentiable in x, y. ``truncate``
    and ``verbose`` are accepted and ignored (as GeomLoss outside multiscale).
    ``backend="multiscale"``: ``cluster_scale``, ``truncate`` and ``tol`` (default 5e-3) as
    ``torch_api.SamplesLoss``; eager only (module docstring); ``tol`` with another backend
    raises. ``label_x`` (N,) (a batch: (B, N)), ``label_y`` (M,) ((B, M)), ``label_cost`` W (K_x, K_y): the label-augmented
    cost (module docstring, "Label costs"); unbatched points only, not with "multiscale".
    """
    del verbose
    rules.reject_tol(tol is not _UNSET, tol, backend)
    blur, diameter, scaling, backend, (rho_x, rho_y) = _check_options(
        loss, p, blur, reach, diameter, scaling, cost, kernel, cluster_scale, backend, precision, reach_x, reach_y)
    relaxed = rho_x is not None or rho_y is not None
    x = check_points("x", x, batched=True)
    y = check_points("y", y, batched=True)
    check_pair(x, y)
    a = check_weights("a", a, x, "x", trailing_one=True)
    b = check_weights("b", b, y, "y", trailing_one=True)
    check_same_weight_dtype(a, b)
    if not relaxed:  # unequal masses are allowed once a marginal is relaxed
        check_balanced(a, b)
    labels = None
    if label_x is not None or label_y is not None or label_cost is not None:
        if backend == "multiscale":
            raise NotImplementedError("label_x, label_y, label_cost take a backend other than 'multiscale'")
        labels = _checked_labels(x, y, label_x, label_y, label_cost, bool(debias))
    if backend == "multiscale":
        return multiscale_samples_loss(
            x, y, a, b, blur=blur, scaling=scaling, diameter=diameter, cluster_scale=cluster_scale,
            truncate=truncate, tol=rules.DEFAULT_TOL if tol is _UNSET else tol, debias=bool(debias),
            potentials=bool(potentials), precision=precision,
            out_dtype=jnp.promote_types(jnp.promote_types(x.dtype, a.dtype), F32),
            relax=(rho_x, rho_y, "potentials" if potentials else "terms") if rules.check_relaxation(rho_x, rho_y)
            else None)
    sched = None
    xc, yc = concrete_value(x), concrete_value(y)
    if diameter is not None or (xc is not None and yc is not None):
        sched = jnp.asarray(host_schedule(xc, yc, blur, diameter, scaling))
    out_dtype = jnp.promote_types(jnp.promote_types(x.dtype, a.dtype), F32)
    if relaxed:
        cfg = RelaxedConfig(bool(debias), precision, backend, rho_x, rho_y, terms=not potentials)
    else:
        cfg = GeomLossConfig(bool(debias), precision, backend)
    return _samples_loss_jit(x, y, a, b, sched, cfg=cfg, potentials=bool(potentials), blur=blur,
                             scaling=scaling, out_dtype=out_dtype, labels=labels)
