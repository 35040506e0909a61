"""Second order and implicit differentiation in torch: the custom ops and their autograd.

The math is :mod:`ot_triton_jax.core.implicit_derivatives` (written once, also run by the
JAX frontend); :class:`Passes` gives it torch's passes and a Python loop. Ops
(namespace ``ot_triton``; opaque to ``torch.compile``):

* ``sinkhorn_hessian_apply``: the Hessian of reg_ot_cost in (x, y, a, b) applied to a
  direction; it is the backward of ``sinkhorn_cost_grads`` (registered by ``sinkhorn_ops``), so the
  double backward of ``reg_ot_cost`` (``create_graph=True``) is an HVP by streaming CG;
* ``sinkhorn_potentials_vjp``: the implicit VJP of the potentials, the backward of
  ``sinkhorn_solve`` (``out.f`` / ``out.g`` carry autograd in x, y, a, b);
* ``sinkhorn_apply_vjp``: the VJP of P v, the backward of ``sinkhorn_apply``
  (``out.apply``, ``out.marginal``).

The setup and backward functions of the three ``sinkhorn_ops`` ops that these serve
(``*_setup``, ``*_backward``) are defined here; ``sinkhorn_ops`` registers them.

CG options travel as one string attribute (``core.implicit_solve.options_key``). Each op
returns an ``info`` tensor [iterations, relative residual, converged] (float32) and warns
(``RuntimeWarning``) when CG stops unconverged. The CG loop reads its stopping test on
the host once every 8 iterations (each iteration is two streaming passes). Derivatives
through epsilon or scale_cost raise ``NotImplementedError``.

KL-relaxed marginals (OTT's tau_a, tau_b < 1): the ops take (tau_a, tau_b) last and solve the
relaxed system (``core.implicit_solve``): HVPs in x, y and the potentials' VJP (in x, y, a, b)
work; second derivatives involving a or b raise (``core.implicit_derivatives.relaxed_weight_message``).
"""

from __future__ import annotations

import warnings
from typing import Optional

import torch
from torch import Tensor

from ot_triton_jax.core import implicit_derivatives as imp, unbalanced
from ot_triton_jax.core.implicit_solve import check_no_eps_tangent, options_from_key, unconverged_message

from . import cuda_graphs
from .kernel_ops import Cloud, apply_plan, apply_weighted, clouds, kernel_params

F32 = torch.float32
CHECK_EVERY = 8


class Passes:
    """The streaming passes of one plan on torch tensors (core.implicit_solve.PlanPasses)."""

    xp = torch

    def __init__(self, X: Cloud, Y: Cloud, f: Tensor, g: Tensor, prm: Tensor, precision: str):
        self.X, self.Y, self.f, self.g, self.prm, self.precision = X, Y, f.detach(), g.detach(), prm, precision
        self.x, self.y, self.n, self.m = X.x, Y.x, X.n, Y.n
        self.eps, self.s = prm[0], prm[1]

    @classmethod
    def of(cls, x, y, f, g, epsilon, scale, precision) -> "Passes":
        return cls(*clouds(x, y), f.to(F32), g.to(F32), kernel_params(epsilon, scale, x.device), precision)

    def apply(self, v):
        return apply_plan(self.X, self.Y, self.f, self.g, self.prm, self.precision, v)

    def apply_t(self, u):
        return apply_plan(self.Y, self.X, self.g, self.f, self.prm, self.precision, u)

    def apply_t_sq(self, u):
        half = torch.stack([0.5 * self.prm[0], self.prm[1]])  # P_ij^2 is the plan at eps / 2
        return apply_plan(self.Y, self.X, self.g, self.f, half, self.precision, u[:, None])[0][:, 0]

    def weighted(self, w, A, B):
        return apply_weighted(self.X, self.Y, self.f, self.g, self.prm, self.precision, w, A, B)

    def weighted_t(self, w, A, B):
        return apply_weighted(self.Y, self.X, self.g, self.f, self.prm, self.precision, w, A, B)

    def transposed(self) -> "Passes":
        return Passes(self.Y, self.X, self.g, self.f, self.prm, self.precision)

    @staticmethod
    def while_loop(cond, body, state):
        # the stopping test is read on the host every CHECK_EVERY iterations only (one sync per
        # block; the CG body is a no-op once converged or at the cap, so extra iterations are exact);
        # on the GPU the blocks after the first replay one CUDA graph (cuda_graphs.while_blocks)
        return cuda_graphs.while_blocks(cond, body, state, CHECK_EVERY)


def _info(info, what: str, warn: bool) -> Tensor:
    k, rel, ok = info
    out = torch.stack([k.to(F32), rel.to(F32), ok.to(F32)])
    if warn and not bool(ok):
        warnings.warn(unconverged_message(what, int(k), float(rel)), RuntimeWarning, stacklevel=3)
    return out


