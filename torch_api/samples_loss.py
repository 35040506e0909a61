"""``SamplesLoss``: a drop-in for GeomLoss's ``SamplesLoss("sinkhorn", p=2, ...)`` on streaming kernels.

Conventions (those of ``geomloss.SamplesLoss("sinkhorn", p=2)``, version 0.3.1, checked
against its tensorized backend in tests/test_samples_loss.py):

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
which GeomLoss detaches too). Second derivatives are not supported (the
backward is ``once_differentiable``).

Differences from GeomLoss, all deliberate:

* inputs are validated (errors name the argument); a and b must have the same
  total mass (GeomLoss only warns in its docstring and returns meaningless values);
* computation is in float32 (``precision="float32"``: float32-accurate, or
  ``"tf32"``); float16/bfloat16/float64 inputs are accepted. Results have dtype
  ``promote_types(x.dtype, a.dtype, float32)``; gradients have the inputs' dtypes;
* potentials of an unbatched call have shape (N,), (M,) (GeomLoss's tensorized
  backend returns (1, N), (1, M) there, contrary to its own documentation);
* all points coinciding (diameter 0, where GeomLoss fails on log(0)) runs the
  schedule [blur^2, blur^2];
* the clouds are centred on the midpoint of their joint bounding box before the
  float32 kernels run (exact in real arithmetic: the cost is translation-invariant;
  it keeps float32 accurate for clouds far from the origin).

Supported options: loss="sinkhorn", p=2, reach=None, cost=None, kernel=None,
cluster_scale=None, backend in {"auto", "tensorized", "online"} (all three run the
same exact streaming solver; "multiscale" is not implemented). ``truncate`` and
``verbose`` are accepted and ignored (GeomLoss reads them only in its multiscale
backend). Anything else raises NotImplementedError naming the option. Cluster
labels (the six-argument call) are not supported either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.autograd.function import once_differentiable

from ot_triton_jax.core.geomloss_options import reject_unsupported, schedule_numbers
from ot_triton_jax.core.schedules import epsilon_schedule

from . import checks as check
from .kernel_ops import Cloud, apply_plan, lse_update, params

_S = 0.5  # cost scale: C = |x - y|^2 / 2 for p = 2
_BACKENDS = ("auto", "tensorized", "online")


# ----------------------------------------------------------------------------- options


def _check_options(loss, p, blur, reach, diameter, scaling, cost, kernel, cluster_scale, backend,
                   precision) -> tuple[float, float | None, float]:
    reject_unsupported(loss, p, reach, cost, kernel, cluster_scale, backend)
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS + ('multiscale',)}; got {backend!r}")
    blur, scaling_f, diam = schedule_numbers(blur, scaling, diameter)
    check.precision(precision)
    return blur, diam, scaling_f


# ----------------------------------------------------------------------------- inputs


def _is_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor; got {type(t).__name__}")


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


def _check_points(x, y):
    _is_tensor("x", x)
    _is_tensor("y", y)
    for name, t in (("x", x), ("y", y)):
        if t.ndim not in (2, 3):
            raise ValueError(f"{name} must have shape (N, D) or (B, N, D) (batch); got shape {tuple(t.shape)}")
    if x.ndim != y.ndim:
        raise ValueError(f"x and y must both be unbatched (N, D) or both batched (B, N, D); got shapes "
                         f"{tuple(x.shape)} and {tuple(y.shape)}")
    if x.device != y.device:
        raise ValueError(f"x and y must be on the same device; got {x.device} and {y.device}")
    for name, t in (("x", x), ("y", y)):
        if t.dtype not in check.FLOAT_DTYPES:
            raise TypeError(f"{name} must be float16, bfloat16, float32 or float64; got {t.dtype}")
    if x.dtype != y.dtype:
        raise TypeError(f"x and y must have the same dtype; got {x.dtype} and {y.dtype}. Cast one of them")
    if x.shape[-1] != y.shape[-1]:
        raise ValueError(f"x and y must have the same dimension D (last axis); got x: {tuple(x.shape)}, "
                         f"y: {tuple(y.shape)}")
    if x.ndim == 3 and x.shape[0] != y.shape[0]:
        raise ValueError(f"x and y must have the same batch size B; got x: {tuple(x.shape)}, y: {tuple(y.shape)}")
    if x.ndim == 3 and x.shape[0] == 0:
        raise ValueError("x and y have batch size B = 0: nothing to compute")
    for name, t in (("x", x), ("y", y)):
        if t.shape[-2] == 0:
            raise ValueError(f"{name} is empty (0 points): a point cloud needs at least one point")
        if t.shape[-1] == 0:
            raise ValueError(f"{name} has dimension D = 0: points need at least one coordinate")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name} contains NaN or Inf coordinates; clean the input")


def _check_weights(name, w, pts, pname):
    """Weights for ``pts``: (N,) / (N, 1), or (B, N) / (B, N, 1) in batch mode; returns (N,) or (B, N)."""
    shape = tuple(pts.shape[:-1])
    if w is None:
        return torch.full(shape, 1.0 / shape[-1], dtype=pts.dtype, device=pts.device)
    _is_tensor(name, w)
    if w.dtype not in check.FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor; got {w.dtype}")
    if w.device != pts.device:
        raise ValueError(f"{name} must be on the points' device {pts.device}; got {w.device}")
    ww = w[..., 0] if (w.ndim == len(shape) + 1 and w.shape[-1] == 1) else w
    if tuple(ww.shape) != shape:
        want = " or ".join(str(s) for s in (shape, shape + (1,)))
        raise ValueError(f"{name} must have shape {want} to match the points {pname} {tuple(pts.shape)}; "
                         f"got {tuple(w.shape)}")
    if not bool(torch.isfinite(ww).all()):
        raise ValueError(f"{name} contains NaN or Inf; weights must be finite")
    if bool((ww < 0).any()):
        raise ValueError(f"{name} has negative entries; weights must be >= 0")
    empty = ~(ww.reshape(-1, shape[-1]) > 0).any(1)
    if bool(empty.any()):
        k = int(empty.nonzero()[0, 0])
        label = name if ww.ndim == 1 else f"{name}[{k}]"
        raise ValueError(f"{label} is all zeros; at least one weight must be positive")
    return ww


def _check_masses(a, b, rtol=1e-5):
    sa = a.detach().double().sum(-1).reshape(-1).tolist()
    sb = b.detach().double().sum(-1).reshape(-1).tolist()
    for k, (ma, mb) in enumerate(zip(sa, sb)):
        if abs(ma - mb) > rtol * max(ma, mb):
            where = "" if a.ndim == 1 else f" in batch {k}"
            raise ValueError(f"a and b must have the same total mass (balanced OT, reach=None){where}; got "
                             f"sum(a)={ma:.8g}, sum(b)={mb:.8g}. Normalize both, e.g. a / a.sum() and b / b.sum()")


def _diameter(x, y) -> float:
    """GeomLoss's default: diagonal of the joint bounding box of all points (whole batch)."""
    d = x.shape[-1]
    pts = torch.cat((x.detach().reshape(-1, d), y.detach().reshape(-1, d))).double()
    return float((pts.max(0).values - pts.min(0).values).norm())


