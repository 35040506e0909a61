"""Functional entropic OT solver with OTT-JAX conventions, on streaming kernels.

Conventions (identical to ``ott.solvers.linear.sinkhorn.Sinkhorn`` on a
``PointCloud(x, y, epsilon=epsilon, scale_cost=scale_cost)``, and to
``ot_triton_jax.sinkhorn``):

* cost C_ij = |x_i - y_j|^2 / scale_cost, epsilon absolute;
* plan P_ij = exp((f_i + g_j - C_ij) / epsilon): no a (x) b factor, so f carries
  epsilon*log a (and is -inf where a_i = 0; likewise g);
* alternating updates, g first, then f:
      g_j <- eps log b_j - eps LSE_i((f_i - C_ij)/eps)
      f_i <- eps log a_i - eps LSE_j((g_j - C_ij)/eps)
* the marginal error ||P^T 1 - b||_1 is measured after iteration ``it`` (0-based)
  when ``it % inner_iterations == inner_iterations - 1`` and ``it >= min_iterations``,
  and after the last iteration ``max_iterations - 1``; ``errors[k]`` (float32, on the
  solve's device, length ceil(max_iterations / inner_iterations)) holds the error of
  the k-th block of ``inner_iterations`` iterations (+inf: run but not measured, -1:
  not run). After a measured block the loop stops if the error is below ``threshold``
  or not finite (errors and threshold compared in float32). ``converged`` (0-d bool
  tensor) = no NaN in ``errors`` and ``errors[-1] < threshold``; ``n_iters`` (0-d
  int32 tensor) = iterations run, never more than ``max_iterations``. Both are tensors
  on the solve's device, as in the JAX frontend (``bool(out.converged)``,
  ``int(out.n_iters)`` read them);
* ``reg_ot_cost`` = sum_{a>0} a (f - eps log a) + sum_{b>0} b (g - eps log b)
  + eps (sum a sum b - sum P), OTT's dual objective at the final (f, g). With
  precision "float32", sum P comes from one extra streaming pass with an unbiased
  cross term (``kernel_ops.exact_row_mass``, "fixed4"): the tensor cores' truncating
  accumulation shrinks <x, y> by a relative ~1e-7 during the solve, and since the
  dual objective is stationary in (f, g), evaluating it with the unbiased cost
  removes that bias from the reported cost to first order. With "tf32", sum P is
  taken as sum a (its value right after the final f-update). The mass term is
  computed when ``reg_ot_cost`` is first read (and kept), so a solve whose cost is
  never read skips that pass.

The marginal error of a state is read off the *next* g-update for free
(kernels/lse.py), so checking convergence costs no extra pass except after
the last iteration.

Derivatives: ``reg_ot_cost`` is differentiable in x, y, a, b and, when they are
tensors that require grad, in ``epsilon`` and ``scale_cost``, by the envelope
theorem (potentials held fixed, OTT's Danskin mode; the formulas of the JAX
frontend's ``cost_grads``, see :func:`torch_api.sinkhorn_ops.sinkhorn_cost_grads`):
streaming P@y / P^T@x passes, memory O((n + m) d). Second order: the backward of
``reg_ot_cost`` is itself differentiable in x, y, a, b (``create_graph=True``, then a
second backward: the Hessian applied by streaming CG on the implicit system,
:mod:`torch_api.implicit_ops`; derivatives in the weights along mass-preserving
directions, :mod:`ot_triton_jax.core.implicit_derivatives`). ``f``, ``g``, ``apply``,
``marginal`` and ``transport_mass`` carry the implicit VJP (OTT's ImplicitDiff) in x,
y, a, b; f and g are defined up to (f + t, g - t) and their derivative is that of the
potentials with sum_{a>0} f - sum_{b>0} g held fixed (exact for every gauge-invariant
function of them). Derivatives through epsilon / scale_cost beyond the first order of
``reg_ot_cost`` raise ``NotImplementedError``.

Unbalanced (KL-relaxed) marginals: ``tau_a``, ``tau_b`` in (0, 1] as OTT's
``LinearProblem(geom, a, b, tau_a, tau_b)`` (1: strict; rho = eps tau / (1 - tau); the
rules are stated once in :mod:`ot_triton_jax.core.unbalanced`). With a tau < 1:

* the updates are damped, g <- tau_b (eps log b - eps LSE_i((f_i - C_ij)/eps)), then
  f <- tau_a (eps log a - eps LSE_j(...)); the masses of a and b may differ;
* the marginal error is OTT's ||P 1 - a e^{-f/rho_a}||_1 + ||P^T 1 - b e^{-g/rho_b}||_1
  (the first term is 0 after the f-update; the second is read off the next g-update);
* ``reg_ot_cost`` = div_a + div_b + eps (sum a sum b - sum P), each div OTT's
  (``unbalanced.ott_marginal_term``: -sum_{a>0} a rho_a (exp(-(f - eps log a)/rho_a) - 1)
  on a relaxed side, the balanced term on a strict one), sum P from the exact mass pass
  (also with "tf32");
* its first derivatives are OTT's (implicit_diff): in x, y the same envelope formula, in a,
  b, epsilon (and scale_cost) the partial derivatives of the formula at fixed (f, g)
  (``unbalanced.ott_marginal_partials``);
* second derivatives of ``reg_ot_cost`` in x, y (``create_graph=True`` then a second backward,
  :func:`torch_api.hvp`) differentiate that envelope gradient with the potentials moving, and
  ``f``, ``g``, ``apply``, ``marginal``, ``transport_mass`` carry the implicit VJP of OTT's
  relaxed fixed point P 1 = a e^{-f/rho_a}, P^T 1 = b e^{-g/rho_b} (no gauge: the derivative of
  the potentials themselves), both by streaming CG on the relaxed system
  (:mod:`ot_triton_jax.core.implicit_solve`);
* NOT implemented, raising ``NotImplementedError`` when asked for: second derivatives
  involving a or b (their first derivatives are partials at fixed potentials), and second
  derivatives on the multiscale backend (which takes tau_a, tau_b with the same first
  derivatives: ``multiscale.sinkhorn``).

Label costs: ``label_x``, ``label_y``, ``label_cost`` add W[label_x_i, label_y_j] to the squared
distance (``C_ij = s (|x_i - y_j|^2 + W[label_x_i, label_y_j])``; :mod:`torch_api.label_inputs`).

torch.compile: the solve, the cost, its gradient and the plan applications are
``torch.library`` custom ops (:mod:`torch_api.sinkhorn_ops`), so
``torch.compile(fullgraph=True)`` traces ``sinkhorn(...)``, its outputs and the
backward of ``reg_ot_cost`` without graph breaks. ``epsilon``, ``scale_cost`` and
``threshold`` may be numbers or 0-d tensors: a new value passed as a tensor never
recompiles (a number is a constant of the compiled graph until Dynamo sees a second
value and makes it a graph input: one recompile).

Bad input: shapes, dtypes, devices and the loop options raise at the call (at trace
time under torch.compile); values (finite points, weights >= 0 and not all zero,
equal masses, epsilon, scale_cost and threshold > 0) are checked inside the solve op,
so they raise eagerly (reading them synchronizes with the GPU, as the early-stopping
loop does anyway) and raise at run time in a compiled function, without a graph break.
A number given for epsilon / scale_cost / threshold is also checked at the call;
``tau_a`` / ``tau_b`` (Python numbers) are always checked at the call.
"""

