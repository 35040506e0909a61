"""``ot_triton_jax.distributed.samples_loss``: GeomLoss's debiased Sinkhorn divergence with the
clouds sharded over a 1-D mesh.

The JAX twin of ``torch_api.distributed.samples_loss`` and the sharded form of
:func:`ot_triton_jax.samples_loss` (``geomloss.SamplesLoss("sinkhorn", p=2)``), to float32
rounding. Its conventions are the single-device call's:

* C(x, y) = |x - y|^2 / 2, eps = blur^2, softmin_i(q) = -eps LSE_j((q_j - C_ij)/eps + log w_j)
  (zero weights drop out exactly);
* the eps-schedule ``core.schedules.epsilon_schedule(2, diameter, blur, scaling)``, ``diameter``
  by default the diagonal of the bounding box of all points of x and y, computed from the full
  clouds exactly as the single-device call does (float64 on the host for concrete points or a
  given diameter; in float32 on the device inside ``jax.jit``), so every device has the same one;
* from zero potentials, symmetric averaged updates of f_ba, g_ab (and f_aa, g_bb with
  ``debias``) at every eps, then one last non-averaged extrapolation at blur^2;
* value <a, F> + <b, G> with (F, G) = (f_ba - f_aa, g_ab - g_bb) (debias) or (f_ba, g_ab);
  ``potentials=True`` returns (F, G);
* ``reach`` (GeomLoss's KL-relaxed marginals, both relaxed alike: rho = reach^2, unequal masses
  allowed): the loop is :func:`.geomloss_unbalanced.damped_solve`, every softmin multiplied by
  damping(eps, rho) = 1 / (1 + eps / rho) at its eps (``core.unbalanced``), and F, G are GeomLoss's
  per-point terms w(f_ba) - w(f_aa), w(f) = (rho + eps/2)(1 - exp(-f / rho)) at eps = blur^2
  (w(f_ba) without debias; ``core.unbalanced.geomloss_weight``), or the damped potentials with
  ``potentials=True`` (``geomloss_unbalanced``: the single-device rules, reused here).

Sharding and communication. x (n, d), y (m, d), a (n,), b (m,) are global arrays split by points
over the devices of a 1-D ``Mesh`` (any placement is accepted and resharded) and the solve runs
under ``jax.jit`` as one ``shard_map`` (:mod:`ot_triton_jax.core.sharding`): every device
all-gathers the points and weights once and centres and splits the full clouds as the single solve
does (:func:`.distributed_shards.prepared`). The annealed loop is the single-device
:func:`.loops.geomloss_solve` (with ``reach`` :func:`.geomloss_unbalanced.damped_solve`) with the
softmin provider :func:`sharded_softmins`: a softmin is the single-device kernel
(``kernel_ops.lse_update``, the fixed shift predicted from the old potential when ``pair_plans``
picks "fold", the online max otherwise) on (this device's rows, the full other cloud), then ONE
``all_gather`` of the new pieces: an update of (f_ba, g_ab) gathers n + m numbers in one
collective, one of f_aa (g_bb) n (m); with ``reach`` the damping multiplies the gathered
(replicated) vectors, so the communication is the same. The potentials are replicated full vectors,
so every device runs the same loop on the same numbers and holds the same loss. Nothing n x m is
communicated. n and m need not be multiples of the device count: the clouds are padded with
zero-weight copies of their last point (absent from every softmin; cut off the outputs).

Outputs: the 0-d loss (replicated), or with ``potentials=True`` F (n,), G (m,) sharded along the
mesh axis (when n, resp. m, is a multiple of the device count; placed by XLA otherwise).

Derivatives, GeomLoss's rule as the single-device ``custom_vjp`` (only the last extrapolation is
differentiated, its inputs detached): dF_i/dx_i = (Q x)_i - (P y)_i with the row-normalised plans
of the last extrapolation (x_i - (P y)_i without debias), likewise for G in y; with ``reach`` each
term carries damping(eps, rho) times the slope w' of its weight (``geomloss_unbalanced``; w' = 1
for the potentials): dF_i/dx_i = damp w'(f_ba_i) (x_i - (P y)_i) - damp w'(f_aa_i) (x_i - (Q x)_i),
damp = 1 / (1 + eps / rho), w'(f) = (1 + eps / (2 rho)) exp(-f / rho), at eps = blur^2. Each
device computes the rows of its own points from its rows of the last plans against the full other
cloud and the replicated potentials and clouds kept from the forward, so the backward runs no
collective. The loss is differentiable in a and b (d/da = F, d/db = G); F, G are differentiable
in x and y. Second derivatives raise NotImplementedError (also with ``reach``, where the
single-device loss has them).

Scope: loss="sinkhorn", p=2, strict (balanced) marginals or ``reach`` (equivalently reach_x =
reach_y), unbatched points, the dense streaming solve (``backend`` None/"auto", a launcher of
:mod:`.launch`, or GeomLoss's "tensorized" / "online"), as ``torch_api.distributed.SamplesLoss``.
reach_x != reach_y (one relaxed marginal, or two different reaches), batched points and
backend="multiscale" raise NotImplementedError (there are no label costs). Values are checked when
concrete (as :func:`ot_triton_jax.samples_loss`); under ``jax.jit`` invalid values (non-finite
points, negative or all-zero weights, unequal masses when balanced) give a NaN loss.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, PartitionSpec as P

from ..core import pair_plans
from .checks import check_balanced, check_pair, check_points, check_same_weight_dtype, check_weights, inputs_ok
from .derivatives import GeomLossConfig, side_direction
from .distributed_shards import gatherer, mesh_axis, own_rows, pad, padded_size, placed, prepared
from . import geomloss_schedule as schedule
from .geomloss_unbalanced import RelaxedConfig, _outputs as relaxed_values, _side as relaxed_side, damped_solve
from .interop import concrete_value
from .kernel_ops import F32, Cloud, lse_update, make_params, masked_log
from .loops import GEOMLOSS_SCALE, geomloss_solve
from .samples_loss import _check_options

__all__ = ["samples_loss"]

_NAME = "ot_triton_jax.distributed.samples_loss"


class LossStatic(NamedTuple):
    """The static part of the sharded loss: mesh and axis, the solve's options, the true sizes;
    ``relaxed``: the single-device relaxed solve's options with ``reach`` (rho_x = rho_y), None
    when balanced."""

    mesh: Mesh
    axis: str
    debias: bool
    precision: str
    backend: str | None
    n: int
    m: int
    relaxed: RelaxedConfig | None = None


def sharded_softmins(X: Cloud, Y: Cloud, Xl: Cloud, Yl: Cloud, la, lb, axis: str, precision: str, backend):
    """(pair, own) of :func:`.loops.dense_softmins` inside the ``shard_map``: X, Y the full
    prepared clouds, Xl, Yl this device's rows of them, la, lb the full log weights; potentials
    in and out are full replicated vectors. Each softmin runs on the local rows against the full
    other cloud; ``pair`` all-gathers its two sides in one collective, ``own`` its one side."""
    fold_pair = pair_plans.pair_mode(X.n, Y.n, X.d, precision) == "fold"
    fold_self = pair_plans.self_mode(X.d, precision) == "fold"
    k = jax.lax.axis_index(axis)
    nl = Xl.n

    def soft(Sl: Cloud, T: Cloud, q, lw, prm, old, fold: bool):
        pold = jax.lax.dynamic_slice_in_dim(old, k * Sl.n, Sl.n) if fold else None
        return lse_update(Sl, T, q, prm, precision=precision, backend=backend, logw_in=lw, pold=pold,
                          compute_err=False, fold=fold)[0]

    def pair(f, g, prm):
        pieces = jnp.concatenate([soft(Xl, Y, g, lb, prm, f, fold_pair), soft(Yl, X, f, la, prm, g, fold_pair)])
        both = jax.lax.all_gather(pieces, axis)  # (devices, nl + ml): [rows of f, rows of g] per device
        return both[:, :nl].reshape(-1), both[:, nl:].reshape(-1)

    def own(side, h, prm):
        S, Sl, lw = (X, Xl, la) if side == 0 else (Y, Yl, lb)
        return gatherer(axis)(soft(Sl, S, h, lw, prm, h, fold_self))

    return pair, own


def _solve_local(xl, yl, al, bl, sched, *, static: LossStatic):
    """The annealed loop on this device's shards: the full (old, new) potential quadruples, the
    full clouds and log weights (all replicated)."""
    axis, gather = static.axis, gatherer(static.axis)
    X, Y, Xl, Yl = prepared(xl, yl, axis, static.backend)
    la, lb = masked_log(gather(al)), masked_log(gather(bl))
    softmins = sharded_softmins(X, Y, Xl, Yl, la, lb, axis, static.precision, static.backend)
    eps_at, n_eps, last_eps = (lambda k: schedule.eps_at(sched, k)), schedule.n_eps(sched), schedule.last_eps(sched)
    if static.relaxed is not None:  # the damped loop (reach), with the same sharded softmins
        old, new = damped_solve(static.relaxed, X, Y, la, lb, eps_at, n_eps, last_eps, softmins)
    else:
        old, new = geomloss_solve(X, Y, la, lb, eps_at, n_eps, last_eps, static.debias, static.precision,
                                  static.backend, softmins)
    return old, new, X, Y, la, lb


def _forward(static: LossStatic, x, y, a, b, sched):
    mesh, axis, n, m = static.mesh, static.axis, static.n, static.m
    sg = jax.lax.stop_gradient
    x, y, a, b = (sg(v).astype(F32) for v in (x, y, a, b))
    sched = jax.tree.map(sg, sched)
    npad, mpad = padded_size(n, mesh, axis), padded_size(m, mesh, axis)
    xp, yp = pad(x, npad, x[-1]), pad(y, mpad, y[-1])  # padding: copies of a point, zero weight
    ap, bp = pad(a, npad, 0.0), pad(b, mpad, 0.0)
    solve = jax.shard_map(functools.partial(_solve_local, static=static), mesh=mesh,
                          in_specs=(P(axis),) * 4 + (P(),), out_specs=P(), check_vma=False)
    old, new, X, Y, la, lb = solve(xp, yp, ap, bp, sched)
    eps = schedule.last_eps(sched)
    if static.relaxed is not None:  # GeomLoss's relaxed terms (or the damped potentials)
        F, G = relaxed_values(static.relaxed, new, eps)
    else:
        F, G = (new[0] - new[2], new[1] - new[3]) if static.debias else (new[0], new[1])
    return (F[:n], G[:m]), (X, Y, la, lb, old, new, eps)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def sharded_potentials(static: LossStatic, x, y, a, b, sched):
    """(F (n,), G (m,)) of the sharded GeomLoss solve (float32 global arrays; with ``reach`` the
    relaxed terms or damped potentials, module docstring); derivative in x, y
    by GeomLoss's rule, none in a, b, sched (detached, as GeomLoss's last extrapolation)."""
    return _forward(static, x, y, a, b, sched)[0]


def _potentials_fwd(static: LossStatic, x, y, a, b, sched):
    out, saved = _forward(static, x, y, a, b, sched)
    return out, (x, y, saved)


def _potentials_bwd(static: LossStatic, res, cts):
    x, y, saved = res
    gx, gy = sharded_grads(static, x, y, cts[0], cts[1], saved)
    return gx, gy, None, None, None


sharded_potentials.defvjp(_potentials_fwd, _potentials_bwd)


def _relaxed_rows(cfg: RelaxedConfig, Sl: Cloud, T: Cloud, S: Cloud, f, g_w, h, h_w, lw, prm, eps, rho):
    """dF_i/dx_i with ``reach`` for the rows Sl of the cloud S (the single-device rule,
    ``geomloss_unbalanced._side``): the cross term of f (local rows) against the full T and, with
    debias, minus the self term of h (local rows) against the full S, each one ``_side`` without
    debias (so that the self plan's columns run over the whole cloud, not over Sl)."""
    one = dataclasses.replace(cfg, debias=False)
    row = relaxed_side(one, Sl, T, f, g_w, None, None, lw, prm, eps, rho)
    if not cfg.debias:
        return row
    return row - relaxed_side(one, Sl, S, h, h_w, None, None, lw, prm, eps, rho)


def _grads_local(uF, uG, saved, *, static: LossStatic):
    """(uF dF/dx, uG dG/dy) for this device's rows (``side_direction``, with ``reach``
    :func:`_relaxed_rows`, on the local rows of the last plans against the full clouds and
    potentials); no collective."""
    X, Y, la, lb, old, new, eps = saved
    f_ba, g_ab, f_aa, g_bb = new
    of_ba, og_ab, of_aa, og_bb = old
    nl, ml, axis = uF.shape[0], uG.shape[0], static.axis
    k = jax.lax.axis_index(axis)
    cut = lambda v, c: jax.lax.dynamic_slice_in_dim(v, k * c, c)  # noqa: E731
    Xl, Yl = own_rows(X, nl, axis), own_rows(Y, ml, axis)
    prm = make_params(eps, GEOMLOSS_SCALE)
    rel = static.relaxed
    if rel is not None:
        dx = _relaxed_rows(rel, Xl, Y, X, cut(f_ba, nl), og_ab + eps * lb, cut(f_aa, nl), of_aa + eps * la, la, prm,
                           eps, rel.rho_x)
        dy = _relaxed_rows(rel, Yl, X, Y, cut(g_ab, ml), of_ba + eps * la, cut(g_bb, ml), og_bb + eps * lb, lb, prm,
                           eps, rel.rho_y)
        return uF[:, None] * dx, uG[:, None] * dy
    cfg, debias = GeomLossConfig(static.debias, static.precision, static.backend), static.debias
    dx = side_direction(Xl, Y, cut(f_ba, nl), og_ab + eps * lb, cut(f_aa, nl),
                        of_aa + eps * la if debias else None, prm, cfg, own=X)
    dy = side_direction(Yl, X, cut(g_ab, ml), of_ba + eps * la, cut(g_bb, ml),
                        og_bb + eps * lb if debias else None, prm, cfg, own=Y)
    return uF[:, None] * dx, uG[:, None] * dy


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def sharded_grads(static: LossStatic, x, y, uF, uG, saved):
    """(uF dF/dx, uG dG/dy) at the saved sharded solve (``x``, ``y`` only carry tangents, so that
    a second derivative reaches the JVP rule below, which raises)."""
    mesh, axis, n, m = static.mesh, static.axis, static.n, static.m
    uF = pad(jnp.asarray(uF, F32), padded_size(n, mesh, axis), 0.0)
    uG = pad(jnp.asarray(uG, F32), padded_size(m, mesh, axis), 0.0)
    rows = jax.shard_map(functools.partial(_grads_local, static=static), mesh=mesh,
                         in_specs=(P(axis), P(axis), P()), out_specs=(P(axis), P(axis)), check_vma=False)
    gx, gy = rows(uF, uG, jax.tree.map(jax.lax.stop_gradient, saved))
    return gx[:n], gy[:m]


@sharded_grads.defjvp
def _sharded_grads_jvp(static: LossStatic, primals, tangents):
    raise NotImplementedError(f"second derivatives of {_NAME} are not implemented (its gradient in x and y, "
                              "GeomLoss's rule, is); use ot_triton_jax.samples_loss on one device for HVPs")


@functools.partial(jax.jit, static_argnames=("static", "potentials", "blur", "scaling", "out_dtype"))
def _loss_jit(x, y, a, b, sched, static: LossStatic, potentials: bool, blur: float, scaling: float, out_dtype):
    if sched is None:
        sched = schedule.device_schedule(x, y, blur, scaling)
    ok = inputs_ok(x, y, a, b, nonneg=(a, b), balanced=() if static.relaxed is not None else ((a, b),))
    F, G = sharded_potentials(static, *(v.astype(F32) for v in (x, y, a, b)), sched)
    nan = jnp.asarray(jnp.nan, out_dtype)
    F, G = jnp.where(ok, F.astype(out_dtype), nan), jnp.where(ok, G.astype(out_dtype), nan)
    if potentials:
        return placed(F, static.mesh, static.axis), placed(G, static.mesh, static.axis)
    return jnp.sum(a.astype(out_dtype) * F) + jnp.sum(b.astype(out_dtype) * G)


def _mesh_and_axis(mesh, axis) -> str:
    if not isinstance(mesh, Mesh):
        raise ValueError(f"mesh must be a 1-D jax.sharding.Mesh; got {type(mesh).__name__}")
    if len(mesh.axis_names) != 1:
        raise ValueError(f"mesh must be a 1-D jax.sharding.Mesh (the points are split along its one axis); "
                         f"got a mesh with axes {mesh.axis_names}")
    return mesh_axis(mesh, axis)


def samples_loss(
    x: jax.Array,
    y: jax.Array,
    a: jax.Array | None = None,
    b: jax.Array | None = None,
    *,
    mesh: Mesh,
    axis: str | None = None,
    loss: str = "sinkhorn",
    p: int = 2,
    blur: float = 0.05,
    reach: Any = None,
    diameter: float | None = None,
    scaling: float = 0.5,
    debias: bool = True,
    potentials: bool = False,
    backend: str | None = None,
    precision: str = "float32",
    reach_x: Any = None,
    reach_y: Any = None,
):
    """:func:`ot_triton_jax.samples_loss` with x (n, d), y (m, d), a (n,) / (n, 1), b (m,) / (m, 1)
    split by points over the devices of the 1-D ``mesh`` (``axis``: its one axis, default), as one
    ``shard_map`` under ``jax.jit`` (module docstring: the math, the communication, the
    derivatives). Options and defaults are the single-device call's (loss="sinkhorn", p=2); strict
    marginals (equal masses), or both relaxed alike by ``reach`` (rho = reach^2; reach_x = reach_y
    is the same), unequal masses then allowed. reach_x != reach_y, batched points and
    backend="multiscale" raise NotImplementedError (as ``torch_api.distributed.SamplesLoss``).

    Returns the 0-d loss (equal on every device), differentiable in x, y, a, b; with
    ``potentials=True`` (F (n,), G (m,)) sharded along ``axis``, differentiable in x, y.
    """
    axis = _mesh_and_axis(mesh, axis)
    if backend == "multiscale":
        raise NotImplementedError(f"{_NAME} runs the dense streaming solve: backend='multiscale' is not "
                                  "implemented sharded; use ot_triton_jax.samples_loss on one device")
    blur, diameter, scaling, backend, (rho_x, rho_y) = _check_options(
        loss, p, blur, reach, diameter, scaling, None, None, None, backend, precision, reach_x, reach_y)
    if rho_x != rho_y:
        raise NotImplementedError(f"{_NAME} relaxes both marginals alike (reach=...): reach_x={reach_x!r}, "
                                  f"reach_y={reach_y!r} (one relaxed marginal, or two different reaches) are not "
                                  "implemented sharded; use ot_triton_jax.samples_loss on one device")
    for name, v in (("x", x), ("y", y)):
        if getattr(v, "ndim", 2) == 3:
            raise NotImplementedError(f"{_NAME} takes unbatched points (n, d): got {name} of shape {v.shape}")
    x, y = check_points("x", x), check_points("y", y)
    check_pair(x, y)
    a = check_weights("a", a, x, "x", trailing_one=True)
    b = check_weights("b", b, y, "y", trailing_one=True)
    check_same_weight_dtype(a, b)
    relaxed = None if rho_x is None else RelaxedConfig(bool(debias), precision, backend, rho_x, rho_y,
                                                      terms=not potentials)
    if relaxed is None:  # unequal masses are allowed once the marginals are relaxed
        check_balanced(a, b)
    sched = None
    xc, yc = concrete_value(x), concrete_value(y)
    if diameter is not None or (xc is not None and yc is not None):
        sched = jnp.asarray(schedule.host_schedule(xc, yc, blur, diameter, scaling))
    out_dtype = jnp.promote_types(jnp.promote_types(x.dtype, a.dtype), F32)
    static = LossStatic(mesh, axis, bool(debias), precision, backend, x.shape[0], y.shape[0], relaxed)
    return _loss_jit(x, y, a, b, sched, static=static, potentials=bool(potentials), blur=blur, scaling=scaling,
                     out_dtype=out_dtype)
