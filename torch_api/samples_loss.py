"""``SamplesLoss``: a drop-in for GeomLoss's ``SamplesLoss("sinkhorn", p=2, ...)`` on streaming kernels.

Conventions (those of ``geomloss.SamplesLoss("sinkhorn", p=2)``, version 0.3.1, checked
against its tensorized backend in tests/test_torch_samples_loss.py):

* cost C(x, y) = |x - y|^2 / 2, temperature eps = blur^2;
* softmin: softmin(eps, C, h)_i = -eps log sum_j exp(h_j - C_ij / eps), where
  h = log b + g / eps (zero weights drop out exactly);
* eps-schedule: ``ot_triton_jax.core.schedules.epsilon_schedule(2, diameter, blur, scaling)``
  = [diameter^2, exp(arange(2 log diameter, 2 log blur, 2 log scaling))..., blur^2];
  ``diameter`` defaults to the diagonal of the bounding box of all points of x and y
  (over the whole batch, as GeomLoss does);
* initialisation at eps_0 = first schedule value, from zero potentials:
  f_ba = softmin(C_xy, log b), g_ab = softmin(C_yx, log a) (and, with debias,
  f_aa = softmin(C_xx, log a), g_bb = softmin(C_yy, log b));
* for every eps of the schedule, symmetric averaged (simultaneous) updates
  f_ba <- (f_ba + softmin(C_xy, log b + g_ab/eps)) / 2, g_ab likewise from the old f_ba,
  and the same for f_aa, g_bb;
* last extrapolation at eps = blur^2: one simultaneous, non-averaged update of the
  four potentials from the final ones ("old" potentials below);
* value: debias -> <a, f_ba - f_aa> + <b, g_ab - g_bb>, else <a, f_ba> + <b, g_ab>;
  ``potentials=True`` returns (F, G) = (f_ba - f_aa, g_ab - g_bb) (debias) or
  (f_ba, g_ab).

KL-relaxed marginals (unbalanced OT; ``core.unbalanced`` holds the formulas):

* ``reach`` (GeomLoss): both marginals relaxed with rho = reach^2 (p = 2);
  ``reach_x`` / ``reach_y`` (flash-sinkhorn 0.4.1): the marginal of x (weights a), resp. of
  y (weights b), relaxed with rho_x = reach_x^2, resp. rho_y = reach_y^2; a side left None
  stays strict (both given: both relaxed, possibly with rho_x != rho_y). ``reach`` with
  ``reach_x`` / ``reach_y`` is an error; ``reach=r`` is ``reach_x=r, reach_y=r``. Each is None
  or a positive finite float. Masses may differ once a marginal is relaxed (weights are used
  as given: flash-sinkhorn normalises them to 1 by default, GeomLoss does not);
* the definition (flash-sinkhorn's ``SamplesLoss`` with its default symmetric backend and
  ``half_cost=True``, ``normalize=False``): S = OT(a, b) - OT(a, a)/2 - OT(b, b)/2 (debias;
  else OT(a, b)), where each of the three problems is solved by the loop above with rho_x on
  its FIRST marginal and rho_y on its SECOND: every softmin of a first-side potential is
  multiplied by damping(eps, rho_x) = 1 / (1 + eps / rho_x), of a second-side one by
  damping(eps, rho_y), at each eps (initialisation and last extrapolation included). So
  OT(a, a) has two potentials (p_a damped with rho_x, q_a with rho_y: the simultaneous
  averaged updates p <- softmin(C_xx, log a + q/eps), q <- softmin(C_xx, log a + p/eps)),
  likewise (p_b, q_b) for OT(b, b); with rho_x = rho_y (``reach``, or balanced) p = q and
  they are GeomLoss's symmetric f_aa, g_bb (one potential each, as computed here then);
* with exactly one relaxed marginal, every update of every problem (initial, averaged and
  last) is followed by flash-sinkhorn's closed-form translation along (f + c, g - c)
  (``unbalanced.semi_unbalanced_translate``; it removes the slow mode of the semi-unbalanced
  loop and changes the numbers a finite schedule returns);
* each OT value is <first weights, w_x(first potential)> + <second weights, w_y(second
  potential)> with w(f) = (rho + eps/2) (1 - exp(-f / rho)) on a relaxed side and w(f) = f on
  a strict one (GeomLoss's ``UnbalancedWeight``; flash-sinkhorn's ``_dual_cost``); no mass
  term is added (flash-sinkhorn adds none). Hence the value is <a, F> + <b, G> with
  F = w_x(f_ba) - (w_x(p_a) + w_y(q_a))/2, G = w_y(g_ab) - (w_x(p_b) + w_y(q_b))/2
  (= w_x(f_ba) - w_x(f_aa), ... when p = q: GeomLoss's loss for ``reach``);
* ``potentials=True`` returns (f_ba - (p_a + q_a)/2, g_ab - (p_b + q_b)/2) (debias; GeomLoss's
  (f_ba - f_aa, g_ab - g_bb) when p = q), else (f_ba, g_ab). flash-sinkhorn's
  ``potentials=True`` always returns the OT(a, b) potentials (f_ba, g_ab) and ignores
  ``debias``: ours coincide with them without debias;
* gradients (GeomLoss's rule, the last extrapolation differentiated with its inputs and the
  translation constant detached): grad_a = F, grad_b = G, and
  dx_i = a_i [damp_x w_x'(f_ba_i) (x_i - (P y)_i) - (damp_x w_x'(p_a,i) (x_i - (Q_q x)_i)
  + damp_y w_y'(q_a,i) (x_i - (Q_p x)_i)) / 2], Q_q (resp. Q_p) the row-normalised plan of the
  p (resp. q) update of OT(a, a), w'(f) = (1 + eps / (2 rho)) exp(-f / rho) (1 on a strict side;
  1 for the potentials); symmetrically in y with (p_b, q_b). On a relaxed side this is
  flash-sinkhorn's gradient (plan row masses exp(-f / rho) times x_i - barycentre, summed over
  both arguments of a self problem) times (rho + eps/2) / (rho + eps), the factor GeomLoss's
  autograd carries and flash-sinkhorn leaves out; on a strict side they are equal. Second
  derivatives of the loss in x, y: this gradient field is, at the fixed point,
  G_x = c_x grad_x R(x, y) - [c_x grad_1 R_a(x, x) + c_y grad_2 R_a(x, x)] / 2 (and G_y alike), R
  OTT's relaxed reg_ot_cost (tau = rho / (rho + eps) per marginal, tau = 1 strict), grad_1 / grad_2
  in a self problem's first / second cloud, c = (rho + eps/2) / (rho + eps) per side (1 strict;
  ``unbalanced.geomloss_hessian_sides``), and the second derivatives are its Jacobian J there. With
  ``reach`` (rho_x = rho_y) J is c times the Hessian of OTT's relaxed divergence; with reach_x !=
  reach_y J is not symmetric, and the double backward (``autograd.grad(<grad, v>, x)``) gives
  J^T v, as a VJP does. Those of the potentials raise NotImplementedError;
* GeomLoss has no one-sided reach: for ``reach`` (rho_x = rho_y, no translation) everything
  above is GeomLoss's ``SamplesLoss("sinkhorn", p=2, reach=...)``.

Label costs (flash-sinkhorn's ``label_cost_matrix`` with ``half_cost=True``, OTDD's augmented
cost): ``loss(x, y, label_x=lx, label_y=ly, label_cost=W)`` (or ``SamplesLoss(label_cost=W)``
and the labels per call), integer classes lx (N,), ly (M,) and a table W (K_x, K_y): the cost is
``C(x_i, y_j) = (|x_i - y_j|^2 + W[lx_i, ly_j]) / 2``, and with ``debias`` the self problems'
``C(x_i, x_k) = (|x_i - x_k|^2 + W[lx_i, lx_k]) / 2``, likewise for y (W must then be square and
symmetric). Everything above holds with these costs: the gradient formulas are unchanged (the
label term does not depend on the points; P and Q are the labelled plans), none flows to W, and
``reach`` / ``reach_x`` / ``reach_y`` compose. A (B, N, D) batch takes labels (B, N), (B, M) and
one W (its problems then run one by one, on the batch's eps schedule); the multiscale backend and
second derivatives raise NotImplementedError. Shapes, dtypes, label ranges and a finite W are
checked at the call.

Gradients are GeomLoss's, computed analytically (no backprop through the loop).
In GeomLoss only the last extrapolation is differentiable, with its input
potentials and log-weights detached, and with C_xy = C(x, y.detach()),
C_yx = C(y, x.detach()), C_xx = C(x, x.detach()), C_yy = C(y, y.detach()).
Hence F depends on x only, G on y only, F_i on x_i only, and with the
row-normalised plans of the last extrapolation

    P_ij = exp((f_ba_i + g_ab_old_j - C(x_i, y_j)) / eps) b_j       (sum_j P_ij = 1)
    Q_ik = exp((f_aa_i + f_aa_old_k - C(x_i, x_k)) / eps) a_k       (sum_k Q_ik = 1)

    dF_i / dx_i = sum_j P_ij (x_i - y_j) - sum_k Q_ik (x_i - x_k)
                = (Q x)_i - (P y)_i               (debias; without it: x_i - (P y)_i)

(symmetrically for G and y). The loss <a, F> + <b, G> therefore has
grad_x = a * ((Q x) - (P y)), grad_y likewise, grad_a = F, grad_b = G: the
envelope-theorem gradients of the Sinkhorn divergence. Each side costs one
streaming plan application per plan (``apply_plan``, which also returns the
row sums used to normalise exactly); nothing n x m is formed and memory is
O((n + m) d). The potentials returned with ``potentials=True`` are
differentiable in x and y with the same rule (as in GeomLoss; not in a, b,
which GeomLoss detaches too). Second derivatives are not supported: the
backward's op (``ot_triton::samples_loss_direction``) has no derivative, and
differentiating through it raises a RuntimeError naming it.

``torch.compile``: the solve and the backward direction are ``torch.library``
custom ops (``samples_loss_ops``), so ``torch.compile(..., fullgraph=True)``
traces forward and backward without a graph break. The diameter, the
eps-schedule and the value checks (finite points, weights >= 0 and not all
zero, equal masses) run inside the solve op at run time: new data with a new
diameter, hence a new schedule, is no recompilation; invalid values raise the
same ValueError there. Reading those values synchronizes the host with the GPU
once per call (the solve is not CUDA-graph capturable). The options (blur,
scaling, diameter, debias, precision, ...) are module attributes: constants for
the compiler (changing one recompiles).

Differences from GeomLoss, all deliberate:

* inputs are validated (errors name the argument); without a relaxed marginal a and b
  must have the same total mass (GeomLoss only warns in its docstring and returns
  meaningless values);
* computation is in float32 (``precision="float32"``: float32-accurate, or
  ``"tf32"``); float16/bfloat16/float64 inputs are accepted. Results have dtype
  ``promote_types(x.dtype, a.dtype, float32)``; gradients have the inputs' dtypes;
* potentials of an unbatched call have shape (N,), (M,) (GeomLoss's tensorized
  backend returns (1, N), (1, M) there, contrary to its own documentation);
* all points coinciding (diameter 0, where GeomLoss fails on log(0)) runs the
  schedule [blur^2, blur^2];
* the clouds are shifted by a common centre (near their means) before the
  float32 kernels run (exact in real arithmetic: the cost is translation-invariant;
  it keeps float32 accurate for clouds far from the origin).

Supported options: loss="sinkhorn", p=2, reach / reach_x / reach_y, cost=None, kernel=None,
backend in {"auto", "tensorized", "online"} (all three run the same exact streaming
solver) or "multiscale" (d <= 3, unbatched: GeomLoss's coarse-to-fine solve on a voxel
grid of side ``cluster_scale``, balanced or with ``reach`` (not reach_x / reach_y), with kernel
truncation ``truncate`` (None: keep every block), finishing sweeps at blur^2 until the marginal error is at most ``tol`` (default
5e-3; None: GeomLoss's schedule alone), see ``multiscale.samples_loss``; ``cluster_scale``
and ``tol`` only with that backend).
``truncate`` is ignored by the other backends, ``verbose`` by all. Anything else raises
NotImplementedError naming the option. Cluster labels (the six-argument call) are not
supported either.
"""

