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
the points, at the cost of B single HVPs; :func:`torch_api.hvp` on a batch gives the same numbers
for reg_ot_cost with one launch per plan pass for the whole batch. Third derivatives raise, as for
a single call.

For problem k with cotangent u_k of its cost R_k, the gradient returned is u_k dR_k/dx_k (and
y_k); for a self term R_k(z_k, z_k) (both clouds move) it is u_k (dR_k/dx + dR_k/dy) at x = y = z_k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .implicit_ops import sinkhorn_potentials_vjp
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
                      taus: tuple, need: tuple[bool, bool], symmetric: bool = False):
    """Per problem k of ``problems`` (x_k, y_k, a_k, b_k, f_k, g_k: points, weights, OTT
    potentials): u_k dR_k/dx_k and u_k dR_k/dy_k as lists (None for a side not in ``need``),
    differentiable in the points and in u (module docstring). ``symmetric``: self terms, whose
    x_k and y_k are the same points z_k; then one list, u_k (dR_k/dx + dR_k/dy)."""
    need_x, need_y = (True, True) if symmetric else need
    gxs, gys = [], []
    for k, (x, y, a, b, f, g) in enumerate(problems):
        gx, gy = sinkhorn_cost_grads(x, y, a, b, eps, scale, f, g, precision, need_x, need_y, False, implicit,
                                     *taus)[:2]
        uk = u[k].to(gx.dtype)
        gxs.append((gx * uk).to(x.dtype) if need_x else None)
        gys.append((gy * uk).to(y.dtype) if need_y else None)
    if symmetric:
        return [gx + gy for gx, gy in zip(gxs, gys)]
    return gxs, gys


class _Packed(torch.autograd.Function):
    """``_Packed.apply(vjp, k, *points, *values)``: copies of ``values`` attached to the k
    ``points``; backward: ``vjp(points, cotangents, needs)`` -> one gradient per point tensor."""

    @staticmethod
    def forward(ctx, vjp, k, *tensors):
        ctx.vjp, ctx.k = vjp, k
        ctx.save_for_backward(*tensors[:k])
        ctx.set_materialize_grads(False)
        return tuple(t.clone() for t in tensors[k:])

    @staticmethod
    def backward(ctx, *cts):
        points, k = ctx.saved_tensors, ctx.k
        if all(c is None for c in cts):
            return (None,) * (2 + k + len(cts))
        with torch.no_grad():
            grads = ctx.vjp(points, cts, ctx.needs_input_grad[2:2 + k])
        if torch.is_grad_enabled():  # a double backward: the first one's values, whose derivative raises
            grads = [None if t is None else NoDerivative.apply(_SECOND, t, *points) for t in grads]
        return (None, None) + tuple(grads) + (None,) * len(cts)


def _involved(P, cts) -> list[bool]:
    """Per problem: whether any cotangent in ``cts`` ((packed rows, side) pairs) is nonzero there (one host read)."""
    total = sum(P.sums(c.detach().abs().double(), side) for c, side in cts if c is not None)
    return [bool(v) for v in (total > 0).tolist()]


def pair_potentials(xin: Tensor, yin: Tensor, f: Tensor, g: Tensor, P, state) -> tuple[Tensor, Tensor]:
    """The packed potentials (f, g) of :func:`torch_api.sinkhorn_batch` attached to the points
    ``xin``, ``yin`` (as :func:`split_points` takes them) with each problem's implicit VJP (module
    docstring); ``P``: the batch's ``batch_packing.Packed``; ``state``: (epsilon, scale, precision,
    implicit key, taus)."""
    eps, scale, precision, key, taus = state

    def vjp(points, cts, need):
        xs = split_points(points[0], P.dense, P.lay.lx.sizes)
        ys = split_points(points[1], P.dense, P.lay.ly.sizes)
        uf, ug = cts
        ufs = P.unpack(uf, 0) if uf is not None else [None] * P.lay.B
        ugs = P.unpack(ug, 1) if ug is not None else [None] * P.lay.B
        rows = zip(xs, ys, P.unpack(P.a, 0), P.unpack(P.b, 1), P.unpack(f, 0), P.unpack(g, 1), ufs, ugs,
                   _involved(P, ((uf, 0), (ug, 1))))
        dxs, dys = [], []
        for x, y, a, b, fk, gk, u, v, involved in rows:
            if not involved:
                dxs.append(torch.zeros_like(x))
                dys.append(torch.zeros_like(y))
                continue
            dx, dy = sinkhorn_potentials_vjp(x, y, a, b, eps, scale, fk, gk, u, v, precision, key, *taus)[:2]
            dxs.append(dx.to(x.dtype))
            dys.append(dy.to(y.dtype))
        return [join_points(dxs, P.dense) if need[0] else None, join_points(dys, P.dense) if need[1] else None]

    return _Packed.apply(vjp, 2, xin, yin, f, g)


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
