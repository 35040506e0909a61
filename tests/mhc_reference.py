"""Float64 references for the mHC tests (CPU and GPU)."""

from __future__ import annotations

import math

import torch


def ref_mhc(logits: torch.Tensor, iters: int, eps: float = 0.0, start: str = "cols"):
    """The documented map in float64: P = exp(M); iters x (columns, rows) normalization."""
    p = logits.double().exp()
    first, second = (-2, -1) if start == "cols" else (-1, -2)
    for _ in range(iters):
        p = p / (p.sum(first, keepdim=True) + eps)
        p = p / (p.sum(second, keepdim=True) + eps)
    return p


def ref_grad(logits, weight, iters, eps=0.0, start="cols"):
    """d/dM sum(weight * mhc(M)) by autograd through the float64 loop."""
    m = logits.detach().double().requires_grad_(True)
    (g,) = torch.autograd.grad((ref_mhc(m, iters, eps, start) * weight.double()).sum(), m)
    return g


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref||; any non-finite entry in x is an infinite error."""
    x = x.double()
    if not torch.isfinite(x).all():
        return math.inf
    return ((x - ref).norm() / ref.norm()).item()