from __future__ import annotations

import torch

from ot_triton_jax.core import checks as rules, multiscale_rules as mrules, unbalanced
from ot_triton_jax.core.multiscale_rules import MultiscaleOptions
from ot_triton_jax.core.implicit_solve import ImplicitOptions, implicit_options, options_key

from . import checks as check
from . import label_inputs
from . import sinkhorn_ops as ops
from .checks import READER
from .multiscale.sinkhorn import MultiscaleSinkhornOutput, sinkhorn_multiscale
from .sinkhorn_output import SinkhornOutput
from .batched import BatchedSinkhornOutput, sinkhorn_batch
from .call_args import prepare, weights_shape

__all__ = ["sinkhorn", "SinkhornOutput", "MultiscaleOptions", "MultiscaleSinkhornOutput"]


def _multiscale(x, y, a, b, epsilon, scale_cost, threshold, precision, options, tau_a=1.0, tau_b=1.0,
                **dense_options):
    mrules.reject_dense_options(**dense_options)
    check.points("x", x)
    check.points("y", y)
    check.pair(x, y)
    a = weights_shape("a", a, x, "x")
    b = weights_shape("b", b, y, "y")
    return sinkhorn_multiscale(x, y, a, b, epsilon=epsilon, scale_cost=scale_cost, threshold=threshold,
                               precision=check.precision(precision), options=options, tau_a=tau_a, tau_b=tau_b)


