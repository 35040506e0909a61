"""Tile helpers shared by the streaming kernels.

Squared Euclidean cost with scale s: C_ij = s * (|x_i|^2 + |y_j|^2 - 2 <x_i, y_j>).
Every kernel needs the cross term <x_i, y_j> for a BLOCK_M x BLOCK_N tile, computed
with tensor-core dots over chunks of BLOCK_K columns (d is zero-padded to BLOCK_K,
at least 16, so tiny d costs almost nothing on the tensor cores). PRECISION:

* "tf32x3" (float32-accurate): the frontends split every cloud once per solve
  (kernels/split.py) into X = x_hi (x rounded to TF32) and XLO = x_lo (the rest,
  rounded to TF32), and <x, y> ~ <x_lo, y_hi> + <x_hi, y_lo> + <x_hi, y_hi>; the
  dropped parts are ~2^-22 relative. Pre-split operands go straight from memory
  to the tensor cores (no per-tile split, no register round trip).
* "tf32": one TF32 product of x_hi, y_hi (~1e-3 relative error in the LSE at eps = 0.1).
* "fp16x3" / "fp16" (the product's choice, launch_plans.fp16_operands): the same three products / one
  product on FP16 heads and tails of the clouds scaled by a power of two per problem
  (kernels/split.py, split_scaled_kernel): FP16 has TF32's 11-bit significand at twice the
  tensor-core rate. The kernels undo the scale in the exponent's coefficient
  (:func:`cross_coef2`: coef2 XSC YSC, XSC = 1 / S of each cloud); products of the plan with
  other matrices stay float32 (:func:`dot_f32`).
* "fp16p" (float32-accurate, d <= 5; launch_plans.packed_operands): the three "fp16x3" products as
  one product over packed FP16 rows: X holds [x_lo, x_hi, x_hi, 0...] and YLO [y_hi, y_lo, y_hi,
  0..., 1] (kernels/split.py, PACKED; a cloud's ``hi`` array is its rows layout, ``lo`` its columns
  layout), so X YLO^T = x_lo.y_hi + x_hi.y_lo + x_hi.y_hi in one HGMMA k16 and one wait. Y and
  XLO are not read.
* "fixed4" (unbiased; reg_ot_cost's mass pass, launch_plans.exact_mass_plan): operands
  from split_fixed_kernel (heads on a per-row fixed-point grid), four TF32 products in two
  accumulators: heads x heads, exact (kernels/split.py), and the three products with a
  tail. cross_tile_fixed4 returns both; the caller scales and adds them. The tensor cores
  truncate toward zero while accumulating, which shrinks the "tf32x3" <x, y> by a
  relative ~1e-7 (d = 64); here only the tails (~2^-10 of the sum) are truncated.
* "ieee": exact float32 FMAs (slow; not used by the launch plans).

Tails in n, m and d are masked with zeros. Points are row-major (float32, or float16 for
"fp16x3" / "fp16") with row stride d; XLO/YLO are only read for "tf32x3" and "fp16x3".
"""

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)


