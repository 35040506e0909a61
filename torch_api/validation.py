"""Input checks for the PyTorch API. Every error names the argument and the fix."""

from __future__ import annotations

import torch

from ot_triton_jax.geomloss_options import positive_number as positive  # noqa: F401 (re-exported)
from ot_triton_jax.launch_plans import check_precision

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def points(name: str, x) -> torch.Tensor:
    """A (n, d) floating tensor with n, d >= 1 (see :func:`finite` for the values)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape (n, d); got {type(x).__name__}")
    if x.ndim != 2:
        raise ValueError(f"{name} must have shape (n, d) (2 dimensions); got shape {tuple(x.shape)}. "
                         f"Use x[None] / x.unsqueeze(-1) to add a missing axis")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64; got {x.dtype}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} is empty (0 points): a point cloud needs at least one point")
    if x.shape[1] == 0:
        raise ValueError(f"{name} has dimension d = 0: points need at least one coordinate")
    return x


def finite(name: str, x: torch.Tensor) -> torch.Tensor:
    if not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf coordinates; clean the input")
    return x


def pair(x: torch.Tensor, y: torch.Tensor, names=("x", "y")) -> None:
    """Two clouds in the same space, on the same device, with the same dtype."""
    nx, ny = names
    if x.shape[1] != y.shape[1]:
        raise ValueError(f"{nx} and {ny} must have the same dimension d; got {nx}: {tuple(x.shape)}, "
                         f"{ny}: {tuple(y.shape)}")
    if x.device != y.device:
        raise ValueError(f"{nx} and {ny} must be on the same device; got {x.device} and {y.device}")
    if x.dtype != y.dtype:
        raise TypeError(f"{nx} and {ny} must have the same dtype; got {x.dtype} and {y.dtype}. "
                        f"Cast one of them")


def weights(name: str, w, n: int, like: torch.Tensor) -> torch.Tensor:
    """Non-negative finite weights of shape (n,), not all zero; None means uniform 1/n."""
    if w is None:
        return torch.full((n,), 1.0 / n, device=like.device, dtype=torch.float32)
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape ({n},) or None; got {type(w).__name__}")
    if w.ndim != 1 or w.shape[0] != n:
        raise ValueError(f"{name} must have shape ({n},) to match the points; got {tuple(w.shape)}")
    if w.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating tensor; got {w.dtype}")
    if w.device != like.device:
        raise ValueError(f"{name} must be on the points' device {like.device}; got {w.device}")
    if not bool(torch.isfinite(w).all()):
        raise ValueError(f"{name} contains NaN or Inf; weights must be finite")
    if bool((w < 0).any()):
        raise ValueError(f"{name} has negative entries; weights must be >= 0")
    if not bool((w > 0).any()):
        raise ValueError(f"{name} is all zeros; at least one weight must be positive")
    return w


def balanced(a: torch.Tensor, b: torch.Tensor, rtol: float = 1e-5) -> None:
    sa, sb = float(a.detach().double().sum()), float(b.detach().double().sum())
    if abs(sa - sb) > rtol * max(sa, sb):
        raise ValueError(f"a and b must have the same total mass for balanced OT; got sum(a)={sa:.8g}, "
                         f"sum(b)={sb:.8g}. Normalize both, e.g. a / a.sum() and b / b.sum()")


def iterations(threshold, inner_iterations, min_iterations, max_iterations) -> None:
    if not (isinstance(inner_iterations, int) and inner_iterations >= 1):
        raise ValueError(f"inner_iterations must be an int >= 1; got {inner_iterations!r}")
    if not (isinstance(max_iterations, int) and max_iterations >= 1):
        raise ValueError(f"max_iterations must be an int >= 1; got {max_iterations!r}")
    if not (isinstance(min_iterations, int) and 0 <= min_iterations <= max_iterations):
        raise ValueError(f"min_iterations must be an int in [0, max_iterations={max_iterations}]; "
                         f"got {min_iterations!r}")
    positive("threshold", threshold)


def precision(p: str) -> str:
    return check_precision(p)
