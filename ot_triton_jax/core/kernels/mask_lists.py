"""The kept pairs of a cluster-pair mask as CSR lists (multiscale solve), in place of a general
nonzero: KEEP int8 (K_r, K_c) row-major; one program per row r, BLOCK columns at a time.

* ``mask_row_counts_kernel``: COUNTS[r] = the number of nonzero entries of row r (int32);
* ``mask_row_lists_kernel``: with LPTR (K_r + 1,) int64 the exclusive prefix sums of COUNTS, the
  kept columns of row r, increasing, into LIDX[LPTR[r]:LPTR[r + 1]] (int32), each placed by its
  rank (a cumulative sum within the block plus the count of the blocks before; empty blocks skip
  the scan); with
  ``WITH_ROWS`` also ROWS[p] = r for those positions (int32): the k-major pair list with its rows.
"""

import triton
import triton.language as tl


@triton.jit
def mask_row_counts_kernel(KEEP, Kc, COUNTS, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    row = KEEP + r.to(tl.int64) * Kc
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for c0 in range(0, Kc, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        acc += (tl.load(row + offs, mask=offs < Kc, other=0) != 0).to(tl.int32)
    tl.store(COUNTS + r, tl.sum(acc, 0))


@triton.jit
def mask_row_lists_kernel(KEEP, Kc, LPTR, LIDX, ROWS, BLOCK: tl.constexpr, WITH_ROWS: tl.constexpr):
    r = tl.program_id(0)
    row = KEEP + r.to(tl.int64) * Kc
    pos = tl.load(LPTR + r)
    for c0 in range(0, Kc, BLOCK):
        offs = c0 + tl.arange(0, BLOCK)
        hit = (tl.load(row + offs, mask=offs < Kc, other=0) != 0).to(tl.int32)
        count = tl.sum(hit, 0)
        if count > 0:  # most blocks of a row hold nothing: no scan for them
            at = pos + (tl.cumsum(hit, 0) - 1).to(tl.int64)
            tl.store(LIDX + at, offs, mask=hit != 0)
            if WITH_ROWS:
                tl.store(ROWS + at, tl.zeros((BLOCK,), dtype=tl.int32) + r, mask=hit != 0)
        pos += count.to(tl.int64)
