"""The label cost inside a tile (OTDD's label-augmented cost; core/labels.py holds the rules).

With integer labels per point and a small class-to-class table W (K_src, K_tgt), row-major, oriented
so that the src labels index its rows, the ground cost of the dense kernels becomes

    C_ij = s (|x_i - y_j|^2 + W[lx_i, ly_j]),

never an n x m array: each tile gathers W[lx_i, ly_j] from the table (a few hundred bytes, L1
resident). The kernels take it when their constexpr LABELS is set, in log2 units:

    lab_ij = lcoef W[lx_i, ly_j],   lcoef = -s log2(e) / eps   (:func:`label_coef`),

added to the exponent. The src labels are read once per row block (:func:`label_rows`: the table
row of each row, as pointers), the tgt labels once per column tile (:func:`label_cols`); per pair
that leaves one address computation, one load and one FFMA.

Out-of-range labels (possible under ``jax.jit``, where the frontends cannot read the values):
the index is clamped into the table for the load, and the row's (column's) poison, 0 when the
label is in range and NaN when not, is added to the row's (column's) bias, so that every output
the label touches is NaN and nothing is read out of bounds. Masked rows and columns read label 0.
"""

import triton
import triton.language as tl

from .tiles import LOG2E


@triton.jit
def label_coef(s, inv_eps):
    """lcoef = -s log2(e) / eps: the table's coefficient in the kernels' base-2 exponents."""
    return -s * inv_eps * LOG2E


@triton.jit
def label_rows(LAB, LTAB, offs_m, mask_m, k_src, k_tgt):
    """(the table row of each row: LTAB + clamp(lx_i) * k_tgt, pointers; the row poison: 0 where
    0 <= lx_i < k_src or the row is masked, NaN elsewhere)."""
    lab = tl.load(LAB + offs_m, mask=mask_m, other=0)
    ok = (lab >= 0) & (lab < k_src)
    lab = tl.minimum(tl.maximum(lab, 0), k_src - 1)
    return LTAB + lab * k_tgt, tl.where(ok, 0.0, float("nan"))


@triton.jit
def label_cols(LAB, offs_n, mask_n, k_tgt):
    """(clamp(ly_j), the column poison: 0 where 0 <= ly_j < k_tgt or the column is masked, NaN
    elsewhere) for a column tile."""
    lab = tl.load(LAB + offs_n, mask=mask_n, other=0)
    ok = (lab >= 0) & (lab < k_tgt)
    return tl.minimum(tl.maximum(lab, 0), k_tgt - 1), tl.where(ok, 0.0, float("nan"))


@triton.jit
def label_tile(lrow, lcol, lcoef):
    """lcoef W[lx_i, ly_j] for a tile: ``lrow`` from :func:`label_rows`, ``lcol`` from
    :func:`label_cols` (both clamped: the gather never leaves the table)."""
    return tl.load(lrow[:, None] + lcol[None, :]) * lcoef
