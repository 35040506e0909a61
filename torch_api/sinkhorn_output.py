"""The result of :func:`torch_api.sinkhorn` (conventions: torch_api/sinkhorn_solver.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ot_triton_jax.core import checks as rules

from . import sinkhorn_ops as ops
from .checks import READER


@dataclass(eq=False)
class SinkhornOutput:
    """Result of :func:`torch_api.sinkhorn`, OTT's fields and methods.

    Attributes:
        f, g: dual potentials (float32), OTT convention (f carries eps log a; -inf where a = 0).
        errors: (ceil(max_iterations / inner_iterations),) float32 marginal errors on the
            solve's device (OTT convention: +inf not measured, -1 not run).
        converged: 0-d bool tensor on the solve's device: no NaN in ``errors`` and
            ``errors[-1] < threshold``.
        n_iters: 0-d int32 tensor on the solve's device, Sinkhorn iterations run
            (each is a g- then an f-update).
        epsilon, scale_cost: as given (number or 0-d tensor); threshold, inner_iterations,
            precision: as given.
        reg_ot_cost (property): 0-d float32 tensor, differentiable in x, y, a, b and in
            epsilon / scale_cost when they are tensors that require grad.
        tau_a, tau_b: OTT's relaxation of each marginal (1: strict; core/unbalanced.py). With a
            tau < 1, reg_ot_cost is OTT's relaxed cost (first derivatives only) and derivatives
            of f, g, apply, marginal and transport_mass raise NotImplementedError.

    With a label cost (``label_x``, ``label_y``, ``label_cost`` of :func:`torch_api.sinkhorn`) the
    plan is that of ``C_ij = s (|x_i - y_j|^2 + W[label_x_i, label_y_j])``; apply, marginal and
    transport_mass use it, and their derivatives (those of f, g) raise NotImplementedError.
    """

    f: torch.Tensor
    g: torch.Tensor
    errors: torch.Tensor
    converged: torch.Tensor
    n_iters: torch.Tensor
    epsilon: float | torch.Tensor
    scale_cost: float | torch.Tensor
    threshold: float | torch.Tensor
    inner_iterations: int
    precision: str
    _x: torch.Tensor  # the problem as given (x, y, a, b; uniform weights when None)
    _y: torch.Tensor
    _a: torch.Tensor
    _b: torch.Tensor
    _eps: torch.Tensor  # epsilon, scale_cost as 0-d tensors (the user's when given as tensors)
    _scale: torch.Tensor
    _mass_from_plan: bool = False  # "tf32": sum P from a pass (symmetric solves) rather than sum a
    _mass: torch.Tensor | None = None  # sum P (float64), once computed
    _implicit: str = "1e-05;0.0;500;none;3;1"  # core.implicit_solve.options_key of the CG options
    tau_a: float = 1.0
    tau_b: float = 1.0
    _labels: tuple | None = None  # (label_x, label_y, label_cost) of a labelled cost (torch_api.label_inputs)

    @property
    def _balanced(self) -> bool:
        return self.tau_a == 1.0 and self.tau_b == 1.0

    @property
    def potentials(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.f, self.g

    @property
    def a(self) -> torch.Tensor:
        return self._a

    @property
    def b(self) -> torch.Tensor:
        return self._b

    def _label_args(self, axis: int) -> tuple:
        """(lx, ly, W) of the plan's rows x (axis 1) or (ly, lx, W^T) of its transpose (axis 0)."""
        if self._labels is None:
            return (None, None, None)
        lx, ly, w = self._labels
        return (lx, ly, w) if axis == 1 else (ly, lx, w.t().contiguous())

    def _detached(self):
        return self._x.detach(), self._y.detach(), self._eps.detach(), self._scale.detach()

    @property
    def reg_ot_cost(self) -> torch.Tensor:
        """OTT's reg_ot_cost at (f, g) (sinkhorn_solver docstring). Its mass term sum P is
        computed on first access and kept (one streaming pass with "float32"); every access
        returns a fresh autograd node (envelope gradient), so reading it under
        ``torch.no_grad`` does not stop a later backward."""
        if self._mass is None:
            x, y, eps, scale = self._detached()
            if self.precision == "float32" or self._mass_from_plan or not self._balanced:
                self._mass = ops.sinkhorn_plan_mass(x, y, self.f.detach(), self.g.detach(), eps, scale,
                                                    self.precision, *self._label_args(1))
            else:  # "tf32", balanced: sum a, the plan's mass right after the final f-update
                self._mass = self._a.detach().to(torch.float32).double().sum()
        # f, g detached: the envelope gradient holds them fixed (their own VJP is not needed here)
        return ops.sinkhorn_reg_ot_cost(self._x, self._y, self._a, self._b, self._eps, self._scale,
                                        self.f.detach(), self.g.detach(), self._mass, self.precision,
                                        self._implicit, self.tau_a, self.tau_b, *self._label_args(1))

    def apply(self, v: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Matrix-free transport of ``v`` (OTT's axis convention), float32.

        axis=0: ``v`` is indexed by the x points, shape (n,) or (n, k); returns P^T v.
        axis=1: ``v`` is indexed by the y points, shape (m,) or (m, k); returns P v.
        Differentiable in x, y, a, b (through the potentials) and v; in epsilon or
        scale_cost it raises.
        """
        ax = rules.axis(axis)
        x, y, eps, scale = self._x, self._y, self._eps, self._scale
        src, tgt, fs, gt = (y, x, self.g, self.f) if ax == 0 else (x, y, self.f, self.g)
        k = tgt.shape[0]
        rules.transport_vector(READER, v, k, ax, READER.device(x))
        out = ops.sinkhorn_apply(src, tgt, fs, gt, eps, scale, v.reshape(k, -1), self.precision,
                                 *self._label_args(ax))
        return out.reshape((src.shape[0],) + tuple(v.shape[1:]))

    def marginal(self, axis: int) -> torch.Tensor:
        """OTT's ``marginal(axis)``: axis=0 gives P^T 1 (size m), axis=1 gives P 1 (size n).
        Differentiable as :meth:`apply`."""
        ax = rules.axis(axis)
        x, y, eps, scale = self._x, self._y, self._eps, self._scale
        if ax == 1:
            return ops.sinkhorn_apply(x, y, self.f, self.g, eps, scale, None, self.precision, *self._label_args(1))
        return ops.sinkhorn_apply(y, x, self.g, self.f, eps, scale, None, self.precision, *self._label_args(0))

    def marginals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(P 1, P^T 1): the row (size n) and column (size m) marginals of the plan."""
        return self.marginal(1), self.marginal(0)

    @property
    def transport_mass(self) -> torch.Tensor:
        """sum P (0-d float32), from the row marginal."""
        return self.marginal(1).sum()
