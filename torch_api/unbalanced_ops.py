"""The torch side of OTT's KL-relaxed marginals (``tau_a``, ``tau_b`` < 1) in the OTT-convention
solves: the kernels' PARAMS with the relaxation tail. (The derivatives of a relaxed problem are
those of the balanced ops with (tau_a, tau_b) passed on: torch_api.implicit_ops.)

The rules themselves (rho, the damped updates, the cost terms and their partials) are in
:mod:`ot_triton_jax.core.unbalanced`.
"""

from __future__ import annotations

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
