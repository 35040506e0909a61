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
class: the frontends sort a labelled cloud by label, so all but at most K - 1 row blocks are such),
W[l, ly_j] is one number per column: the LSE kernels then add lcoef TT[ly_j, l] to the tile's
column biases (one load per column tile and row block, nothing per pair: :func:`label_logits`)
and skip the products. :func:`label_uniform` says which blocks qualify.

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
def label_logits(xy, coef2, bias, shift, onehot, lrow, LAB_Y, TT, offs_n, mask_n, k_src, k_tgt, lcoef,
                 KP: tl.constexpr, HAS_SHIFT: tl.constexpr, UNIFORM: tl.constexpr):
    """The tile's exponents with the label cost: xy coef2 + bias_j (- shift_i with HAS_SHIFT) +
    lcoef W[lx_i, ly_j], plus the column poison. UNIFORM (a block of one label ``lrow``,
    :func:`label_uniform`): lcoef TT[ly_j, lrow] joins the column biases; otherwise the one-hot
    products (:func:`label_tile`). The caller branches on ``lrow`` outside its column loop (a
    product inside a data-dependent branch of the loop does not compile) and passes UNIFORM."""
    lab = tl.load(LAB_Y + offs_n, mask=mask_n, other=0)
    ok = (lab >= 0) & (lab < k_tgt)
    lab = tl.minimum(tl.maximum(lab, 0), k_tgt - 1)
    bias = bias + tl.where(ok, 0.0, float("nan"))
    if UNIFORM:
        bias += lcoef * tl.load(TT + lab * k_src + lrow, mask=mask_n, other=0.0)
    if HAS_SHIFT:
        t = xy * coef2 + (bias[None, :] - shift[:, None])
    else:
        t = xy * coef2 + bias[None, :]
    if not UNIFORM:
        ks = tl.arange(0, KP)
        cols = tl.load(TT + lab[:, None] * k_src + ks[None, :], mask=ks[None, :] < k_src, other=0.0)
        t += label_tile(onehot, cols) * lcoef
    return t
