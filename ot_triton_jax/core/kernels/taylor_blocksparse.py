"""Block-sparse LSE update through a Taylor expansion of the cross term inside each kept cluster
pair (the multiscale solve's "Taylor pass"; docs/performance.md).

Both clouds are sorted by cluster (as for lse_blocksparse.py). For a kept cluster pair (k, l) of
the rows' clouds X and the columns' Y, with cluster centres c (any points; the solve takes the
midpoints of the clusters' bounding boxes), x_i = c_k + u_i, y_j = c_l + v_j,
D = c_k - c_l and C_ij = |x_i - y_j|^2 / 2 (PARAMS = [eps, s], s = 1/2),

    (f_i + g_j + eps logw_j - C_ij) / eps = A_il + B_kj - |D|^2 / (2 eps) + <u_i, v_j> / eps,
    A_il = (f_i - |u_i|^2 / 2 - <D, u_i>) / eps,
    B_kj = (g_j + eps logw_j - |v_j|^2 / 2 + <D, v_j>) / eps,

and exp(<u, v> / eps) = sum_alpha phi_alpha(u) phi_alpha(v), phi_alpha(u) = (u / sqrt(eps))^alpha /
sqrt(alpha!), over the multi-indices alpha of total degree <= P (R of them, padded with zero
columns). Truncated there, each pair's term has relative error at most t^(P+1) / (P+1)! e^t,
t = r_k r_l / eps (cluster radii around the centres; multiscale_rules.taylor_bound). So for the rows
of k,

    r_i = sum_{l kept} exp(A_il - |D|^2 / (2 eps) + s_kl) sum_alpha phi_alpha(u_i) M_kl,alpha,
    M_kl,alpha = sum_{j in l} exp(B_kj - s_kl) phi_alpha(v_j),    s_kl = max_j B_kj,

one exponential per (k, j) and per (i, l) and two rank-R tensor-core products, instead of one
exponential per (i, j). With f the row side's previous potential, the update is
f_i - eps log r_i and the marginal error |r_i - 1| (lse_blocksparse.py's FOLD with POLD).

The softmin mean of the columns' points (the gradient's P y / P 1, MEAN): with y_j = c_k - D + v_j,
sum_j P_ij y_j = c_k r_i + sum_l (N_il - R_il D), R_il the pair's part of r_i and
N_il = sum_{j in l} P_ij v_j. Since v_c exp(<u, v> / eps) = eps d/du_c exp(<u, v> / eps), the same
moments give N through the derivatives of the rows' monomials: N_il,c = sqrt(eps) sum_alpha
psi^c_alpha(u_i) M_kl,alpha with psi^c_alpha = sqrt(alpha_c) phi_(alpha - e_c) = sqrt(eps) d phi_alpha
/ du_c, the derivative of the truncated series, of order P - 1 (relative error at most t^P / P! e^t
of the pair's |v|-weighted mass). The rows' side carries G row groups per point (G a power of two
> D: phi, then psi^c for c < D, zero groups beyond; multiscale_rules.taylor_derivative_table), so
the evaluation's product is one (G BLOCK_I, R) x (R, BLOCK_L) product per step over the stacked
rows (i, g), each pair's moments read once (G groups of shifted moments per pair, written and
read, would move 4x M's bytes).

Operands are FP16 heads and tails (hi = fp16(x), lo = fp16(x - hi)) in three products: float32
accuracy at twice the TF32 rate (W in (0, 1], the monomials within [-1, 1] for t <= 1, M below
the cluster size). Kernels:

* ``taylor_monomials_kernel``: the (rows, G, R) heads and tails of the G monomial groups of a
  range of rows of a sorted cloud (G = 1: phi_alpha(u_i)).
* ``taylor_moments_kernel``: one program per column cluster l of a chunk of them: M and s of every
  kept (k, l), written to the pair's slot (the chunk's k-major order), M as its FP16 head and tail
  (the evaluation's operands: split once per pair, not once per row chunk reading it).
* ``taylor_evaluate_kernel``: one program per row cluster k of a chunk of them: r_i into ACC
  (and with G > 1 the softmin mean into MEAN_OUT (n, D)).

Kept pairs come as two lists: k-major (LPTR (K_r + 1,) into LIDX, the column cluster) and l-major
(KIDX, the row cluster, with SLOT its k-major position); a chunk holds the
pairs of consecutive row clusters, the l-major runs [KLO[l], KHI[l]) of each column cluster.
"""

