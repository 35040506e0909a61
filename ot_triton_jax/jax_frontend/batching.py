"""The batching rule of a kernel launch: ``jax.vmap`` as a loop over the batch.

XLA sees a kernel launch as an opaque custom call (``jax_triton.triton_call``
on a GPU, a ``buffer_callback`` elsewhere); neither has a batching rule of its
own. :func:`loop_over_batch` gives one to any function of arrays that launches
kernels: a ``jax.custom_batching.custom_vmap`` whose rule runs the function once
per batch element with ``jax.lax.map`` (an XLA loop; one launch per element).
Only the batched operands are sliced; the unbatched ones are closed over, never
broadcast to the batch size (a vmap over epsilon alone re-reads the same point
clouds, with no copies).

:func:`ot_triton_jax.jax_frontend.launch.launch` wraps every launch in it, so
every streaming operation batches without a rule of its own: the Sinkhorn
solve (its ``lax.while_loop`` with a batched stopping test keeps every
problem's own iteration count: the loop runs until the last problem stops and
a stopped problem's state is frozen), the ``custom_vjp`` backward passes,
``apply``/``marginal``, ``sinkhorn_divergence`` and ``samples_loss`` (with its
device-side eps-schedule). Nested ``vmap`` nests the loops; ``in_axes=None``
operands stay unbatched.

Cost: batched launch by launch, every launch slices its batched operands (the
clouds included) and stacks its outputs, and a ``while_loop`` gets a batched
stopping test (it runs every problem until the slowest one stops). Wrapping a
whole loop instead (a solve on ``stop_gradient``-ed inputs, e.g.
``loops.alternating_solve``) slices once per problem and gives every problem its
own stopping loop. Better still, a ``fold``: a batched implementation of the
whole function that this rule tries first. The OTT solve has one
(:mod:`.batched_loop`: the problems packed into one cloud per side, one
block-sparse launch per half-step for the batch), so has GeomLoss's strict
annealed loop of ``samples_loss`` (:mod:`.geomloss_packed`: one block-sparse
launch per softmin for the batch), and so have the plan passes
(``kernel_ops.apply_plan``); the per-launch loop is the fallback that makes
every other operation batch.

mHC (:mod:`ot_triton_jax.jax_frontend.mhc`) is different: its own
``custom_vmap`` rules, applied before this one, fold the mapped axis into the
kernel's batch of matrices, so a vmapped ``mhc_sinkhorn`` is one launch.

Derivatives: a ``custom_vmap`` is differentiated by differentiating its
function, and a kernel launch has no derivative; the library only ever
launches kernels on ``stop_gradient``-ed values (zero tangents, so the launch
is not differentiated at all) and attaches its derivatives with
``custom_vjp`` around them, so ``jax.grad`` of a vmap and ``jax.vmap`` of a
grad both work.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax

__all__ = ["loop_over_batch"]


def loop_over_batch(fun: Callable[..., Any], fold: Callable[..., Any] | None = None):
    """``fun`` (positional pytrees of arrays -> a pytree of arrays) with a ``vmap`` rule
    that maps it over the batch with ``jax.lax.map``, the unbatched leaves closed over.
    ``fold(axis_size, in_batched, *args)``: a batched implementation tried first (it returns
    ``(outs, out_batched)``, or None where it does not apply and the loop runs).

    Every output of the batched call is batched (leading axis of the batch size).
    Apply it only where no tangent flows in (a ``custom_vmap`` has no transpose
    rule): on ``stop_gradient``-ed values, inside the derivative rules.
    """
    op = jax.custom_batching.custom_vmap(fun)

    @op.def_vmap
    def _rule(axis_size, in_batched, *args):
        if fold is not None:
            folded = fold(axis_size, in_batched, *args)
            if folded is not None:
                return folded
        leaves, tree = jax.tree_util.tree_flatten(args)
        flags = jax.tree_util.tree_leaves(in_batched)  # same structure as args
        mapped = [v for v, b in zip(leaves, flags) if b]

        def one(slices):
            it = iter(slices)
            full = [next(it) if b else v for v, b in zip(leaves, flags)]
            # op, not fun: inside an outer vmap the loop body is batched again (nested loops)
            return op(*jax.tree_util.tree_unflatten(tree, full))

        outs = jax.lax.map(one, mapped)
        return outs, jax.tree_util.tree_map(lambda _: True, outs)

    return op
