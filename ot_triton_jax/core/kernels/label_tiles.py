"""The label cost inside a tile (OTDD's label-augmented cost; core/labels.py holds the rules).

With integer labels per point and a small class-to-class table W, the ground cost of the dense
kernels becomes

    C_ij = s (|x_i - y_j|^2 + W[lx_i, ly_j])        (lx: the src rows' labels, ly: the tgt columns'),

never an n x m array. The kernels take it when their constexpr LABELS = KP > 0 (KP: the src
class count padded to a power of two >= 16), in log2 units added to the exponent:

    lab_ij = lcoef W[lx_i, ly_j],   lcoef = -s log2(e) / eps   (:func:`label_coef`).

A per-pair gather from the table costs ~7 instructions per pair (64-bit address, load, and the
layout conversions of the index tiles; SASS at d = 3 on sm_90: 12.4 instructions per pair
against 5.2 without labels). Instead the gather is a product on the tensor cores, which the
d <= 64 loops leave mostly idle:

    W[lx_i, ly_j] = sum_k onehot(lx_i)_k TT[ly_j, k],   TT = W^T (K_tgt, K_src) row-major,

``onehot`` (BLOCK_M, KP) built once per row block (:func:`label_rows`), the rows TT[ly_j, :]
(BLOCK_N, KP) gathered once per column tile (:func:`label_cols`: KP / BLOCK_M loads per pair),
and two TF32 products per tile (:func:`label_tile`; the one-hot factor is exact, so the product
is float32-accurate): per pair one FFMA (lcoef lab + t) onto the exponent.

Row blocks of one label. When every row of a block carries the same label l (clouds grouped by
class: all but at most K - 1 row blocks are such), W[l, ly_j] is one number per column: the LSE
half-step's column-bias pass (``column_bias_kernel``) writes, beside the plain biases, one row of
biases per source label with lcoef W[l, ly_j] added, and such a block runs the unlabelled loop on
its label's row: nothing per pair. :func:`label_uniform` says which blocks qualify; the others
take the one-hot products (:func:`label_logits`). A mixed block costs ~3x a
one-label block, so on a GPU with several waves of row blocks the few mixed ones would finish last:
:func:`label_block_order_kernel` lists the mixed blocks first and the LSE kernel takes its row
block from that list (ORDERED).

Out-of-range labels (possible under ``jax.jit``, where the frontends cannot read the values): a
row's one-hot is then zero and a column's index is clamped into the table, so nothing is read
out of bounds, and the row's (column's) poison, 0 when the label is in range and NaN when not, is
added to the row's bias or sum (the column's bias), so that every output the label touches is
NaN. Masked rows and columns read label 0.
"""

import triton
import triton.language as tl

from .split import rn_tf32
from .tiles import LOG2E


@triton.jit
def label_coef(s, inv_eps):
    """lcoef = -s log2(e) / eps: the table's coefficient in the kernels' base-2 exponents."""
    return -s * inv_eps * LOG2E


@triton.jit
def label_rows(LAB, offs_m, mask_m, k_src, KP: tl.constexpr):
    """(onehot(lx_i) (rows, KP) float32, zero for a label outside [0, k_src); the row poison:
    0 where 0 <= lx_i < k_src or the row is masked, NaN elsewhere)."""
    lab = tl.load(LAB + offs_m, mask=mask_m, other=0)
    ok = (lab >= 0) & (lab < k_src)
    onehot = tl.where(ok[:, None] & (lab[:, None] == tl.arange(0, KP)[None, :]), 1.0, 0.0)
    return onehot, tl.where(ok, 0.0, float("nan"))


@triton.jit
def label_cols(LAB, TT, offs_n, mask_n, k_src, k_tgt, KP: tl.constexpr):
    """(TT[clamp(ly_j), :] (cols, KP), zero beyond k_src; the column poison: 0 where
    0 <= ly_j < k_tgt or the column is masked, NaN elsewhere) for a column tile. TT: the table
    (k_tgt, k_src) row-major whose row ly_j holds W[., ly_j]."""
    lab = tl.load(LAB + offs_n, mask=mask_n, other=0)
    ok = (lab >= 0) & (lab < k_tgt)
    lab = tl.minimum(tl.maximum(lab, 0), k_tgt - 1)
    ks = tl.arange(0, KP)
    rows = tl.load(TT + lab[:, None] * k_src + ks[None, :], mask=ks[None, :] < k_src, other=0.0)
    return rows, tl.where(ok, 0.0, float("nan"))


