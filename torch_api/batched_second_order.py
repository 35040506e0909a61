"""Second derivatives of packed batches: the double backward (``create_graph=True``) of
:func:`torch_api.sinkhorn_batch`'s reg_ot_cost and of the packed divergence's self terms.

The first backward of a packed batch computes every problem's envelope gradient in one
block-sparse pass per side, from potentials that carry no derivative. When autograd records that
backward for a second one, each problem's gradient is instead taken from
``sinkhorn_cost_grads``, the single call's gradient op, whose backward is that problem's Hessian
applied to the cotangent (streaming CG on the implicit system, :mod:`torch_api.implicit_ops`,
with the call's ``implicit`` options; relaxed marginals included). A double backward through a
batch therefore gives each problem's single-call second derivatives in the points, at the cost
of B single HVPs; :func:`torch_api.hvp` on a batch gives the same numbers for reg_ot_cost with
one launch per plan pass for the whole batch. Third derivatives raise, as for a single call.

For problem k with cotangent u_k of its cost R_k, the gradient returned is u_k dR_k/dx_k (and
y_k); for a self term R_k(z_k, z_k) (both clouds move) it is u_k (dR_k/dx + dR_k/dy) at x = y = z_k.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .sinkhorn_ops import sinkhorn_cost_grads

__all__ = ["split_points", "join_points", "problem_gradients"]


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
