"""The packed form of a batched ``torch_api.sinkhorn_divergence``: three loops for 3B problems.

For x (B, n, d), y (B, m, d) the B (x, y) problems run as one packed alternating loop
(:func:`torch_api.sinkhorn_batch`) and the 2B self problems (x_k, x_k, a_k, a_k), (y_k, y_k, b_k,
b_k) as one packed symmetric loop (``batched_loop.batched_symmetric``: OTT's symmetric solve,
h <- 0.5 h + 0.5 T(h), each problem with its own stop), so a half-step of the whole batch is one
launch per loop. Each problem's potentials, iterations, error records and costs are those of its
single call to float32 rounding; the divergence per problem is
R(x, y) - 1/2 R(x, x) - 1/2 R(y, y) + 1/2 eps (sum a - sum b)^2 as in the single call.

A self term's R is OTT's reg_ot_cost of the symmetric plan P_ij = exp((h_i + h_j - C_ij)/eps):
its marginal terms on both sides plus eps (sum(a)^2 - sum P), sum P from one block-sparse pass.
Its envelope gradient in the points (both sides move, P symmetric) is
4 s (r_i x_i - (P x)_i), r = P 1; that of R(x, y) is :func:`torch_api.sinkhorn_batch`'s.

The packed form serves the calls whose derivatives it has (in the points) and whose options are
shared by the batch: OTT's symmetric self solves with tau_a == tau_b, no label cost, weights and
epsilon / scale_cost without derivatives. :func:`packed_divergence` returns None for any other
call, which then runs problem by problem. Every problem's potentials (the self terms' h included)
have its single call's implicit VJP in the points, and a double backward through a packed
divergence gives each problem's single-call second derivatives in the points
(:mod:`torch_api.batched_implicit`).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ot_triton_jax.core import unbalanced
from ot_triton_jax.core.implicit_solve import implicit_options, options_key
from ot_triton_jax.core.options import LoopOptions

from .batch_packing import pack_concat
from .batched import record_converged, sinkhorn_batch
from .batched_loop import batched_symmetric
from .batched_implicit import problem_gradients, self_potentials_packed
from .call_args import scalar_tensor
from .kernel_ops import apply_plan_blocksparse, clouds, kernel_params
from .unbalanced_ops import relaxed_params

__all__ = ["packed_divergence"]


def _grad(v) -> bool:
    return isinstance(v, Tensor) and v.requires_grad


@torch.compiler.disable  # packed loops with host reads: eager under torch.compile (a graph break)
def packed_divergence(x: Tensor, y: Tensor, per_problem: dict, kw: dict):
    """The fields of the batch's ``SinkhornDivergenceOutput`` (each with a leading batch axis), or
    None when the call is not one the packed form serves (module docstring). ``per_problem``: a, b, label_x, label_y (batched
    or None); ``kw``: sinkhorn_divergence's other options, checked (tau_a, tau_b included)."""
    a, b = per_problem["a"], per_problem["b"]
    labelled = any(v is not None for v in (kw["label_cost"], per_problem["label_x"], per_problem["label_y"]))
    if (x.dim() != 3 or y.dim() != 3 or not kw["symmetric_sinkhorn"] or kw["tau_a"] != kw["tau_b"] or labelled
            or any(_grad(v) for v in (a, b, kw["epsilon"], kw["scale_cost"]))):
        return None
    if kw["offset_static_b"] is not None and not kw["static_b"]:
        raise ValueError("offset_static_b is only used with static_b=True; pass static_b=True or drop it")
    tau = kw["tau_a"]
    solve = {k: kw[k] for k in ("epsilon", "scale_cost", "threshold", "inner_iterations", "min_iterations",
                                "max_iterations", "precision", "tau_a", "tau_b", "implicit")}
    xy = sinkhorn_batch(x, y, a, b, **solve)  # checks every input's shape and value
    (B, n, d), m, dev = x.shape, y.shape[1], x.device
    a = torch.full((B, n), 1.0 / n, device=dev) if a is None else a.to(torch.float32)
    b = torch.full((B, m), 1.0 / m, device=dev) if b is None else b.to(torch.float32)
    eps = scalar_tensor("epsilon", kw["epsilon"], dev).detach()
    scale = scalar_tensor("scale_cost", kw["scale_cost"], dev).detach()
    thr = scalar_tensor("threshold", kw["threshold"], dev).detach().to(torch.float32)
    static_b = bool(kw["static_b"])
    pts = [x.reshape(B * n, d)] + ([] if static_b else [y.reshape(B * m, d).to(x.dtype)])
    ws = [a.reshape(-1)] + ([] if static_b else [b.reshape(-1)])
    sizes = (n,) * B + (() if static_b else (m,) * B)
    z, w = torch.cat(pts), torch.cat(ws)
    opts = LoopOptions(solve["precision"], solve["inner_iterations"], solve["min_iterations"], solve["max_iterations"])
    key = options_key(implicit_options(kw["implicit"]))
    h, n_iters, errors, cost = _self_batch(z, w, sizes, eps, scale, thr, tau, opts, key)
    cost_xx = cost[:B]
    if static_b:
        offset = 0.0 if kw["offset_static_b"] is None else kw["offset_static_b"]
        cost_yy = torch.as_tensor(offset, device=dev).to(torch.float32).reshape(()).expand(B)
    else:
        cost_yy = cost[B:]
    mass = unbalanced.divergence_mass_term(a.sum(1), b.sum(1), eps.float())
    div = xy.reg_ot_cost - 0.5 * (cost_xx + cost_yy) + mass
    conv = record_converged(errors, thr)
    f, g = torch.stack(xy.f), torch.stack(xy.g)
    hx, hy = h[:B * n].view(B, n), (None if static_b else h[B * n:].view(B, m))

    def triple(v_xy, v):
        return v_xy, v[:B], (None if static_b else v[B:])

    return dict(divergence=div, a=a, b=b, potentials=((f, g), (hx, hx), None if static_b else (hy, hy)),
                errors=triple(xy.errors, errors), converged=triple(xy.converged, conv),
                n_iters=triple(xy.n_iters, n_iters), costs=(xy.reg_ot_cost, cost_xx, cost_yy))


