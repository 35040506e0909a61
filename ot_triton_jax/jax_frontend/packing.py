"""Packing a batch of equal-size problems into the row-block layout of the block-sparse kernels.

The layout itself is :mod:`ot_triton_jax.core.batch_layout` (problem k's rows start on a row
block, zero-weight padding): here are its JAX array helpers, used by the packed solve
(:mod:`.batched_loop`) and the packed plan passes (:mod:`.kernel_ops`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from ..core import batch_layout, multiscale_plans
from .launch import kernels_on_gpu

__all__ = ["layouts", "pack", "segment_sum", "batch_rows", "unpack"]


def layouts(B: int, n: int, m: int, d: int, precision: str) -> tuple[batch_layout.CloudLayout, ...]:
    """The packed layouts of B problems of n and m points (rows in the block-sparse kernels' BLOCK_M)."""
    block = multiscale_plans.blocksparse_block_m(d, precision, kernels_on_gpu())
    return batch_layout.cloud_layout([n] * B, block), batch_layout.cloud_layout([m] * B, block)


def batch_rows(value: jax.Array, batched: bool, B: int) -> jax.Array:
    """The B problems' rows concatenated, (B * n, ...), of an operand of a batching rule: (B, n, ...)
    when ``batched``, else one problem's (n, ...) shared by the batch (broadcast)."""
    value = value if batched else jnp.broadcast_to(value, (B,) + value.shape)
    return value.reshape((-1,) + value.shape[2:])


def pack(values: jax.Array, layout: batch_layout.CloudLayout, fill=0.0) -> jax.Array:
    """The problems' rows concatenated, (sum n_k, ...), or stacked (B, n, ...) for equal sizes ->
    the packed (rows, ...) array of ``layout``, ``fill`` on the padding rows."""
    if values.shape[0] != sum(layout.sizes):
        values = values.reshape((-1,) + values.shape[2:])
    out = jnp.full((layout.rows,) + values.shape[1:], fill, values.dtype)
    return out.at[np.asarray(layout.index)].set(values)


def unpack(packed: jax.Array, layout: batch_layout.CloudLayout) -> jax.Array:
    """The (sum n_k, ...) concatenated rows of the problems from a packed array."""
    return packed[np.asarray(layout.index)]


def segment_sum(rows: jax.Array, layout: batch_layout.CloudLayout) -> jax.Array:
    """(B,) per-problem sums of a packed (rows,) array (padding rows dropped)."""
    seg = np.where(layout.segment < 0, len(layout.sizes), layout.segment)
    return jax.ops.segment_sum(rows, jnp.asarray(seg), num_segments=len(layout.sizes) + 1)[:-1]
