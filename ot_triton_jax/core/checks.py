"""Validation rules and their error messages, written once for both frontends.

A frontend passes a :class:`Reader` that knows how to read its arrays (shape,
dtype, device, and a few reductions over the values); the rules and every
message live here. A reduction returns ``None`` when the values are not
available (JAX inside ``jax.jit``): value rules are then skipped, and the
frontend turns invalid values into NaN outputs instead (documented in the
README, "Bad input").

Every error names the argument and says what to do.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any, Protocol

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
PRECISIONS = ("float32", "tf32")


class Reader(Protocol):
    """How one framework reads its arrays for the rules below."""

    array_type: str  # "torch.Tensor" or "jax.Array", for messages

    def is_array(self, v: Any) -> bool: ...
    def shape(self, v: Any) -> tuple[int, ...]: ...
    def dtype(self, v: Any) -> str: ...  # "float32", "int32", ...
    def device(self, v: Any) -> str | None: ...  # None: the framework places arrays itself
    def all_finite(self, v: Any) -> bool | None: ...
    def all_nonneg(self, v: Any) -> bool | None: ...
    def rows_any_positive(self, v: Any) -> list[bool] | None: ...  # over the last axis
    def rows_sum(self, v: Any) -> list[float] | None: ...  # float64 sums over the last axis


# ----------------------------------------------------------------------------- points


def points(r: Reader, name: str, v, *, batched: bool = False) -> None:
    """A (n, d) floating array (or (B, N, D) when ``batched``) with n, d >= 1."""
    layout = "(N, D) or (B, N, D) (batch)" if batched else "(n, d)"
    if not r.is_array(v):
        raise TypeError(f"{name} must be a {r.array_type} of shape {layout}; got {type(v).__name__}")
    shape = r.shape(v)
    if len(shape) not in ((2, 3) if batched else (2,)):
        fix = (f"Add a missing axis with {name}[None] or {name}[:, None]" if len(shape) < 2 else
               "A batch of problems goes through jax.vmap (JAX), torch_api.sinkhorn / sinkhorn_batch, hvp or "
               "SamplesLoss on (B, n, d) (PyTorch)")
        raise ValueError(f"{name} must have shape {layout}; got shape {shape}. {fix}")
    if r.dtype(v) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64; got {r.dtype(v)}. "
                        f"Cast it to float32")
    if shape[-2] == 0:
        raise ValueError(f"{name} is empty (0 points): a point cloud needs at least one point")
    if shape[-1] == 0:
        raise ValueError(f"{name} has dimension d = 0: points need at least one coordinate")


def batch_shapes(shape_x: Sequence[int], shape_y: Sequence[int], per_problem: dict, kind: str = "tensor") -> None:
    """A batch of problems: x (B, n, d), y (B, m, d) with the same B; ``per_problem`` maps a name to
    (its shape or None, "x" or "y"): a (B, n) row per problem of that cloud (None: absent)."""
    if len(shape_x) != 3 or len(shape_y) != 3 or shape_x[0] != shape_y[0]:
        raise ValueError(f"a batch takes x (B, n, d) and y (B, m, d) with the same B; got shapes {tuple(shape_x)} "
                         f"and {tuple(shape_y)}")
    for name, (shape, side) in per_problem.items():
        want = tuple((shape_x if side == "x" else shape_y)[:2])
        if shape is not None and tuple(shape) != want:
            raise ValueError(f"{name} must be a {want} {kind}, one row per problem (or None); got shape "
                             f"{tuple(shape)}")


def finite(r: Reader, name: str, v) -> None:
    if r.all_finite(v) is False:
        raise ValueError(f"{name} contains NaN or Inf coordinates; clean the input")


def pair(r: Reader, x, y, names: tuple[str, str] = ("x", "y")) -> None:
    """Two clouds in the same space, on the same device, with the same dtype (and batch size)."""
    nx, ny = names
    sx, sy = r.shape(x), r.shape(y)
    if len(sx) != len(sy):
        raise ValueError(f"{nx} and {ny} must both be unbatched (N, D) or both batched (B, N, D); "
                         f"got shapes {sx} and {sy}")
    if sx[-1] != sy[-1]:
        raise ValueError(f"{nx} and {ny} must have the same dimension d; got {nx}: {sx}, {ny}: {sy}")
    if len(sx) == 3:
        if sx[0] != sy[0]:
            raise ValueError(f"{nx} and {ny} must have the same batch size B; got {nx}: {sx}, {ny}: {sy}")
        if sx[0] == 0:
            raise ValueError(f"{nx} and {ny} have batch size B = 0: nothing to compute")
    dx, dy = r.device(x), r.device(y)
    if dx is not None and dx != dy:
        raise ValueError(f"{nx} and {ny} must be on the same device; got {dx} and {dy}")
    if r.dtype(x) != r.dtype(y):
        raise TypeError(f"{nx} and {ny} must have the same dtype; got {r.dtype(x)} and {r.dtype(y)}. "
                        f"Cast one of them")


# ----------------------------------------------------------------------------- weights


def weights(r: Reader, name: str, w, pts, pname: str, *, trailing_one: bool = False) -> bool:
    """Weights for the points ``pts`` (shape (..., N, D)): shape (..., N) (or (..., N, 1)
    when ``trailing_one``), floating, on the points' device. Returns True when the
    trailing singleton axis must be dropped; then check the values with
    :func:`weight_values`."""
    want = r.shape(pts)[:-1]
    if not r.is_array(w):
        raise TypeError(f"{name} must be a {r.array_type} of shape {want} or None; got {type(w).__name__}")
    shape = r.shape(w)
    squeeze = trailing_one and shape == want + (1,)
    if shape != want and not squeeze:
        alt = f" or {want + (1,)}" if trailing_one else ""
        raise ValueError(f"{name} must have shape {want}{alt} to match the points {pname} {r.shape(pts)}; "
                         f"got {shape}")
    if r.dtype(w) not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating array (float16, bfloat16, float32 or float64); "
                        f"got {r.dtype(w)}")
    dw, dp = r.device(w), r.device(pts)
    if dw is not None and dw != dp:
        raise ValueError(f"{name} must be on the points' device {dp}; got {dw}")
    return squeeze


def weight_values(r: Reader, name: str, w) -> None:
    """Finite, >= 0 and not all zero (per problem when ``w`` is (B, N))."""
    if r.all_finite(w) is False:
        raise ValueError(f"{name} contains NaN or Inf; weights must be finite")
    if r.all_nonneg(w) is False:
        raise ValueError(f"{name} has negative entries; weights must be >= 0")
    rows = r.rows_any_positive(w)
    if rows is not None:
        for k, ok in enumerate(rows):
            if not ok:
                label = name if len(r.shape(w)) == 1 else f"{name}[{k}]"
                raise ValueError(f"{label} is all zeros; at least one weight must be positive")


def same_weight_dtype(r: Reader, a, b) -> None:
    if r.dtype(a) != r.dtype(b):
        raise TypeError(f"a and b must have the same dtype; got {r.dtype(a)} and {r.dtype(b)}. "
                        f"Cast one of them")


def balanced(r: Reader, a, b, rtol: float = 1e-5) -> None:
    """Equal total masses (per problem of a batch): balanced OT needs them."""
    sa, sb = r.rows_sum(a), r.rows_sum(b)
    if sa is None or sb is None:
        return
    for k, (ma, mb) in enumerate(zip(sa, sb)):
        if abs(ma - mb) > rtol * max(ma, mb):
            where = "" if len(sa) == 1 else f" in batch {k}"
            raise ValueError(f"a and b must have the same total mass for balanced OT{where}; got "
                             f"sum(a)={ma:.8g}, sum(b)={mb:.8g}. Normalize both, e.g. a / a.sum() "
                             f"and b / b.sum(), or relax a marginal (tau_a / tau_b < 1 in sinkhorn, "
                             f"reach / reach_x / reach_y in SamplesLoss)")


# ----------------------------------------------------------------------------- scalars and options


def positive(name: str, v) -> float:
    """``v`` as a finite float > 0, or an error naming ``name``."""
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a positive number; got {v!r}") from None
    if not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0; got {v}")
    return v


def scalar_shape(name: str, shape: Sequence[int]) -> None:
    if len(shape) != 0 and tuple(shape) != (1,):
        raise ValueError(f"{name} must be a scalar; got shape {tuple(shape)}")


def iterations(inner_iterations, min_iterations, max_iterations) -> tuple[int, int, int]:
    """OTT's loop sizes: ints, inner >= 1, max >= 1, 0 <= min <= max (static under jit)."""
    for name, v in (("inner_iterations", inner_iterations), ("max_iterations", max_iterations)):
        if not _is_int(v) or v < 1:
            raise ValueError(f"{name} must be a Python int >= 1 (it is static under jit); got {v!r}")
    if not _is_int(min_iterations) or not 0 <= min_iterations <= max_iterations:
        raise ValueError(f"min_iterations must be an int in [0, max_iterations={max_iterations}]; "
                         f"got {min_iterations!r}")
    return int(inner_iterations), int(min_iterations), int(max_iterations)


