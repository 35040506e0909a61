"""Float64 references the areas gate their rows with.

* ``f64_sinkhorn``: OTT-convention alternating iterations (g then f, uniform weights, zero start,
  C = |x - y|^2; damped by tau on a relaxed side) in float64, dense in row chunks on the inputs'
  device; ``f_error`` compares a potential with it on 512 sampled rows.
* ``f64_flash_unbalanced``: flash-sinkhorn's own unbalanced alternating iterations, the same way.
* ``geomloss_f64``: GeomLoss's ``SamplesLoss("sinkhorn", backend="tensorized")`` in float64 on the
  same points (loss and gradient in x).
* ``hvp_reference``: the dense float64 implicit-function HVP of tests/hvp_reference_gpu.py (potentials
  solved to an L1 marginal error of 1e-10 by Sinkhorn + Newton, Cholesky of the Schur complement).
"""

from __future__ import annotations

import math
import os
import sys

import torch

from bench.harness import ROOT


def _softmin(src, tgt, pot, logw_in, eps: float, chunk: int):
    """-eps LSE_j((pot_j - |src_i - tgt_j|^2)/eps + logw_in_j) in float64, dense in row chunks."""
    srcn, tgtn = (src * src).sum(1), (tgt * tgt).sum(1)
    out = torch.empty(src.shape[0], dtype=torch.float64, device=src.device)
    for i in range(0, src.shape[0], chunk):
        C = srcn[i:i + chunk, None] + tgtn[None] - 2 * src[i:i + chunk] @ tgt.T
        out[i:i + chunk] = -eps * torch.logsumexp((pot[None] - C) / eps + logw_in, 1)
    return out


def f64_sinkhorn(x: torch.Tensor, y: torch.Tensor, iters: int, eps: float, chunk: int = 2048,
                 tau_a: float = 1.0, tau_b: float = 1.0):
    """(f, g, reg_ot_cost) after ``iters`` float64 alternating iterations (uniform weights); with
    tau < 1, OTT's damped updates (core/unbalanced.py; the cost is then not computed: None)."""
    n, m = x.shape[0], y.shape[0]
    X, Y = x.double(), y.double()
    la, lb = math.log(1.0 / n), math.log(1.0 / m)
    f = torch.zeros(n, dtype=torch.float64, device=x.device)
    g = torch.zeros(m, dtype=torch.float64, device=x.device)
    for _ in range(iters):
        g = tau_b * (eps * lb + _softmin(Y, X, f, 0.0, eps, chunk))
        f = tau_a * (eps * la + _softmin(X, Y, g, 0.0, eps, chunk))
    if tau_a != 1.0 or tau_b != 1.0:
        return f, g, None
    cost = (f.mean() - eps * la) + (g.mean() - eps * lb)  # + eps (1 - sum P), sum P = 1
    return f, g, float(cost)


def f64_flash_unbalanced(x: torch.Tensor, y: torch.Tensor, iters: int, eps: float, rho_x: float | None,
                         rho_y: float | None, chunk: int = 2048):
    """flash-sinkhorn 0.4.1's unbalanced alternating iterations (``sinkhorn_flashstyle_alternating``
    with rho_x / rho_y, GeomLoss's potentials, uniform weights) in float64, as its source defines
    them: f first, f = d_x softmin(g + eps log b), g = d_y softmin(f + eps log a), d = 1 / (1 + eps /
    rho); with one side relaxed, each iteration ends with its closed-form translation along
    (f + c, g - c). Returns (f, g)."""
    n, m = x.shape[0], y.shape[0]
    X, Y = x.double(), y.double()
    la, lb = math.log(1.0 / n), math.log(1.0 / m)
    damp = lambda rho: 1.0 if rho is None else 1.0 / (1.0 + eps / rho)  # noqa: E731
    f = torch.zeros(n, dtype=torch.float64, device=x.device)
    g = torch.zeros(m, dtype=torch.float64, device=x.device)
    for _ in range(iters):
        f = damp(rho_x) * _softmin(X, Y, g, lb, eps, chunk)
        g = damp(rho_y) * _softmin(Y, X, f, la, eps, chunk)
        if rho_y is not None and rho_x is None:
            c = rho_y * (0.0 - torch.logsumexp(lb - g / rho_y, 0))
            f, g = f + c, g - c
        elif rho_x is not None and rho_y is None:
            c = rho_x * (0.0 - torch.logsumexp(la - f / rho_x, 0))
            f, g = f - c, g + c
    return f, g


def sample_rows(n: int, k: int = 512, seed: int = 0) -> torch.Tensor:
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed))[:k]


def f_error(f, ref: torch.Tensor, rows: torch.Tensor) -> float:
    """||f - ref|| / ||ref|| on the sampled rows (f: a torch tensor or an array)."""
    f = f if isinstance(f, torch.Tensor) else torch.from_numpy(__import__("numpy").array(f))
    f, ref = f.detach().double().cpu()[rows], ref.double().cpu()[rows]
    return float((f - ref).norm() / ref.norm())


def loss_and_grad(loss, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """loss(x, y) and its gradient in x: the call a user makes to train with a loss."""
    xg = x.detach().clone().requires_grad_(True)
    value = loss(xg, y)
    (grad,) = torch.autograd.grad(value, xg)
    return value.detach(), grad


def geomloss_f64(x: torch.Tensor, y: torch.Tensor, blur: float, scaling: float) -> tuple[torch.Tensor, torch.Tensor]:
    import geomloss
    loss = geomloss.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=scaling, debias=True, backend="tensorized")
    return loss_and_grad(loss, x.double(), y.double())


def hvp_reference_module():
    """tests/hvp_reference_gpu.py (solve_potentials, hvp_reference, at_potentials, rel_err) and
    tests/implicit_reference.py's Problem, for the HVP area."""
    tests = os.path.join(ROOT, "tests")
    if tests not in sys.path:
        sys.path.insert(0, tests)
    import hvp_reference_gpu
    return hvp_reference_gpu