def sinkhorn(
    x: torch.Tensor,
    y: torch.Tensor,
    a: torch.Tensor | None = None,
    b: torch.Tensor | None = None,
    *,
    epsilon: float | torch.Tensor,
    scale_cost: float | torch.Tensor = 1.0,
    threshold: float | torch.Tensor = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    init: tuple[torch.Tensor, torch.Tensor] | None = None,
    implicit: ImplicitOptions | None = None,
    multiscale: MultiscaleOptions | None = None,
    tau_a: float = 1.0,
    tau_b: float = 1.0,
    label_x: torch.Tensor | None = None,
    label_y: torch.Tensor | None = None,
    label_cost: torch.Tensor | None = None,
) -> SinkhornOutput | MultiscaleSinkhornOutput | BatchedSinkhornOutput:
    """Entropic OT between point clouds x (n, d) and y (m, d) with OTT-JAX conventions.

    See the module docstring for the exact conventions, derivatives, torch.compile and
    the behaviour on bad input. ``a``/``b`` default to uniform weights 1/n, 1/m and
    must have equal total mass unless a tau < 1. ``epsilon`` and ``scale_cost`` are numbers or 0-d
    tensors (differentiable when they require grad). ``precision`` is "float32"
    (float32-accurate) or "tf32" (faster, ~1e-3 relative LSE error).
    ``init`` = (f0, g0) warm-starts the potentials. Inputs are never modified;
    float16/bfloat16/float64 inputs are computed in float32. Non-convergence is
    reported through ``converged=False`` and ``errors``, never silently. ``implicit``:
    :class:`ImplicitOptions` of the conjugate-gradient solve behind second derivatives and
    the derivatives of f, g, ``apply`` and ``marginal`` (None: the defaults).
    ``multiscale``: a :class:`MultiscaleOptions` solves the same problem (d <= 3) with the
    multiscale backend instead (eps-scaling from the clusters, truncated block-sparse sweeps,
    stopping at marginal error ``threshold``) and returns a :class:`MultiscaleSinkhornOutput`
    (:mod:`torch_api.multiscale.sinkhorn`: its conventions and derivatives); the loop options,
    ``init`` and ``implicit`` then raise.
    ``tau_a``, ``tau_b``: OTT's KL relaxation of the marginals of a and b, in (0, 1] (1:
    strict, the default; see the module docstring and :mod:`ot_triton_jax.core.unbalanced`):
    with a tau < 1 the masses may differ, ``reg_ot_cost`` is OTT's relaxed cost with its first
    derivatives and its second derivatives in x, y; f, g, apply and marginal carry the relaxed
    implicit VJP; second derivatives involving a or b raise ``NotImplementedError``.
    Batches: x (B, n, d), y (B, m, d), a (B, n), b (B, m) (or None) solve the B problems in one
    packed loop (:func:`torch_api.sinkhorn_batch`, one epsilon, scale_cost and tau_a, tau_b for the
    batch) and return its :class:`BatchedSinkhornOutput` (each problem's f, g, (B,) reg_ot_cost,
    with the single call's derivatives (:mod:`torch_api.batched`), n_iters, converged, errors); ``init`` and ``multiscale``
    then raise. A batch with a label cost (label_x (B, n), label_y (B, m), one ``label_cost``) is solved
    problem by problem (the packed kernels have no label lookup; ``jax.vmap`` does the same), each
    output that of its single call (its reg_ot_cost with all of the single call's derivatives).
    ``label_x`` (n,), ``label_y`` (m,) integer classes and ``label_cost`` W (K_x, K_y): the
    label-augmented cost ``C_ij = s (|x_i - y_j|^2 + W[label_x_i, label_y_j])``, s = 1 / scale_cost
    (flash-sinkhorn's and OTDD's; rules in :mod:`ot_triton_jax.core.labels`). All three or none;
    shapes, dtypes, label ranges and a finite W are checked at the call (a device sync). The
    first derivatives of reg_ot_cost in x, y (envelope formula with the labelled plan), a, b,
    epsilon and scale_cost are exact; none in label_cost; derivatives of f, g, apply, marginal,
    second derivatives and the multiscale backend raise NotImplementedError.
    """
    tau_a, tau_b = unbalanced.check_tau("tau_a", tau_a), unbalanced.check_tau("tau_b", tau_b)
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and (x.dim() == 3 or y.dim() == 3):
        return _batch(x, y, a, b, dict(epsilon=epsilon, scale_cost=scale_cost, threshold=threshold,
                                       inner_iterations=inner_iterations, min_iterations=min_iterations,
                                       max_iterations=max_iterations, precision=precision, tau_a=tau_a, tau_b=tau_b,
                                       implicit=implicit),
                      (label_x, label_y, label_cost), init=init, multiscale=multiscale)
    labels = label_inputs.checked(label_x, label_y, label_cost, x.shape[0], y.shape[0])
    if multiscale is not None and labels is not None:
        raise NotImplementedError("the multiscale backend has no label cost: pass multiscale=None with label_cost")
    if multiscale is not None:
        return _multiscale(x, y, a, b, epsilon, scale_cost, threshold, precision, multiscale, tau_a, tau_b,
                           inner_iterations=inner_iterations, min_iterations=min_iterations,
                           max_iterations=max_iterations, init=init, implicit=implicit)
    a, b, eps, scale, thr, opts = prepare(x, y, a, b, epsilon, scale_cost, threshold, inner_iterations,
                                          min_iterations, max_iterations, precision)
    f0 = g0 = None
    if init is not None:
        rules.init_shapes(init, x.shape[0], y.shape[0], READER.shape)
        f0, g0 = (v.detach().to(device=x.device, dtype=torch.float32) for v in init)
    key = options_key(implicit_options(implicit))
    # not detached: f and g carry the implicit VJP in x, y, a, b (torch_api.implicit_ops)
    f, g, errors, n_iters, converged = ops.solve(
        x, y, a, b, eps, scale, thr.detach(), opts.inner_iterations, opts.min_iterations, opts.max_iterations,
        opts.precision, f0, g0, key, tau_a, tau_b, *(labels or (None, None, None)))
    return SinkhornOutput(f=f, g=g, errors=errors, converged=converged, n_iters=n_iters, epsilon=epsilon,
                          scale_cost=scale_cost, threshold=threshold, inner_iterations=opts.inner_iterations,
                          precision=opts.precision, _x=x, _y=y, _a=a, _b=b, _eps=eps, _scale=scale,
                          _implicit=key, tau_a=tau_a, tau_b=tau_b, _labels=labels)


