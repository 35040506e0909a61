"""The ``torch.library`` custom ops behind :func:`torch_api.sinkhorn` and
:func:`torch_api.sinkhorn_divergence`.

Each op is opaque to ``torch.compile``: Dynamo and AOTAutograd see only its fake
implementation (shapes, dtypes, devices), so the solver's data-dependent loop, the
value checks and the Triton launches never cause a graph break. Run-time numbers
(epsilon, scale_cost, threshold) are 0-d tensors, so a new value never recompiles; sizes,
iteration counts and ``precision`` are op attributes.

Ops (namespace ``ot_triton``):

* ``sinkhorn_solve``: OTT's alternating loop with early stopping -> (f, g, errors,
  n_iters, converged); checks the values of x, y, a, b, epsilon, scale_cost, threshold
  first; f, g carry the implicit VJP (torch_api.implicit_ops);
* ``sinkhorn_symmetric_solve``: OTT's symmetric solve of an (x, x, a, a) problem
  (momentum 0.5), as ``sinkhorn_divergence`` runs its self terms -> (h, errors,
  n_iters, converged);
* ``sinkhorn_plan_mass``: sum P (float64) for the mass term of reg_ot_cost;
* ``sinkhorn_reg_ot_cost``: OTT's dual objective at (f, g), differentiable in x, y,
  a, b, epsilon, scale_cost (``register_autograd``: envelope theorem, f, g and the
  mass held fixed); its backward calls ``sinkhorn_cost_grads``;
* ``sinkhorn_cost_grads``: the envelope gradients (two streaming passes); its backward
  is the Hessian (double backward, torch_api.implicit_ops);
* ``sinkhorn_apply``: P v or P 1, matrix-free (backward: torch_api.implicit_ops).

With a label cost (``lx``, ``ly``, ``w``: trailing optional tensor arguments of the solves, the
mass, cost, gradient and apply ops; :mod:`torch_api.label_inputs`) every kernel runs on labelled
clouds; the backward of the solves (the potentials' VJP), of ``sinkhorn_apply`` and of
``sinkhorn_cost_grads`` (second order) then raise NotImplementedError.

The public functions call the two solves through :func:`solve` and :func:`symmetric_solve`,
which skip the dispatcher where it has nothing to do (:mod:`torch_api.direct_call`).

Kernel inputs always come from :func:`torch_api.kernel_ops.clouds` (centred) and the PARAMS
array [eps, 1/scale_cost] (float32 on the points' device), built by every op from
its tensor arguments, so no op reads a device scalar on the host except the solves.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from ot_triton_jax.core import unbalanced
from ot_triton_jax.core.options import LoopOptions

from . import checks as check
from . import direct_call
from .host_copy import to_device
from .implicit_ops import (apply_backward, apply_setup, cost_grads_backward, cost_grads_setup, potentials_backward,
                           potentials_setup)
from .kernel_ops import apply_plan, exact_row_mass, kernel_params
from .label_inputs import by_label, check_labelled_derivative, pair_clouds
from .sinkhorn_loops import alternating_loop, masked_log, symmetric_loop
from .unbalanced_ops import relaxed_params

F32 = torch.float32


def _check_values(pts: tuple, wts: tuple, epsilon: Tensor, scale: Tensor, threshold: Tensor,
                  balanced: bool) -> tuple[float, "check.DeferredValues"]:
    """The value rules of core.checks (they raise eagerly: this runs inside the solve ops),
    returned deferred: the loop applies them right after launching its first block of
    iterations (``DeferredValues.finish``), so checking costs the GPU no idle time before the
    first half-step. Returns (threshold as a float, deferred rules)."""
    if all(check.is_uniform_default(w) for _, w in wts):
        wts, balanced = (), False  # the library's own 1/n weights (checks.uniform_weights)
    thr = threshold.detach().item()
    deferred = check.DeferredValues(dict(pts), dict(wts), balanced_pair=(wts[0][0], wts[1][0]) if balanced else None,
                                    numbers={"epsilon": epsilon, "scale_cost": scale, "threshold": thr})
    return thr, deferred


def _fake_loop_outputs(like: Tensor, inner: int, max_it: int):
    n_blocks = -(-max_it // inner)
    return (like.new_empty((n_blocks,), dtype=F32), like.new_empty((), dtype=torch.int32),
            like.new_empty((), dtype=torch.bool))


# ----------------------------------------------------------------------------- solves


def _sinkhorn_solve(x: Tensor, y: Tensor, a: Tensor, b: Tensor, epsilon: Tensor, scale: Tensor,
                   threshold: Tensor, inner_iterations: int, min_iterations: int, max_iterations: int,
                   precision: str, f0: Optional[Tensor], g0: Optional[Tensor], implicit: str,
                   tau_a: float = 1.0, tau_b: float = 1.0, lx: Optional[Tensor] = None, ly: Optional[Tensor] = None, w: Optional[Tensor] = None
                   ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    thr, checks = _check_values((("x", x), ("y", y)), (("a", a), ("b", b)), epsilon, scale, threshold,
                                balanced=unbalanced.is_balanced(tau_a, tau_b))
    opts = LoopOptions(precision, inner_iterations, min_iterations, max_iterations)
    prm = relaxed_params(kernel_params(epsilon, scale, x.device), tau_a, tau_b)
    init = [None if v is None else v.to(device=x.device, dtype=F32) for v in (f0, g0)]
    relax = (unbalanced.relax_at("a", tau_a), unbalanced.relax_at("b", tau_b))
    if w is None:
        return alternating_loop(x, y, a.to(F32), b.to(F32), prm, thr, opts, *init, checks=checks, relax=relax)
    (px, ix), (py, iy) = by_label(lx), by_label(ly)  # the loop runs on clouds grouped by label
    f0, g0 = (None if v is None else v[p] for v, p in zip(init, (px, py)))
    f, g, *record = alternating_loop(x[px], y[py], a[px].to(F32), b[py].to(F32), prm, thr, opts, f0, g0,
                                     checks=checks, relax=relax, labels=(lx[px], ly[py], w))
    return (f[ix], g[iy], *record)


sinkhorn_solve = torch.library.custom_op("ot_triton::sinkhorn_solve", mutates_args=())(_sinkhorn_solve)


@sinkhorn_solve.register_fake
def _(x, y, a, b, epsilon, scale, threshold, inner_iterations, min_iterations, max_iterations, precision, f0, g0,
      implicit, tau_a=1.0, tau_b=1.0, lx=None, ly=None, w=None):
    return (x.new_empty((x.shape[0],), dtype=F32), x.new_empty((y.shape[0],), dtype=F32),
            *_fake_loop_outputs(x, inner_iterations, max_iterations))


def _sinkhorn_symmetric_solve(x: Tensor, a: Tensor, epsilon: Tensor, scale: Tensor, threshold: Tensor,
                             inner_iterations: int, min_iterations: int, max_iterations: int,
                             precision: str, tau: float = 1.0, lx: Optional[Tensor] = None,
                             w: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    thr, checks = _check_values((("x", x),), (("a", a),), epsilon, scale, threshold, balanced=False)
    opts = LoopOptions(precision, inner_iterations, min_iterations, max_iterations)
    prm = relaxed_params(kernel_params(epsilon, scale, x.device), tau, tau)
    return symmetric_loop(x, a.to(F32), prm, thr, opts, checks=checks, relax=(unbalanced.relax_at("a", tau),),
                          labels=None if w is None else (lx, w))


sinkhorn_symmetric_solve = torch.library.custom_op("ot_triton::sinkhorn_symmetric_solve",
                                                   mutates_args=())(_sinkhorn_symmetric_solve)


def solve(*args):
    """:func:`sinkhorn_solve`, called directly where the dispatcher has nothing to do
    (:mod:`torch_api.direct_call`)."""
    return direct_call.call(sinkhorn_solve, _sinkhorn_solve, *args)


def symmetric_solve(*args):
    """:func:`sinkhorn_symmetric_solve`, likewise."""
    return direct_call.call(sinkhorn_symmetric_solve, _sinkhorn_symmetric_solve, *args)


@sinkhorn_symmetric_solve.register_fake
def _(x, a, epsilon, scale, threshold, inner_iterations, min_iterations, max_iterations, precision, tau=1.0,
      lx=None, w=None):
    return (x.new_empty((x.shape[0],), dtype=F32),) + _fake_loop_outputs(x, inner_iterations, max_iterations)


def _sinkhorn_self_pair_solve(x: Tensor, a: Tensor, epsilon: Tensor, scale: Tensor, threshold: Tensor,
                              inner_iterations: int, min_iterations: int, max_iterations: int, precision: str,
                              tau_a: float, tau_b: float, lx: Optional[Tensor] = None, w: Optional[Tensor] = None
                              ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """OTT's parallel solve (momentum 0.5) of (x, x, a, a) with tau_a != tau_b: (f, g, errors,
    n_iters, converged)."""
    thr, checks = _check_values((("x", x),), (("a", a),), epsilon, scale, threshold, balanced=False)
    opts = LoopOptions(precision, inner_iterations, min_iterations, max_iterations)
    prm = relaxed_params(kernel_params(epsilon, scale, x.device), tau_a, tau_b)
    relax = (unbalanced.relax_at("a", tau_a), unbalanced.relax_at("b", tau_b))
    return symmetric_loop(x, a.to(F32), prm, thr, opts, checks=checks, relax=relax,
                          labels=None if w is None else (lx, w))


sinkhorn_self_pair_solve = torch.library.custom_op("ot_triton::sinkhorn_self_pair_solve",
                                                   mutates_args=())(_sinkhorn_self_pair_solve)


@sinkhorn_self_pair_solve.register_fake
def _(x, a, epsilon, scale, threshold, inner_iterations, min_iterations, max_iterations, precision, tau_a, tau_b,
      lx=None, w=None):
    return ((x.new_empty((x.shape[0],), dtype=F32), x.new_empty((x.shape[0],), dtype=F32))
            + _fake_loop_outputs(x, inner_iterations, max_iterations))


def self_pair_solve(*args):
    """:func:`sinkhorn_self_pair_solve`, likewise."""
    return direct_call.call(sinkhorn_self_pair_solve, _sinkhorn_self_pair_solve, *args)


# ----------------------------------------------------------------------------- reg_ot_cost


@torch.library.custom_op("ot_triton::sinkhorn_plan_mass", mutates_args=())
def sinkhorn_plan_mass(x: Tensor, y: Tensor, f: Tensor, g: Tensor, epsilon: Tensor, scale: Tensor,
                       precision: str, lx: Optional[Tensor] = None, ly: Optional[Tensor] = None, w: Optional[Tensor] = None) -> Tensor:
    """sum P (0-d float64): "float32": the row-sum pass with the unbiased "fixed4" cross
    term (kernel_ops.exact_row_mass); "tf32": the plan's own row sums."""
    X, Y = pair_clouds(x, y, lx, ly, w)
    prm = kernel_params(epsilon, scale, x.device)
    if precision == "float32":
        return exact_row_mass(X, Y, f, g, prm).double().sum()
    return apply_plan(X, Y, f, g, prm, precision)[1].double().sum()


