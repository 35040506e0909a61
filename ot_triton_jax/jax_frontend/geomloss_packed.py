"""A batch of GeomLoss problems in one annealed loop: one block-sparse launch per softmin.

GeomLoss's annealed symmetric loop (:func:`.loops.geomloss_solve`) sweeps four potentials at
every eps of the schedule, each the averaged update p <- (p + softmin(q)) / 2 with

    softmin_i(q) = -eps LSE_j((q_j - C_ij)/eps + log w_j),   C_ij = |x_i - y_j|^2 / 2,

f_ba, g_ab from the cross problem (X rows vs Y columns and back) and f_aa, g_bb from the self
problems (X vs X, Y vs Y), then one last extrapolation at blur^2. For B problems of equal sizes
(x_k (n, d), y_k (m, d)) this module packs the clouds as :mod:`.batched_loop` does
(:mod:`ot_triton_jax.core.batch_layout` via :mod:`.packing`: problem k's rows start on a row
block of the block-sparse kernels, zero-weight padding, log weight -inf) and runs every softmin
of the sweep as ONE launch of the block-sparse LSE kernel (:func:`.kernel_ops.lse_blocksparse`,
``logw_in`` the packed log weights) in which the row blocks of problem k stream only problem k's
columns of the other cloud (``batch_layout.column_ranges``: "xy", "yx", "xx", "yy"). No pair of
points of two different problems is ever formed, and a padding row has weight zero, so each
problem's softmins are its own: the potentials equal its single solve to float32 rounding (each
problem keeps its own centring, done per problem before packing; the packed clouds get one common
centre and float16 split, as in :mod:`.batched_loop`). A sweep is 2 + 2 (debias) launches for
the whole batch instead of as many per problem.

The same holds for GeomLoss's damped loop with both marginals relaxed alike
(``geomloss_unbalanced.damped_solve`` with rho_x == rho_y: every softmin multiplied by
rho / (rho + eps), a per-point factor; the self problems unsplit, no translation). With one
relaxed marginal (every problem translated by sums of its own) or rho_x != rho_y (split self
problems) the solve stays per problem, as torch_api's ``can_pack`` says.

When it folds: :func:`vmappable` gives the per-problem solve ``solve(X, Y, la, lb, sched)`` a
``jax.vmap`` rule (:func:`.batching.loop_over_batch` with a ``fold``) that packs the batch when
the eps-schedule is shared by the batch (``sched`` unbatched: a host schedule, or a device one of
a (B, N, D) batch / a given ``diameter``) and the clouds carry no label cost. Otherwise (a batched
schedule, e.g. ``jax.vmap(samples_loss)`` with ``diameter=None`` and traced points, where every
problem has its own schedule; labels) it falls back to one solve per problem. The derivatives
(:mod:`.derivatives`: GeomLoss's rule at the saved potentials) are not part of this rule: their
plan products fold on their own (``kernel_ops.apply_plan`` under ``jax.vmap``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from ..core import batch_layout
from . import geomloss_schedule as schedule
from . import kernel_ops
from .batching import loop_over_batch
from .kernel_ops import Cloud
from .loops import geomloss_solve
from .packing import batch_rows, layouts, pack, unpack

__all__ = ["packed_softmins", "vmappable", "vmappable_geomloss"]


def packed_softmins(X: Cloud, Y: Cloud, la, lb, lx: batch_layout.CloudLayout, ly: batch_layout.CloudLayout,
                    precision: str, backend):
    """(pair, own) of :func:`.loops.dense_softmins` for the packed clouds X, Y (layouts ``lx``,
    ``ly``; packed log weights ``la``, ``lb``): every softmin one block-sparse launch for the batch."""
    pairs = {"xy": (lx, ly), "yx": (ly, lx), "xx": (lx, lx), "yy": (ly, ly)}
    ranges = {k: jnp.asarray(batch_layout.column_ranges(r, c)) for k, (r, c) in pairs.items()}
    kw = dict(precision=precision, backend=backend)

    def soft(key, S, T, q, lw, prm):  # softmin for the rows of S of q on T's points (weights lw)
        return kernel_ops.lse_blocksparse(S, T, q, prm, ranges[key], logw_in=lw, **kw)[0]

    def pair(f, g, prm):
        return soft("xy", X, Y, g, lb, prm), soft("yx", Y, X, f, la, prm)

    def own(side, h, prm):
        return soft("xx", X, X, h, la, prm) if side == 0 else soft("yy", Y, Y, h, lb, prm)

    return pair, own


def _fold(run, precision: str, backend):
    """The batched rule of :func:`vmappable`: the B problems packed, ``run`` once on the packed
    clouds with :func:`packed_softmins` (None, the per-problem loop, where it does not apply)."""

    def rule(B, in_batched, X, Y, la, lb, sched):
        bX, bY, bla, blb, bsched = in_batched
        if X.labels is not None or Y.labels is not None or any(jax.tree_util.tree_leaves(bsched)):
            return None
        n, m, d = X.x.shape[-2], Y.x.shape[-2], X.x.shape[-1]
        lx, ly = layouts(B, n, m, d, precision)
        # each problem's clouds are centred on their own centre: packing keeps every problem's cost
        Xp, Yp = kernel_ops.clouds(pack(batch_rows(X.x, bX.x, B), lx), pack(batch_rows(Y.x, bY.x, B), ly),
                                   backend=backend)
        lap, lbp = pack(batch_rows(la, bla, B), lx, -jnp.inf), pack(batch_rows(lb, blb, B), ly, -jnp.inf)
        old, new = run(Xp, Yp, lap, lbp, sched, packed_softmins(Xp, Yp, lap, lbp, lx, ly, precision, backend))
        sides = (lx, ly, lx, ly)

        def unpacked(pots):
            return tuple(unpack(p, lay).reshape(B, -1) for p, lay in zip(pots, sides))

        outs = (unpacked(old), unpacked(new))
        return outs, jax.tree_util.tree_map(lambda _: True, outs)

    return rule


def vmappable(run, precision: str, backend):
    """``run(X, Y, la, lb, sched, softmins)`` -> (old, new) potential quadruples (an annealed loop
    of one problem on stop-gradient'ed values, ``softmins`` None for its own dense ones) as
    ``solve(X, Y, la, lb, sched)``, whose ``jax.vmap`` packs the batch (module docstring)."""
    return loop_over_batch(lambda X, Y, la, lb, sched: run(X, Y, la, lb, sched, None),
                           fold=_fold(run, precision, backend))


def vmappable_geomloss(debias: bool, precision: str, backend):
    """:func:`.loops.geomloss_solve` of one strict problem ``(X, Y, la, lb, sched)`` -> (old, new)
    (``sched`` a :mod:`.geomloss_schedule` schedule), packed under ``jax.vmap`` (module docstring)."""

    def run(X, Y, la, lb, sched, softmins):
        return geomloss_solve(X, Y, la, lb, lambda k: schedule.eps_at(sched, k), schedule.n_eps(sched),
                              schedule.last_eps(sched), debias, precision, backend, softmins)

    return vmappable(run, precision, backend)
