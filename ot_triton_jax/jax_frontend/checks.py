"""Input checks for the JAX frontend: the rules of ``ot_triton_jax.core.checks``
read through JAX, and the run-time validity flag used under ``jax.jit``.

Shapes, dtypes and static options are checked at trace time. Values (finite
points, weights >= 0 and not all zero, equal masses, epsilon > 0) are checked
when they are concrete (eager calls, eager ``jax.grad``); inside ``jax.jit``
they are tracers, and :func:`inputs_ok` computes a flag on the device instead:
the solvers then run no iteration and return NaN (README, "Bad input").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..core import checks as rules, unbalanced
from ..core.checks import positive, precision  # noqa: F401 (re-exported)
from .interop import concrete_value

F32 = jnp.float32
BALANCE_RTOL = 1e-5  # relative mass difference accepted as balanced (the eager rule's)


class _JaxReader:
    array_type = "jax.Array"

    @staticmethod
    def is_array(v) -> bool:
        return hasattr(v, "shape") and hasattr(v, "dtype")

    @staticmethod
    def shape(v) -> tuple[int, ...]:
        return tuple(v.shape)

    @staticmethod
    def dtype(v) -> str:
        return str(jnp.dtype(v.dtype))

    @staticmethod
    def device(v) -> None:
        return None  # JAX places the arrays of one computation itself

    @staticmethod
    def _eval(v, fn):
        c = concrete_value(v)
        if c is None:
            return None
        with jax.ensure_compile_time_eval():
            return fn(jnp.asarray(c))

    def all_finite(self, v):
        return self._eval(v, lambda c: bool(jnp.all(jnp.isfinite(c))))

    def all_nonneg(self, v):
        return self._eval(v, lambda c: bool(jnp.all(c >= 0)))

    def rows_any_positive(self, v):
        return self._eval(v, lambda c: np.asarray(jnp.any(c > 0, -1)).reshape(-1).tolist())

    def rows_sum(self, v):
        """Each row's sum: float64 on the host from float32 sums of 64 entries on the device (a
        float32 sum of 64 nonnegative terms is within 63 ulp-halves, 3.8e-6 relative, well inside
        BALANCE_RTOL), so only n / 64 numbers travel to the host, not the weights themselves."""
        c = concrete_value(v)
        if c is None:
            return None
        with jax.ensure_compile_time_eval():
            return np.asarray(_block_sums(jnp.asarray(c)), np.float64).sum(-1).reshape(-1).tolist()


@jax.jit
def _block_sums(w):
    """(rows, cdiv(n, 64)) sums of 64 consecutive entries of each row of ``w`` (..., n), zero-padded;
    float64 weights (x64 enabled) are summed whole."""
    rows = w.reshape(-1, w.shape[-1])
    if rows.dtype == jnp.float64:
        return rows.sum(-1, keepdims=True)
    rows = rows.astype(F32)
    rows = jnp.pad(rows, ((0, 0), (0, (-rows.shape[1]) % 64)))
    return rows.reshape(rows.shape[0], -1, 64).sum(-1)


READER = _JaxReader()


def as_array(name: str, v, layout: str):
    """Python lists, tuples, numbers and numpy arrays become jax arrays; other objects raise."""
    if READER.is_array(v):
        return v
    if isinstance(v, (list, tuple, np.ndarray, float, int)):
        return jnp.asarray(v)
    raise TypeError(f"{name} must be a jax.Array of shape {layout}; got {type(v).__name__}")


def check_points(name: str, x, *, batched: bool = False):
    """(n, d) floating array ((B, N, D) with ``batched``); finite entries checked when concrete."""
    x = as_array(name, x, "(n, d)")
    rules.points(READER, name, x, batched=batched)
    rules.finite(READER, name, x)
    return x


def check_pair(x, y, names=("x", "y")) -> None:
    rules.pair(READER, x, y, names)


def check_weights(name: str, w, pts, pname: str, *, trailing_one: bool = False):
    """Weights for ``pts``; None means uniform 1/N (float32). Values checked when concrete."""
    if w is None:
        shape = tuple(pts.shape[:-1])
        return jnp.full(shape, 1.0 / shape[-1], dtype=jnp.promote_types(pts.dtype, F32))
    w = as_array(name, w, str(tuple(pts.shape[:-1])))
    if rules.weights(READER, name, w, pts, pname, trailing_one=trailing_one):
        w = w[..., 0]
    rules.weight_values(READER, name, w)
    return w


def check_balanced(a, b) -> None:
    rules.balanced(READER, a, b, rtol=BALANCE_RTOL)


def check_tau(name: str, tau) -> float:
    """A static tau in (0, 1] (OTT's ``tau_a`` / ``tau_b``) as a Python float. tau picks the
    kernels' variant and the loop, so it must be known at trace time: a traced value (an
    argument of ``jax.jit`` not marked static) raises a TypeError that says so; a concrete
    0-d array is read."""
    if hasattr(tau, "shape") and hasattr(tau, "dtype"):
        c = concrete_value(tau)
        if c is None:
            raise TypeError(f"{name} must be a static Python float in (0, 1], not a traced value: it selects "
                            f"the solver's update rule at trace time. Pass a Python float, or list {name} in "
                            f"jax.jit's static_argnames")
        if tuple(jnp.shape(c)) != ():
            raise TypeError(f"{name} must be a float in (0, 1], got an array of shape {tuple(jnp.shape(c))}")
        tau = float(np.asarray(c))
    return unbalanced.check_tau(name, tau)


def check_same_weight_dtype(a, b) -> None:
    rules.same_weight_dtype(READER, a, b)


def check_positive(name: str, v):
    """A positive finite scalar; a traced scalar is checked at run time (NaN output)."""
    if hasattr(v, "shape"):
        rules.scalar_shape(name, tuple(jnp.shape(v)))
    vc = concrete_value(v)
    if vc is not None:
        positive(name, vc)
    return v


def check_iterations(threshold, inner_iterations, min_iterations, max_iterations) -> tuple[int, int, int]:
    check_positive("threshold", threshold)
    return rules.iterations(inner_iterations, min_iterations, max_iterations)


def check_backend(backend):
    """None, "auto" or one of the launchers of :mod:`.launch`."""
    from .launch import BACKENDS

    if backend is not None and backend != "auto" and backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'auto' or one of {BACKENDS}; got {backend!r}")
    return backend


def is_traced(v) -> bool:
    """No concrete value behind ``v`` (it is traced by jit): value checks are skipped."""
    return concrete_value(v) is None


def inputs_ok(*arrays, positive=(), nonneg=(), balanced=(), empty_pair=None) -> jax.Array:
    """Run-time validity flag (the value rules above, on the device): every array finite,
    ``positive`` scalars > 0, ``nonneg`` arrays >= 0 with a positive entry per row,
    each ``balanced`` pair (a, b) of equal total mass per row (relative BALANCE_RTOL). With
    ``empty_pair`` (a, b), both of ``nonneg``, a problem whose a and b are both all zero (a padding
    problem of a batch: nothing to transport) is valid too."""
    ok = jnp.array(True)
    for v in arrays:
        ok &= jnp.all(jnp.isfinite(v))
    for v in positive:
        ok &= v > 0
    empty = None if empty_pair is None else ~jnp.any(empty_pair[0] > 0, -1) & ~jnp.any(empty_pair[1] > 0, -1)
    for v in nonneg:
        some = jnp.any(v > 0, -1)
        ok &= jnp.all(v >= 0) & jnp.all(some if empty is None else some | empty)
    for a, b in balanced:
        sa, sb = jnp.sum(a, -1), jnp.sum(b, -1)
        ok &= jnp.all(jnp.abs(sa - sb) <= BALANCE_RTOL * jnp.maximum(sa, sb))
    return ok
