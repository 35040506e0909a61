"""Functional entropic OT solver with OTT-JAX conventions, on streaming kernels.

Conventions (identical to ``ott.solvers.linear.sinkhorn.Sinkhorn`` on a
``PointCloud(x, y, epsilon=epsilon, scale_cost=scale_cost)``):

* cost C_ij = |x_i - y_j|^2 / scale_cost, epsilon absolute;
* plan P_ij = exp((f_i + g_j - C_ij) / epsilon): no a (x) b factor, so f carries
  epsilon*log a (and is -inf where a_i = 0; likewise g);
* alternating updates, g first, then f:
      g_j <- eps log b_j - eps LSE_i((f_i - C_ij)/eps)
      f_i <- eps log a_i - eps LSE_j((g_j - C_ij)/eps)
* the marginal error ||P^T 1 - b||_1 is measured after iteration ``it`` when
  ``it % inner_iterations == inner_iterations - 1`` and ``it >= min_iterations``
  (and always after the last iteration); ``errors[k]`` holds the error of the
  k-th block of ``inner_iterations`` iterations, +inf if not measured, -1 if not
  run. The loop stops after a block whose error is below ``threshold`` (or not
  finite); ``converged`` is False whenever it stopped for any other reason;
* ``reg_ot_cost`` = sum_{a>0} a (f - eps log a) + sum_{b>0} b (g - eps log b)
  + eps (sum a sum b - sum P), OTT's dual objective at the final (f, g). With
  precision "float32", sum P comes from one extra streaming pass with an unbiased
  cross term (``kernel_calls.exact_row_mass``, "fixed4"): the tensor cores' truncating
  accumulation shrinks <x, y> by a relative ~1e-7 during the solve, and since the
  dual objective is stationary in (f, g), evaluating it with the unbiased cost
  removes that bias from the reported cost to first order. With "tf32", sum P is
  taken as sum a (its value right after the final f-update). ``reg_ot_cost`` is
  computed when first read, so a solve whose cost is never read skips that pass.

The marginal error of a state is read off the *next* g-update for free
(kernels/lse.py), so checking convergence costs no extra pass except after
the last iteration.

Gradients of ``reg_ot_cost`` (envelope theorem: potentials held fixed, as
OTT's Danskin mode) in x, y, a, b come from streaming P@y / P^T@x passes;
memory stays O((n + m) d).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import checks as check
from .kernel_ops import Cloud, apply_plan, exact_row_mass, lse_update, params


@dataclass
class SinkhornOutput:
    """Result of :func:`sinkhorn`.

    Attributes:
        f, g: dual potentials (float32), OTT convention (f carries eps log a).
        reg_ot_cost: 0-d tensor, differentiable in x, y, a, b (a property: computed on
            first access, one streaming pass for its mass term with "float32").
        errors: (ceil(max_iterations / inner_iterations),) float64 CPU tensor.
        converged: whether the last measured marginal error is below threshold.
        n_iters: Sinkhorn iterations run (each is a g- then an f-update).
    """

    f: torch.Tensor
    g: torch.Tensor
    errors: torch.Tensor
    converged: bool
    n_iters: int
    epsilon: float
    scale_cost: float
    precision: str
    _x: Cloud
    _y: Cloud
    _params: torch.Tensor
    _inputs: tuple  # (x, y, a, b) as given, and a, b in float32
    _cost: torch.Tensor | None = None  # value of reg_ot_cost, once computed

    @property
    def reg_ot_cost(self) -> torch.Tensor:
        """OTT's reg_ot_cost at (f, g) (module docstring). The value is computed on first
        access and kept; every access returns a fresh autograd node (envelope gradient),
        so reading it under ``torch.no_grad`` does not stop a later backward."""
        x, y, a, b, a32, b32 = self._inputs
        if self._cost is None:
            with torch.no_grad():
                mass = _plan_mass(self._x, self._y, self.f, self.g, a32, self._params, self.precision)
                self._cost = _cost_value(self.f, self.g, a32, b32, self.epsilon, mass)
        return _RegOTCost.apply(x, y, a, b, self, a32, b32)

    def apply(self, v: torch.Tensor, axis: int = 0) -> torch.Tensor:
        """Matrix-free transport of ``v`` (OTT's axis convention).

        axis=0: ``v`` is indexed by the x points, shape (n,) or (n, k); returns P^T v.
        axis=1: ``v`` is indexed by the y points, shape (m,) or (m, k); returns P v.
        """
        if axis not in (0, 1):
            raise ValueError(f"axis must be 0 (returns P^T v) or 1 (returns P v); got {axis!r}")
        src, tgt, fs, ft = (self._y, self._x, self.g, self.f) if axis == 0 else (self._x, self._y, self.f, self.g)
        if not isinstance(v, torch.Tensor) or v.ndim not in (1, 2) or v.shape[0] != tgt.n:
            shape = tuple(v.shape) if isinstance(v, torch.Tensor) else type(v).__name__
            raise ValueError(f"v must be a tensor of shape ({tgt.n},) or ({tgt.n}, k) for axis={axis}; got {shape}")
        if v.device != tgt.x.device:
            raise ValueError(f"v must be on device {tgt.x.device}; got {v.device}")
        vv = v.reshape(tgt.n, -1)
        out, _ = apply_plan(src, tgt, fs, ft, self._params, self.precision, vv)
        return out.reshape((src.n,) + tuple(v.shape[1:]))

    def marginals(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(P 1, P^T 1): the row (size n) and column (size m) marginals of the plan."""
        _, rows = apply_plan(self._x, self._y, self.f, self.g, self._params, self.precision)
        _, cols = apply_plan(self._y, self._x, self.g, self.f, self._params, self.precision)
        return rows, cols


def _masked_log(w: torch.Tensor) -> torch.Tensor:
    return torch.where(w > 0, w.clamp_min(torch.finfo(w.dtype).tiny).log(), -torch.inf)


def _solve(X: Cloud, Y: Cloud, a, b, prm, precision, threshold, inner, min_it, max_it, init):
    la, lb = _masked_log(a), _masked_log(b)
    if init is None:
        f = torch.where(a > 0, 0.0, -torch.inf)
        g = torch.where(b > 0, 0.0, -torch.inf)
    else:
        f, g = init
    errors = [-1.0] * math.ceil(max_it / inner)
    it, pending = 0, False
    while it < max_it:
        # the previous potential predicts the LSE shift (kernels/lse.py, FOLD; verified in
        # the kernel); not for the very first g-update, as in the JAX solver (same launches)
        g_new, err = lse_update(Y, X, f, prm, precision, logw_out=lb, pold=g, compute_err=pending,
                                fold=it > 0)
        if pending:
            e = float(err.double().sum())
            errors[(it - 1) // inner] = e
            pending = False
            at_block_end = it % inner == 0
            if at_block_end and it >= min_it and (not math.isfinite(e) or e < threshold):
                break
        g = g_new
        f, _ = lse_update(X, Y, g, prm, precision, logw_out=la, pold=f, compute_err=False, fold=True)
        errors[it // inner] = math.inf
        pending = it == max_it - 1 or (it % inner == inner - 1 and it >= min_it)
        it += 1
    if pending:
        _, err = lse_update(Y, X, f, prm, precision, logw_out=lb, pold=g)
        errors[(it - 1) // inner] = float(err.double().sum())
    converged = not any(math.isnan(e) for e in errors) and errors[-1] < threshold
    return f, g, torch.tensor(errors, dtype=torch.float64), converged, it


def _cost_value(f, g, a, b, eps, total: torch.Tensor) -> torch.Tensor:
    """OTT's reg_ot_cost at (f, g); ``total`` = sum P (float64)."""
    fa = torch.where(a > 0, a * (f - eps * _masked_log(a)), 0.0).double().sum()
    gb = torch.where(b > 0, b * (g - eps * _masked_log(b)), 0.0).double().sum()
    return (fa + gb + eps * (a.double().sum() * b.double().sum() - total)).to(torch.float32)


def _plan_mass(X: Cloud, Y: Cloud, f, g, a, prm, precision: str) -> torch.Tensor:
    """sum P for reg_ot_cost's mass term (module docstring), float64."""
    if precision == "float32":
        return exact_row_mass(X, Y, f, g, prm).double().sum()
    return a.double().sum()


class _RegOTCost(torch.autograd.Function):
    """reg_ot_cost as a function of (x, y, a, b); the backward is the envelope gradient."""

    @staticmethod
    def forward(ctx, x, y, a, b, sol: SinkhornOutput, a32, b32):
        ctx.sol, ctx.a32, ctx.b32 = sol, a32, b32
        ctx.dtypes = (x.dtype, y.dtype, a.dtype, b.dtype)
        return sol._cost.clone()

    @staticmethod
    def backward(ctx, gout):
        sol, a, b = ctx.sol, ctx.a32, ctx.b32
        eps, s = sol.epsilon, 1.0 / sol.scale_cost
        need_x, need_y, need_a, need_b = ctx.needs_input_grad[:4]
        gx = gy = ga = gb = None
        if need_x:
            py, r = apply_plan(sol._x, sol._y, sol.f, sol.g, sol._params, sol.precision, sol._y.x)
            gx = py.neg_().addcmul_(r[:, None], sol._x.x).mul_(2 * s * gout).to(ctx.dtypes[0])
        if need_y:
            px, c = apply_plan(sol._y, sol._x, sol.g, sol.f, sol._params, sol.precision, sol._x.x)
            gy = px.neg_().addcmul_(c[:, None], sol._y.x).mul_(2 * s * gout).to(ctx.dtypes[1])
        if need_a:
            base = eps * b.double().sum()
            ga = torch.where(a > 0, sol.f - eps * _masked_log(a) - eps + base, base)
            ga = (ga * gout).to(ctx.dtypes[2])
        if need_b:
            base = eps * a.double().sum()
            gb = torch.where(b > 0, sol.g - eps * _masked_log(b) - eps + base, base)
            gb = (gb * gout).to(ctx.dtypes[3])
        return gx, gy, ga, gb, None, None, None


def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    epsilon: float,
    scale_cost: float = 1.0,
    threshold: float = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SinkhornOutput:
    """Entropic OT between point clouds x (n, d) and y (m, d) with OTT-JAX conventions.

    See the module docstring for the exact conventions. ``a``/``b`` default to
    uniform weights 1/n, 1/m and must have equal total mass. ``precision`` is
    "float32" (float32-accurate) or "tf32" (faster, ~1e-3 relative LSE error).
    ``init`` = (f0, g0) warm-starts the potentials. Inputs are never modified;
    float16/bfloat16/float64 inputs are computed in float32. Non-convergence is
    reported through ``converged=False`` and ``errors``, never silently.
    """
    check.points("x", x)
    check.points("y", y)
    check.pair(x, y)
    check.finite("x", x)
    check.finite("y", y)
    a_in = check.weights("a", a, x.shape[0], x)
    b_in = check.weights("b", b, y.shape[0], y)
    check.balanced(a_in, b_in)
    eps = check.positive("epsilon", epsilon)
    scale = check.positive("scale_cost", scale_cost)
    check.iterations(threshold, inner_iterations, min_iterations, max_iterations)
    check.precision(precision)
    a32, b32 = a_in.detach().to(torch.float32), b_in.detach().to(torch.float32)
    if init is not None:
        if not (isinstance(init, (tuple, list)) and len(init) == 2):
            raise TypeError("init must be a pair (f0, g0) of tensors of shapes (n,), (m,)")
        f0, g0 = init
        if tuple(f0.shape) != (x.shape[0],) or tuple(g0.shape) != (y.shape[0],):
            raise ValueError(f"init must have shapes ({x.shape[0]},), ({y.shape[0]},); "
                             f"got {tuple(f0.shape)}, {tuple(g0.shape)}")
        init = (f0.detach().to(device=x.device, dtype=torch.float32).clone(),
                g0.detach().to(device=x.device, dtype=torch.float32).clone())

    with torch.no_grad():
        X, Y = Cloud(x), Cloud(y)
        prm = params(eps, 1.0 / scale, x.device)
        f, g, errors, converged, n_iters = _solve(X, Y, a32, b32, prm, precision, float(threshold),
                                                  inner_iterations, min_iterations, max_iterations, init)
    return SinkhornOutput(f=f, g=g, errors=errors, converged=converged, n_iters=n_iters, epsilon=eps,
                          scale_cost=scale, precision=precision, _x=X, _y=Y, _params=prm,
                          _inputs=(x, y, a_in, b_in, a32, b32))