# ----------------------------------------------------------------------------- solver


@dataclass
class _State:
    """Everything one problem's backward needs: O((n + m) d)."""

    X: Cloud
    Y: Cloud
    la: torch.Tensor            # log a (-inf on zero weights), float32
    lb: torch.Tensor
    old: tuple                  # (f_ba, g_ab, f_aa, g_bb) entering the last extrapolation
    new: tuple                  # the same after it (f_aa, g_bb are None without debias)
    eps: float
    prm: torch.Tensor
    precision: str
    debias: bool


def _masked_log(w: torch.Tensor) -> torch.Tensor:
    return torch.where(w > 0, w.clamp_min(torch.finfo(w.dtype).tiny).log(), -torch.inf)


def _solve(X: Cloud, Y: Cloud, a32, b32, eps_list, debias, precision) -> _State:
    la, lb = _masked_log(a32), _masked_log(b32)
    dev = X.x.device

    def softmin(src, tgt, pot, logw, prm):
        return lse_update(src, tgt, pot, prm, precision, logw_in=logw)[0]

    def sweep(pots, prm):
        f_ba, g_ab, f_aa, g_bb = pots
        out = [softmin(X, Y, g_ab, lb, prm), softmin(Y, X, f_ba, la, prm), None, None]
        if debias:
            out[2], out[3] = softmin(X, X, f_aa, la, prm), softmin(Y, Y, g_bb, lb, prm)
        return tuple(out)

    zx = torch.zeros(X.n, dtype=torch.float32, device=dev)
    zy = torch.zeros(Y.n, dtype=torch.float32, device=dev)
    pots = sweep((zx, zy, zx, zy), params(eps_list[0], _S, dev))
    for eps in eps_list:
        new = sweep(pots, params(eps, _S, dev))
        pots = tuple(None if p is None else 0.5 * (p + q) for p, q in zip(pots, new))
    prm = params(eps_list[-1], _S, dev)
    last = sweep(pots, prm)
    return _State(X=X, Y=Y, la=la, lb=lb, old=pots, new=last, eps=eps_list[-1], prm=prm,
                  precision=precision, debias=debias)


