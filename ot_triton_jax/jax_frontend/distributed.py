"""``ot_triton_jax.distributed.sinkhorn``: OTT-convention Sinkhorn with the clouds sharded over a 1-D mesh.

The JAX twin of ``torch_api.distributed.sinkhorn``, on ``jax.sharding``: x (n, d), y (m, d), a, b
are global arrays split by points over the devices of a 1-D ``Mesh`` (``NamedSharding(mesh,
P(axis))``; any placement is accepted and resharded) and the solve runs under ``jax.jit`` as a
``shard_map`` with the scheme of :mod:`ot_triton_jax.core.sharding`: every device all-gathers the
clouds once and centres and splits the full clouds as the single solve does, then each half-step
is the single-device kernel on (its own rows, the full other cloud) followed by one
``all_gather`` of the new potential pieces, and each measured marginal error is one ``psum``.
Nothing n x m is communicated. n and m need not be multiples of the number of devices: the clouds
are padded with zero-weight points (absent from every sum; their potentials are -inf and are cut
off the outputs).

Conventions and outputs are :func:`ot_triton_jax.sinkhorn`'s (OTT's alternating loop, g then f,
its stopping rule, ``errors`` / ``n_iters`` / ``converged``, ``reg_ot_cost``) for balanced problems
without labels; f and g come back as global arrays sharded along the mesh axis (when n, resp. m,
is a multiple of the number of devices; placed by XLA otherwise). Derivatives:
``reg_ot_cost`` is differentiable in x, y, a and b (envelope theorem, potentials fixed: d cost /
d x_i = 2 s (r_i x_i - (P y)_i), r = P 1, s = 1 / scale_cost, one sharded plan pass per side, no
collective beyond gathering the clouds; d cost / d a_i = f_i - eps log a_i - eps + eps sum b where
a_i > 0, eps sum b where a_i = 0, likewise in b with g and sum a: elementwise on the shards, the
global masses kept from the forward); in epsilon and scale_cost the global derivatives
(the single-device formulas, from the same passes' partial sums and one ``psum``); a derivative of
f and g, or a second derivative, raises NotImplementedError (``hvp`` gives HVPs in x or y). Values are checked
when concrete (as :func:`ot_triton_jax.sinkhorn`); under ``jax.jit`` invalid values give NaN
outputs and ``converged=False``.

``sinkhorn_divergence`` (:mod:`.distributed_divergence`) combines three such sharded solves as
:func:`ot_triton_jax.sinkhorn_divergence` does (its self terms by OTT's symmetric solve, sharded the
same way); ``samples_loss`` (:mod:`.distributed_loss`) runs GeomLoss's annealed loop with sharded
softmins, and ``hvp`` (:mod:`.distributed_hvp`) the core's CG with sharded plan passes. The
sharded loop, padding and envelope gradient live in :mod:`.distributed_shards`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from ..core.options import LoopOptions
from .checks import check_iterations
from .distributed_divergence import sinkhorn_divergence
from .distributed_hvp import hvp
from .distributed_loss import samples_loss
from .distributed_shards import Static, mesh_axis, sharded_cost
from .kernel_ops import F32
from .sinkhorn_solver import check_problem

__all__ = ["sinkhorn", "sinkhorn_divergence", "samples_loss", "hvp", "ShardedSinkhornOutput"]


class ShardedSinkhornOutput(NamedTuple):
    """f (n,), g (m,) sharded by points like the inputs; reg_ot_cost (differentiable in x, y, a, b,
    epsilon and scale_cost),
    errors, n_iters, converged as :class:`ot_triton_jax.SinkhornOutput`'s."""

    f: jax.Array
    g: jax.Array
    reg_ot_cost: jax.Array
    errors: jax.Array
    n_iters: jax.Array
    converged: jax.Array


@functools.partial(jax.jit, static_argnames=("mesh", "axis", "opts", "backend"))
def _sharded(x, y, a, b, eps, scale, thr, mesh: Mesh, axis: str, opts: LoopOptions, backend):
    static = Static(mesh, axis, opts, backend, x.shape[0], y.shape[0], "sinkhorn")
    return sharded_cost(x, y, a, b, eps, scale, thr, static)


def sinkhorn(
    x: jax.Array,
    y: jax.Array,
    a: jax.Array | None = None,
    b: jax.Array | None = None,
    *,
    mesh: Mesh,
    axis: str | None = None,
    epsilon: Any,
    scale_cost: Any = 1.0,
    threshold: Any = 1e-3,
    inner_iterations: int = 10,
    min_iterations: int = 0,
    max_iterations: int = 2000,
    precision: str = "float32",
    backend: str | None = None,
) -> ShardedSinkhornOutput:
    """:func:`ot_triton_jax.sinkhorn` with x (n, d), y (m, d), a (n,), b (m,) split by points over
    the devices of ``mesh`` along ``axis`` (default: its only axis), as one ``shard_map`` under
    ``jax.jit`` (module docstring: the communication, the padding, the derivatives). Returns a
    :class:`ShardedSinkhornOutput` whose f and g are sharded along ``axis``."""
    axis = mesh_axis(mesh, axis)
    x, y, a, b = check_problem(x, y, a, b, epsilon, scale_cost)
    inner, lo, hi = check_iterations(threshold, inner_iterations, min_iterations, max_iterations)
    opts = LoopOptions(precision, inner, lo, hi)
    cost, f, g, errors, n_iters = _sharded_outputs(x, y, a, b, epsilon, scale_cost, threshold, mesh, axis, opts,
                                                   backend)
    converged = ~jnp.any(jnp.isnan(errors)) & (errors[-1] < threshold)
    return ShardedSinkhornOutput(f, g, cost, errors, n_iters, converged)


def _sharded_outputs(x, y, a, b, eps, scale, thr, mesh, axis, opts, backend):
    return _sharded(x, y, a, b, jnp.asarray(eps, F32), jnp.asarray(scale, F32), jnp.asarray(thr, F32),
                    mesh=mesh, axis=axis, opts=opts, backend=backend)