@triton.jit
def load_rows(P, offs, mask, d, k0, BLOCK_K: tl.constexpr):
    """A (rows, BLOCK_K) tile of a row-major (*, d) array, columns k0..k0+BLOCK_K."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    ptrs = P + offs[:, None] * d + offs_k[None, :]
    return tl.load(ptrs, mask=mask[:, None] & (offs_k[None, :] < d), other=0.0)


@triton.jit
def dot_x3(x_hi, x_lo, y_hi, y_lo, acc, PRECISION: tl.constexpr = "tf32x3"):
    """acc + x y^T with float32 accuracy from three tensor-core products of pre-split operands
    ("tf32x3": TF32 from float32 operands; "fp16x3": FP16 operands)."""
    if PRECISION == "fp16x3":
        acc = tl.dot(x_lo, tl.trans(y_hi), acc)
        acc = tl.dot(x_hi, tl.trans(y_lo), acc)
        return tl.dot(x_hi, tl.trans(y_hi), acc)
    else:
        acc = tl.dot(x_lo, tl.trans(y_hi), acc, input_precision="tf32")
        acc = tl.dot(x_hi, tl.trans(y_lo), acc, input_precision="tf32")
        return tl.dot(x_hi, tl.trans(y_hi), acc, input_precision="tf32")


# Conditions on PRECISION are chains of single comparisons: Triton folds "if C == 'a':" at
# compile time, but not "if C == 'a' or C == 'b':", whose branches would all be compiled.


@triton.jit
def dot_one(x_hi, y_hi, acc, PRECISION: tl.constexpr):
    """acc + x_hi y_hi^T, one product ("tf32", "fp16", "fp16p" (packed rows and columns), "ieee")."""
    if PRECISION == "fp16":
        return tl.dot(x_hi, tl.trans(y_hi), acc)
    elif PRECISION == "fp16p":
        return tl.dot(x_hi, tl.trans(y_hi), acc)
    else:
        return tl.dot(x_hi, tl.trans(y_hi), acc, input_precision=PRECISION)


@triton.jit
def cross_coef2(coef2, XSC, YSC, PRECISION: tl.constexpr):
    """The exponent's coefficient of <x, y> in the cross term's units: coef2 for TF32
    operands, coef2 / (S_x S_y) for the scaled FP16 ones (XSC, YSC hold 1 / S)."""
    if PRECISION == "fp16x3":
        return coef2 * (tl.load(XSC) * tl.load(YSC))
    elif PRECISION == "fp16":
        return coef2 * (tl.load(XSC) * tl.load(YSC))
    elif PRECISION == "fp16p":
        return coef2 * (tl.load(XSC) * tl.load(YSC))
    else:
        return coef2


@triton.jit
def dot_f32(a, b, acc, PRECISION: tl.constexpr):
    """acc + a b for float32 a, b (the plan times a matrix): three TF32 products (Triton's
    "tf32x3") for the float32-accurate precisions, one for "tf32" and "fp16"."""
    if PRECISION == "tf32":
        return tl.dot(a, b, acc, input_precision="tf32")
    elif PRECISION == "fp16":
        return tl.dot(a, b, acc, input_precision="tf32")
    elif PRECISION == "ieee":
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision="tf32x3")


@triton.jit
def cross_tile_dot(X, XLO, Y, YLO, offs_m, offs_n, mask_m, mask_n, d,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   PRECISION: tl.constexpr):
    """<x_i, y_j> for a tile, looping over d in chunks of BLOCK_K (x not resident)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, d, BLOCK_K):
        xt = load_rows(X, offs_m, mask_m, d, k0, BLOCK_K)
        yt = load_rows(Y, offs_n, mask_n, d, k0, BLOCK_K)
        if PRECISION == "tf32x3":
            acc = dot_x3(xt, load_rows(XLO, offs_m, mask_m, d, k0, BLOCK_K),
                         yt, load_rows(YLO, offs_n, mask_n, d, k0, BLOCK_K), acc, PRECISION)
        elif PRECISION == "fp16x3":
            acc = dot_x3(xt, load_rows(XLO, offs_m, mask_m, d, k0, BLOCK_K),
                         yt, load_rows(YLO, offs_n, mask_n, d, k0, BLOCK_K), acc, PRECISION)
        elif PRECISION == "fp16p":
            acc = dot_one(xt, load_rows(YLO, offs_n, mask_n, d, k0, BLOCK_K), acc, PRECISION)
        else:
            acc = dot_one(xt, yt, acc, PRECISION)
    return acc


