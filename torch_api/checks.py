"""Input checks for the PyTorch frontend: the rules of ``ot_triton_jax.core.checks``
read through torch. Every error names the argument and the fix.

Value checks (finite points, weights >= 0, equal masses) read the values, which
synchronizes with the GPU; the operations run them inside their custom ops, so
``torch.compile`` traces the call without a graph break.
"""

from __future__ import annotations

import torch

from ot_triton_jax.core import checks as rules
from ot_triton_jax.core.checks import positive, precision  # noqa: F401 (re-exported)

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class _TorchReader:
    array_type = "torch.Tensor"

    @staticmethod
    def is_array(v) -> bool:
        return isinstance(v, torch.Tensor)

    @staticmethod
    def shape(v) -> tuple[int, ...]:
        return tuple(v.shape)

    @staticmethod
    def dtype(v) -> str:
        return str(v.dtype).removeprefix("torch.")

    @staticmethod
    def device(v) -> str:
        return str(v.device)

    @staticmethod
    def _real(v) -> bool:
        return v.device.type != "meta" and not torch.compiler.is_compiling()

    @classmethod
    def all_finite(cls, v) -> bool | None:
        return bool(torch.isfinite(v).all()) if cls._real(v) else None

    @classmethod
    def all_nonneg(cls, v) -> bool | None:
        return bool((v >= 0).all()) if cls._real(v) else None

    @classmethod
    def rows_any_positive(cls, v) -> list[bool] | None:
        return (v > 0).reshape(-1, v.shape[-1]).any(1).tolist() if cls._real(v) else None

    @classmethod
    def rows_sum(cls, v) -> list[float] | None:
        return v.detach().double().sum(-1).reshape(-1).tolist() if cls._real(v) else None


READER = _TorchReader()


def points(name: str, x, *, batched: bool = False) -> torch.Tensor:
    """A (n, d) floating tensor with n, d >= 1 ((B, N, D) allowed when ``batched``)."""
    rules.points(READER, name, x, batched=batched)
    return x


def finite(name: str, x: torch.Tensor) -> torch.Tensor:
    rules.finite(READER, name, x)
    return x


def pair(x: torch.Tensor, y: torch.Tensor, names=("x", "y")) -> None:
    rules.pair(READER, x, y, names)


def weights(name: str, w, n: int, like: torch.Tensor) -> torch.Tensor:
    """Weights of shape (n,) for the points ``like`` (values checked); None means uniform 1/n."""
    if w is None:
        return torch.full((n,), 1.0 / n, device=like.device, dtype=torch.float32)
    rules.weights(READER, name, w, like, "x" if name == "a" else "y")
    rules.weight_values(READER, name, w)
    return w


def samples_weights(name: str, w, pts: torch.Tensor, pname: str) -> torch.Tensor:
    """GeomLoss weights: (N,) / (N, 1), or (B, N) / (B, N, 1); returns (N,) or (B, N)."""
    if w is None:
        shape = tuple(pts.shape[:-1])
        return torch.full(shape, 1.0 / shape[-1], dtype=pts.dtype, device=pts.device)
    if rules.weights(READER, name, w, pts, pname, trailing_one=True):
        w = w[..., 0]
    rules.weight_values(READER, name, w)
    return w


def balanced(a: torch.Tensor, b: torch.Tensor) -> None:
    rules.balanced(READER, a, b)


def same_weight_dtype(a: torch.Tensor, b: torch.Tensor) -> None:
    rules.same_weight_dtype(READER, a, b)


def iterations(threshold, inner_iterations, min_iterations, max_iterations) -> tuple[int, int, int]:
    positive("threshold", threshold)
    return rules.iterations(inner_iterations, min_iterations, max_iterations)


def scalar(name: str, v) -> float | torch.Tensor:
    """A positive scalar: a number (checked now) or a 0-d tensor (checked when concrete;
    a tensor that requires grad makes the result differentiable in it)."""
    if isinstance(v, torch.Tensor):
        rules.scalar_shape(name, tuple(v.shape))
        if READER._real(v):
            positive(name, v.detach().reshape(()).item())
        return v.reshape(())
    return positive(name, v)