def precision(p) -> str:
    if p not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {p!r}")
    return p


def init_shapes(init, n: int, m: int, shape_of) -> None:
    """``init`` = (f0, g0) of shapes (n,), (m,); ``shape_of`` reads a shape."""
    if not (isinstance(init, (tuple, list)) and len(init) == 2):
        raise TypeError(f"init must be a pair (f0, g0) of arrays of shapes ({n},), ({m},)")
    s0, s1 = (tuple(shape_of(v)) for v in init)
    if s0 != (n,) or s1 != (m,):
        raise ValueError(f"init must have shapes ({n},), ({m},); got {s0}, {s1}")


def axis(v) -> int:
    if v not in (0, 1):
        raise ValueError(f"axis must be 0 (P^T v, indexed by y) or 1 (P v, indexed by x); got {v!r}")
    return int(v)


def transport_vector(r: Reader, v, k: int, ax: int, device) -> None:
    """``v`` for ``apply(v, axis)``: shape (k,) or (k, p), on the solve's device."""
    shape = r.shape(v) if r.is_array(v) else type(v).__name__
    if not r.is_array(v) or len(shape) not in (1, 2) or shape[0] != k:
        raise ValueError(f"v must have shape ({k},) or ({k}, p) for axis={ax}; got {shape}")
    dv = r.device(v)
    if dv is not None and device is not None and dv != device:
        raise ValueError(f"v must be on device {device}; got {dv}")


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def second_order_message(name: str) -> str:
    """The error raised when a derivative path is not implemented (never a silent zero)."""
    return (f"{name}: this derivative involves epsilon or scale_cost (their second derivatives, and the "
            "derivatives of the potentials, apply and marginal in them, are not implemented). "
            "Differentiate in x, y, a, b, or hold epsilon and scale_cost fixed (jax.lax.stop_gradient / "
            "a tensor without requires_grad).")


HVP_WRT = ("x", "y")
HVP_LOSSES = ("reg_ot_cost", "sinkhorn_divergence")


def hvp_args(wrt, loss) -> None:
    """The choices of the explicit ``hvp`` functions."""
    if wrt not in HVP_WRT:
        raise ValueError(f"wrt must be 'x' or 'y' (the cloud the Hessian is taken in); got {wrt!r}")
    if loss not in HVP_LOSSES:
        raise ValueError(f"loss must be one of {HVP_LOSSES}; got {loss!r}")


def hvp_direction(r: "Reader", v, like, name: str) -> None:
    """The direction of an HVP has the shape of the cloud it perturbs."""
    if not r.is_array(v) or tuple(r.shape(v)) != tuple(r.shape(like)):
        got = tuple(r.shape(v)) if r.is_array(v) else type(v).__name__
        raise ValueError(f"v must have the shape of {name}, {tuple(r.shape(like))}; got {got}")
