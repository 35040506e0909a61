"""Point clouds sharded over the P ranks of a process group: the rules both frontends share.

Layout. A cloud of n points is split by rows into P contiguous shards in rank order, shard r
holding the global rows [offset_r, offset_r + size_r). The default split follows
``numpy.array_split``: the first n % P ranks get n // P + 1 points, the others n // P
(:func:`split_sizes`); a frontend also accepts any sizes its ranks hold (:class:`ShardLayout`
from the gathered sizes), and every rule below reads the sizes, never assumes the default.

Gathers of unequal pieces. Collectives gather equal-sized pieces, so each rank pads its
shard to ``width`` = max_r size_r rows (:meth:`ShardLayout.pad`); the gathered (P, width, ...)
buffer, flattened over its first two axes, holds the global rows at
:meth:`ShardLayout.gather_index` (piece r's first size_r rows, in rank order). The padding
rows are never read.

Communication of the sharded OTT Sinkhorn loop (alternating, g then f; rank r holds x_r, a_r,
y_r, b_r and the matching pieces f_r, g_r of the potentials):

* once, at the start: one all-gather of each rank's sizes, dimensions and options (all ranks
  must agree), then one all-gather of the points with their weights per side (O((n + m) d)
  numbers); every rank centres the full clouds exactly as the single-device solve does and
  keeps its own rows;
* per half-step: the g-update g_j = eps log b_j - eps LSE_i((f_i - C_ij)/eps) of the local
  columns j needs every f_i and x_i, which every rank holds, so it is the single-device kernel
  on (local y rows, full x cloud); then ONE all-gather of the new local g pieces (O(m)
  numbers). The f-update is the same with the roles exchanged, then one all-gather of f
  (O(n) numbers). Nothing n x m is ever communicated;
* at a measurement (the g-update that follows a measured iteration, ``LoopOptions.measured``;
  and one extra g-update after ``max_iterations``): each rank sums its columns' errors
  |P^T 1 - b|_j (float64) and ONE all-reduce (SUM) gives ||P^T 1 - b||_1 to every rank, so
  every rank takes the same stop decision;
* at the end: one all-reduce (SUM) of the partial sums of the cost (the weighted potentials,
  the masses and sum P over the local rows). The envelope gradient of a rank's points needs
  no collective: its rows of P are built from local rows and the full potentials, which every
  rank already holds.

Ring exchange (``exchange="ring"`` of ``torch_api.distributed``'s solves and SamplesLoss, for
clouds that do not fit one device): the points are not gathered. The centre, the FP16 scale and
GeomLoss's default diameter come from the same numbers (the centre's sampled rows by one exact
all-reduce, the largest |x - c| and the bounding box by MAX all-reduces);
every pass over the other side then visits its P shards in P steps, the shard held moving to
rank r + 1 while the kernels run on it (O(m d) numbers per rank and half-step); a softmin's
shard results combine by a log-sum-exp, sums (plan applications, masses) by addition.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

__all__ = ["split_sizes", "ShardLayout", "check_agreement"]


def split_sizes(n: int, parts: int) -> tuple[int, ...]:
    """Sizes of ``parts`` shards of ``n`` points, ``numpy.array_split``'s convention: the first
    ``n % parts`` shards get ``n // parts + 1`` points, the others ``n // parts``."""
    if parts < 1:
        raise ValueError(f"parts must be >= 1; got {parts}")
    if n < 0:
        raise ValueError(f"n must be >= 0; got {n}")
    q, r = divmod(n, parts)
    return tuple(q + 1 if k < r else q for k in range(parts))


@dataclass(frozen=True)
class ShardLayout:
    """Where each rank's rows sit in a cloud sharded over ``len(sizes)`` ranks (in rank order)."""

    sizes: tuple[int, ...]

    def __post_init__(self):
        sizes = tuple(int(s) for s in self.sizes)
        if not sizes or min(sizes) < 0:
            raise ValueError(f"shard sizes must be a non-empty sequence of sizes >= 0; got {self.sizes}")
        object.__setattr__(self, "sizes", sizes)

    @classmethod
    def even(cls, n: int, parts: int) -> "ShardLayout":
        """The default split of :func:`split_sizes`."""
        return cls(split_sizes(n, parts))

    @property
    def parts(self) -> int:
        return len(self.sizes)

    @property
    def total(self) -> int:
        """n, the points of all shards."""
        return sum(self.sizes)

    @property
    def offsets(self) -> tuple[int, ...]:
        """The first global row of each shard."""
        return tuple(int(v) for v in np.cumsum((0,) + self.sizes[:-1]))

    @property
    def width(self) -> int:
        """The common length of the padded pieces of an all-gather: the largest shard (>= 1)."""
        return max(max(self.sizes), 1)

    def rows(self, rank: int) -> tuple[int, int]:
        """The global rows [start, stop) of ``rank``'s shard."""
        start = self.offsets[rank]
        return start, start + self.sizes[rank]

    def pad(self, rank: int) -> int:
        """Rows of padding ``rank`` appends to its shard before an all-gather."""
        return self.width - self.sizes[rank]

    def gather_index(self) -> np.ndarray:
        """(total,) int64: for each global row, its position in the gathered buffer flattened
        over (rank, row): ``gathered.reshape(parts * width, ...)[gather_index()]`` unpads it."""
        return np.concatenate([r * self.width + np.arange(s, dtype=np.int64)
                               for r, s in enumerate(self.sizes)]).astype(np.int64)

    def unpad(self, gathered: np.ndarray) -> np.ndarray:
        """The global rows of a gathered (parts, width, ...) array (the numpy form of
        :meth:`gather_index`, for frontends that gather numpy arrays)."""
        g = np.asarray(gathered)
        if g.shape[:2] != (self.parts, self.width):
            raise ValueError(f"gathered must have shape ({self.parts}, {self.width}, ...); got {g.shape}")
        return g.reshape((self.parts * self.width,) + g.shape[2:])[self.gather_index()]


def check_agreement(names: Sequence[str], table: Sequence[Sequence[float]], what: str = "sinkhorn") -> None:
    """Raise a ValueError naming the first quantity of ``names`` on which the ranks disagree:
    ``table[r][k]`` is rank r's value of ``names[k]`` (gathered, so every rank raises the same
    error). NaN equals NaN here (an absent value on every rank)."""
    rows = np.asarray(table, dtype=np.float64)
    for k, name in enumerate(names):
        col = rows[:, k]
        same = np.all((col == col[0]) | (np.isnan(col) & np.isnan(col[0])))
        if not same:
            vals = ", ".join(f"rank {r}: {v:.8g}" for r, v in enumerate(col))
            raise ValueError(f"{what}: every rank must pass the same {name}; got {vals}")
