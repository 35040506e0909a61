"""The quantities of :mod:`parity.quantities` computed with the PyTorch frontend ``torch_api``.

Each group runs one solve (or one divergence / SamplesLoss call) whose autograd graph serves all
of the group's quantities. Inputs are the case's float32 arrays on the first CUDA device (CPU
without one: the Triton interpreter). Results come back as float64 numpy arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

import torch_api

from .cases import Case, Inputs
from .solve_settings import SolveRecord, divergence_terms, geomloss_options, solve_kwargs, stop_kwargs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().double().cpu().numpy()


def _tensors(inp: Inputs, *names: str, grad: bool = False) -> list[torch.Tensor]:
    return [torch.tensor(getattr(inp, k), device=DEVICE).requires_grad_(grad) for k in names]


def _record(out: Any) -> SolveRecord:
    errs = out.errors.detach().cpu().numpy()
    measured = errs[errs >= 0]
    return SolveRecord(converged=bool(out.converged), n_iters=int(out.n_iters),
                       last_error=float(measured[-1]) if measured.size else float("nan"))


def compute(case: Case, inp: Inputs, groups: tuple[str, ...]) -> tuple[dict[str, np.ndarray], dict[str, SolveRecord]]:
    """Values of every quantity in ``groups`` and the solves' records (keyed by group)."""
    kw = solve_kwargs(case, inp, torch_api.ImplicitOptions)
    kw.update({k: torch.tensor(v, device=DEVICE) for k, v in inp.labels().items()})
    vals: dict[str, np.ndarray] = {}
    recs: dict[str, SolveRecord] = {}
    vx, vy, wf, wg = _tensors(inp, "vx", "vy", "wf", "wg")
    if {"solve", "grad", "hvp", "pot_vjp", "hvp_default"} & set(groups):
        x, y, a, b = _tensors(inp, "x", "y", "a", "b", grad=True)
        out = torch_api.sinkhorn(x, y, a, b, **kw)
        recs["solve"] = _record(out)
        vals.update(f=_np(out.f), g=_np(out.g), reg_ot_cost=_np(out.reg_ot_cost))
        if {"grad", "hvp"} & set(groups):
            keep = "pot_vjp" in groups  # out.f, out.g are differentiated afterwards
            gx, gy, ga, gb = torch.autograd.grad(out.reg_ot_cost, (x, y, a, b), create_graph="hvp" in groups,
                                                 retain_graph=keep or "hvp" in groups)
            vals.update(grad_x=_np(gx), grad_y=_np(gy), grad_a=_np(ga), grad_b=_np(gb))
            if "hvp" in groups:
                vals["hvp_x"] = _np(torch.autograd.grad((gx * vx).sum(), x, retain_graph=keep)[0])
                hy, _ = torch_api.hvp(x.detach(), y.detach(), vy, wrt="y", a=a.detach(), b=b.detach(), **kw)
                vals["hvp_y"] = _np(hy)
        if "hvp_default" in groups:  # the library's default CG options at a converged forward
            dkw = {**kw, "implicit": None}
            for side, v in (("x", vx), ("y", vy)):
                h, _ = torch_api.hvp(x.detach(), y.detach(), v, wrt=side, a=a.detach(), b=b.detach(), **dkw)
                vals[f"hvp_default_{side}"] = _np(h)
        if "pot_vjp" in groups:
            phi = (wf * torch.where(a > 0, out.f, 0.0)).sum() + (wg * torch.where(b > 0, out.g, 0.0)).sum()
            for k, t in zip("xyab", torch.autograd.grad(phi, (x, y, a, b))):
                vals[f"pot_vjp_{k}"] = _np(t)
    if "hess" in groups:
        x, y, a, b = _tensors(inp, "x", "y", "a", "b")
        hess = torch.autograd.functional.hessian(lambda z: torch_api.sinkhorn(z, y, a, b, **kw).reg_ot_cost, x)
        vals["hess_xx"] = _np(hess)
    if "div" in groups:
        x, y = _tensors(inp, "x", "y", grad=True)
        a, b = _tensors(inp, "a", "b")
        div, dout = torch_api.sinkhorn_divergence(x, y, a, b, **kw)
        host = lambda ts: [None if t is None else t.detach().cpu() for t in ts]  # noqa: E731
        recs["div"] = SolveRecord.of_divergence(host(dout.converged), host(dout.n_iters), host(dout.errors))
        gx, gy = torch.autograd.grad(div, (x, y), create_graph=True)
        vals.update(div=_np(div), div_grad_x=_np(gx), div_grad_y=_np(gy), div_terms=divergence_terms(dout.costs))
        vals["div_hvp_y"] = _np(torch.autograd.grad((gy * vy).sum(), y)[0])
        hx, _ = torch_api.hvp(x.detach(), y.detach(), vx, a=a, b=b, loss="sinkhorn_divergence", **kw)
        vals["div_hvp_x"] = _np(hx)
    if "samples_loss" in groups:
        x, y = _tensors(inp, "x", "y", grad=True)
        a, b = _tensors(inp, "a", "b")
        opts = geomloss_options(case, inp)
        loss = torch_api.SamplesLoss("sinkhorn", precision=case.precision, **opts)(a, x, b, y)
        vals.update(sl_value=_np(loss), sl_grad_x=_np(torch.autograd.grad(loss, x)[0]))
        F, G = torch_api.SamplesLoss("sinkhorn", potentials=True, precision=case.precision, **opts)(
            a, x.detach(), b, y.detach())
        vals.update(sl_f=_np(F), sl_g=_np(G))
    if "stop" in groups:
        x, y, a, b = _tensors(inp, "x", "y", "a", "b")
        out = torch_api.sinkhorn(x, y, a, b, **stop_kwargs(case, inp))
        recs["stop"] = _record(out)
        vals.update(stop_f=_np(out.f), stop_g=_np(out.g))
    return vals, recs
