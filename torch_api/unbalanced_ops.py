"""The torch side of OTT's KL-relaxed marginals (``tau_a``, ``tau_b`` < 1) in the OTT-convention
solves: the kernels' PARAMS with the relaxation tail, and the derivatives that are not
implemented for a relaxed problem (they raise instead of returning a wrong number).

The rules themselves (rho, the damped updates, the cost terms and their partials) are in
:mod:`ot_triton_jax.core.unbalanced`.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from ot_triton_jax.core import unbalanced

_PARAMS: dict = {}  # (id(prm), tau_a, tau_b) -> (prm, relaxed PARAMS): the library's cached PARAMS only


def relaxed_params(prm: Tensor, tau_a: float, tau_b: float) -> Tensor:
    """[eps, s] + ``unbalanced.params_tail`` = [eps, s, tau_a, 1/rho_a, tau_b, 1/rho_b] (float32,
    on prm's device, filled there: no host copy), or ``prm`` itself for a balanced problem.
    Made once per (PARAMS tensor, tau_a, tau_b) outside torch.compile (``prm`` is kept with it,
    so its id is not reused; PARAMS are never written)."""
    if unbalanced.is_balanced(tau_a, tau_b):
        return prm
    key = None
    if not torch.compiler.is_compiling():
        key = (id(prm), tau_a, tau_b)
        hit = _PARAMS.get(key)
        if hit is not None and hit[0] is prm:
            return hit[1]
    eps = prm[0]
    tail = [torch.full_like(eps, tau_a), unbalanced.inv_rho(eps, tau_a),
            torch.full_like(eps, tau_b), unbalanced.inv_rho(eps, tau_b)]
    out = torch.cat([prm, torch.stack(tail).to(prm.dtype)])
    if key is not None:
        if len(_PARAMS) >= 256:
            _PARAMS.clear()
        _PARAMS[key] = (prm, out)
    return out


def not_implemented_message(what: str) -> str:
    return (f"{what} is not implemented for an unbalanced problem (tau_a < 1 or tau_b < 1): only the first "
            "derivatives of reg_ot_cost (and of sinkhorn_divergence) in x, y, a, b, epsilon and scale_cost are. "
            "Detach the potentials (out.f.detach()) or solve the balanced problem (tau_a = tau_b = 1)")


def check_relaxed_derivative(backward: Callable, setup: Callable, n_base: int, what: str) -> tuple[Callable, Callable]:
    """(backward, setup_context) for an op whose first ``n_base`` inputs are those of the balanced
    ``backward`` / ``setup`` and whose last two are (tau_a, tau_b): the balanced rule when both
    are 1; with a tau < 1, a backward that receives a cotangent raises NotImplementedError
    naming ``what`` (never a silently wrong number)."""

    def setup_context(ctx, inputs, output):
        inputs = tuple(inputs)
        taus = (inputs[n_base:] + (1.0, 1.0))[:2]
        setup(ctx, inputs[:n_base], output)
        ctx.relaxed_taus = None if unbalanced.is_balanced(*taus) else taus
        ctx.n_extra = len(inputs) - n_base

    def relaxed_backward(ctx, *cotangents):
        if ctx.relaxed_taus is not None and any(c is not None for c in cotangents):
            raise NotImplementedError(not_implemented_message(what))
        return tuple(backward(ctx, *cotangents)) + (None,) * ctx.n_extra

    return relaxed_backward, setup_context