def _dual_pair(st: _State) -> tuple[torch.Tensor, torch.Tensor]:
    f_ba, g_ab, f_aa, g_bb = st.new
    if st.debias:
        return f_ba - f_aa, g_ab - g_bb
    return f_ba, g_ab


def _side_direction(st: _State, side: int) -> torch.Tensor:
    """dF_i/dx_i (side 0) or dG_j/dy_j (side 1), one row per point; see the module docstring."""
    f_ba, g_ab, f_aa, g_bb = st.new
    of_ba, og_ab, of_aa, og_bb = st.old
    # Source cloud S, other cloud T; the plans' weights are folded into the potentials
    # (eps log w: -inf on zero weights), so P and Q below are GeomLoss's softmax weights.
    if side == 0:
        S, T, f_st, g_st, f_ss, old_ss, lw_s, lw_t = st.X, st.Y, f_ba, og_ab, f_aa, of_aa, st.la, st.lb
    else:
        S, T, f_st, g_st, f_ss, old_ss, lw_s, lw_t = st.Y, st.X, g_ab, of_ba, g_bb, og_bb, st.lb, st.la
    p_t, r = apply_plan(S, T, f_st, g_st + st.eps * lw_t, st.prm, st.precision, T.x)   # (P y, P 1)
    mean_t = p_t / r[:, None]
    if not st.debias:
        return S.x - mean_t
    q_s, q = apply_plan(S, S, f_ss, old_ss + st.eps * lw_s, st.prm, st.precision, S.x)  # (Q x, Q 1)
    return q_s / q[:, None] - mean_t


class _Potentials(torch.autograd.Function):
    """(F, G) as functions of (x, y) with GeomLoss's last-extrapolation derivative rule."""

    @staticmethod
    def forward(ctx, x, y, st: _State, out_dtype):
        ctx.st = st
        ctx.dtypes = (x.dtype, y.dtype)
        ctx.set_materialize_grads(False)
        F, G = _dual_pair(st)
        return F.to(out_dtype), G.to(out_dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, uF, uG):
        st = ctx.st
        gx = gy = None
        if ctx.needs_input_grad[0] and uF is not None:
            gx = (uF.to(torch.float32)[:, None] * _side_direction(st, 0)).to(ctx.dtypes[0])
        if ctx.needs_input_grad[1] and uG is not None:
            gy = (uG.to(torch.float32)[:, None] * _side_direction(st, 1)).to(ctx.dtypes[1])
        return gx, gy, None, None


def _cloud(x: torch.Tensor, center: torch.Tensor) -> Cloud:
    return Cloud((x.detach().double() - center).to(torch.float32))


# ----------------------------------------------------------------------------- module


