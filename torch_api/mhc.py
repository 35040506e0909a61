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
not); float32, bfloat16, float16 or float64 (float64 is cast to float32 for
the kernels and the result and gradient cast back: float32 accuracy). Both
kernels store nothing but their result: the forward reads 4 n^2 bytes (fp32)
per matrix and writes as many, the backward reads the logits and the output
gradient and writes the input gradient.

torch.compile and CUDA graphs: the kernels are ``torch.library`` custom ops
(``ot_triton::mhc_forward``, ``ot_triton::mhc_backward``, see
``torch_api.mhc_ops``) with fake implementations and an autograd rule, so
``torch.compile(..., fullgraph=True)`` traces the forward and the backward
without graph breaks. The default call (``check_finite=False``) never
synchronizes the host, forward or backward, and can be captured in a CUDA graph.

Bad input: shapes, dtypes and options raise ``ValueError`` / ``TypeError``
naming the argument (rules and messages in ``ot_triton_jax.core.mhc_checks``,
shared with the JAX frontend). Finite logits are checked only on request:
``check_finite=True`` runs one reduction and a host sync in eager mode (skipped
under ``torch.compile`` tracing). Unchecked (the default): a NaN or +inf logit
makes its own matrix NaN (output and gradient) and touches no other matrix; a
-inf logit is an exact zero entry (exp(-inf) = 0), which is fine unless a
whole row or column is -inf (NaN again).

Double backward is not supported.
"""

from __future__ import annotations

import torch
from torch import nn

from ot_triton_jax.core import mhc_checks as rules
from ot_triton_jax.core import runtime

from .mhc_ops import EagerMHC, mhc_forward

__all__ = ["mhc_sinkhorn", "FusedMHC", "BACKWARDS", "STARTS"]

BACKWARDS = rules.BACKWARDS
STARTS = rules.STARTS
_CAST_HINT = ".float()"


def _check_logits(logits) -> None:
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    rules.logits_shape(logits.shape)
    rules.logits_dtype(str(logits.dtype).removeprefix("torch."), _CAST_HINT)
    rules.logits_device(str(logits.device), runtime.on_gpu())


def mhc_sinkhorn(logits: torch.Tensor, iters: int = 20, *, backward: str = "unrolled",
                 start: str = "cols", eps: float = 0.0, check_finite: bool = False) -> torch.Tensor:
    """Doubly-stochastic matrices from (..., n, n) logits by ``iters`` Sinkhorn-Knopp steps.

    Args:
      logits: (..., n, n) float32 / bfloat16 / float16 / float64 tensor,
        2 <= n <= 64, any leading batch shape (on the GPU when one is present).
        Arithmetic is float32; float64 logits are cast to float32 and the result
        (and the gradient) cast back to float64.
      iters: number T of (column, row) normalization pairs, >= 1 (a compile-time
        constant of the kernels: each new value compiles once).
      backward: "unrolled" (exact gradient of the T-step map) or "implicit"
        (fixed-point gradient; exact only at convergence). See the module docstring.
      start: "cols" (normalize columns first: T_r(T_c(.)), the mHC paper) or "rows".
      eps: added to every normalization denominator (>= 0; 1e-6 in DeepSeek's
        kernels). Its value is a run-time kernel argument (no recompilation),
        only eps == 0 versus eps > 0 selects a kernel variant.
      check_finite: checked only on request. False (default): nothing is read
        on the host, the call (forward and backward) never synchronizes and
        composes with CUDA graphs and torch.compile; a NaN / +inf logit gives
        its own matrix NaN, a -inf logit a zero entry (module docstring).
        True: in eager mode raise ValueError if a logit is NaN or +-inf (one
        reduction and a host sync; skipped under torch.compile tracing).

    Returns:
      A tensor of the shape and dtype of ``logits``: exp(M) after T column and
      row normalizations, computed in float32.
    """
    iters, backward, rows_first, eps = rules.options(iters, backward, start, eps)
    _check_logits(logits)
    if check_finite and not torch.compiler.is_compiling() and logits.numel():
        rules.finite(bool(torch.isfinite(logits).all()))
    # eager: a plain autograd.Function (less host time per call); traced: the custom op
    op = mhc_forward if torch.compiler.is_compiling() else EagerMHC.apply
    if logits.dtype == torch.float64:
        return op(logits.to(torch.float32), iters, backward, rows_first, eps).to(torch.float64)
    return op(logits, iters, backward, rows_first, eps)


class FusedMHC(nn.Module):
    """``mhc_sinkhorn`` as a module: (..., n, n) logits -> doubly-stochastic matrices.

    Autocast-safe: runs with autocast disabled, computes in float32 and returns
    the dtype of its input (float32, bfloat16, float16 or float64).

    The default module never synchronizes the host (``check_finite=False``:
    non-finite logits are checked only on request), so it can be compiled with
    ``torch.compile(fullgraph=True)`` and captured in a CUDA graph, forward and
    backward.

    Args: as :func:`mhc_sinkhorn` (``iters=20, backward="unrolled", start="cols",
    eps=0.0, check_finite=False``).
    """

    def __init__(self, iters: int = 20, backward: str = "unrolled", start: str = "cols",
                 eps: float = 0.0, check_finite: bool = False):
        super().__init__()
        self.iters, self.backward_mode, _, self.eps = rules.options(iters, backward, start, eps)
        self.start = start
        self.check_finite = bool(check_finite)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device_type=logits.device.type, enabled=False):
            return mhc_sinkhorn(logits, self.iters, backward=self.backward_mode, start=self.start,
                                eps=self.eps, check_finite=self.check_finite)

    def extra_repr(self) -> str:
        return (f"iters={self.iters}, backward={self.backward_mode!r}, start={self.start!r}, "
                f"eps={self.eps}")
