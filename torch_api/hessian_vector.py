"""``torch_api.hvp``: an explicit Hessian-vector product in x or y, with the CG record.

The same numbers as the double backward (``torch.autograd.grad(..., create_graph=True)``
then the gradient of <grad, v>), without building the autograd graph: one forward solve,
then the Hessian of reg_ot_cost applied to v by streaming CG
(:mod:`ot_triton_jax.core.implicit_derivatives`). For ``loss="sinkhorn_divergence"``
(OTT's debiased divergence, symmetric self terms) the HVP in x is
H_xy(v) - 1/2 (H_xx(v, v)_x + H_xx(v, v)_y), the self term's Hessian taken with both of its
clouds moving. ``tau_a``, ``tau_b`` < 1 (OTT's KL-relaxed marginals): the Hessian of the
envelope gradient with the potentials of the relaxed fixed point moving (the relaxed system of
:mod:`ot_triton_jax.core.implicit_solve`; :mod:`ot_triton_jax.core.implicit_derivatives` says
which function it is the Hessian of). The JAX twin is ``ot_triton_jax.hvp``.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch

from ot_triton_jax.core import checks as rules, implicit_derivatives as imp, unbalanced
from ot_triton_jax.core.implicit_solve import (ImplicitOptions, implicit_options, options_from_key, options_key,
                                               unconverged_message)

from .checks import READER
from .divergence import sinkhorn_divergence
from .implicit_ops import sinkhorn_hessian_apply
from .batched import sinkhorn_batch
from .batched_hvp import PackedPasses
from .kernel_ops import kernel_params
from .samples_loss_anneal import PackedBatch
from .sinkhorn_solver import prepare, sinkhorn

__all__ = ["hvp", "HVPInfo", "ImplicitOptions"]


@dataclass(frozen=True)
class HVPInfo:
    """The record of :func:`hvp` (0-d tensors on the points' device).

    cg_iterations: CG iterations (the largest over the solves of a divergence);
    cg_residual: final relative residual (the largest); cg_converged: every CG solve met
    its tolerance; solve_converged: every forward Sinkhorn solve converged."""

    cg_iterations: torch.Tensor
    cg_residual: torch.Tensor
    cg_converged: torch.Tensor
    solve_converged: torch.Tensor


def _apply(x, y, a, b, eps, scale, f, g, vx, vy, precision, key, taus, symmetric=False):
    tx, ty, _, _, info = sinkhorn_hessian_apply(x, y, a, b, eps, scale, f, g, vx, vy, None, None, precision,
                                                vx is not None, vy is not None, False, False, key, *taus, symmetric)
    return tx, ty, info


def hvp(
    x: torch.Tensor,
    y: torch.Tensor,
    v: torch.Tensor,
    *,
    wrt: str = "x",
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    epsilon: float | torch.Tensor,
    scale_cost: float | torch.Tensor = 1.0,
    loss: str = "reg_ot_cost",
    threshold: float | torch.Tensor = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    implicit: ImplicitOptions | None = None,
    tau_a: float = 1.0,
    tau_b: float = 1.0,
) -> tuple[torch.Tensor, HVPInfo]:
    """Hessian of ``loss`` (OTT conventions, as :func:`torch_api.sinkhorn`) in ``wrt`` applied to v.

    ``v`` has the shape of the cloud ``wrt``; the other arguments are those of
    :func:`torch_api.sinkhorn`. Returns (hvp float32 with v's shape, :class:`HVPInfo`).
    CG options: ``implicit`` (:class:`ImplicitOptions`); a ``RuntimeWarning`` is issued
    when CG stops unconverged. ``tau_a``, ``tau_b``: OTT's relaxed marginals (module docstring).

    Batches: x (B, n, d), y (B, m, d), v like the cloud ``wrt``, a (B, n), b (B, m) (or None)
    give the (B, ...) HVPs of the B problems, each that of its single call to float32 rounding;
    ``reg_ot_cost``'s forward solves run as one packed loop (:func:`torch_api.sinkhorn_batch`) and its
    CG as one loop for the batch, each plan pass one block-sparse launch (:mod:`torch_api.batched_hvp`;
    each problem keeps its own CG stop); a divergence runs problem by problem. The :class:`HVPInfo`
    fields are then (B,) tensors.
    """
    taus = (unbalanced.check_tau("tau_a", tau_a), unbalanced.check_tau("tau_b", tau_b))
    rules.hvp_args(wrt, loss)
    rules.hvp_direction(READER, v, x if wrt == "x" else y, wrt)
    key = options_key(implicit_options(implicit))
    kw = dict(epsilon=epsilon, scale_cost=scale_cost, threshold=threshold, inner_iterations=inner_iterations,
              min_iterations=min_iterations, max_iterations=max_iterations, precision=precision,
              tau_a=taus[0], tau_b=taus[1])
    x, y, v = x.detach(), y.detach(), v.detach()
    if x.dim() == 3 or y.dim() == 3:
        return _batched(x, y, v, a, b, wrt, loss, kw, key, taus)
    return _one(x, y, v, a, b, wrt, loss, kw, key, taus)


def _one(x, y, v, a, b, wrt: str, loss: str, kw: dict, key: str, taus: tuple):
    """:func:`hvp` of one problem."""
    precision = kw["precision"]
    a, b, eps, scale, _, _ = prepare(x, y, a, b, kw["epsilon"], kw["scale_cost"], kw["threshold"],
                                     kw["inner_iterations"], kw["min_iterations"], kw["max_iterations"], precision)
    a, b, eps, scale = a.detach(), b.detach(), eps.detach(), scale.detach()
    vx, vy = (v, None) if wrt == "x" else (None, v)
    if loss == "reg_ot_cost":
        out = sinkhorn(x, y, a, b, **kw)
        f, g, solved = out.f, out.g, out.converged
        tx, ty, info = _apply(x, y, a, b, eps, scale, f.detach(), g.detach(), vx, vy, precision, key, taus)
        res, infos = (tx if wrt == "x" else ty), [info]
    else:
        _, dout = sinkhorn_divergence(x, y, a, b, **kw)
        (f, g), hx, hy = dout.potentials
        tx, ty, info = _apply(x, y, a, b, eps, scale, f.detach(), g.detach(), vx, vy, precision, key, taus)
        z, w, (hf, hg) = (x, a, hx) if wrt == "x" else (y, b, hy)
        sx, sy, info_self = _apply(z, z, w, w, eps, scale, hf.detach(), hg.detach(), v, v, precision, key, taus,
                                   symmetric=taus[0] == taus[1])
        res = (tx if wrt == "x" else ty) - 0.5 * (sx + sy)
        infos = [info, info_self]
        solved = dout.converged[0] & dout.converged[1] & dout.converged[2]
    stack = torch.stack(infos)
    record = HVPInfo(cg_iterations=stack[:, 0].max().to(torch.int32), cg_residual=stack[:, 1].max(),
                     cg_converged=stack[:, 2].min() > 0, solve_converged=solved)
    return res, record


@torch.compiler.disable  # a packed loop with host reads: eager under torch.compile (a graph break)
def _batched(x, y, v, a, b, wrt: str, loss: str, kw: dict, key: str, taus: tuple):
    """:func:`hvp` of each problem of a batch x (B, n, d), y (B, m, d), v like x or y, a (B, n), b
    (B, m) (or None): ``reg_ot_cost`` packed (:func:`_packed`); a divergence problem by problem."""
    rules.batch_shapes(x.shape, y.shape, {n: (None if w is None else tuple(w.shape), side)
                                          for n, w, side in (("a", a, "x"), ("b", b, "y"))})
    B = x.shape[0]
    if loss == "reg_ot_cost":
        return _packed(x, y, v, a, b, wrt, kw, key, taus)
    a_, b_ = [None] * B if a is None else list(a), [None] * B if b is None else list(b)
    results = [_one(x[k], y[k], v[k], a_[k], b_[k], wrt, loss, kw, key, taus) for k in range(B)]
    infos = [r[1] for r in results]
    record = HVPInfo(*(torch.stack([getattr(i, name) for i in infos]) for name in
                       ("cg_iterations", "cg_residual", "cg_converged", "solve_converged")))
    return torch.stack([r[0] for r in results]), record


def _packed(x, y, v, a, b, wrt: str, kw: dict, key: str, taus: tuple):
    """:func:`hvp` of reg_ot_cost for a batch: the forward solves in one packed loop
    (:func:`torch_api.sinkhorn_batch`), then every problem's CG in one loop of packed plan passes
    (:mod:`torch_api.batched_hvp`)."""
    (B, n, _), m, precision = x.shape, y.shape[1], kw["precision"]
    out = sinkhorn_batch(x, y, a, b, **kw)
    _, _, eps, scale, _, _ = prepare(x[0], y[0], None, None, kw["epsilon"], kw["scale_cost"], kw["threshold"],
                                     kw["inner_iterations"], kw["min_iterations"], kw["max_iterations"], precision)
    a = torch.full((B, n), 1.0 / n, device=x.device) if a is None else a.detach().to(torch.float32)
    b = torch.full((B, m), 1.0 / m, device=x.device) if b is None else b.detach().to(torch.float32)
    f, g = torch.stack(out.f), torch.stack(out.g)
    ops = PackedPasses(PackedBatch(x, y, a, b, precision), f, g, kernel_params(eps, scale, x.device), precision)
    opts = options_from_key(key)
    v = v.to(torch.float32)
    tangents, want = ((v, None), (True, False)) if wrt == "x" else ((None, v), (False, True))
    (tx, ty, _, _), (k, rel, ok) = imp.hessian_apply(ops, f, g, a, b, tangents + (None, None), want + (False, False),
                                                    opts, taus)
    if opts.warn and not bool(ok.all()):
        worst = int(torch.argmax(torch.where(ok, -1.0, rel)))
        warnings.warn(unconverged_message(f"HVP of reg_ot_cost (problem {worst} of the batch)", int(k[worst]),
                                          float(rel[worst])), RuntimeWarning, stacklevel=3)
    record = HVPInfo(cg_iterations=k.to(torch.int32), cg_residual=rel.to(torch.float32), cg_converged=ok,
                     solve_converged=out.converged)
    return (tx if wrt == "x" else ty), record
