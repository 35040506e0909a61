"""Float32 sums as accurate as the float32 result allows (JAX runs without float64 by default).

``jnp.sum`` rounds every partial sum: summing n terms t_i costs up to ~u log2(n) sum |t_i| (u =
2^-24), which matters where the terms are much larger than their sum (the dual objective's
a_i (f_i - eps log a_i) at large eps: the reports in parity/reports/). :func:`accurate_sum`
reduces (sum, compensation) pairs with Neumaier's error-free two-sum inside one XLA reduction
(pairwise, any order): the result is the exact sum up to O(n u^2) sum |t_i| before its final
rounding to float32, i.e. within about one ulp of the sum, like the torch frontend's float64
accumulation. XLA does not reassociate floating-point arithmetic unless fast-math is enabled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def _two_sum(p, q):
    (s1, c1), (s2, c2) = p, q
    s = s1 + s2
    t = s - s1
    err = (s1 - (s - t)) + (s2 - t)
    return s, c1 + c2 + err


@jax.custom_jvp
def accurate_sum(x: jax.Array) -> jax.Array:
    """sum(x) over all entries (0-d, x's dtype), compensated (module docstring).
    Differentiable: its tangent is the plain sum of the tangents (XLA cannot differentiate a
    reduction with a custom reducer)."""
    # the barrier keeps XLA from constant-folding the reduction when x is a constant (uniform
    # weights under jit): folding interprets the reducer per entry, minutes at a million points
    x = jax.lax.optimization_barrier(jnp.ravel(x))
    zero = jnp.zeros((), x.dtype)
    s, c = jax.lax.reduce((x, jnp.zeros_like(x)), (zero, zero), _two_sum, (0,))
    return s + c


@accurate_sum.defjvp
def _accurate_sum_jvp(primals, tangents):
    (x,), (t,) = primals, tangents
    return accurate_sum(x), jnp.sum(t)