@triton.jit
def cross_tile_resident(x_hi, x_lo, Y, YLO, offs_n, mask_n, d,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        PRECISION: tl.constexpr):
    """<x_i, y_j> when d <= BLOCK_K and the x block stays in registers across column tiles."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if PRECISION == "fp16p":
        return dot_one(x_hi, load_rows(YLO, offs_n, mask_n, d, 0, BLOCK_K), acc, PRECISION)
    yt = load_rows(Y, offs_n, mask_n, d, 0, BLOCK_K)
    if PRECISION == "tf32x3":
        return dot_x3(x_hi, x_lo, yt, load_rows(YLO, offs_n, mask_n, d, 0, BLOCK_K), acc, PRECISION)
    elif PRECISION == "fp16x3":
        return dot_x3(x_hi, x_lo, yt, load_rows(YLO, offs_n, mask_n, d, 0, BLOCK_K), acc, PRECISION)
    else:
        return dot_one(x_hi, yt, acc, PRECISION)


@triton.jit
def load_resident(X, XLO, offs_m, mask_m, d, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    """The resident x block: (x_hi, x_lo) (x_lo unused unless tf32x3, fp16x3 or fixed4)."""
    x_hi = load_rows(X, offs_m, mask_m, d, 0, BLOCK_K)
    if PRECISION == "tf32":
        return x_hi, x_hi
    elif PRECISION == "fp16":
        return x_hi, x_hi
    elif PRECISION == "fp16p":
        return x_hi, x_hi
    else:
        return x_hi, load_rows(XLO, offs_m, mask_m, d, 0, BLOCK_K)


@triton.jit
def dot_x4_fixed(x_hi, x_lo, y_hi, y_lo, hh, tails):
    """(hh + x_hi y_hi^T, tails + the three products with a tail), in two accumulators."""
    hh = tl.dot(x_hi, tl.trans(y_hi), hh, input_precision="tf32")
    tails = tl.dot(x_lo, tl.trans(y_hi), tails, input_precision="tf32")
    tails = tl.dot(x_hi, tl.trans(y_lo), tails, input_precision="tf32")
    return hh, tl.dot(x_lo, tl.trans(y_lo), tails, input_precision="tf32")


@triton.jit
def cross_tile_fixed4(X, XLO, Y, YLO, x_hi, x_lo, offs_m, offs_n, mask_m, mask_n, d,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      SINGLE_K: tl.constexpr):
    """<x_i, y_j> = hh + tails for "fixed4" operands (x_hi, x_lo: the resident block when
    SINGLE_K). Never add hh + tails in the kernel: Triton's combine pass rewrites
    add(dot(a, b, 0), c) into dot(a, b, c), which chains the products again; scale both
    (c hh + (c tails + bias)) instead."""
    hh = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    tails = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SINGLE_K:
        hh, tails = dot_x4_fixed(x_hi, x_lo, load_rows(Y, offs_n, mask_n, d, 0, BLOCK_K),
                                 load_rows(YLO, offs_n, mask_n, d, 0, BLOCK_K), hh, tails)
    else:
        for k0 in range(0, d, BLOCK_K):
            hh, tails = dot_x4_fixed(load_rows(X, offs_m, mask_m, d, k0, BLOCK_K),
                                     load_rows(XLO, offs_m, mask_m, d, k0, BLOCK_K),
                                     load_rows(Y, offs_n, mask_n, d, k0, BLOCK_K),
                                     load_rows(YLO, offs_n, mask_n, d, k0, BLOCK_K), hh, tails)
    return hh, tails


@triton.jit
def plan_row_bias(F, XN, offs_m, mask_m, s, inv_eps):
    """(f_i - s |x_i|^2) / eps in log2 units for the rows of a plan tile (-inf on masked rows).
    Taken in float64 once per row: f and s |x|^2 / eps nearly cancel (see lse.py's epilogue)."""
    f = tl.load(F + offs_m, mask=mask_m, other=0.0)
    xn = tl.load(XN + offs_m, mask=mask_m, other=0.0)
    row2 = ((f.to(tl.float64) - s.to(tl.float64) * xn.to(tl.float64)) * inv_eps.to(tl.float64)) * LOG2E
    return tl.where(mask_m, row2.to(tl.float32), float("-inf"))


@triton.jit
def plan_col_bias(G, YN, offs_n, mask_n, s, inv_eps):
    """(g_j - s |y_j|^2) / eps in log2 units for the columns of a plan tile (-inf on masked columns)."""
    g = tl.load(G + offs_n, mask=mask_n, other=0.0)
    yn = tl.load(YN + offs_n, mask=mask_n, other=0.0)
    return tl.where(mask_n, (g - s * yn) * inv_eps * LOG2E, float("-inf"))


@triton.jit
def plan_tile(X, XLO, Y, YLO, x_hi, x_lo, offs_m, offs_n, mask_m, mask_n, row2, col2, coef2, d,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE_K: tl.constexpr,
              PRECISION: tl.constexpr, LABELS: tl.constexpr = 0, lab=None):
    """P_ij = exp2(coef2 <x_i, y_j> + row2_i + col2_j) for a tile (PRECISION "tf32x3", "tf32",
    "fp16x3" or "fp16", coef2 from :func:`cross_coef2`;
    x_hi, x_lo: the resident x block when SINGLE_K). LABELS: plus ``lab``, the tile's label
    cost in the exponent's units (kernels/label_tiles.py)."""
    if SINGLE_K:
        xy = cross_tile_resident(x_hi, x_lo, Y, YLO, offs_n, mask_n, d, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    else:
        xy = cross_tile_dot(X, XLO, Y, YLO, offs_m, offs_n, mask_m, mask_n, d, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    if LABELS:
        return tl.exp2(xy * coef2 + row2[:, None] + col2[None, :] + lab)
    return tl.exp2(xy * coef2 + row2[:, None] + col2[None, :])


@triton.jit
def plan_times_v(plan, V, offs_n, mask_n, offs_p, mask_p, acc, BLOCK_P: tl.constexpr, P_FMA: tl.constexpr,
                 PRECISION: tl.constexpr, P: tl.constexpr):
    """acc + (plan tile) @ (the V rows offs_n, columns offs_p): FMAs for P_FMA > 0, else tl.dot."""
    if P_FMA > 0:
        cols = tl.arange(0, BLOCK_P)
        for k in tl.static_range(P_FMA):
            vk = tl.load(V + offs_n * P + k, mask=mask_n, other=0.0)
            pv = tl.sum(plan * vk[None, :], axis=1)
            acc += tl.where(cols[None, :] == k, pv[:, None], 0.0)
    else:
        vt = tl.load(V + offs_n[:, None] * P + offs_p[None, :], mask=mask_n[:, None] & mask_p[None, :], other=0.0)
        acc = dot_f32(plan, vt, acc, PRECISION)
    return acc


@triton.jit
def coordinate(PTS, offs, mask, c: tl.constexpr, D: tl.constexpr):
    """Coordinate c of the points ``offs`` of a row-major (n, D) float32 array (zeros for c >= D, so
    that d <= 3 kernels can write three coordinates)."""
    if c < D:
        return tl.load(PTS + offs * D + c, mask=mask, other=0.0)
    else:
        return tl.zeros(offs.shape, dtype=tl.float32)


@triton.jit
def online_lse_step(run_max, run_sum, t):
    """One step of a running (max, sum of exp2) per row over a (rows, cols) tile ``t`` of base-2
    exponents (-inf where absent): returns the new (max, sum); a row still at -inf keeps sum 0."""
    new_max = tl.maximum(run_max, tl.max(t, axis=1))
    safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
    run_sum = run_sum * tl.exp2(run_max - safe_max) + tl.sum(tl.exp2(t - safe_max[:, None]), axis=1)
    return new_max, run_sum