def _opt(t: Optional[Tensor]) -> Optional[Tensor]:
    return None if t is None else t.to(F32)


def _zeros_like(t: Tensor) -> Tensor:
    return torch.zeros(t.shape, dtype=F32, device=t.device)


def _tensor_positions(ctx, inputs) -> None:
    ctx.tensor_pos = [i for i, v in enumerate(inputs) if isinstance(v, Tensor)]


def required(ctx, i: int) -> bool:
    """Whether the running backward needs the gradient of input ``i``: it requires grad *and*
    the engine will run its node (``needs_input_grad`` alone is only the first), so a
    derivative that is not implemented raises only when it is actually asked for."""
    if not ctx.needs_input_grad[i]:
        return False
    try:
        node = ctx.next_functions[ctx.tensor_pos.index(i)][0]
        return node is not None and bool(torch._C._will_engine_execute_node(node))
    except (AttributeError, RuntimeError, ValueError, IndexError):
        return True


# ----------------------------------------------------------------------------- Hessian


@torch.library.custom_op("ot_triton::sinkhorn_hessian_apply", mutates_args=())
def sinkhorn_hessian_apply(x: Tensor, y: Tensor, a: Tensor, b: Tensor, epsilon: Tensor, scale: Tensor,
                           f: Tensor, g: Tensor, vx: Optional[Tensor], vy: Optional[Tensor],
                           da: Optional[Tensor], db: Optional[Tensor], precision: str, want_x: bool,
                           want_y: bool, want_a: bool, want_b: bool, implicit: str, tau_a: float = 1.0,
                           tau_b: float = 1.0, symmetric: bool = False) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(tx, ty, ta, tb, info): the Hessian of reg_ot_cost applied to (vx, vy, da, db) (None:
    zero); outputs not asked for are zeros. (tau_a, tau_b): OTT's relaxation (x, y only if < 1).
    ``symmetric``: a self problem (x = y, a = b, f = g) moved as one cloud (vx = vy), solved on
    the symmetric system (core.implicit_derivatives.hessian_apply)."""
    opts = options_from_key(implicit)
    ops = Passes.of(x, y, f, g, epsilon, scale, precision)
    want = (want_x, want_y, want_a, want_b)
    tangents = tuple(map(_opt, (vx, vy, da, db)))
    if symmetric:
        tangents = (tangents[0], tangents[0]) + tangents[2:]
    out, info = imp.hessian_apply(ops, ops.f, ops.g, a.to(F32), b.to(F32), tangents, want, opts, (tau_a, tau_b),
                                  symmetric)
    if symmetric:  # a custom op's outputs may not alias: tx = ty and ta = tb there
        out = (out[0], None if out[1] is None else out[1].clone(), out[2], None if out[3] is None else out[3].clone())
    likes = (x, y, a, b)
    res = tuple(_zeros_like(l) if t is None else t for t, l in zip(out, likes))
    return res + (_info(info, "HVP of reg_ot_cost", opts.warn),)


@sinkhorn_hessian_apply.register_fake
def _(x, y, a, b, epsilon, scale, f, g, vx, vy, da, db, precision, want_x, want_y, want_a, want_b, implicit,
      tau_a=1.0, tau_b=1.0, symmetric=False):
    return tuple(t.new_empty(t.shape, dtype=F32) for t in (x, y, a, b)) + (x.new_empty((3,), dtype=F32),)


def _hessian_setup(ctx, inputs, output):
    x, y, a, b, epsilon, scale, f, g = inputs[:8]
    ctx.save_for_backward(x, y, a, b, epsilon, scale, f, g)
    ctx.precision, ctx.want, ctx.implicit = inputs[12], inputs[13:17], inputs[17]
    ctx.taus, ctx.n_inputs = tuple((tuple(inputs[18:]) + (1.0, 1.0))[:2]), len(inputs)
    _tensor_positions(ctx, inputs)
    ctx.set_materialize_grads(False)


def _hessian_backward(ctx, ux, uy, ua, ub, _info):
    """The Hessian is symmetric: the VJP in the direction is the Hessian applied to the cotangent.
    Third derivatives (in x, y, a, b, eps, scale, f, g) raise."""
    if any(required(ctx, i) for i in range(8)):
        raise NotImplementedError("third derivatives of reg_ot_cost are not implemented (the HVP is linear in "
                                  "its direction only); differentiate the HVP in the direction v alone")
    cts = tuple(u if w else None for u, w in zip((ux, uy, ua, ub), ctx.want))
    need = tuple(ctx.needs_input_grad[8:12])
    if all(c is None for c in cts) or not any(need):
        return (None,) * ctx.n_inputs
    x, y, a, b, epsilon, scale, f, g = ctx.saved_tensors
    tx, ty, ta, tb, _ = sinkhorn_hessian_apply(x, y, a, b, epsilon, scale, f, g, *cts, ctx.precision, *need,
                                               ctx.implicit, *ctx.taus)
    return (None,) * 8 + tuple(t if n else None for t, n in zip((tx, ty, ta, tb), need)) + (None,) * (ctx.n_inputs - 12)


sinkhorn_hessian_apply.register_autograd(_hessian_backward, setup_context=_hessian_setup)


def cost_grads_setup(ctx, inputs, output):
    x, y, a, b, epsilon, scale, f, g, precision, need_x, need_y, need_eps_scale, implicit = inputs[:13]
    ctx.save_for_backward(x, y, a, b, epsilon, scale, f, g)
    ctx.precision, ctx.implicit = precision, implicit
    ctx.taus, ctx.n_inputs = tuple((tuple(inputs[13:]) + (1.0, 1.0))[:2]), len(inputs)
    ctx.computed = (need_x, need_y, need_eps_scale)
    ctx.self_problem = _same(x, y) and _same(a, b) and _same(f, g) and ctx.taus[0] == ctx.taus[1]
    _tensor_positions(ctx, inputs)
    ctx.set_materialize_grads(False)


def _same(u: Tensor, w: Tensor) -> bool:
    """Whether two tensors are views of the same memory with the same layout (under
    torch.compile, whose fake tensors have no memory: only the same object)."""
    if u is w:
        return True
    if torch.compiler.is_compiling():
        return False
    try:
        return (u.data_ptr() == w.data_ptr() and u.shape == w.shape and u.stride() == w.stride()
                and u.dtype == w.dtype)
    except RuntimeError:  # a tensor without storage
        return False


def _moved_as_one(ctx, ux, uy, ua, ub) -> bool:
    """Whether a second derivative of a self problem's cost (x = y, a = b, f = g: the symmetric
    solve's, with tau_a = tau_b) moves its one cloud: equal cotangents on both sides, none on the
    weights. Then the symmetric system serves (``core.implicit_solve.symmetric_solve``): one pass
    per CG iteration where the pair's Schur system crawls on a near-diagonal plan."""
    return (ctx.self_problem and ux is not None and uy is not None and ua is None and ub is None
            and (ux is uy or (not torch.compiler.is_compiling() and torch.equal(ux, uy))))