from __future__ import annotations

import torch

from ot_triton_jax.core.geomloss_options import reject_unsupported, relaxation, schedule_numbers

from ot_triton_jax.core import checks as core_checks
from ot_triton_jax.core import multiscale_rules as rules

from . import checks as check
from . import label_inputs
from . import samples_loss_ops as ops
from .multiscale.prewarm import start_first_call
from .multiscale.samples_loss import multiscale_potentials

_BACKENDS = ("auto", "tensorized", "online")


# ----------------------------------------------------------------------------- options

_UNSET = object()  # tol not given: the multiscale default (rules.DEFAULT_TOL)


def _check_options(loss, p, blur, reach, diameter, scaling, cost, kernel, cluster_scale, backend,
                   precision, reach_x=None, reach_y=None) -> tuple[float, float | None, float, tuple]:
    reject_unsupported(loss, p, cost, kernel, cluster_scale, backend)
    if backend not in _BACKENDS + ("multiscale",):
        raise ValueError(f"backend must be one of {_BACKENDS + ('multiscale',)}; got {backend!r}")
    blur, scaling_f, diam = schedule_numbers(blur, scaling, diameter)
    check.precision(precision)
    if backend == "multiscale" and cluster_scale is not None:
        rules.cluster_scale_value(cluster_scale, 1.0, 1)  # positive and finite, or an error naming it
    return blur, diam, scaling_f, relaxation(reach, reach_x, reach_y, 2, backend)


