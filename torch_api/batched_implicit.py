"""Implicit derivatives of packed batches, problem by problem: the VJP of the potentials of
:func:`torch_api.sinkhorn_batch` (and of the packed divergence's self terms), and the double
backward (``create_graph=True``) of its reg_ot_cost and of the packed divergence's self terms.

A packed batch solves every problem in one loop, but each problem's implicit system is its own. So
its potentials' VJP is each problem's single-call VJP (:func:`torch_api.implicit_ops.sinkhorn_potentials_vjp`,
streaming CG with the call's ``implicit`` options, relaxed marginals included), for the problems whose
cotangents are not zero (one host read finds them): the derivatives of the potentials of a batch are
exactly those of the single solves, at the cost of one single VJP per problem involved. The self
terms' potentials h take their (x, x) problem's VJP (:mod:`torch_api.self_potentials`).
Second derivatives of the potentials raise ``NotImplementedError``.

The first backward of a packed reg_ot_cost computes every problem's envelope gradient in one
block-sparse pass per side, from potentials that carry no derivative. When autograd records that
backward for a second one, each problem's gradient is instead taken from
``sinkhorn_cost_grads``, the single call's gradient op, whose backward is that problem's Hessian
applied to the cotangent (streaming CG on the implicit system, :mod:`torch_api.implicit_ops`). A
double backward through a batch therefore gives each problem's single-call second derivatives in
the points and weights, at the cost of B single HVPs; :func:`torch_api.hvp` on a batch gives the same numbers
for reg_ot_cost with one launch per plan pass for the whole batch. Third derivatives raise, as for
a single call.

For problem k with cotangent u_k of its cost R_k, the gradient returned is u_k dR_k/dx_k (and
y_k); for a self term R_k(z_k, z_k) (both clouds move) it is u_k (dR_k/dx + dR_k/dy) at x = y = z_k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ot_triton_jax.core.implicit_solve import check_no_eps_tangent

from .implicit_ops import required, sinkhorn_potentials_vjp
from .no_derivative import NoDerivative
from .self_potentials import self_potentials_vjp
from .sinkhorn_ops import sinkhorn_cost_grads

__all__ = ["split_points", "join_points", "problem_gradients", "pair_potentials", "self_potentials_packed"]

_SECOND = "second derivatives of the potentials of a packed batch are not implemented"


def split_points(t: Tensor, dense: bool, sizes) -> list[Tensor]:
    """The problems' points: rows of a (B, n, d) batch, or pieces of concatenated clouds of
    ``sizes`` (differentiable views, so gradients flow to the caller's tensor)."""
    return list(t.unbind(0)) if dense else list(t.split(list(sizes)))


def join_points(parts: list[Tensor], dense: bool) -> Tensor:
    return torch.stack(parts) if dense else torch.cat(parts)


def problem_gradients(problems, u: Tensor, eps: Tensor, scale: Tensor, precision: str, implicit: str,
                      taus: tuple, need: tuple, symmetric: bool = False):
    """Per problem k of ``problems`` (x_k, y_k, a_k, b_k, f_k, g_k: points, weights, OTT
    potentials): u_k dR_k/dx_k, u_k dR_k/dy_k, u_k dR_k/da_k, u_k dR_k/db_k as four lists (None for an
    input not in ``need``, a 4-tuple of flags), differentiable in the points, the weights and u
    (module docstring). ``symmetric``: self terms, whose x_k and y_k are the same points z_k; then
    one list, u_k (dR_k/dx + dR_k/dy)."""
    need = (True, True, False, False) if symmetric else tuple(need)
    out = ([], [], [], [])
    for k, (x, y, a, b, f, g) in enumerate(problems):
        grads = sinkhorn_cost_grads(x, y, a, b, eps, scale, f, g, precision, need[0], need[1], False, implicit,
                                    *taus)[:4]
        uk = u[k].to(grads[0].dtype)
        for lst, gr, like, n in zip(out, grads, (x, y, a, b), need):
            lst.append((gr * uk).to(like.dtype) if n else None)
    if symmetric:
        return [gx + gy for gx, gy in zip(out[0], out[1])]
    return out


class _Packed(torch.autograd.Function):
    """``_Packed.apply(vjp, k, *points, *values)``: copies of ``values`` attached to the k
    ``points``; backward: ``vjp(points, cotangents, needs)`` -> one gradient per point tensor."""

    @staticmethod
    def forward(ctx, vjp, k, *tensors):
        ctx.vjp, ctx.k = vjp, k
        ctx.tensor_pos = [2 + i for i, t in enumerate(tensors) if isinstance(t, Tensor)]
        ctx.save_for_backward(*tensors[:k])
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors[k:])

    @staticmethod
    def backward(ctx, *cts):
        points, k = ctx.saved_tensors, ctx.k
        if all(c is None for c in cts):
            return (None,) * (2 + k + len(cts))
        with torch.no_grad():
            grads = ctx.vjp(points, cts, [required(ctx, 2 + i) for i in range(k)])
        if torch.is_grad_enabled():  # a double backward: the first one's values, whose derivative raises
            grads = [None if t is None else NoDerivative.apply(_SECOND, t, *points) for t in grads]
        return (None, None) + tuple(grads) + (None,) * len(cts)