def cost_grads_backward(ctx, ux, uy, ua, ub, ueps, us):
    """VJP of the gradient map = the Hessian applied to the cotangents (it is symmetric). With a
    relaxed marginal only the x, y block (the a, b gradients are partials at fixed potentials)."""
    x, y, a, b, epsilon, scale, f, g = ctx.saved_tensors
    need_x, need_y, need_eps_scale = ctx.computed
    check_no_eps_tangent("a second derivative of reg_ot_cost through epsilon or scale_cost",
                         (need_eps_scale and (ueps is not None or us is not None))
                         or required(ctx, 4) or required(ctx, 5))
    ux = ux if need_x else None  # outputs not computed are constant zeros
    uy = uy if need_y else None
    if ux is None and uy is None and ua is None and ub is None:
        return (None,) * ctx.n_inputs
    nx, ny, na, nb = ctx.needs_input_grad[:4]
    if not unbalanced.is_balanced(*ctx.taus):
        if ua is not None or ub is not None or required(ctx, 2) or required(ctx, 3):
            raise NotImplementedError(imp.relaxed_weight_message("A second derivative of reg_ot_cost in a or b"))
        na = nb = False
    if _moved_as_one(ctx, ux, uy, ua, ub):
        tx, ty, ta, tb, _ = sinkhorn_hessian_apply(x, y, a, b, epsilon, scale, f, g, ux, None, None, None,
                                                   ctx.precision, nx, ny, na, nb, ctx.implicit, *ctx.taus, True)
    else:
        tx, ty, ta, tb, _ = sinkhorn_hessian_apply(x, y, a, b, epsilon, scale, f, g, ux, uy, ua, ub, ctx.precision,
                                                   nx, ny, na, nb, ctx.implicit, *ctx.taus)
    cast = lambda t, like, need: t.to(like.dtype) if need else None
    return (cast(tx, x, nx), cast(ty, y, ny), cast(ta, a, na), cast(tb, b, nb)) + (None,) * (ctx.n_inputs - 4)


# ----------------------------------------------------------------------------- potentials


