"""mHC: batched Sinkhorn-Knopp on fused Triton kernels (PyTorch frontend).

``mhc_sinkhorn(logits)`` turns a (..., n, n) tensor of logits into
doubly-stochastic matrices, the mixing matrices of manifold-constrained
hyper-connections (mHC). ``FusedMHC`` is the same as an ``nn.Module``.

Semantics (float32 arithmetic whatever the input dtype; the result has the
input's dtype):

    P = exp(M);  then ``iters`` times:  P <- P / (1^T P + eps)   (normalize columns)
                                        P <- P / (P 1 + eps)     (normalize rows)

i.e. the mHC paper's T_r(T_c(.)) repeated; ``start="rows"`` normalizes rows
first (T_c(T_r(.)), as some implementations do). ``eps`` (default 0; DeepSeek's
kernels use 1e-6) is added to every denominator, including the first one:
``exp(M_ij) / (sum_i exp(M_ij) + eps)``. The first normalization is computed
with a per-column max subtracted and eps rescaled to match, so any finite
logits are safe from overflow; underflow (a logit ~87 or more below the
largest one of its column) gives exact zeros, and with eps = 0 a row of K
that is entirely zero makes that matrix NaN.

Backward (``backward=``):

* ``"unrolled"`` (default): the exact gradient of the ``iters``-step map.
  Nothing but the input is kept for the backward; the kernel replays the
  forward on chip and runs the reverse sweep in registers, SEG iterations at
  a time (SEG = 20 for n <= 4 on the GPU, 10 with eps > 0, 2-5 for larger n).
  Beyond SEG iterations each segment is replayed from the logits, so the
  backward costs ~iters^2 / (2 SEG) forward iterations: for hundreds of
  iterations prefer "implicit".
* ``"implicit"``: the gradient of the Sinkhorn fixed point, by solving
  (diag(c) - R^T diag(r)^-1 R) v = s_c - R^T diag(r)^-1 s_r in the kernel
  (r, c the row and column sums of the computed R). Exact only when the
  forward has converged; at few iterations on nearly-diagonal logits
  (e.g. 5 I + noise) it differs from the unrolled gradient by tens of percent.
  Cheaper than "unrolled" (one replay plus an n x n solve per matrix).

Shapes and types: any leading batch shape; 2 <= n <= 64 (powers of two or
not); float32, bfloat16 or float16. Both kernels store nothing but their
result: the forward reads 4 n^2 bytes (fp32) per matrix and writes as many,
the backward reads the logits and the output gradient and writes the input
gradient.

Bad input raises ``ValueError`` / ``TypeError`` naming the argument. Finite
logits are checked in eager mode (``check_finite=True``, one reduction and a
host sync). Without the check (``check_finite=False``, or under
``torch.compile`` tracing where it is skipped): a NaN or +inf logit makes its
own matrix NaN (output and gradient) and touches no other matrix; a -inf
logit is an exact zero entry (exp(-inf) = 0), which is fine unless a whole
row or column is -inf (NaN again).

Double backward is not supported.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.autograd.function import once_differentiable

from ot_triton_jax.core import runtime
from ot_triton_jax.core.kernels.mhc import (
    mhc_backward_implicit_kernel,
    mhc_backward_unrolled_kernel,
    mhc_forward_kernel,
)
from ot_triton_jax.core.mhc_plans import N_MAX, N_MIN, mhc_plan

from .launch import launch

__all__ = ["mhc_sinkhorn", "FusedMHC", "BACKWARDS", "STARTS"]

BACKWARDS = ("unrolled", "implicit")
STARTS = ("cols", "rows")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)

_BWD_KERNELS = {"unrolled": mhc_backward_unrolled_kernel, "implicit": mhc_backward_implicit_kernel}
_PARAMS_CACHE: dict = {}


def _params(eps: float, device: torch.device) -> torch.Tensor:
    """float32 [eps] on ``device`` (cached: no host-to-device copy per call)."""
    key = (device, eps)
    t = _PARAMS_CACHE.get(key)
    if t is None:
        if len(_PARAMS_CACHE) > 64:
            _PARAMS_CACHE.clear()
        t = torch.tensor([eps], dtype=torch.float32, device=device)
        _PARAMS_CACHE[key] = t
    return t


def _check_options(iters, backward, start, eps) -> None:
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not math.isfinite(eps) or eps < 0:
        raise ValueError(f"eps must be a finite float >= 0, got {eps!r}")


def _check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if logits.dim() < 2 or logits.shape[-1] != logits.shape[-2]:
        raise ValueError(
            "logits must have shape (..., n, n) with square last two dims; "
            f"got {tuple(logits.shape)}"
        )
    n = logits.shape[-1]
    if not (N_MIN <= n <= N_MAX):
        raise ValueError(f"logits must have n in [{N_MIN}, {N_MAX}] (shape (..., n, n)); got n = {n}")
    if logits.dtype not in DTYPES:
        raise TypeError(
            f"logits must be float32, bfloat16 or float16; got {logits.dtype} "
            "(cast with .float() first; arithmetic is float32 in any case)"
        )
    if runtime.on_gpu() and logits.device.type != "cuda":
        raise ValueError(
            f"logits must be on a CUDA device (kernels run on the GPU); got device {logits.device}"
        )


def _launch(kind, kernel, inputs, out, batch, n, iters, rows_first, eps):
    """kernel(*inputs, PARAMS, batch, out) with the shared launch plan, on ``out``'s device."""
    plan = mhc_plan(kind, batch, n, iters, rows_first, eps > 0, runtime.on_gpu())
    args = (*inputs, _params(eps, out.device), batch, out)
    if out.device.type == "cuda" and out.device.index != torch.cuda.current_device():
        with torch.cuda.device(out.device):
            launch(kernel, plan.grid, args, plan.constexprs, num_warps=plan.num_warps,
                   num_stages=plan.num_stages)
    else:
        launch(kernel, plan.grid, args, plan.constexprs, num_warps=plan.num_warps, num_stages=plan.num_stages)