def _batch(x, y, a, b, kw: dict, labels: tuple, **unsupported) -> BatchedSinkhornOutput:
    """:func:`sinkhorn` of a (B, n, d) batch: :func:`torch_api.sinkhorn_batch`, which takes
    neither warm starts nor the multiscale backend. With a label cost (label_x (B, n), label_y
    (B, m), one W) the problems are solved one by one, each its single labelled call (the packed
    kernels have no label lookup), and the (B,) outputs stacked."""
    label_x, label_y, label_cost = labels
    rules.batch_shapes(x.shape, y.shape, {"a": (_shape(a), "x"), "b": (_shape(b), "y"),
                                          "label_x": (_shape(label_x), "x"), "label_y": (_shape(label_y), "y")})
    for name, value in unsupported.items():
        if value is not None:
            raise NotImplementedError(f"sinkhorn on a (B, n, d) batch takes no {name} (torch_api.sinkhorn_batch "
                                      f"does not): pass {name}=None, or call sinkhorn per problem")
    if all(v is None for v in labels):
        return sinkhorn_batch(x, y, a, b, **kw)
    if label_x is None or label_y is None:
        raise ValueError("a batch with a label cost needs label_x (B, n) and label_y (B, m) with label_cost")
    row = lambda v, k: None if v is None else v[k]  # noqa: E731
    outs = [sinkhorn(x[k], y[k], row(a, k), row(b, k), label_x=label_x[k], label_y=label_y[k],
                     label_cost=label_cost, **kw) for k in range(x.shape[0])]
    return BatchedSinkhornOutput([o.f for o in outs], [o.g for o in outs],
                                 torch.stack([o.reg_ot_cost for o in outs]), torch.stack([o.n_iters for o in outs]),
                                 torch.stack([o.converged for o in outs]),
                                 torch.stack([o.errors for o in outs]))


def _shape(v):
    return None if v is None else tuple(v.shape)