@sinkhorn_plan_mass.register_fake
def _(x, y, f, g, epsilon, scale, precision, lx=None, ly=None, w=None):
    return x.new_empty((), dtype=torch.float64)


@torch.library.custom_op("ot_triton::sinkhorn_reg_ot_cost", mutates_args=())
def sinkhorn_reg_ot_cost(x: Tensor, y: Tensor, a: Tensor, b: Tensor, epsilon: Tensor, scale: Tensor,
                         f: Tensor, g: Tensor, mass: Tensor, precision: str, implicit: str,
                         tau_a: float = 1.0, tau_b: float = 1.0, lx: Optional[Tensor] = None, ly: Optional[Tensor] = None, w: Optional[Tensor] = None) -> Tensor:
    """R = sum_{a>0} a (f - eps log a) + sum_{b>0} b (g - eps log b) + eps (sum a sum b - mass),
    accumulated in float64, returned as 0-d float32 on the points' device; with a tau < 1,
    that side's term is OTT's relaxed one (``core.unbalanced.ott_marginal_term``)."""
    a32, b32 = a.to(F32), b.to(F32)
    eps32 = to_device(epsilon.detach().reshape(()).to(F32), x.device)
    if not unbalanced.is_balanced(tau_a, tau_b):
        e64, a64, b64 = eps32.double(), a32.double(), b32.double()
        div = (unbalanced.ott_marginal_term(torch, f.double(), a64, e64, tau_a)
               + unbalanced.ott_marginal_term(torch, g.double(), b64, e64, tau_b))
        return (div + e64 * (a64.sum() * b64.sum() - to_device(mass, x.device))).to(F32)
    fa = torch.where(a32 > 0, a32 * (f - eps32 * masked_log(a32)), 0.0).double().sum()
    gb = torch.where(b32 > 0, b32 * (g - eps32 * masked_log(b32)), 0.0).double().sum()
    mass_term = a32.double().sum() * b32.double().sum() - to_device(mass, x.device)
    return (fa + gb + eps32.double() * mass_term).to(F32)


