"""Values whose derivative is not implemented: differentiating them raises, never a silent zero."""

from __future__ import annotations

import torch

__all__ = ["NoDerivative"]


class NoDerivative(torch.autograd.Function):
    """``NoDerivative.apply(message, value, *inputs)``: a copy of ``value`` attached to the graph of
    ``inputs`` whose backward raises ``NotImplementedError(message)``."""

    @staticmethod
    def forward(ctx, message, value, *inputs):
        ctx.message = message
        return value.clone()

    @staticmethod
    def backward(ctx, *_):
        raise NotImplementedError(ctx.message)