def _involved(P, cts) -> list[bool]:
    """Per problem: whether any cotangent in ``cts`` ((packed rows, side) pairs) is nonzero there (one host read)."""
    total = sum(P.sums(c.detach().abs().double(), side) for c, side in cts if c is not None)
    return [bool(v) for v in (total > 0).tolist()]


def pair_potentials(inputs: tuple, f: Tensor, g: Tensor, P, state) -> tuple[Tensor, Tensor]:
    """The packed potentials (f, g) of :func:`torch_api.sinkhorn_batch` attached to ``inputs`` = (x, y,
    a, b, epsilon, scale_cost) as autograd sees them (points as :func:`split_points` takes them,
    weights likewise or None) with each problem's implicit VJP (module docstring; in epsilon or
    scale_cost it raises, as for a single call); ``P``: the batch's ``batch_packing.Packed``;
    ``state``: (epsilon, scale, precision, implicit key, taus)."""
    eps, scale, precision, key, taus = state
    lx, ly = P.lay.lx.sizes, P.lay.ly.sizes

    def vjp(points, cts, need):
        check_no_eps_tangent("the gradient of a function of the potentials", need[4] or need[5])
        xin, yin, ain, bin_ = points[:4]
        xs, ys = split_points(xin, P.dense, lx), split_points(yin, P.dense, ly)
        as_ = P.unpack(P.a, 0) if ain is None else split_points(ain, P.dense, lx)
        bs = P.unpack(P.b, 1) if bin_ is None else split_points(bin_, P.dense, ly)
        uf, ug = cts
        ufs = P.unpack(uf, 0) if uf is not None else [None] * P.lay.B
        ugs = P.unpack(ug, 1) if ug is not None else [None] * P.lay.B
        rows = zip(xs, ys, as_, bs, P.unpack(f, 0), P.unpack(g, 1), ufs, ugs, _involved(P, ((uf, 0), (ug, 1))))
        out = ([], [], [], [])
        for x, y, a, b, fk, gk, u, v, involved in rows:
            like = (x, y, a, b)
            if involved:
                grads = sinkhorn_potentials_vjp(x, y, a, b, eps, scale, fk, gk, u, v, precision, key, *taus)[:4]
            else:
                grads = tuple(torch.zeros_like(t) for t in like)
            for lst, gr, t in zip(out, grads, like):
                lst.append(gr.to(t.dtype))
        return [join_points(lst, P.dense) if n else None for lst, n in zip(out, need)] + [None, None]

    return _Packed.apply(vjp, 6, *inputs, f, g)


def self_potentials_packed(z: Tensor, h: Tensor, P, state) -> Tensor:
    """The packed self problems' potential h (OTT's symmetric solve, in the packing's row order)
    attached to their concatenated points ``z`` with each problem's VJP (module docstring);
    ``P``: the (z, z) packing; ``state`` as :func:`pair_potentials`'s."""
    eps, scale, precision, key, taus = state

    def vjp(points, cts, need):
        zs = points[0].split(list(P.lay.lx.sizes))
        (u,) = cts
        rows = zip(zs, P.unpack(P.a, 0), P.unpack(h, 0), P.unpack(u, 0), _involved(P, ((u, 0),)))
        out = []
        for zk, wk, hk, uk, involved in rows:
            dz = self_potentials_vjp(zk, wk, hk, hk, 0.5 * uk, 0.5 * uk, (eps, scale, precision, key, taus))[0] \
                if involved else torch.zeros_like(zk)
            out.append(dz.to(zk.dtype))
        return [torch.cat(out)]

    return _Packed.apply(vjp, 1, z, h)[0]
