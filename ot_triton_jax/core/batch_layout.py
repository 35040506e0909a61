"""Many problems in one launch: the packed layout of a batch of point clouds (host-side plan).

B problems (x_k (n_k, d), y_k (m_k, d)), of equal or different sizes, are packed into one
x cloud and one y cloud. Problem k's rows start at a multiple of the block-sparse kernels'
BLOCK_M (``multiscale_plans.blocksparse_block_m``) in each cloud, and its padding rows carry
zero weight, so that

* every row block belongs to one problem, and the block-sparse LSE / apply kernels
  (kernels/lse_blocksparse.py, apply_blocksparse.py) stream, for the row blocks of problem k,
  the single column range of problem k in the other cloud: one launch serves the whole batch
  for each half-step, with no pair of two different problems ever formed;
* a zero-weight padding row is absent from every sum (its log weight is -inf) and its own
  potential is -inf, as for any zero weight of a single problem.

The padding costs at most BLOCK_M - 1 rows per problem and cloud. Per-problem quantities
(marginal errors, masses, costs) are segment sums over ``segment`` (the problem of each packed
row, -1 for padding). Sizes are Python ints: the plan is built once per batch shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class CloudLayout:
    """Where the problems of one side sit in the packed cloud.

    sizes: (B,) points per problem; offsets: (B,) first packed row of each problem (multiples of
    ``block``); rows: packed rows in all (a multiple of ``block``); block: the row-block size."""

    sizes: tuple[int, ...]
    offsets: tuple[int, ...]
    rows: int
    block: int

    @property
    def segment(self) -> np.ndarray:
        """(rows,) int32: the problem of each packed row, -1 on padding."""
        seg = np.full(self.rows, -1, np.int32)
        for k, (o, s) in enumerate(zip(self.offsets, self.sizes)):
            seg[o:o + s] = k
        return seg

    @property
    def index(self) -> np.ndarray:
        """(sum sizes,) int64: the packed row of each point, problems concatenated in order."""
        return np.concatenate([np.arange(o, o + s, dtype=np.int64) for o, s in zip(self.offsets, self.sizes)])


def cloud_layout(sizes, block: int) -> CloudLayout:
    """The packed layout of clouds of ``sizes`` points with rows in blocks of ``block``. Every
    problem needs at least one point (a problem of one point is fine)."""
    sizes = tuple(int(s) for s in sizes)
    if not sizes:
        raise ValueError("a batch needs at least one problem")
    if min(sizes) < 1:
        raise ValueError(f"every problem needs at least one point; got sizes {sizes}")
    offsets, at = [], 0
    for s in sizes:
        offsets.append(at)
        at += -(-s // block) * block
    return CloudLayout(sizes, tuple(offsets), at, int(block))


def column_ranges(rows: CloudLayout, cols: CloudLayout) -> np.ndarray:
    """(rows.rows / block, 1, 2) int32: row block b of problem k streams the columns
    [cols.offsets[k], cols.offsets[k] + cols.sizes[k]) (the ``ranges`` of the block-sparse kernels)."""
    if len(rows.sizes) != len(cols.sizes):
        raise ValueError(f"x and y hold different numbers of problems: {len(rows.sizes)} and {len(cols.sizes)}")
    out = np.zeros((rows.rows // rows.block, 1, 2), np.int32)
    for k, o in enumerate(rows.offsets):
        first, last = o // rows.block, -(-(o + rows.sizes[k]) // rows.block)
        out[first:last, 0, 0] = cols.offsets[k]
        out[first:last, 0, 1] = cols.offsets[k] + cols.sizes[k]
    return out


def block_problems(rows: CloudLayout) -> np.ndarray:
    """(rows.rows / block,) int32: the problem of each row block (its first row is always one of
    the problem's points: a problem's blocks end with the block holding its last point)."""
    return rows.segment[::rows.block].copy()


def active_ranges(xp, ranges, block_problem, done):
    """``ranges`` (:func:`column_ranges`) with every row block of a stopped problem emptied
    (end = start): the block-sparse kernels then stream no column for it, so a stopped problem's
    tiles cost nothing while the rest of its batch runs. Its rows' outputs are then the empty-row
    values of the kernels (lse_blocksparse.py), which the loops discard: a stopped problem's state
    is frozen. ``done`` (B,) bool and ``block_problem`` (:func:`block_problems`) are arrays of the
    namespace ``xp`` (numpy, jax.numpy or torch)."""
    stopped = done[block_problem][:, None, None]
    return xp.where(stopped, ranges[..., :1], ranges)


def segment_sizes(name: str, n: int, num_per_segment=None, segment_ids=None, num_segments=None) -> list[int]:
    """Sizes of the segments of the ``n`` points of ``name`` (OTT's ``segment_sinkhorn`` form): from
    ``num_per_segment_<name>`` (sizes of consecutive segments) or ``segment_ids_<name>`` (one id per
    point, in any order: :func:`segment_order` groups them; ``num_segments`` segments, default max
    id + 1). Values must be concrete (numbers or arrays that numpy can read): the sizes fix the
    shapes of the batch."""
    if (num_per_segment is None) == (segment_ids is None):
        raise ValueError(f"give exactly one of num_per_segment_{name} and segment_ids_{name}")
    try:
        if num_per_segment is not None:
            sizes = [int(v) for v in np.asarray(num_per_segment).reshape(-1)]
        else:
            ids = np.asarray(segment_ids).reshape(-1)
    except Exception as err:  # a traced array (jax.jit) cannot be read
        raise TypeError(f"the segments of {name} must be concrete (they fix the batch's shapes): pass "
                        f"num_per_segment_{name} / segment_ids_{name} as numbers, outside jax.jit or as "
                        "static arguments") from err
    if num_per_segment is None:
        if ids.size != n:
            raise ValueError(f"segment_ids_{name} must give one segment per point of {name} ({n}); got {ids.size}")
        if ids.size and ids.min() < 0:
            raise ValueError(f"segment_ids_{name} must be non-negative")
        count = int(num_segments) if num_segments is not None else int(ids.max()) + 1 if ids.size else 0
        if ids.size and ids.max() >= count:
            raise ValueError(f"segment_ids_{name} holds ids >= num_segments ({count})")
        sizes = np.bincount(ids.astype(np.int64), minlength=count).tolist()
    if sum(sizes) != n:
        raise ValueError(f"the segments of {name} hold {sum(sizes)} points, {name} has {n}")
    if any(s < 1 for s in sizes):
        raise ValueError(f"every segment needs at least one point; the segments of {name} have sizes {sizes}")
    return sizes


def segment_order(segment_ids) -> np.ndarray | None:
    """The stable order that makes the points of each segment consecutive, or None when the ids
    (concrete, as :func:`segment_sizes` reads them) are already sorted or not given."""
    if segment_ids is None:
        return None
    ids = np.asarray(segment_ids).reshape(-1)
    if ids.size < 2 or not (ids[1:] < ids[:-1]).any():
        return None
    return np.argsort(ids, kind="stable")


def check_measure_size(max_measure_size, sx: list[int], sy: list[int]) -> int | None:
    """OTT's ``max_measure_size``: None, or an int at least the largest segment (the padded size)."""
    if max_measure_size is None:
        return None
    if isinstance(max_measure_size, bool) or not isinstance(max_measure_size, (int, np.integer)):
        raise TypeError(f"max_measure_size must be an int, got {type(max_measure_size).__name__}")
    largest = max(sx + sy, default=0)
    if max_measure_size < largest:
        raise ValueError(f"max_measure_size ({max_measure_size}) must be at least the largest segment ({largest} "
                         "points); raise it or leave it None")
    return int(max_measure_size)
