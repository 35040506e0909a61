"""Torch launchers for the streaming kernels (plans from ot_triton_jax.core.launch_plans)."""

from __future__ import annotations

import torch

from ot_triton_jax.core import launch_plans, runtime
from ot_triton_jax.core.kernels import (
    apply_plan_kernel, lse_combine_kernel, lse_update_kernel, split_fixed_kernel, split_tf32_kernel,
)

from .launch import launch


class Cloud:
    """A point cloud as the kernels want it: float32 contiguous ``x``, its TF32 head
    and tail ``hi``, ``lo`` (kernels/split.py) and squared norms."""

    __slots__ = ("x", "hi", "lo", "sqnorm")

    def __init__(self, x: torch.Tensor):
        self.x = x.detach().to(torch.float32).contiguous()
        self.sqnorm = (self.x * self.x).sum(1)
        self.hi, self.lo = torch.empty_like(self.x), torch.empty_like(self.x)
        plan = launch_plans.split_plan(self.x.numel(), runtime.on_gpu())
        launch(split_tf32_kernel, plan.grid, (self.x, self.x.numel(), self.hi, self.lo), plan.constexprs,
               num_warps=plan.num_warps, num_stages=plan.num_stages)

    @property
    def n(self) -> int:
        return self.x.shape[0]

    @property
    def d(self) -> int:
        return self.x.shape[1]


def params(eps: float, s: float, device) -> torch.Tensor:
    """The PARAMS array [eps, s] read by every kernel."""
    return torch.tensor([eps, s], dtype=torch.float32, device=device)


def lse_update(src: Cloud, tgt: Cloud, pot_tgt: torch.Tensor, prm: torch.Tensor, precision: str, *,
               logw_in: torch.Tensor | None = None, logw_out: torch.Tensor | None = None,
               pold: torch.Tensor | None = None, compute_err: bool | None = None,
               fold: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """New potential on the ``src`` side (see kernels/lse.py). ``pold``: the previous
    potential of the ``src`` side; with it, the per-point marginal error of the plan
    built from ``pold`` (``compute_err``, default: whenever ``pold`` is given) and, with
    ``fold``, the fixed-shift loop predicted from ``pold`` (verified in the kernel)."""
    n, m, d = src.n, tgt.n, src.d
    on_gpu = runtime.on_gpu()
    plan = launch_plans.lse_plan(n, m, d, precision, on_gpu, fold=fold)
    split = plan.constexprs["SPLIT"]
    compute_err = pold is not None if compute_err is None else bool(compute_err)
    if (compute_err or fold) and pold is None:
        raise ValueError("lse_update: compute_err and fold need pold (the previous potential)")
    out = torch.empty(n, dtype=torch.float32, device=src.x.device)
    err = torch.empty(n, dtype=torch.float32, device=src.x.device) if compute_err else out
    part = torch.empty(2 * split * n, dtype=torch.float32, device=src.x.device) if split > 1 else out
    flags = launch_plans.lse_constexprs(plan, has_logw_in=logw_in is not None,
                                        has_logw_out=logw_out is not None, compute_err=compute_err)
    logw_out = logw_out if logw_out is not None else prm
    pold = pold if pold is not None else prm
    launch(lse_update_kernel, plan.grid,
           (src.hi, src.lo, tgt.hi, tgt.lo, src.sqnorm, tgt.sqnorm, pot_tgt,
            logw_in if logw_in is not None else prm, logw_out, pold, prm, n, m, out, err, part),
           {**plan.constexprs, **flags}, num_warps=plan.num_warps, num_stages=plan.num_stages)
    if split > 1:
        cplan = launch_plans.lse_combine_plan(n, split, on_gpu)
        launch(lse_combine_kernel, cplan.grid, (part, src.sqnorm, logw_out, pold, prm, n, out, err),
               {"HAS_LOGW_OUT": flags["HAS_LOGW_OUT"], "COMPUTE_ERR": compute_err, **cplan.constexprs},
               num_warps=cplan.num_warps, num_stages=cplan.num_stages)
    return out, (err if compute_err else None)


def apply_plan(src: Cloud, tgt: Cloud, f: torch.Tensor, g: torch.Tensor, prm: torch.Tensor,
               precision: str, v: torch.Tensor | None = None) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(P v, P 1) with P_ij = exp((f_i + g_j - C_ij)/eps); v is (m, p) or None."""
    n, m, d = src.n, tgt.n, src.d
    p = 0 if v is None else v.shape[1]
    plan = launch_plans.apply_plan(n, m, d, p, precision, runtime.on_gpu())
    rowsum = torch.empty(n, dtype=torch.float32, device=src.x.device)
    out = torch.empty((n, p), dtype=torch.float32, device=src.x.device) if p else rowsum
    vv = v.to(torch.float32).contiguous() if p else prm
    launch(apply_plan_kernel, plan.grid,
           (src.hi, src.lo, tgt.hi, tgt.lo, src.sqnorm, tgt.sqnorm, f.contiguous(), g.contiguous(), vv, prm,
            n, m, out, rowsum),
           plan.constexprs, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return (out if p else None), rowsum


def fixed_split(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Heads on a per-row fixed-point grid and TF32 tails of a float32 contiguous (n, d)
    array (kernels/split.py, split_fixed_kernel), for the "fixed4" cross term."""
    n, d = x.shape
    plan = launch_plans.fixed_split_plan(n, d, runtime.on_gpu())
    hi, lo = torch.empty_like(x), torch.empty_like(x)
    launch(split_fixed_kernel, plan.grid, (x, n, hi, lo), plan.constexprs,
           num_warps=plan.num_warps, num_stages=plan.num_stages)
    return hi, lo


def exact_row_mass(src: Cloud, tgt: Cloud, f: torch.Tensor, g: torch.Tensor, prm: torch.Tensor) -> torch.Tensor:
    """P 1 (P_ij = exp((f_i + g_j - C_ij)/eps)) with an unbiased cross term ("fixed4").

    For the mass term of reg_ot_cost: the TF32 tensor cores truncate while they accumulate,
    which shrinks the solver's <x, y> by a relative ~1e-7 (d = 64; bench/NOTES.md) and
    biases every P_ij alike; the cost is the dual objective, stationary in (f, g), so
    evaluating its mass term with an unbiased cross term removes that bias to first order.
    "fixed4" (kernels/tiles.py): four TF32 products on fixed-point heads whose products
    sum exactly (launch_plans.exact_mass_plan)."""
    n, m, d = src.n, tgt.n, src.d
    plan = launch_plans.exact_mass_plan(n, m, d, runtime.on_gpu())
    xh, xl = fixed_split(src.x)
    yh, yl = (xh, xl) if tgt is src else fixed_split(tgt.x)
    split = plan.constexprs["SPLIT"]
    part = torch.empty(split * n, dtype=torch.float32, device=src.x.device)
    launch(apply_plan_kernel, plan.grid,
           (xh, xl, yh, yl, src.sqnorm, tgt.sqnorm, f.contiguous(), g.contiguous(), prm, prm,
            n, m, part, part),
           plan.constexprs, num_warps=plan.num_warps, num_stages=plan.num_stages)
    return part.view(split, n).sum(0) if split > 1 else part