class SamplesLoss(torch.nn.Module):
    """Debiased Sinkhorn divergence between sampled measures, GeomLoss conventions.

    ``SamplesLoss(loss="sinkhorn", p=2, blur=0.05, diameter=None, scaling=0.5,
    debias=True, potentials=False, backend="auto", precision="float32")`` then
    ``loss(x, y)`` or ``loss(a, x, b, y)``. Points are (N, D) or (B, N, D)
    (batches are solved one after the other with one shared eps-schedule, as
    GeomLoss does); weights are (N,) / (N, 1) or (B, N) / (B, N, 1), default
    uniform 1/N, non-negative, with equal total masses for a and b.

    Returns a 0-d tensor (or (B,) in batch mode), differentiable in x, y, a, b;
    with ``potentials=True`` the pair (F, G) of shapes (N,), (M,) (or (B, N),
    (B, M)), differentiable in x and y. See the module docstring for the exact
    algorithm, the gradient rule, and the differences from GeomLoss.

    ``precision``: "float32" (default, float32-accurate kernels) or "tf32".
    """

    def __init__(self, loss="sinkhorn", p=2, blur=0.05, reach=None, diameter=None, scaling=0.5,
                 truncate=5, cost=None, kernel=None, cluster_scale=None, debias=True, potentials=False,
                 verbose=False, backend="auto", precision="float32"):
        super().__init__()
        self.loss, self.p, self.blur, self.reach = loss, p, blur, reach
        self.diameter, self.scaling, self.truncate, self.cost = diameter, scaling, truncate, cost
        self.kernel, self.cluster_scale, self.debias = kernel, cluster_scale, debias
        self.potentials, self.verbose, self.backend, self.precision = potentials, verbose, backend, precision
        self._options()

    def _options(self):
        return _check_options(self.loss, self.p, self.blur, self.reach, self.diameter, self.scaling,
                              self.cost, self.kernel, self.cluster_scale, self.backend, self.precision)

    def extra_repr(self) -> str:
        return (f"loss={self.loss!r}, p={self.p}, blur={self.blur}, diameter={self.diameter}, "
                f"scaling={self.scaling}, debias={self.debias}, potentials={self.potentials}, "
                f"precision={self.precision!r}")

    def forward(self, *args):
        blur, diameter, scaling = self._options()
        a, x, b, y = _parse(args)
        _check_points(x, y)
        a = _check_weights("a", a, x, "x")
        b = _check_weights("b", b, y, "y")
        if a.dtype != b.dtype:
            raise TypeError(f"a and b must have the same dtype; got {a.dtype} and {b.dtype}. Cast one of them")
        _check_masses(a, b)

        if diameter is None:
            diameter = _diameter(x, y)
            if diameter == 0.0:  # every point coincides: GeomLoss fails on log(0); anneal nothing
                diameter = blur
        eps_list = epsilon_schedule(2, diameter, blur, scaling)
        out_dtype = torch.promote_types(torch.promote_types(x.dtype, a.dtype), torch.float32)

        batched = x.ndim == 3
        xs, ys, as_, bs = (x, y, a, b) if batched else (x[None], y[None], a[None], b[None])
        Fs, Gs = [], []
        for k in range(xs.shape[0]):
            xk, yk = xs[k], ys[k]
            with torch.no_grad():
                pts = torch.cat((xk.detach(), yk.detach())).double()
                center = 0.5 * (pts.max(0).values + pts.min(0).values)
                X, Y = _cloud(xk, center), _cloud(yk, center)
                a32 = as_[k].detach().to(torch.float32)
                b32 = bs[k].detach().to(torch.float32)
                st = _solve(X, Y, a32, b32, eps_list, bool(self.debias), self.precision)
            F, G = _Potentials.apply(xk, yk, st, out_dtype)
            Fs.append(F)
            Gs.append(G)

        if self.potentials:
            if batched:
                return torch.stack(Fs), torch.stack(Gs)
            return Fs[0], Gs[0]
        values = [(as_[k].to(out_dtype) * Fs[k]).sum() + (bs[k].to(out_dtype) * Gs[k]).sum()
                  for k in range(len(Fs))]
        return torch.stack(values) if batched else values[0]
