"""Column runs of the block-sparse kernels, built from a cluster-pair keep mask (multiscale solve).

The rows of one cloud are sorted by cluster; row block b (``BLOCK_M`` consecutive rows) spans the
clusters SPAN[b, 0] .. SPAN[b, 1]. It keeps column cluster c when any of those clusters keeps it:

    v_c = OR over k in [SPAN[b, 0], SPAN[b, 1]] of KEEP[k, c]      (KEEP int8 (K_r, K_c), row-major)

and streams the maximal runs c0 .. c1 of kept clusters as the column ranges
[COL_START[c0], COL_START[c1 + 1]) (COL_START int32 (K_c + 1,): the first sorted column of each
cluster, and m). One program per row block, BLOCK_C clusters at a time:

* ``FILL = False``: OUT[b] = the number of runs of row block b (int32 (B,));
* ``FILL = True``: OUT[b, q] = the q-th run's [start, end) for q < runs, [0, 0) for the padding
  up to R (int32 (B, R, 2), every element written; R >= the largest count).

A run's start is a kept cluster whose left neighbour is not kept, its end a kept cluster whose
right neighbour is not; the q-th start and the q-th end bound the q-th run, so each is placed by
its rank (a cumulative sum within the chunk plus the count of the chunks before).
"""

import triton
import triton.language as tl


@triton.jit(do_not_specialize=["R"])
def block_runs_kernel(KEEP, SPAN, COL_START, Kc, R, OUT, FILL: tl.constexpr, BLOCK_C: tl.constexpr):
    b = tl.program_id(0)
    k0 = tl.load(SPAN + 2 * b)
    k1 = tl.load(SPAN + 2 * b + 1)
    starts = tl.zeros((), dtype=tl.int32)
    ends = tl.zeros((), dtype=tl.int32)
    for c0 in range(0, Kc, BLOCK_C):
        offs = c0 + tl.arange(0, BLOCK_C)
        here = tl.zeros((BLOCK_C,), dtype=tl.int32)
        left = tl.zeros((BLOCK_C,), dtype=tl.int32)
        right = tl.zeros((BLOCK_C,), dtype=tl.int32)
        row = KEEP + k0.to(tl.int64) * Kc
        for _ in range(k0, k1 + 1):
            here |= (tl.load(row + offs, mask=offs < Kc, other=0) != 0).to(tl.int32)
            left |= (tl.load(row + offs - 1, mask=(offs >= 1) & (offs <= Kc), other=0) != 0).to(tl.int32)
            right |= (tl.load(row + offs + 1, mask=offs + 1 < Kc, other=0) != 0).to(tl.int32)
            row += Kc
        first = here * (1 - left)
        last = here * (1 - right)
        if FILL:
            rank_s = starts + tl.cumsum(first, 0) - 1
            rank_e = ends + tl.cumsum(last, 0) - 1
            col_s = tl.load(COL_START + offs, mask=first != 0, other=0)
            col_e = tl.load(COL_START + offs + 1, mask=last != 0, other=0)
            base = OUT + b.to(tl.int64) * R * 2
            tl.store(base + rank_s * 2, col_s, mask=first != 0)
            tl.store(base + rank_e * 2 + 1, col_e, mask=last != 0)
        starts += tl.sum(first, 0)
        ends += tl.sum(last, 0)
    if FILL:
        base = OUT + b.to(tl.int64) * R * 2
        for q0 in range(0, R, BLOCK_C):  # the padding [0, 0) after the runs
            q = q0 + tl.arange(0, BLOCK_C)
            pad = (q >= starts) & (q < R)
            zero = tl.zeros((BLOCK_C,), dtype=tl.int32)
            tl.store(base + q * 2, zero, mask=pad)
            tl.store(base + q * 2 + 1, zero, mask=pad)
    else:
        tl.store(OUT + b, starts)