@sinkhorn_reg_ot_cost.register_fake
def _(x, y, a, b, epsilon, scale, f, g, mass, precision, implicit, tau_a=1.0, tau_b=1.0, lx=None, ly=None, w=None):
    return x.new_empty((), dtype=F32)


@torch.library.custom_op("ot_triton::sinkhorn_cost_grads", mutates_args=())
def sinkhorn_cost_grads(x: Tensor, y: Tensor, a: Tensor, b: Tensor, epsilon: Tensor, scale: Tensor,
                        f: Tensor, g: Tensor, precision: str, need_x: bool, need_y: bool,
                        need_eps_scale: bool, implicit: str, tau_a: float = 1.0, tau_b: float = 1.0,
                        lx: Optional[Tensor] = None, ly: Optional[Tensor] = None, w: Optional[Tensor] = None) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Envelope gradients of reg_ot_cost at fixed (f, g), all float32 on the points' device,
    by the formulas stated once in ``ot_triton_jax.jax_frontend.kernel_ops.cost_grads``
    (C = s|x - y|^2; two streaming passes P y, P^T x with the row and column sums r, c).

    Returned: (dx, dy, da, db, deps, ds); the streaming passes run only for what is
    needed (entries not asked for are zeros). ds is the derivative in s = 1/scale_cost.
    Differentiable in x, y, a, b (torch_api.implicit_ops: the Hessian, by streaming CG with
    the options ``implicit``); f, g are taken as the solution for the other inputs. With a
    tau < 1 the a, b, eps entries are the partials of the relaxed reg_ot_cost at fixed (f, g)
    (``core.unbalanced.ott_marginal_partials`` plus the mass term's), and differentiating
    them again raises NotImplementedError (the x, y entries' derivatives are the relaxed HVP). With a label cost (``lx``, ``ly``, ``w``: cost
    s (|x_i - y_j|^2 + W[lx_i, ly_j])) the x, y entries are the same formula with the labelled
    plan, and the eps / s entries add sum_ij P_ij W[lx_i, ly_j] (from the P y pass, widened by
    the one-hot columns of ly); differentiating them again raises NotImplementedError."""
    X, Y = pair_clouds(x, y, lx, ly, w)
    prm = kernel_params(epsilon, scale, x.device)
    eps, s = prm[0].double(), prm[1].double()
    a32, b32 = a.to(F32), b.to(F32)
    gx, gy = torch.zeros_like(X.x), torch.zeros_like(Y.x)
    geps, gs = (torch.zeros((), dtype=F32, device=x.device) for _ in range(2))
    py = r = c = None
    pw = 0.0  # sum P W (float64) with a label cost
    if need_x or need_eps_scale:
        if w is not None and need_eps_scale:
            k_y = w.shape[1]
            onehot = torch.nn.functional.one_hot(ly.to(x.device).long(), k_y).to(F32)
            pyw, r = apply_plan(X, Y, f, g, prm, precision, torch.cat([Y.x, onehot], dim=1))
            py, pk = pyw[:, :Y.x.shape[1]], pyw[:, Y.x.shape[1]:]  # pk[i, l] = sum_{j: ly_j = l} P_ij
            pw = (pk.double() * w.to(x.device).double()[lx.to(x.device).long()]).sum()
        else:
            py, r = apply_plan(X, Y, f, g, prm, precision, Y.x)
        if need_x:
            gx = (r[:, None] * X.x - py).mul_(2.0 * prm[1])
    if need_y:
        px, c = apply_plan(Y, X, g, f, prm, precision, X.x)
        gy = (c[:, None] * Y.x - px).mul_(2.0 * prm[1])
    elif need_eps_scale:
        _, c = apply_plan(Y, X, g, f, prm, precision)
    la, lb = masked_log(a32.double()), masked_log(b32.double())
    sa, sb = a32.double().sum(), b32.double().sum()
    relaxed = not unbalanced.is_balanced(tau_a, tau_b)
    if relaxed:
        pa, ea = unbalanced.ott_marginal_partials(torch, f.double(), a32.double(), eps, tau_a)
        pb, eb = unbalanced.ott_marginal_partials(torch, g.double(), b32.double(), eps, tau_b)
        ga, gb = (pa + eps * sb).to(F32), (pb + eps * sa).to(F32)
    else:
        ga = torch.where(a32 > 0, f.double() - eps * la - eps + eps * sb, eps * sb).to(F32)
        gb = torch.where(b32 > 0, g.double() - eps * lb - eps + eps * sa, eps * sa).to(F32)
    if need_eps_scale:
        r64, c64 = r.double(), c.double()
        pc = s * ((r64 * X.sqnorm.double()).sum() + (c64 * Y.sqnorm.double()).sum()
                  - 2.0 * (X.x.double() * py.double()).sum() + pw)
        rf = torch.where(r64 > 0, r64 * f.double(), 0.0).sum()
        cg = torch.where(c64 > 0, c64 * g.double(), 0.0).sum()
        ent = torch.where(a32 > 0, a32.double() * la, 0.0).sum() + torch.where(b32 > 0, b32.double() * lb, 0.0).sum()
        div_eps = (ea + eb) if relaxed else -ent
        geps = (div_eps + sa * sb - r64.sum() + (rf + cg - pc) / eps).to(F32)
        gs = (pc / s).to(F32)
    return gx, gy, ga, gb, geps, gs


@sinkhorn_cost_grads.register_fake
def _(x, y, a, b, epsilon, scale, f, g, precision, need_x, need_y, need_eps_scale, implicit, tau_a=1.0, tau_b=1.0,
      lx=None, ly=None, w=None):
    return (x.new_empty(x.shape, dtype=F32), x.new_empty(y.shape, dtype=F32), x.new_empty(a.shape, dtype=F32),
            x.new_empty(b.shape, dtype=F32), x.new_empty((), dtype=F32), x.new_empty((), dtype=F32))


def _cost_setup(ctx, inputs, output):
    x, y, a, b, epsilon, scale, f, g, mass, precision, implicit, tau_a, tau_b, lx, ly, w = (
        tuple(inputs) + (1.0, 1.0, None, None, None)[len(inputs) - 11:])
    ctx.save_for_backward(x, y, a, b, epsilon, scale, f, g)
    ctx.precision, ctx.implicit, ctx.taus, ctx.labels = precision, implicit, (tau_a, tau_b), (lx, ly, w)


def _cast(grad: Tensor, like: Tensor) -> Tensor:
    return grad.to(device=like.device, dtype=like.dtype).reshape(like.shape)


def _cost_backward(ctx, gout):
    x, y, a, b, epsilon, scale, f, g = ctx.saved_tensors
    nx, ny, na, nb, ne, ns = ctx.needs_input_grad[:6]
    if not (nx or ny or na or nb or ne or ns):
        return (None,) * 16
    gx, gy, ga, gb, geps, gs = sinkhorn_cost_grads(x, y, a, b, epsilon, scale, f, g, ctx.precision,
                                                   nx, ny, ne or ns, ctx.implicit, *ctx.taus, *ctx.labels)
    out = [_cast(gx * gout, x) if nx else None, _cast(gy * gout, y) if ny else None,
           _cast(ga * gout, a) if na else None, _cast(gb * gout, b) if nb else None,
           _cast(geps * gout, epsilon) if ne else None, None]
    if ns:  # s = 1 / scale_cost: dR/dscale = -dR/ds / scale^2
        sc = scale.detach()
        out[5] = -_cast(gs * gout, scale) / (sc * sc)
    return tuple(out) + (None,) * 10


sinkhorn_reg_ot_cost.register_autograd(_cost_backward, setup_context=_cost_setup)


# ----------------------------------------------------------------------------- transport


@torch.library.custom_op("ot_triton::sinkhorn_apply", mutates_args=())
def sinkhorn_apply(src: Tensor, tgt: Tensor, f_src: Tensor, g_tgt: Tensor, epsilon: Tensor, scale: Tensor,
                   v: Optional[Tensor], precision: str, lx: Optional[Tensor] = None, ly: Optional[Tensor] = None, w: Optional[Tensor] = None) -> Tensor:
    """P v (n, p) for v (m, p), or P 1 (n,) when v is None; rows of P are the ``src``
    points, P_ij = exp((f_i + g_j - C_ij)/eps). Float32; differentiable in src, tgt, f_src,
    g_tgt and v (torch_api.implicit_ops; with a label cost ``lx`` (src), ``ly`` (tgt), ``w``
    (K_src, K_tgt) it raises NotImplementedError)."""
    S, T = pair_clouds(src, tgt, lx, ly, w)
    prm = kernel_params(epsilon, scale, src.device)
    out, rows = apply_plan(S, T, f_src, g_tgt, prm, precision, v)
    return rows if v is None else out


@sinkhorn_apply.register_fake
def _(src, tgt, f_src, g_tgt, epsilon, scale, v, precision, lx=None, ly=None, w=None):
    shape = (src.shape[0],) if v is None else (src.shape[0], v.shape[1])
    return src.new_empty(shape, dtype=F32)


def _apply_setup(ctx, inputs, output):
    apply_setup(ctx, tuple(inputs)[:8], output)
    ctx.n_labels = len(inputs) - 8


# the backward of the ops above: implicit differentiation (torch_api.implicit_ops; relaxed marginals included)
_pot_backward, _pot_setup = check_labelled_derivative(
    potentials_backward, potentials_setup, 16, "the derivative of the potentials f, g (and of apply / marginal / "
    "transport_mass through them)")
sinkhorn_solve.register_autograd(_pot_backward, setup_context=_pot_setup)
_cg_backward, _cg_setup = check_labelled_derivative(
    cost_grads_backward, cost_grads_setup, 15, "a second derivative of reg_ot_cost (create_graph=True, then a "
    "second backward)")
sinkhorn_cost_grads.register_autograd(_cg_backward, setup_context=_cg_setup)
_ap_backward, _ap_setup = check_labelled_derivative(
    lambda ctx, u: tuple(apply_backward(ctx, u)) + (None,) * ctx.n_labels, _apply_setup, 8,
    "the derivative of apply / marginal / transport_mass")
sinkhorn_apply.register_autograd(_ap_backward, setup_context=_ap_setup)