@triton.jit
def label_tile(onehot, cols):
    """W[lx_i, ly_j] for a tile (the caller multiplies by lcoef: one FFMA per pair): the one-hot
    rows of :func:`label_rows` times the table rows of :func:`label_cols`, float32-accurate: the one-hot factor is exact in TF32, so two
    TF32 products (the rows' TF32 head and tail, kernels/split.py) in one accumulator suffice
    (Triton's "tf32x3" would add a third product and a NaN check per pair)."""
    hi = rn_tf32(cols)
    acc = tl.dot(onehot, tl.trans(rn_tf32(cols - hi)), input_precision="tf32")
    return tl.dot(onehot, tl.trans(hi), acc, input_precision="tf32")


@triton.jit
def label_uniform(LAB, offs_m, mask_m, k_src):
    """The label shared by every (unmasked) row of the block when it lies in [0, k_src), else -1
    (mixed labels, or one out of range: the one-hot products handle those)."""
    lab = tl.load(LAB + offs_m, mask=mask_m, other=0)
    lo = tl.min(tl.where(mask_m, lab, 2147483647), axis=0)
    hi = tl.max(tl.where(mask_m, lab, -1), axis=0)
    return tl.where((lo == hi) & (lo >= 0) & (lo < k_src), lo, -1)


@triton.jit
def label_logits(xy, coef2, bias, shift, onehot, LAB_Y, TT, offs_n, mask_n, k_src, k_tgt, lcoef,
                 KP: tl.constexpr, HAS_SHIFT: tl.constexpr):
    """The tile's exponents with the label cost, for a block of mixed labels: xy coef2 + bias_j
    (- shift_i with HAS_SHIFT) + lcoef W[lx_i, ly_j] (the one-hot products, :func:`label_tile`),
    plus the column poison."""
    lab = tl.load(LAB_Y + offs_n, mask=mask_n, other=0)
    ok = (lab >= 0) & (lab < k_tgt)
    lab = tl.minimum(tl.maximum(lab, 0), k_tgt - 1)
    bias = bias + tl.where(ok, 0.0, float("nan"))
    if HAS_SHIFT:
        t = xy * coef2 + (bias[None, :] - shift[:, None])
    else:
        t = xy * coef2 + bias[None, :]
    ks = tl.arange(0, KP)
    cols = tl.load(TT + lab[:, None] * k_src + ks[None, :], mask=ks[None, :] < k_src, other=0.0)
    return t + label_tile(onehot, cols) * lcoef


@triton.jit
def _mixed_blocks(LAB, blocks, n, nb, k_src, BLOCK_M: tl.constexpr):
    """1 for each of ``blocks`` (< nb) whose rows do not share one label in [0, k_src), else 0."""
    rows = blocks[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
    mask = rows < n
    lab = tl.load(LAB + rows, mask=mask, other=0)
    lo = tl.min(tl.where(mask, lab, 2147483647), axis=1)
    hi = tl.max(tl.where(mask, lab, -1), axis=1)
    mixed = (lo != hi) | (lo < 0) | (lo >= k_src)
    return tl.where(blocks < nb, mixed.to(tl.int32), 0)


@triton.jit(do_not_specialize=["n", "k_src"])
def label_block_order_kernel(LAB, n, k_src, ORDER, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    """ORDER (cdiv(n, BLOCK_M),): the row blocks of mixed labels first, then those of one label,
    each group in increasing order. One program; two passes over the labels (count, place)."""
    nb = tl.cdiv(n, BLOCK_M)
    n_mixed = 0
    for c in range(0, nb, CHUNK):
        n_mixed += tl.sum(_mixed_blocks(LAB, c + tl.arange(0, CHUNK), n, nb, k_src, BLOCK_M), axis=0)
    seen_mixed = 0
    seen_one = 0
    for c in range(0, nb, CHUNK):
        blocks = c + tl.arange(0, CHUNK)
        valid = blocks < nb
        mixed = _mixed_blocks(LAB, blocks, n, nb, k_src, BLOCK_M)
        one = tl.where(valid, 1 - mixed, 0)
        pos = tl.where(mixed > 0, seen_mixed + tl.cumsum(mixed, axis=0) - 1,
                       n_mixed + seen_one + tl.cumsum(one, axis=0) - 1)
        tl.store(ORDER + pos, blocks, mask=valid)
        seen_mixed += tl.sum(mixed, axis=0)
        seen_one += tl.sum(one, axis=0)