@torch.library.custom_op("ot_triton::sinkhorn_potentials_vjp", mutates_args=())
def sinkhorn_potentials_vjp(x: Tensor, y: Tensor, a: Tensor, b: Tensor, epsilon: Tensor, scale: Tensor,
                            f: Tensor, g: Tensor, uf: Optional[Tensor], ug: Optional[Tensor], precision: str,
                            implicit: str, tau_a: float = 1.0, tau_b: float = 1.0
                            ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dx, dy, da, db, info): the implicit VJP of the potentials for cotangents (uf, ug)
    (OTT's relaxed fixed point when a tau < 1)."""
    opts = options_from_key(implicit)
    ops = Passes.of(x, y, f, g, epsilon, scale, precision)
    out, info = imp.potentials_vjp(ops, ops.f, ops.g, a.to(F32), b.to(F32), _opt(uf), _opt(ug), (True,) * 4, opts,
                                   (tau_a, tau_b))
    return tuple(out) + (_info(info, "VJP of the potentials", opts.warn),)


@sinkhorn_potentials_vjp.register_fake
def _(x, y, a, b, epsilon, scale, f, g, uf, ug, precision, implicit, tau_a=1.0, tau_b=1.0):
    return tuple(t.new_empty(t.shape, dtype=F32) for t in (x, y, a, b)) + (x.new_empty((3,), dtype=F32),)


def potentials_setup(ctx, inputs, output):
    x, y, a, b, epsilon, scale = inputs[:6]
    ctx.precision, ctx.implicit = inputs[10], inputs[13]
    ctx.taus, ctx.n_inputs = tuple((tuple(inputs[14:]) + (1.0, 1.0))[:2]), len(inputs)
    ctx.save_for_backward(x, y, a, b, epsilon, scale, output[0], output[1])
    ctx.mark_non_differentiable(*output[2:])  # errors, n_iters, converged
    _tensor_positions(ctx, inputs)
    ctx.set_materialize_grads(False)


def potentials_backward(ctx, uf, ug, *_):
    if uf is None and ug is None:
        return (None,) * ctx.n_inputs
    x, y, a, b, epsilon, scale, f, g = ctx.saved_tensors
    check_no_eps_tangent("the gradient of a function of the potentials", required(ctx, 4) or required(ctx, 5))
    dx, dy, da, db, _ = sinkhorn_potentials_vjp(x, y, a, b, epsilon, scale, f, g, uf, ug, ctx.precision,
                                                ctx.implicit, *ctx.taus)
    grads = tuple(t.to(like.dtype) if need else None
                  for t, like, need in zip((dx, dy, da, db), (x, y, a, b), ctx.needs_input_grad[:4]))
    return grads + (None,) * (ctx.n_inputs - 4)


# ----------------------------------------------------------------------------- P v


@torch.library.custom_op("ot_triton::sinkhorn_apply_vjp", mutates_args=())
def sinkhorn_apply_vjp(src: Tensor, tgt: Tensor, f_src: Tensor, g_tgt: Tensor, epsilon: Tensor, scale: Tensor,
                       v: Tensor, u: Tensor, precision: str) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Cotangents (src, tgt, f_src, g_tgt, v) of out = P v for d out = u (v (m, k), u (n, k))."""
    ops = Passes.of(src, tgt, f_src, g_tgt, epsilon, scale, precision)
    return imp.apply_vjp(ops, v.to(F32).contiguous(), u.to(F32).contiguous())


@sinkhorn_apply_vjp.register_fake
def _(src, tgt, f_src, g_tgt, epsilon, scale, v, u, precision):
    return tuple(t.new_empty(t.shape, dtype=F32) for t in (src, tgt, f_src, g_tgt, v))


def apply_setup(ctx, inputs, output):
    src, tgt, f_src, g_tgt, epsilon, scale, v, precision = inputs
    ctx.precision, ctx.has_v = precision, v is not None
    ctx.save_for_backward(src, tgt, f_src, g_tgt, epsilon, scale,
                          v if v is not None else src.new_ones((tgt.shape[0], 1), dtype=F32))
    _tensor_positions(ctx, inputs)


def apply_backward(ctx, u):
    src, tgt, f_src, g_tgt, epsilon, scale, v = ctx.saved_tensors
    check_no_eps_tangent("the gradient of apply / marginal", required(ctx, 4) or required(ctx, 5))
    u2 = u.reshape(src.shape[0], -1)
    ds, dt, df, dg, dv = sinkhorn_apply_vjp(src, tgt, f_src, g_tgt, epsilon, scale, v, u2, ctx.precision)
    need = ctx.needs_input_grad
    cast = lambda t, like, k: t.to(like.dtype).reshape(like.shape) if need[k] else None
    return (cast(ds, src, 0), cast(dt, tgt, 1), cast(df, f_src, 2), cast(dg, g_tgt, 3), None, None,
            cast(dv, v, 6) if ctx.has_v else None, None)