def _self_batch(z: Tensor, w: Tensor, sizes: tuple, eps: Tensor, scale: Tensor, thr: Tensor, tau: float,
                opts: LoopOptions, implicit: str):
    """The symmetric solves of the self problems (z_k, z_k, w_k, w_k) given concatenated (problem
    sizes ``sizes``): (h in z's point order, n_iters, errors (P, n_blocks), reg_ot_cost (P,)), the
    cost differentiable in z (twice; ``implicit``: the CG options key of the second derivatives)."""
    P = pack_concat(z, z, w, w, sizes, sizes, opts.precision)
    lay, dev = P.lay, z.device
    prm = relaxed_params(kernel_params(eps, scale, dev), tau, tau)
    inputs = {"x": P.x, "la": P.la, "f0": P.f0, "prm": prm, "rx": lay.rx, "bx": lay.bx, "seg_x": lay.seg_x,
              "rows_x": lay.rows_x, "thr": thr, "done0": torch.zeros(lay.B, dtype=torch.bool, device=dev)}
    h, n_iters, _, errors = batched_symmetric(inputs, opts, (lay.lx.sizes, z.shape[1]),
                                              unbalanced.relax_at("a", tau))
    (X,) = clouds(P.x)
    rows = apply_plan_blocksparse(X, X, h, h, prm, lay.rx, opts.precision)[1]
    mass = P.sums(torch.where(lay.seg_x >= 0, rows, 0.0).double(), 0)
    e = eps.double()
    term = P.sums(unbalanced.ott_marginal_entries(torch, h.double(), P.a.double(), e, tau), 0)
    mass_a = P.sums(P.a.double(), 0)
    cost = (2.0 * term + e * (mass_a * mass_a - mass)).float()
    if z.requires_grad:
        cost = _SelfEnvelope.apply(z, cost, (X, h, prm, P, opts.precision, (eps, scale, implicit, (tau, tau))))
        h = self_potentials_packed(z, h, P, (eps, scale, opts.precision, implicit, (tau, tau)))
    return h[lay.ix], n_iters, errors, cost


class _SelfEnvelope(torch.autograd.Function):
    """Self terms' reg_ot_cost (P,) with the envelope gradient of each in its own points,
    4 s (r_i z_i - (P z)_i) (module docstring; the packed clouds' common centre cancels); problem
    by problem and differentiable once more when a double backward follows."""

    @staticmethod
    def forward(ctx, z, cost, state):
        ctx.state, ctx.meta = state, (z.dtype, z.shape)
        ctx.save_for_backward(z)
        return cost.clone()

    @staticmethod
    def backward(ctx, u):
        X, h, prm, P, precision, (eps, scale, key, taus) = ctx.state
        if torch.is_grad_enabled():  # a double backward will follow
            (z,) = ctx.saved_tensors
            ws, hs = P.unpack(P.a, 0), P.unpack(h, 0)
            problems = [(zk, zk, wk, wk, hk, hk) for zk, wk, hk in zip(z.split(list(P.lay.lx.sizes)), ws, hs)]
            return torch.cat(problem_gradients(problems, u, eps, scale, precision, key, taus, (True, True),
                                               symmetric=True)), None, None
        pz, r = apply_plan_blocksparse(X, X, h, h, prm, P.lay.rx, precision, v=X.x)
        rows = 4.0 * prm[1] * (r[:, None] * X.x - pz) * u.detach().float()[P.lay.rows_x][:, None]
        return P.gather(rows, 0, ctx.meta[1]).to(ctx.meta[0]), None, None