# ----------------------------------------------------------------------------- inputs


def _parse(args):
    """(a or None, x, b or None, y) from forward's positional arguments."""
    if len(args) == 2:
        return None, args[0], None, args[1]
    if len(args) == 4:
        return args
    if len(args) == 6:
        raise NotImplementedError("cluster labels (the six-argument call l_x, a, x, l_y, b, y) belong to "
                                  "GeomLoss's multiscale backend, which is not implemented")
    raise TypeError(f"SamplesLoss expects (x, y) or (a, x, b, y); got {len(args)} arguments")


def _labels(x, y, label_x, label_y, label_cost, debias: bool) -> tuple:
    """(lx, ly, W) checked (label_inputs.checked), or (None, None, None) without a label cost. A
    (B, N, D) batch takes labels (B, N), (B, M) (one row per problem) and one table W."""
    if label_x is None and label_y is None and label_cost is None:
        return (None, None, None)
    if x.ndim == 3:
        shape = lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else None  # noqa: E731
        core_checks.batch_shapes(x.shape, y.shape, {"label_x": (shape(label_x), "x"), "label_y": (shape(label_y), "y")})
        flat = lambda v: v.reshape(-1) if isinstance(v, torch.Tensor) else v  # noqa: E731
        checked = label_inputs.checked(flat(label_x), flat(label_y), label_cost, x.shape[0] * x.shape[1],
                                       y.shape[0] * y.shape[1], square=debias)
        return label_x, label_y, checked[2]
    return label_inputs.checked(label_x, label_y, label_cost, x.shape[0], y.shape[0], square=debias)


