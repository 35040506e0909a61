"""ot_triton_jax.ott.segment_sinkhorn: OTT-JAX 0.6's ``segment_sinkhorn`` tool on our PointCloud.

Each case calls OTT's own ``ott.tools.segment_sinkhorn.segment_sinkhorn`` and ours with the same
arguments (float32, tiny ragged segments under the Triton interpreter) and compares the costs of
every segment (to 1e-5 of the largest) and the gradients in the points and the weights (to 1e-4
of the largest entry): both interfaces (contiguous sizes; segment ids in any order), non-uniform
weights with zeros, a segment of one point, x and y segments of different sizes, OTT solver
options passed through ``sinkhorn_kwargs``, ``jax.jit``. Bad segment arguments raise.
"""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import ott  # noqa: F401  (a missing peer must fail, not skip)
from ott.solvers.linear import acceleration
from ott.tools import segment_sinkhorn as ott_tool

from ot_triton_jax.ott import segment_sinkhorn
from test_ott_pointcloud_solvers import RTOL_GRAD, RTOL_VALUE, assert_close

SIZES_X, SIZES_Y = (7, 1, 10), (9, 6, 4)


def clouds(seed=0, d=3):
    k = jax.random.split(jax.random.key(seed), 4)
    x = jax.random.normal(k[0], (sum(SIZES_X), d))
    y = jax.random.normal(k[1], (sum(SIZES_Y), d)) * 0.8 + 0.3
    return x, y, k[2], k[3]


def segment_weights(key, sizes, zero_at=()):
    """Non-uniform weights summing to 1 within each contiguous segment, zeros at ``zero_at``."""
    w = jax.random.uniform(key, (sum(sizes),)) + 0.2
    w = w.at[jnp.array(zero_at, dtype=jnp.int32)].set(0.0) if zero_at else w
    ids = np.repeat(np.arange(len(sizes)), sizes)
    return w / jax.ops.segment_sum(w, jnp.asarray(ids), len(sizes))[ids]


@pytest.mark.parametrize("kw", [
    {"epsilon": 0.5},
    {"epsilon": 0.2, "scale_cost": "mean", "sinkhorn_kwargs": {"momentum": acceleration.Momentum(value=1.2)}},
], ids=["default", "mean-momentum"])
def test_contiguous_segments_match_ott(kw):
    x, y, ka, kb = clouds()
    wx = segment_weights(ka, SIZES_X, zero_at=(2,))
    wy = segment_weights(kb, SIZES_Y, zero_at=(10, 17))
    args = dict(num_per_segment_x=SIZES_X, num_per_segment_y=SIZES_Y, weights_x=wx, weights_y=wy, **kw)

    def costs(fn, x, y, wx, wy):
        return fn(x, y, **dict(args, weights_x=wx, weights_y=wy))

    ref = costs(ott_tool.segment_sinkhorn, x, y, wx, wy)
    ours = jax.jit(lambda *v: costs(segment_sinkhorn, *v))(x, y, wx, wy)
    assert ours.shape == (3,)
    assert_close(ours, ref, RTOL_VALUE)
    # gradients of a weighted sum of the costs in both clouds and both weight vectors
    c = jnp.array([1.0, -0.5, 2.0])
    grads = [jax.grad(lambda *v: jnp.dot(c, costs(fn, *v)), argnums=(0, 1, 2, 3))(x, y, wx, wy)
             for fn in (segment_sinkhorn, ott_tool.segment_sinkhorn)]
    for name, g_ours, g_ref in zip("x y a b".split(), *grads):
        if name in "ab":
            # OTT's weight gradient is NaN at a zero weight (its d/da of a log a); ours is OTT's there too.
            # On the support: defined up to a constant per segment (mass-preserving directions)
            w, sizes = (wx, SIZES_X) if name == "a" else (wy, SIZES_Y)
            on = np.asarray(w) > 0
            np.testing.assert_array_equal(np.isnan(np.asarray(g_ours)), ~on)
            np.testing.assert_array_equal(np.isnan(np.asarray(g_ref)), ~on)
            ids = np.repeat(np.arange(3), sizes)[on]
            def center(v):
                v = np.asarray(v, np.float64)[on]
                return v - (np.bincount(ids, v) / np.bincount(ids))[ids]
            g_ours, g_ref = center(g_ours), center(g_ref)
        assert_close(g_ours, g_ref, RTOL_GRAD)


def test_segment_ids_in_any_order_match_ott():
    x, y, ka, kb = clouds(seed=3, d=2)
    perm_x = jax.random.permutation(ka, x.shape[0])
    perm_y = jax.random.permutation(kb, y.shape[0])
    ids_x = jnp.repeat(jnp.arange(3), jnp.array(SIZES_X), total_repeat_length=x.shape[0])[perm_x]
    ids_y = jnp.repeat(jnp.arange(3), jnp.array(SIZES_Y), total_repeat_length=y.shape[0])[perm_y]
    # weights given: OTT's default weights (1 / size, laid out contiguously) assume sorted ids
    wx, wy = segment_weights(kb, SIZES_X), segment_weights(ka, SIZES_Y, zero_at=(3,))
    args = dict(segment_ids_x=ids_x, segment_ids_y=ids_y, num_segments=3, max_measure_size=12, epsilon=0.3,
                weights_x=wx[perm_x], weights_y=wy[perm_y])
    ref = ott_tool.segment_sinkhorn(x[perm_x], y[perm_y], **args)
    ours = segment_sinkhorn(x[perm_x], y[perm_y], **args)
    assert_close(ours, ref, RTOL_VALUE)
    # the same problems given contiguously
    contiguous = segment_sinkhorn(x, y, num_per_segment_x=SIZES_X, num_per_segment_y=SIZES_Y, epsilon=0.3,
                                  weights_x=wx, weights_y=wy)
    assert_close(ours, contiguous, RTOL_VALUE)


def test_bad_segment_arguments_raise():
    x, y, _, _ = clouds()
    ids = jnp.zeros(x.shape[0], dtype=jnp.int32)
    with pytest.raises(ValueError, match="num_per_segment_x and num_per_segment_y"):
        segment_sinkhorn(x, y, num_per_segment_x=SIZES_X)
    with pytest.raises(ValueError, match="go together"):
        segment_sinkhorn(x, y, segment_ids_x=ids, num_segments=1, max_measure_size=18)
    with pytest.raises(ValueError, match="max_measure_size"):
        segment_sinkhorn(x, y, segment_ids_x=ids, segment_ids_y=jnp.zeros(y.shape[0], dtype=jnp.int32))
    with pytest.raises(ValueError, match="same number of segments"):
        segment_sinkhorn(x, y, num_per_segment_x=SIZES_X, num_per_segment_y=(10, 9))