class _MHCSinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, iters, backward, rows_first, eps):
        shape = logits.shape
        n = shape[-1]
        x = logits.detach().reshape(-1, n, n).contiguous()
        batch = x.shape[0]
        out = torch.empty_like(x)
        if batch:
            _launch("forward", mhc_forward_kernel, [x], out, batch, n, iters, rows_first, eps)
        ctx.save_for_backward(x)
        ctx.cfg = (shape, iters, backward, rows_first, eps)
        return out.view(shape)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        shape, iters, backward, rows_first, eps = ctx.cfg
        n = shape[-1]
        batch = x.shape[0]
        g = grad_out.reshape(-1, n, n).contiguous()
        dm = torch.empty_like(x)
        if batch:
            _launch(backward, _BWD_KERNELS[backward], [x, g], dm, batch, n, iters, rows_first, eps)
        return dm.view(shape), None, None, None, None


def mhc_sinkhorn(logits: torch.Tensor, iters: int = 20, *, backward: str = "unrolled",
                 start: str = "cols", eps: float = 0.0, check_finite: bool = True) -> torch.Tensor:
    """Doubly-stochastic matrices from (..., n, n) logits by ``iters`` Sinkhorn-Knopp steps.

    Args:
      logits: (..., n, n) float32 / bfloat16 / float16 tensor, 2 <= n <= 64,
        any leading batch shape (on the GPU when one is present).
      iters: number T of (column, row) normalization pairs, >= 1 (a compile-time
        constant of the kernels: each new value compiles once).
      backward: "unrolled" (exact gradient of the T-step map) or "implicit"
        (fixed-point gradient; exact only at convergence). See the module docstring.
      start: "cols" (normalize columns first: T_r(T_c(.)), the mHC paper) or "rows".
      eps: added to every normalization denominator (>= 0; 1e-6 in DeepSeek's
        kernels). Its value is a run-time kernel argument (no recompilation),
        only eps == 0 versus eps > 0 selects a kernel variant.
      check_finite: in eager mode, raise ValueError if a logit is NaN or +-inf
        (costs one reduction and a host sync; skipped under torch.compile tracing).
        Unchecked, NaN / +inf give a NaN matrix, -inf a zero entry (module docstring).

    Returns:
      A tensor of the shape and dtype of ``logits``: exp(M) after T column and
      row normalizations, computed in float32.
    """
    _check_options(iters, backward, start, eps)
    _check_logits(logits)
    if check_finite and not torch.compiler.is_compiling() and logits.numel():
        if not bool(torch.isfinite(logits).all()):
            raise ValueError(
                "logits contain NaN or inf; mhc_sinkhorn needs finite logits "
                "(pass check_finite=False to get NaN matrices instead of this error)"
            )
    return _MHCSinkhorn.apply(logits, int(iters), backward, start == "rows", float(eps))


class FusedMHC(nn.Module):
    """``mhc_sinkhorn`` as a module: (..., n, n) logits -> doubly-stochastic matrices.

    Autocast-safe: runs with autocast disabled, computes in float32 and returns
    the dtype of its input (float32, bfloat16 or float16).

    Args: as :func:`mhc_sinkhorn` (``iters=20, backward="unrolled", start="cols",
    eps=0.0, check_finite=True``).
    """

    def __init__(self, iters: int = 20, backward: str = "unrolled", start: str = "cols",
                 eps: float = 0.0, check_finite: bool = True):
        super().__init__()
        _check_options(iters, backward, start, eps)
        self.iters = int(iters)
        self.backward_mode = backward
        self.start = start
        self.eps = float(eps)
        self.check_finite = bool(check_finite)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=logits.device.type, enabled=False):
            return mhc_sinkhorn(logits, self.iters, backward=self.backward_mode, start=self.start,
                                eps=self.eps, check_finite=self.check_finite)

    def extra_repr(self) -> str:
        return (f"iters={self.iters}, backward={self.backward_mode!r}, start={self.start!r}, "
                f"eps={self.eps}")