# ----------------------------------------------------------------------------- module


class SamplesLoss(torch.nn.Module):
    """Debiased Sinkhorn divergence between sampled measures, GeomLoss conventions.

    ``SamplesLoss(loss="sinkhorn", p=2, blur=0.05, reach=None, diameter=None, scaling=0.5,
    debias=True, potentials=False, backend="auto", precision="float32", reach_x=None,
    reach_y=None)`` then ``loss(x, y)`` or ``loss(a, x, b, y)``. Points are (N, D) or
    (B, N, D) (one eps-schedule for the batch, as GeomLoss; the B problems run packed, one
    block-sparse launch per softmin for the whole batch, unless exactly one marginal is relaxed,
    then one after the other); weights are (N,) / (N, 1) or (B, N) / (B, N, 1), default
    uniform 1/N, non-negative, with equal total masses for a and b unless a marginal is
    relaxed: ``reach`` (both, rho = reach^2, GeomLoss), ``reach_x`` (only the marginal of x),
    ``reach_y`` (only that of y), flash-sinkhorn's; see the module docstring.

    Returns a 0-d tensor (or (B,) in batch mode), differentiable in x, y, a, b;
    with ``potentials=True`` the pair (F, G) of shapes (N,), (M,) (or (B, N),
    (B, M)), differentiable in x and y. See the module docstring for the exact
    algorithm, the gradient rule, and the differences from GeomLoss.

    ``precision``: "float32" (default, float32-accurate kernels) or "tf32".
    ``label_cost`` W (K_x, K_y) (here or per call) with ``label_x`` (N,), ``label_y`` (M,) (a batch:
    (B, N), (B, M)) given to the call: the label-augmented cost (module docstring, "Label costs").
    """

    def __init__(self, loss="sinkhorn", p=2, blur=0.05, reach=None, diameter=None, scaling=0.5,
                 truncate=5, cost=None, kernel=None, cluster_scale=None, debias=True, potentials=False,
                 verbose=False, backend="auto", precision="float32", tol=_UNSET, reach_x=None, reach_y=None,
                 label_cost=None):
        super().__init__()
        self.label_cost = label_cost
        rules.reject_tol(tol is not _UNSET, tol, backend)
        self.tol = rules.DEFAULT_TOL if tol is _UNSET else tol
        self.loss, self.p, self.blur, self.reach = loss, p, blur, reach
        self.reach_x, self.reach_y = reach_x, reach_y
        self.diameter, self.scaling, self.truncate, self.cost = diameter, scaling, truncate, cost
        self.kernel, self.cluster_scale, self.debias = kernel, cluster_scale, debias
        self.potentials, self.verbose, self.backend, self.precision = potentials, verbose, backend, precision
        self._options()

    def _options(self):
        if self.backend == "multiscale":
            rules.truncate_value(self.truncate)
            rules.tol_value(self.tol)
        return _check_options(self.loss, self.p, self.blur, self.reach, self.diameter, self.scaling,
                              self.cost, self.kernel, self.cluster_scale, self.backend, self.precision,
                              self.reach_x, self.reach_y)

    def extra_repr(self) -> str:
        return (f"loss={self.loss!r}, p={self.p}, blur={self.blur}, reach={self.reach}, reach_x={self.reach_x}, "
                f"reach_y={self.reach_y}, diameter={self.diameter}, "
                f"scaling={self.scaling}, debias={self.debias}, potentials={self.potentials}, "
                f"precision={self.precision!r}")

    def forward(self, *args, label_x=None, label_y=None, label_cost=None):
        if label_cost is None:
            label_cost = self.label_cost
        if self.backend == "multiscale":
            if label_x is not None or label_y is not None or label_cost is not None:
                raise NotImplementedError("backend='multiscale' has no label cost: use backend='online' with "
                                          "label_x, label_y, label_cost")
            start_first_call()  # compile workers start before the checks (the first call's compiles)
        blur, diameter, scaling, (rho_x, rho_y) = self._options()
        a, x, b, y = _parse(args)
        check.points("x", x, batched=True)
        check.points("y", y, batched=True)
        check.pair(x, y)
        check.finite("x", x)
        check.finite("y", y)
        a = check.samples_weights("a", a, x, "x")
        b = check.samples_weights("b", b, y, "y")
        check.same_weight_dtype(a, b)
        if rho_x is None and rho_y is None:  # unequal masses are allowed once a marginal is relaxed
            check.balanced(a, b)
        out_dtype = torch.promote_types(torch.promote_types(x.dtype, a.dtype), torch.float32)
        labels = _labels(x, y, label_x, label_y, label_cost, bool(self.debias))

        if self.backend == "multiscale":
            return self._multiscale(x, y, a, b, blur, scaling, diameter, out_dtype, rho_x, rho_y)
        # Under torch.compile the value checks above see no values (checks.py): the op
        # runs them at run time. The diameter and the eps-schedule are computed there too.
        F, G = ops.solve(x, y, a, b, blur, scaling, diameter, bool(self.debias), self.precision,
                         torch.compiler.is_compiling(), rho_x, rho_y, not self.potentials, *labels)[:2]
        F, G = F.to(out_dtype), G.to(out_dtype)
        batched = x.ndim == 3
        if self.potentials:
            return (F, G) if batched else (F[0], G[0])
        if not batched:
            return (a.to(out_dtype) * F[0]).sum() + (b.to(out_dtype) * G[0]).sum()
        return (a.to(out_dtype) * F).sum(-1) + (b.to(out_dtype) * G).sum(-1)

    def _multiscale(self, x, y, a, b, blur, scaling, diameter, out_dtype, rho_x=None, rho_y=None):
        if x.ndim == 3:
            raise NotImplementedError("backend='multiscale' solves one problem at a time: pass x (N, D), "
                                      "y (M, D), or use backend='online' for batches")
        rules.check_dim(x.shape[-1])
        truncate = rules.truncate_value(self.truncate)
        if diameter is None:
            diameter = ops.diameter(x, y) or blur
        self.last_multiscale = None  # the previous solve's state (cluster masks) is not kept through this one
        relax = None
        if rules.check_relaxation(rho_x, rho_y):  # reach: the potentials, or the loss's per-point terms
            relax = (rho_x, rho_y, "potentials" if self.potentials else "terms")
        F, G, res = multiscale_potentials(x, y, a, b, blur, scaling, diameter, self.cluster_scale, truncate,
                                          bool(self.debias), self.precision, rules.tol_value(self.tol), relax)
        self.last_multiscale = res
        F, G = F.to(out_dtype), G.to(out_dtype)
        if self.potentials:
            return F, G
        return (a.to(out_dtype) * F).sum() + (b.to(out_dtype) * G).sum()