import triton
import triton.language as tl

from .tiles import LOG2E, coordinate


@triton.jit
def split_fp16(x):
    """(fp16 head, fp16 tail) of float32 x (|x| < 65504; tails below 2^-24 flush)."""
    hi = x.to(tl.float16)
    return hi, (x - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def split_tf32(x):
    """(TF32 head, tail) of float32 x, both float32: the head rounded to 10 significand bits (to
    nearest, ties away), exact as a TF32 operand; the tail exact in float32."""
    hi = ((x.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)
    return hi, x - hi


@triton.jit
def dot3_tf32(a_hi, a_lo, b_hi, b_lo, acc):
    """acc + a b from pre-split TF32 parts (three TF32 products): any float32 range."""
    acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
    acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
    return tl.dot(a_hi, b_hi, acc, input_precision="tf32")


@triton.jit
def dot3_fp16(a_hi, a_lo, b_hi, b_lo, acc):
    """acc + a b from FP16 heads and tails: three FP16 products, float32 accumulation."""
    acc = tl.dot(a_lo, b_hi, acc)
    acc = tl.dot(a_hi, b_lo, acc)
    return tl.dot(a_hi, b_hi, acc)


@triton.jit
def _monomials(u0, u1, u2, ALPHA, R: tl.constexpr, P: tl.constexpr):
    """(rows, R) tile of phi_alpha(u) (u already divided by sqrt(eps)); ALPHA (R, 4) float32 rows
    [a_0, a_1, a_2, 1 / sqrt(alpha!)], 0 in the last column of padding rows."""
    cols = tl.arange(0, R)
    a0 = tl.load(ALPHA + cols * 4 + 0)
    a1 = tl.load(ALPHA + cols * 4 + 1)
    a2 = tl.load(ALPHA + cols * 4 + 2)
    out = tl.load(ALPHA + cols * 4 + 3)[None, :] + tl.zeros((u0.shape[0], R), dtype=tl.float32)
    for t in tl.static_range(P):
        out = out * tl.where(a0[None, :] > t, u0[:, None], 1.0)
        out = out * tl.where(a1[None, :] > t, u1[:, None], 1.0)
        out = out * tl.where(a2[None, :] > t, u2[:, None], 1.0)
    return out


# the row range is not specialized on: one compile serves the whole cloud and every chunk of it
@triton.jit(do_not_specialize=["row0", "n"])
def taylor_monomials_kernel(PTS, CEN, LAB, ALPHA, PARAMS, row0, n, OUT_HI, OUT_LO,
                            BLOCK: tl.constexpr, R: tl.constexpr, P: tl.constexpr, D: tl.constexpr,
                            GROUPS: tl.constexpr):
    """OUT[i - row0, g] = the monomials of ALPHA's group g (a (GROUPS, R, 4) table) at
    (p_i - c_label(i)) / sqrt(eps), for the n rows i from row0, as FP16 head and tail."""
    local = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = local < n
    offs = row0 + local
    lab = tl.load(LAB + offs, mask=mask, other=0)
    rs = 1.0 / tl.sqrt(tl.load(PARAMS))
    u0 = (coordinate(PTS, offs, mask, 0, D) - coordinate(CEN, lab, mask, 0, D)) * rs
    u1 = (coordinate(PTS, offs, mask, 1, D) - coordinate(CEN, lab, mask, 1, D)) * rs
    u2 = (coordinate(PTS, offs, mask, 2, D) - coordinate(CEN, lab, mask, 2, D)) * rs
    for g in range(GROUPS):  # a loop, not unrolled: the first call compiles this kernel
        hi, lo = split_fp16(_monomials(u0, u1, u2, ALPHA + g * (R * 4), R, P))
        ptrs = (local.to(tl.int64)[:, None] * GROUPS + g) * R + tl.arange(0, R)[None, :]
        tl.store(OUT_HI + ptrs, hi, mask=mask[:, None])
        tl.store(OUT_LO + ptrs, lo, mask=mask[:, None])


# the chunk index is not specialized on (Triton would compile c == 1 apart)
@triton.jit(do_not_specialize=["c"])
def taylor_moments_kernel(Y, CY, G, LW, START_Y, KLO, KHI, KIDX, SLOT, CX, PSI_HI, PSI_LO, PARAMS, LPTR,
                          FIRST_K, c, M_HI, M_LO, SIG, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr,
                          D: tl.constexpr):
    """Program l: M[slot] (R values, as its FP16 head M_HI and tail M_LO: the evaluation's operands,
    split once here) and SIG[slot] of the kept pairs KIDX[KLO[l]:KHI[l]] (module docstring), slot =
    SLOT less the chunk's first k-major position LPTR[FIRST_K[c]].
    <v_j, D_kl> / eps comes from a K = 16 product (three TF32 products: D / eps may exceed FP16's
    range), so that the exponents live
    in the accumulator's layout; the points of l in chunks of BLOCK_J with an online max over the
    chunks (the chunk size sets the padding of the contraction)."""
    l = tl.program_id(0)
    pos0 = tl.load(LPTR + tl.load(FIRST_K + c))  # the chunk's first k-major position
    j0 = tl.load(START_Y + l)
    j1 = tl.load(START_Y + l + 1)
    p0 = tl.load(KLO + l)
    p1 = tl.load(KHI + l)
    eps = tl.load(PARAMS)
    inv_eps = 1.0 / eps
    rows = tl.arange(0, R)
    c16 = tl.arange(0, 16)
    in_d = c16 < D
    cl = tl.load(CY + l * D + c16, mask=in_d, other=0.0)
    for pb in range(p0, p1, BLOCK_K):
        offs_p = pb + tl.arange(0, BLOCK_K)
        mask_p = offs_p < p1
        k = tl.load(KIDX + offs_p, mask=mask_p, other=0)
        dk = (tl.load(CX + k[:, None] * D + c16[None, :], mask=in_d[None, :], other=0.0) - cl[None, :]) * inv_eps
        dk_hi, dk_lo = split_tf32(tl.where(in_d[None, :], dk, 0.0))
        sig = tl.full((BLOCK_K,), float("-inf"), dtype=tl.float32)
        m = tl.zeros((R, BLOCK_K), dtype=tl.float32)
        for jc in range(j0, j1, BLOCK_J):
            offs_j = jc + tl.arange(0, BLOCK_J)
            mask_j = offs_j < j1
            keep_v = mask_j[:, None] & in_d[None, :]
            v = tl.where(keep_v, tl.load(Y + offs_j[:, None] * D + c16[None, :], mask=keep_v, other=0.0) - cl[None, :], 0.0)
            v_hi, v_lo = split_tf32(v)
            cross = dot3_tf32(v_hi, v_lo, tl.trans(dk_hi), tl.trans(dk_lo), tl.zeros((BLOCK_J, BLOCK_K), dtype=tl.float32))
            g = tl.load(G + offs_j, mask=mask_j, other=0.0)
            lw = tl.load(LW + offs_j, mask=mask_j, other=0.0)
            base = tl.where(mask_j, (g + eps * lw - 0.5 * tl.sum(v * v, axis=1)) * inv_eps, float("-inf"))
            z = cross + base[:, None]
            sig_c = tl.maximum(sig, tl.max(z, axis=0))
            m = m * tl.exp2((sig - sig_c) * LOG2E)[None, :]  # the earlier chunks' sums, rescaled
            sig = sig_c
            w_hi, w_lo = split_fp16(tl.exp2((z - sig[None, :]) * LOG2E))
            ptrs = offs_j[None, :] * R + rows[:, None]
            m = dot3_fp16(tl.load(PSI_HI + ptrs, mask=mask_j[None, :], other=0.0),
                          tl.load(PSI_LO + ptrs, mask=mask_j[None, :], other=0.0), w_hi, w_lo, m)
        slot = tl.load(SLOT + offs_p, mask=mask_p, other=0) - pos0
        m_hi, m_lo = split_fp16(m)
        m_ptrs = slot.to(tl.int64)[None, :] * R + rows[:, None]
        tl.store(M_HI + m_ptrs, m_hi, mask=mask_p[None, :])
        tl.store(M_LO + m_ptrs, m_lo, mask=mask_p[None, :])
        tl.store(SIG + slot, sig, mask=mask_p)


# the chunk index and its first row are not specialized on (Triton would compile c == 1 apart)
@triton.jit(do_not_specialize=["c", "row0"])
def taylor_evaluate_kernel(X, CX, F, START_X, LPTR, LIDX, CY, PHI_HI, PHI_LO, M_HI, M_LO, SIG, PARAMS, FIRST_K, c, row0, ACC,
                           MEAN_OUT, BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr, R: tl.constexpr,
                           D: tl.constexpr, G: tl.constexpr):
    """Program k = FIRST_K[c] + pid (a chunk of row clusters): ACC_i = r_i for the rows of cluster k,
    in chunks of BLOCK_I rows (module docstring; F = the rows' previous potential). The chunk's M
    and SIG rows are its pairs' k-major positions (LPTR) less the chunk's first, LPTR[FIRST_K[c]];
    PHI holds G monomial groups per row from row0 (taylor_monomials_kernel).

    G = 1: r only. G > 1: also MEAN_OUT_i = sum_j P_ij y_j / r_i. Each step takes BLOCK_L pairs and
    one product of the (G BLOCK_I, R) tile of stacked rows q = (i, g) (group g of row i: phi, then
    psi^c) with the pairs' (R, BLOCK_L) moments; each pair's exponential multiplies the G products
    of its row (computed on the stacked tile: G times the exponentials of a (BLOCK_I, BLOCK_L) tile,
    one tensor-core-shaped tile instead of a broadcast across layouts)."""
    k = tl.load(FIRST_K + c) + tl.program_id(0)
    pos0 = tl.load(LPTR + tl.load(FIRST_K + c))  # the chunk's first k-major position
    i0 = tl.load(START_X + k)
    i1 = tl.load(START_X + k + 1)
    p0 = tl.load(LPTR + k)
    p1 = tl.load(LPTR + k + 1)
    eps = tl.load(PARAMS)
    inv_eps = 1.0 / eps
    sqrt_eps = tl.sqrt(eps)
    cols = tl.arange(0, R)
    q = tl.arange(0, G * BLOCK_I)  # stacked rows: row ic + q // G, group q % G
    c0 = tl.load(CX + k * D + 0)
    c1 = 0.0
    c2 = 0.0
    if D > 1:
        c1 = tl.load(CX + k * D + 1)
    if D > 2:
        c2 = tl.load(CX + k * D + 2)
    for ic in range(i0, i1, BLOCK_I):
        offs_i = ic + q // G
        mask_i = offs_i < i1
        u0 = tl.where(mask_i, coordinate(X, offs_i, mask_i, 0, D) - c0, 0.0)
        u1 = tl.where(mask_i, coordinate(X, offs_i, mask_i, 1, D) - c1, 0.0)
        u2 = tl.where(mask_i, coordinate(X, offs_i, mask_i, 2, D) - c2, 0.0)
        f = tl.load(F + offs_i, mask=mask_i, other=0.0)
        rowbase = (f - 0.5 * (u0 * u0 + u1 * u1 + u2 * u2)) * inv_eps
        ptrs = ((ic - row0).to(tl.int64) * G + q)[:, None] * R + cols[None, :]
        acc = tl.zeros((G * BLOCK_I,), dtype=tl.float32)  # per stacked row: sum_l exp(.) (its group's product)
        n0 = tl.zeros((G * BLOCK_I,), dtype=tl.float32)  # ... times D_kl,c (used on the group-0 rows)
        n1 = tl.zeros((G * BLOCK_I,), dtype=tl.float32)
        n2 = tl.zeros((G * BLOCK_I,), dtype=tl.float32)
        # the stacked rows' monomials stay resident across the pairs (-10% for this kernel on the H100)
        a_hi = tl.load(PHI_HI + ptrs, mask=mask_i[:, None], other=0.0)
        a_lo = tl.load(PHI_LO + ptrs, mask=mask_i[:, None], other=0.0)
        for pb in range(p0, p1, BLOCK_L):
            offs_p = pb + tl.arange(0, BLOCK_L)
            mask_p = offs_p < p1
            l = tl.load(LIDX + offs_p, mask=mask_p, other=0)
            d0 = c0 - coordinate(CY, l, mask_p, 0, D)
            d1 = c1 - coordinate(CY, l, mask_p, 1, D)
            d2 = c2 - coordinate(CY, l, mask_p, 2, D)
            rows_m = (offs_p - pos0).to(tl.int64)
            # the moments come split (FP16 head and tail, taylor_moments_kernel): loaded straight into
            # the product's operands, no conversion on the way (measured on the H100)
            m_ptrs = rows_m[:, None] * R + cols[None, :]
            mt_hi = tl.load(M_HI + m_ptrs, mask=mask_p[:, None], other=0.0)
            mt_lo = tl.load(M_LO + m_ptrs, mask=mask_p[:, None], other=0.0)
            s = dot3_fp16(a_hi, a_lo, tl.trans(mt_hi), tl.trans(mt_lo), tl.zeros((G * BLOCK_I, BLOCK_L), dtype=tl.float32))
            sig = tl.load(SIG + rows_m, mask=mask_p, other=float("-inf"))
            colterm = sig - 0.5 * (d0 * d0 + d1 * d1 + d2 * d2) * inv_eps
            e = rowbase[:, None] + colterm[None, :] - (u0[:, None] * d0[None, :] + u1[:, None] * d1[None, :]
                                                       + u2[:, None] * d2[None, :]) * inv_eps
            w = tl.exp2(e * LOG2E) * s
            acc += tl.sum(w, axis=1)
            if G > 1:
                n0 += tl.sum(w * d0[None, :], axis=1)
                if D > 1:
                    n1 += tl.sum(w * d1[None, :], axis=1)
                if D > 2:
                    n2 += tl.sum(w * d2[None, :], axis=1)
        if G == 1:
            tl.store(ACC + offs_i, acc, mask=mask_i)
        else:
            rows_i = ic + tl.arange(0, BLOCK_I)
            in_i = rows_i < i1
            grp = tl.arange(0, G)[None, :]
            a2 = tl.reshape(acc, (BLOCK_I, G))
            r = tl.sum(tl.where(grp == 0, a2, 0.0), axis=1)
            tl.store(ACC + rows_i, r, mask=in_i)
            r = tl.where(in_i, r, 1.0)
            # N_c = sqrt(eps) sum_l exp(.) psi^c M - sum_l exp(.) phi M D_c
            m0 = sqrt_eps * tl.sum(tl.where(grp == 1, a2, 0.0), axis=1) - tl.sum(
                tl.where(grp == 0, tl.reshape(n0, (BLOCK_I, G)), 0.0), axis=1)
            tl.store(MEAN_OUT + rows_i * D, c0 + m0 / r, mask=in_i)
            if D > 1:
                m1 = sqrt_eps * tl.sum(tl.where(grp == 2, a2, 0.0), axis=1) - tl.sum(
                    tl.where(grp == 0, tl.reshape(n1, (BLOCK_I, G)), 0.0), axis=1)
                tl.store(MEAN_OUT + rows_i * D + 1, c1 + m1 / r, mask=in_i)
            if D > 2:
                m2 = sqrt_eps * tl.sum(tl.where(grp == 3, a2, 0.0), axis=1) - tl.sum(
                    tl.where(grp == 0, tl.reshape(n2, (BLOCK_I, G)), 0.0), axis=1)
                tl.store(MEAN_OUT + rows_i * D + 2, c2 + m2 / r, mask=in_i)
