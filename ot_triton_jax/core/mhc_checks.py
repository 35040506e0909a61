"""Validation rules of ``mhc_sinkhorn`` and their error messages, written once.

Both frontends (``torch_api.mhc`` and ``ot_triton_jax.jax_frontend.mhc``) read
the shape, dtype name and device of their logits their own way and hand them,
with the Python options, to the functions below; every rule and every message
lives here. Framework-free: plain Python values only (shapes as tuples of
ints, dtypes as names such as ``"float32"``).

Errors name the argument and say what to do.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence

from .mhc_plans import N_MAX, N_MIN

__all__ = ["BACKWARDS", "STARTS", "DTYPES", "NON_FINITE", "options", "logits_shape",
           "logits_dtype", "logits_device", "finite"]

BACKWARDS = ("unrolled", "implicit")
STARTS = ("cols", "rows")
# accepted logits dtypes; arithmetic is float32 for all of them (float64 is cast to
# float32 before the kernels and the result / gradient cast back)
DTYPES = ("float32", "bfloat16", "float16", "float64")
NON_FINITE = ("logits contain NaN or inf; mhc_sinkhorn needs finite logits (checked because "
              "check_finite=True; unchecked, the default, such a matrix comes out NaN instead)")


def options(iters, backward, start, eps) -> tuple[int, str, bool, float]:
    """Checked static options -> (iters, backward, rows_first, eps)."""
    if not isinstance(iters, numbers.Integral) or isinstance(iters, bool) or iters < 1:
        raise ValueError(f"iters must be an int >= 1, got {iters!r}")
    if backward not in BACKWARDS:
        raise ValueError(f"backward must be one of {BACKWARDS}, got {backward!r}")
    if start not in STARTS:
        raise ValueError(f"start must be one of {STARTS}, got {start!r}")
    if (isinstance(eps, bool) or not isinstance(eps, numbers.Real)
            or not math.isfinite(eps) or eps < 0):
        raise ValueError(f"eps must be a finite float >= 0 (a static Python number), got {eps!r}")
    return int(iters), backward, start == "rows", float(eps)


def logits_shape(shape: Sequence[int]) -> int:
    """(..., n, n) with 2 <= n <= 64 -> n (only the last two sizes are read)."""
    shape = tuple(shape)
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(
            f"logits must have shape (..., n, n) with square last two dims; got {shape}"
        )
    n = shape[-1]
    if not (N_MIN <= n <= N_MAX):
        raise ValueError(f"logits must have n in [{N_MIN}, {N_MAX}] (shape (..., n, n)); got n = {n}")
    return n


def logits_dtype(dtype: str, cast_hint: str) -> None:
    """``dtype`` (a name) one of :data:`DTYPES`; ``cast_hint`` says how to cast in this frontend."""
    if dtype not in DTYPES:
        raise TypeError(
            f"logits must be float32, bfloat16, float16 or float64; got {dtype} "
            f"(cast with {cast_hint} first; arithmetic is float32 in any case)"
        )


def logits_device(device: str, on_gpu: bool) -> None:
    """When the kernels run on the GPU, the logits must be on a CUDA device (``device`` is its name)."""
    if on_gpu and not device.startswith("cuda"):
        raise ValueError(
            f"logits must be on a CUDA device (kernels run on the GPU); got device {device}"
        )


def finite(all_finite: bool | None) -> None:
    """Raise :data:`NON_FINITE` when ``all_finite`` is False (``None``: values not readable, skip)."""
    if all_finite is False:
        raise ValueError(NON_FINITE)
