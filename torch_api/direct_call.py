"""Calling a ``torch.library`` custom op's implementation directly, where the dispatcher
has nothing to do.

The dispatcher's path through a Python custom op (autograd wrapper, redispatch, the
aliasing check of the outputs, the ``torch._dynamo`` guard around the implementation)
costs about 50 us of host time per call on the H100 machine (docs/performance.md),
a tenth of a 10-iteration solve at n = m = 8192. When no tensor argument needs a
gradient and nothing intercepts the call (no torch.compile tracing, no functorch or
forward-mode AD transform, no Python dispatch or function mode, only plain tensors), the op
would return exactly what its implementation returns, so the implementation is called as a
plain function. Everywhere else the op is called as usual.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.autograd.forward_ad as forward_ad


def plain(tensors) -> bool:
    """Whether a call on ``tensors`` (None entries ignored) passes through the dispatcher
    unchanged: plain tensors, none needing a gradient, no tracing, transform or mode active."""
    if (torch.compiler.is_compiling() or torch._C._are_functorch_transforms_active()
            or forward_ad._current_level >= 0 or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._is_torch_function_mode_enabled()):
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:
        if t is not None and (type(t) is not torch.Tensor or (grad and t.requires_grad)):
            return False
    return True


def call(op, impl: Callable, *args):
    """``op(*args)``, through ``impl(*args)`` (the op's own implementation) when :func:`plain`."""
    if plain(a for a in args if isinstance(a, torch.Tensor) or a is None):
        return impl(*args)
    return op(*args)
