"""ot_triton_jax's compensated float32 sum (jax_frontend/summation.py) against exact float64 sums
on terms far larger than their sum, as the dual objective's are at large epsilon."""

import numpy as np
import pytest

import torch_api  # noqa: F401  (configures the Triton interpreter switch before jax)
import jax
import jax.numpy as jnp

from ot_triton_jax.jax_frontend.summation import accurate_sum

U = 2.0 ** -24


@pytest.mark.parametrize("n", [1, 7, 1000, 100_000])
def test_within_one_ulp_of_the_exact_sum(n):
    rng = np.random.default_rng(n)
    big = (rng.standard_normal(n) * 80.0).astype(np.float32)
    terms = np.concatenate([big, -big[::-1] * np.float32(0.999), rng.random(n).astype(np.float32)])
    exact = float(np.sum(terms.astype(np.float64)))
    got = float(jax.jit(accurate_sum)(jnp.asarray(terms)))
    assert abs(got - exact) <= 1.01 * U * abs(exact) + 1e-30, (got, exact)


def test_vmap_and_dtype():
    x = jnp.arange(12, dtype=jnp.float32).reshape(3, 4)
    out = jax.vmap(accurate_sum)(x)
    assert out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), np.array([6.0, 22.0, 38.0], np.float32))


def test_derivatives_are_those_of_the_sum():
    x = jnp.asarray(np.random.default_rng(1).standard_normal(50).astype(np.float32))
    t = jnp.asarray(np.random.default_rng(2).standard_normal(50).astype(np.float32))
    _, tan = jax.jvp(accurate_sum, (x,), (t,))
    np.testing.assert_allclose(float(tan), float(np.sum(np.asarray(t, np.float64))), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(jax.grad(accurate_sum)(x)), np.ones(50, np.float32))
    hess_vec = jax.jvp(jax.grad(lambda z: accurate_sum(z * z)), (x,), (t,))[1]
    np.testing.assert_allclose(np.asarray(hess_vec), 2 * np.asarray(t), rtol=1e-6)


@pytest.mark.gpu
def test_within_one_ulp_on_the_gpu():
    """XLA's GPU reduction keeps the two-sum exact (no reassociation)."""
    gpu = jax.devices("gpu")[0]
    rng = np.random.default_rng(0)
    big = (rng.standard_normal(1_000_000) * 80.0).astype(np.float32)
    terms = np.concatenate([big, -big[::-1] * np.float32(0.999), rng.random(1_000_000).astype(np.float32)])
    exact = float(np.sum(terms.astype(np.float64)))
    got = float(jax.jit(accurate_sum)(jax.device_put(terms, gpu)))
    assert abs(got - exact) <= 1.01 * U * abs(exact), (got, exact)
