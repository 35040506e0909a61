"""The mHC kernels as ``torch.library`` custom ops (what ``torch_api.mhc`` calls).

* ``ot_triton::mhc_forward(logits, iters, backward, rows_first, eps) -> out``:
  ``mhc_forward_kernel`` on the flattened (B, n, n) logits; ``backward`` is
  unused by the forward and only recorded for the autograd rule.
* ``ot_triton::mhc_backward(logits, grad, iters, backward, rows_first, eps) -> dlogits``:
  ``mhc_backward_unrolled_kernel`` or ``mhc_backward_implicit_kernel``.

Both have a fake (meta) implementation, so ``torch.compile`` traces them
without running them and without graph breaks, and the forward has an autograd
rule (``register_autograd``) that saves nothing but the logits and calls the
backward op. Neither reads a value on the host: launches only (through
:func:`torch_api.launch.launch`, the fast path on the GPU), so both can be
captured in a CUDA graph. Double backward is not supported (the backward op
has no autograd rule).

Inputs: float32, bfloat16 or float16 (float64 is cast by the caller), any
strides; outputs are fresh contiguous tensors of the input's shape and dtype.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ot_triton_jax.core import runtime
from ot_triton_jax.core.kernels.mhc import (
    mhc_backward_implicit_kernel,
    mhc_backward_unrolled_kernel,
    mhc_forward_kernel,
)
from ot_triton_jax.core.mhc_plans import mhc_plan

from .launch import launch

__all__ = ["mhc_forward", "mhc_backward", "EagerMHC"]

_BWD_KERNELS = {"unrolled": mhc_backward_unrolled_kernel, "implicit": mhc_backward_implicit_kernel}
_PARAMS_CACHE: dict = {}


def _params(eps: float, device: torch.device) -> torch.Tensor:
    """float32 [eps] on ``device``, cached (a fill kernel the first time: no host copy, no sync).

    Cached so that repeated calls (and CUDA-graph replays of them) read one
    fixed buffer.
    """
    key = (device, eps)
    t = _PARAMS_CACHE.get(key)
    if t is None:
        if len(_PARAMS_CACHE) > 64:
            _PARAMS_CACHE.clear()
        t = torch.full((1,), eps, dtype=torch.float32, device=device)
        _PARAMS_CACHE[key] = t
    return t


def _launch(kind, kernel, inputs, out, batch, n, iters, rows_first, eps):
    """kernel(*inputs, PARAMS, batch, out) with the shared launch plan, on ``out``'s device."""
    plan = mhc_plan(kind, batch, n, iters, rows_first, eps > 0, runtime.on_gpu())
    args = (*inputs, _params(eps, out.device), batch, out)
    if out.device.type == "cuda" and out.device.index != torch.cuda.current_device():
        with torch.cuda.device(out.device):
            launch(kernel, plan.grid, args, plan.constexprs, num_warps=plan.num_warps,
                   num_stages=plan.num_stages)
    else:
        launch(kernel, plan.grid, args, plan.constexprs, num_warps=plan.num_warps,
               num_stages=plan.num_stages)


def forward_impl(logits: torch.Tensor, iters: int, rows_first: bool, eps: float) -> torch.Tensor:
    """Launch the forward kernel (shared by the custom op and the eager Function)."""
    n = logits.shape[-1]
    x = logits.reshape(-1, n, n).contiguous()
    batch = x.shape[0]
    out = torch.empty((batch, n, n), dtype=x.dtype, device=x.device)
    if batch:
        _launch("forward", mhc_forward_kernel, [x], out, batch, n, iters, rows_first, eps)
    return out.view(logits.shape)


def backward_impl(logits: torch.Tensor, grad: torch.Tensor, iters: int, backward: str, rows_first: bool,
                  eps: float) -> torch.Tensor:
    """Launch the backward kernel of ``backward`` (shared by the custom op and the eager Function)."""
    n = logits.shape[-1]
    x = logits.reshape(-1, n, n).contiguous()
    g = grad.to(x.dtype).reshape(-1, n, n).contiguous()
    batch = x.shape[0]
    dm = torch.empty((batch, n, n), dtype=x.dtype, device=x.device)
    if batch:
        _launch(backward, _BWD_KERNELS[backward], [x, g], dm, batch, n, iters, rows_first, eps)
    return dm.view(logits.shape)


@torch.library.custom_op("ot_triton::mhc_forward", mutates_args=())
def mhc_forward(logits: torch.Tensor, iters: int, backward: str, rows_first: bool,
                eps: float) -> torch.Tensor:
    return forward_impl(logits, iters, rows_first, eps)


@mhc_forward.register_fake
def _(logits, iters, backward, rows_first, eps):
    return logits.new_empty(logits.shape)


@torch.library.custom_op("ot_triton::mhc_backward", mutates_args=())
def mhc_backward(logits: torch.Tensor, grad: torch.Tensor, iters: int, backward: str,
                 rows_first: bool, eps: float) -> torch.Tensor:
    return backward_impl(logits, grad, iters, backward, rows_first, eps)


@mhc_backward.register_fake
def _(logits, grad, iters, backward, rows_first, eps):
    return logits.new_empty(logits.shape)


def _setup_context(ctx, inputs, output):
    logits, iters, backward, rows_first, eps = inputs
    ctx.save_for_backward(logits)
    ctx.cfg = (iters, backward, rows_first, eps)


def _backward(ctx, grad):
    (logits,) = ctx.saved_tensors
    iters, backward, rows_first, eps = ctx.cfg
    return mhc_backward(logits, grad, iters, backward, rows_first, eps), None, None, None, None


mhc_forward.register_autograd(_backward, setup_context=_setup_context)


class EagerMHC(torch.autograd.Function):
    """The same launches as :func:`mhc_forward` / :func:`mhc_backward` for eager calls:
    a plain ``autograd.Function`` costs a fraction of a custom op's host time per call
    (the default forward + backward at B = 2^20, n = 4 is host-bound on the H100), and
    it synchronizes nothing either (CUDA-graph capture works the same). Under
    ``torch.compile`` the custom ops are used (``torch_api.mhc`` picks)."""

    @staticmethod
    def forward(ctx, logits, iters, backward, rows_first, eps):
        ctx.save_for_backward(logits)
        ctx.cfg = (iters, backward, rows_first, eps)
        return forward_impl(logits.detach(), iters, rows_first, eps)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        (logits,) = ctx.saved_tensors
        iters, backward, rows_first, eps = ctx.cfg
        return backward_impl(logits, grad, iters, backward, rows_first, eps), None, None, None, None
