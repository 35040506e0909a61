"""Feasibility probe: the block-sparse LSE pass through a Taylor expansion of the cross term inside
each kept cluster pair (bench/NOTES.md 93), against the direct pass on the same solve at 2^20.

The direct pass takes one exponential per kept point pair (9.6e10 at 2^20: the MUFU floor). With
x_i = c_k + u_i, y_j = c_l + v_j (cluster means), D = c_k - c_l and C = |x - y|^2 / 2,

    (f_i + g_j - C_ij) / eps = A_il + B_kj - |D|^2 / (2 eps) + <u_i, v_j> / eps,
    A_il = (f_i - |u_i|^2 / 2 - <D, u_i>) / eps,   B_kj = (g_j + eps log b_j - |v_j|^2 / 2 + <D, v_j>) / eps,

and exp(<u, v> / eps) = sum over multi-indices alpha of phi_alpha(u) phi_alpha(v),
phi_alpha(u) = (u / sqrt(eps))^alpha / sqrt(alpha!). Truncated at |alpha| <= p, the relative error of
every pair's term is at most t^(p+1) / (p+1)! e^t, t = r_k r_l / eps (cluster radii). So

    r_i = sum_{l kept by k} exp(A_il - |D|^2 / (2 eps) + s_kl) sum_alpha phi_alpha(u_i) M_kl,alpha,
    M_kl,alpha = sum_{j in l} exp(B_kj - s_kl) phi_alpha(v_j)       (s_kl = max_j B_kj),

one exponential per (k, j) and per (i, l) instead of per (i, j), and two tensor-core products of
rank R = C(p + 3, 3) (120 at p = 7, padded to 128). Kernel A (one program per y cluster l) writes
M and s for every kept (k, l); kernel B (one program per x cluster k) reads them in k-major order.
M is materialized (kept pairs x 128 floats: ~10 GB at 2^20; a product would chunk it). The monomials
are computed once per point (monomials_kernel) and pre-split into TF32 heads and tails, so every
product is three TF32 products on exact operands (3xTF32, float32-accurate).

The defaults: the "dot" moments kernel, FP16 heads and tails (TAYLOR_F16=1; TF32 ones with 0).

Measured (H100, bench/results/probe_taylor_lse_nvidia-h100-80gb-hbm3.json, NOTES 93): at 2^20 the
Taylor pass is ~8e-7 eps from float64 (the direct pass 2.4e-5 eps) and takes ~17 ms against the
direct pass's 32 ms (moments ~8.5 ms, evaluation ~8.7 ms, FP16 parts; TF32 parts: ~38 ms). At 2^18
(17 points per cluster) it cannot pay: 62 ms against 3.2 (first version).

    python3 bench/probe_taylor_lse.py [--n 1048576]      (H100; writes bench/results/probe_taylor_lse_<device>.json)
    TRITON_INTERPRET=1 python3 bench/probe_taylor_lse.py --cpu-check   (small synthetic problem, float64 reference)
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import statistics
import sys

import torch
import triton
import triton.language as tl

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))

LOG2E = tl.constexpr(1.4426950408889634)
R_PAD = 128
STAGES = 3  # the evaluation kernel
MOMENT_STAGES = int(os.environ.get("MOMENT_STAGES", "1"))  # 2 stages: slower in every variant tried
MOMENT_WARPS = int(os.environ.get("MOMENT_WARPS", "4"))
MOMENT_RS = int(os.environ.get("MOMENT_RS", "1"))
MOMENT_BK = int(os.environ.get("MOMENT_BK", "64"))  # kept k per step
MOMENT_BJ = int(os.environ.get("MOMENT_BJ", "32"))  # points of l per chunk (less padding than 64)
F16 = os.environ.get("TAYLOR_F16", "1") == "1"  # FP16 heads / tails instead of TF32 ones
EVAL_BI = int(os.environ.get("EVAL_BI", "128"))  # rows of k per chunk (evaluation)
EVAL_BL = int(os.environ.get("EVAL_BL", "32"))  # kept l per step (evaluation)
EVAL_WARPS = int(os.environ.get("EVAL_WARPS", "8"))


@triton.jit
def _monomials(v0, v1, v2, A0, A1, A2, INVF, R: tl.constexpr, P: tl.constexpr):
    """(rows, R) tile of phi_alpha(v) = v^alpha / sqrt(alpha!) (v already divided by sqrt(eps));
    padding columns have INVF = 0."""
    cols = tl.arange(0, R)
    a0 = tl.load(A0 + cols)
    a1 = tl.load(A1 + cols)
    a2 = tl.load(A2 + cols)
    out = tl.load(INVF + cols)[None, :] + tl.zeros((v0.shape[0], R), dtype=tl.float32)
    for t in tl.static_range(P):
        out = out * tl.where(a0[None, :] > t, v0[:, None], 1.0)
        out = out * tl.where(a1[None, :] > t, v1[:, None], 1.0)
        out = out * tl.where(a2[None, :] > t, v2[:, None], 1.0)
    return out


@triton.jit
def tf32_head(x):
    """x rounded to TF32's 10-bit significand (to nearest, ties away): exact as a TF32 operand,
    and x - head is exact in float32 (the 3xTF32 split, done once instead of in every product)."""
    bits = x.to(tl.uint32, bitcast=True)
    return ((bits + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def split2(x, F16: tl.constexpr):
    """(head, tail) of float32 x: TF32 heads (float32 storage) or, F16, FP16 head and tail (twice the
    tensor-core rate, half the bytes; for |x| < 65504, the tail flushing below 2^-24)."""
    if F16:
        hi = x.to(tl.float16)
        return hi, (x - hi.to(tl.float32)).to(tl.float16)
    else:
        hi = tf32_head(x)
        return hi, x - hi


@triton.jit
def dot3(a_hi, a_lo, b_hi, b_lo, acc, F16: tl.constexpr = False):
    """acc + a b with float32 accuracy from pre-split parts (three TF32 or FP16 products)."""
    if F16:
        acc = tl.dot(a_lo, b_hi, acc)
        acc = tl.dot(a_hi, b_lo, acc)
        return tl.dot(a_hi, b_hi, acc)
    else:
        acc = tl.dot(a_lo, b_hi, acc, input_precision="tf32")
        acc = tl.dot(a_hi, b_lo, acc, input_precision="tf32")
        return tl.dot(a_hi, b_hi, acc, input_precision="tf32")


@triton.jit
def monomials_kernel(PTS, CEN, LAB, A0, A1, A2, INVF, OUT, OUT_LO, eps, n, BLOCK: tl.constexpr, R: tl.constexpr,
                     P: tl.constexpr, F16: tl.constexpr = False):
    """OUT[i] = phi_alpha((p_i - c_label(i)) / sqrt(eps)) for every alpha (a row of R floats)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    lab = tl.load(LAB + offs, mask=mask, other=0)
    rs = 1.0 / tl.sqrt(eps)
    u0 = (tl.load(PTS + offs * 3 + 0, mask=mask, other=0.0) - tl.load(CEN + lab * 3 + 0, mask=mask, other=0.0)) * rs
    u1 = (tl.load(PTS + offs * 3 + 1, mask=mask, other=0.0) - tl.load(CEN + lab * 3 + 1, mask=mask, other=0.0)) * rs
    u2 = (tl.load(PTS + offs * 3 + 2, mask=mask, other=0.0) - tl.load(CEN + lab * 3 + 2, mask=mask, other=0.0)) * rs
    phi = _monomials(u0, u1, u2, A0, A1, A2, INVF, R, P)
    hi, lo = split2(phi, F16)
    cols = tl.arange(0, R)
    tl.store(OUT + offs.to(tl.int64)[:, None] * R + cols[None, :], hi, mask=mask[:, None])
    tl.store(OUT_LO + offs.to(tl.int64)[:, None] * R + cols[None, :], lo, mask=mask[:, None])


@triton.jit
def taylor_moments_dot_kernel(Y, CY, G, LW, START_Y, KPTR, KIDX, SLOT, CX, PSI, PSI_LO, M, SIG, eps,
                              BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                              RS: tl.constexpr = 1, F16: tl.constexpr = False):
    """Moments with <v_j, D_kl> / eps from a K = 16 tensor-core product (3xTF32; the two earlier
    variants, exponents computed elementwise in the rows or transposed orientation, are in bench/NOTES.md 93):
    the exponents then live in the product's accumulator layout, where the per-point vectors
    (the column part of B) cost a few registers instead of a 16-per-thread slice layout. The
    cluster's points in chunks of BLOCK_J with an online max over the chunks. RS > 1: the monomial
    columns in RS slices, each slice's pass over all kept k recomputing the exponentials, so that
    the slice's monomial tiles (re-read at every step) stay in L1 (ncu: 6% L1 hits with all R)."""
    l = tl.program_id(0)
    j0 = tl.load(START_Y + l)
    j1 = tl.load(START_Y + l + 1)
    p0 = tl.load(KPTR + l)
    p1 = tl.load(KPTR + l + 1)
    c16 = tl.arange(0, 16)
    inv_eps = 1.0 / eps
    cl = tl.load(CY + l * 3 + c16, mask=c16 < 3, other=0.0)
    for h in range(0, RS):
        rows = h * (R // RS) + tl.arange(0, R // RS)
        for pb in range(p0, p1, BLOCK_K):
            offs_p = pb + tl.arange(0, BLOCK_K)
            mask_p = offs_p < p1
            k = tl.load(KIDX + offs_p, mask=mask_p, other=0)
            dk = (tl.load(CX + k[:, None] * 3 + c16[None, :], mask=c16[None, :] < 3, other=0.0) - cl[None, :]) * inv_eps
            dk = tl.where(c16[None, :] < 3, dk, 0.0)
            dk_hi = tf32_head(dk)
            sig = tl.full((BLOCK_K,), float("-inf"), dtype=tl.float32)
            m = tl.zeros((R // RS, BLOCK_K), dtype=tl.float32)
            for jc in range(j0, j1, BLOCK_J):
                offs_j = jc + tl.arange(0, BLOCK_J)
                mask_j = offs_j < j1
                v = tl.load(Y + offs_j[:, None] * 3 + c16[None, :], mask=mask_j[:, None] & (c16[None, :] < 3), other=0.0)
                v = tl.where(mask_j[:, None] & (c16[None, :] < 3), v - cl[None, :], 0.0)
                v_hi = tf32_head(v)
                cross = dot3(v_hi, v - v_hi, tl.trans(dk_hi), tl.trans(dk - dk_hi),
                             tl.zeros((BLOCK_J, BLOCK_K), dtype=tl.float32))
                g = tl.load(G + offs_j, mask=mask_j, other=0.0)
                lw = tl.load(LW + offs_j, mask=mask_j, other=0.0)
                vv = tl.sum(v * v, axis=1)
                base = tl.where(mask_j, (g + eps * lw - 0.5 * vv) * inv_eps, float("-inf"))
                z = cross + base[:, None]
                sig_c = tl.maximum(sig, tl.max(z, axis=0))
                m = m * tl.exp2((sig - sig_c) * LOG2E)[None, :]  # the earlier chunks' sums, rescaled
                sig = sig_c
                w = tl.exp2((z - sig[None, :]) * LOG2E)
                w_hi, w_lo = split2(w, F16)
                ptrs = offs_j[None, :] * R + rows[:, None]  # int32 (m R < 2^31): vector loads
                m = dot3(tl.load(PSI + ptrs, mask=mask_j[None, :], other=0.0),
                         tl.load(PSI_LO + ptrs, mask=mask_j[None, :], other=0.0), w_hi, w_lo, m, F16)
            slot = tl.load(SLOT + offs_p, mask=mask_p, other=0)
            tl.store(M + slot.to(tl.int64)[None, :] * R + rows[:, None], m, mask=mask_p[None, :])
            if h == 0:
                tl.store(SIG + slot, sig, mask=mask_p)


@triton.jit
def taylor_lse_kernel(X, CX, F, START_X, LPTR, LIDX, CY, PHI, PHI_LO, M, SIG, OUT, eps,
                      BLOCK_I: tl.constexpr, BLOCK_L: tl.constexpr, R: tl.constexpr, P: tl.constexpr,
                      F16: tl.constexpr = False):
    """Program k: OUT_i = f_i - eps log r_i for the rows of cluster k (module docstring)."""
    k = tl.program_id(0)
    i0 = tl.load(START_X + k)
    i1 = tl.load(START_X + k + 1)
    inv_eps = 1.0 / eps
    c0 = tl.load(CX + k * 3 + 0)
    c1 = tl.load(CX + k * 3 + 1)
    c2 = tl.load(CX + k * 3 + 2)
    p0 = tl.load(LPTR + k)
    p1 = tl.load(LPTR + k + 1)
    cols = tl.arange(0, R)
    for ic in range(i0, i1, BLOCK_I):  # the cluster's rows in chunks of BLOCK_I
        offs_i = ic + tl.arange(0, BLOCK_I)
        mask_i = offs_i < i1
        u0 = tl.where(mask_i, tl.load(X + offs_i * 3 + 0, mask=mask_i, other=0.0) - c0, 0.0)
        u1 = tl.where(mask_i, tl.load(X + offs_i * 3 + 1, mask=mask_i, other=0.0) - c1, 0.0)
        u2 = tl.where(mask_i, tl.load(X + offs_i * 3 + 2, mask=mask_i, other=0.0) - c2, 0.0)
        f = tl.load(F + offs_i, mask=mask_i, other=0.0)
        rowbase = (f - 0.5 * (u0 * u0 + u1 * u1 + u2 * u2)) * inv_eps
        acc = tl.zeros((BLOCK_I,), dtype=tl.float32)
        for pb in range(p0, p1, BLOCK_L):
            offs_p = pb + tl.arange(0, BLOCK_L)
            mask_p = offs_p < p1
            l = tl.load(LIDX + offs_p, mask=mask_p, other=0)
            d0 = c0 - tl.load(CY + l * 3 + 0)
            d1 = c1 - tl.load(CY + l * 3 + 1)
            d2 = c2 - tl.load(CY + l * 3 + 2)
            mt = tl.load(M + offs_p.to(tl.int64)[:, None] * R + cols[None, :], mask=mask_p[:, None], other=0.0)
            sig = tl.load(SIG + offs_p, mask=mask_p, other=float("-inf"))
            ptrs = offs_i.to(tl.int64)[:, None] * R + cols[None, :]
            phi = tl.load(PHI + ptrs, mask=mask_i[:, None], other=0.0)
            phi_lo = tl.load(PHI_LO + ptrs, mask=mask_i[:, None], other=0.0)
            mt_hi, mt_lo = split2(mt, F16)
            s = dot3(phi, phi_lo, tl.trans(mt_hi), tl.trans(mt_lo), tl.zeros((BLOCK_I, BLOCK_L), dtype=tl.float32), F16)
            colterm = sig - 0.5 * (d0 * d0 + d1 * d1 + d2 * d2) * inv_eps
            e = rowbase[:, None] + colterm[None, :] - (u0[:, None] * d0[None, :] + u1[:, None] * d1[None, :]
                                                       + u2[:, None] * d2[None, :]) * inv_eps
            acc += tl.sum(tl.exp2(e * LOG2E) * s, axis=1)
        tl.store(OUT + offs_i, f - eps * tl.log(tl.where(mask_i, acc, 1.0)), mask=mask_i)


def multi_indices(p: int) -> tuple:
    """(A0, A1, A2, INVF) int32 / float32 vectors of length R_PAD: every alpha with |alpha| <= p in
    graded order, 1 / sqrt(alpha!), padding columns zero."""
    alphas = [a for deg in range(p + 1) for a in itertools.product(range(deg + 1), repeat=3) if sum(a) == deg]
    assert len(alphas) <= R_PAD, (p, len(alphas))
    pad = R_PAD - len(alphas)
    cols = list(zip(*alphas))
    invf = [1.0 / math.sqrt(math.factorial(a) * math.factorial(b) * math.factorial(c)) for a, b, c in alphas]
    return (torch.tensor(list(cols[0]) + [0] * pad, dtype=torch.int32), torch.tensor(list(cols[1]) + [0] * pad, dtype=torch.int32),
            torch.tensor(list(cols[2]) + [0] * pad, dtype=torch.int32), torch.tensor(invf + [0.0] * pad, dtype=torch.float32))


def order_for(t: float, target: float = 2.0 ** -24) -> int:
    """Least p with t^(p+1) / (p+1)! e^t <= target (the truncation's relative error per pair)."""
    p = 0
    while t ** (p + 1) / math.factorial(p + 1) * math.exp(t) > target and p < 30:
        p += 1
    return p


def segment_means(pts: torch.Tensor, start: torch.Tensor) -> tuple:
    """(cluster means (K, 3) float32, radii (K,) float64) of points sorted by cluster."""
    k = start.numel() - 1
    counts = (start[1:] - start[:-1]).long()
    lab = torch.repeat_interleave(torch.arange(k, device=pts.device), counts)
    p64 = pts.double()
    c = torch.zeros(k, 3, dtype=torch.float64, device=pts.device).index_add_(0, lab, p64) / counts[:, None]
    r = torch.zeros(k, dtype=torch.float64, device=pts.device).scatter_reduce_(
        0, lab, (p64 - c[lab]).norm(dim=1), reduce="amax", include_self=True)
    return c.float().contiguous(), r, lab


class TaylorLSE:
    """Host side: CSR lists of the kept cluster pairs in both orders, the slots, the buffers."""

    def __init__(self, xs, ys, start_x, start_y, keep, eps: float, p: int | None = None):
        dev = xs.device
        self.xs, self.ys, self.eps = xs.contiguous(), ys.contiguous(), eps
        self.start_x, self.start_y = start_x.int().contiguous(), start_y.int().contiguous()
        self.cx, rx, lab_x = segment_means(xs, start_x)
        self.cy, ry, lab_y = segment_means(ys, start_y)
        nz = keep.nonzero()
        self.pairs = nz.shape[0]
        t = float((rx[nz[:, 0]] * ry[nz[:, 1]]).max()) / eps
        self.t_max, self.p = t, order_for(t) if p is None else p
        self.p = min(self.p, 7)  # R_PAD = 128 holds C(10, 3) = 120 monomials at most
        self.trunc_bound = t ** (self.p + 1) / math.factorial(self.p + 1) * math.exp(t)
        self.lptr = torch.zeros(keep.shape[0] + 1, dtype=torch.int32, device=dev)
        self.lptr[1:] = torch.cumsum(keep.sum(1), 0).to(torch.int32)
        self.lidx = nz[:, 1].int().contiguous()
        order = torch.argsort(nz[:, 1] * keep.shape[0] + nz[:, 0])
        self.kptr = torch.zeros(keep.shape[1] + 1, dtype=torch.int32, device=dev)
        self.kptr[1:] = torch.cumsum(keep.sum(0), 0).to(torch.int32)
        self.kidx = nz[order, 0].int().contiguous()
        self.slot = order.int().contiguous()
        self.alpha = tuple(a.to(dev) for a in multi_indices(self.p))
        self.lab_x, self.lab_y = lab_x.int().contiguous(), lab_y.int().contiguous()
        self.phi = self.monomials(self.xs, self.cx, self.lab_x)
        self.psi = self.monomials(self.ys, self.cy, self.lab_y)
        self.m = torch.empty(self.pairs, R_PAD, dtype=torch.float32, device=dev)
        self.sig = torch.empty(self.pairs, dtype=torch.float32, device=dev)
        sizes = torch.cat([start_x[1:] - start_x[:-1], start_y[1:] - start_y[:-1]])
        self.max_cluster = int(sizes.max())

    def monomials(self, pts, cen, lab):
        out = torch.empty(2, pts.shape[0], R_PAD, dtype=torch.float16 if F16 else torch.float32, device=pts.device)
        monomials_kernel[(triton.cdiv(pts.shape[0], 64),)](pts, cen, lab, *self.alpha, out[0], out[1], self.eps,
                                                           pts.shape[0], BLOCK=64, R=R_PAD, P=self.p, F16=F16, num_warps=4)
        return out

    def moments(self, g, lw):
        kern, extra = taylor_moments_dot_kernel, {"RS": MOMENT_RS, "F16": F16}
        kern[(self.start_y.numel() - 1,)](
            self.ys, self.cy, g, lw, self.start_y, self.kptr, self.kidx, self.slot, self.cx, self.psi[0], self.psi[1],
            self.m, self.sig, self.eps, BLOCK_J=MOMENT_BJ, BLOCK_K=MOMENT_BK, R=R_PAD, P=self.p, num_warps=MOMENT_WARPS, num_stages=MOMENT_STAGES, **extra)

    def lse(self, f):
        out = torch.empty_like(f)
        taylor_lse_kernel[(self.start_x.numel() - 1,)](
            self.xs, self.cx, f, self.start_x, self.lptr, self.lidx, self.cy, self.phi[0], self.phi[1], self.m, self.sig,
            out, self.eps, BLOCK_I=EVAL_BI, BLOCK_L=EVAL_BL, R=R_PAD, P=self.p, F16=F16, num_warps=EVAL_WARPS, num_stages=STAGES)
        return out

    def __call__(self, f, g, lw):
        self.moments(g, lw)
        return self.lse(f)


def float64_update(xs, ys, f, g, lw, eps: float, rows: torch.Tensor, cols_of) -> torch.Tensor:
    """f_i - eps log sum_{j in cols_of(i)} exp((f_i + g_j + eps lw_j - |x_i - y_j|^2 / 2) / eps), float64."""
    out = []
    for i in rows.tolist():
        cols = cols_of(i)
        z = (f[i].double() + g[cols].double() + eps * lw[cols].double()
             - 0.5 * ((xs[i].double() - ys[cols].double()) ** 2).sum(1)) / eps
        out.append(f[i].double() - eps * torch.logsumexp(z, 0))
    return torch.stack(out)


def cluster_cols(keep, lab_x, start_y):
    """Columns of row i: its cluster's kept y clusters."""
    def cols(i):
        ls = keep[lab_x[i]].nonzero()[:, 0].tolist()
        return torch.cat([torch.arange(int(start_y[l]), int(start_y[l + 1]), device=keep.device) for l in ls])
    return cols


def small_problem_error(side: float = 0.06, seed: int = 0, p: int | None = None) -> dict:
    """A small synthetic problem (voxel clusters of ``side``, eps = 0.05^2, 60% of the cluster pairs
    kept, every row keeping one at least): the kernels against float64 on every row."""
    gen = torch.Generator().manual_seed(seed)
    eps = 0.05 ** 2
    x, y = torch.rand(300, 3, generator=gen) * 0.3, torch.rand(280, 3, generator=gen) * 0.3
    def sort(p):
        ids = (p / side).floor().long()
        key = (ids[:, 0] * 64 + ids[:, 1]) * 64 + ids[:, 2]
        uniq, lab = torch.unique(key, return_inverse=True)
        perm = torch.argsort(lab, stable=True)
        counts = torch.bincount(lab, minlength=uniq.numel())
        start = torch.zeros(uniq.numel() + 1, dtype=torch.int32)
        start[1:] = torch.cumsum(counts, 0)
        return p[perm].contiguous(), start, lab[perm]
    xs, sx, lx = sort(x)
    ys, sy, _ = sort(y)
    kx, ky = sx.numel() - 1, sy.numel() - 1
    keep = torch.rand(kx, ky, generator=gen) < 0.6
    keep[torch.arange(kx), torch.randint(0, ky, (kx,), generator=gen)] = True
    f, g = torch.randn(xs.shape[0], generator=gen) * 0.01, torch.randn(ys.shape[0], generator=gen) * 0.01
    lw = torch.full((ys.shape[0],), -math.log(ys.shape[0]))
    t = TaylorLSE(xs, ys, sx, sy, keep, eps, p)
    out = t(f, g, lw)
    ref = float64_update(xs, ys, f, g, lw, eps, torch.arange(xs.shape[0]), cluster_cols(keep, lx, sy))
    err = float((out.double() - ref).abs().max() / eps)
    return {"clusters": [kx, ky], "pairs": t.pairs, "t_max": t.t_max, "p": t.p, "trunc_bound": t.trunc_bound,
            "max_err_over_eps": err, "finite": bool(torch.isfinite(out).all())}


def cpu_check() -> int:
    row = small_problem_error()
    print(json.dumps(row))
    return 0 if row["finite"] and row["max_err_over_eps"] < max(2 * row["trunc_bound"], 4e-6) else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=1 << 20)
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time moments-kernel configurations")
    args = ap.parse_args()
    if args.cpu_check:
        return cpu_check()
    from common import cuda_median_ms, environment
    from ot_triton_jax.core import launch_plans
    from sweep_blocksparse import last_sweep
    from torch_api import kernel_ops
    from torch_api.multiscale_clusters import column_ranges, row_block_mask

    X, Y, g_old, lb, f_new, prm, keep, lx, start_y = last_sweep(args.n)
    eps = float(prm[0])
    bm = launch_plans.GPU_BLOCKSPARSE["k16"]["BLOCK_M"]
    rng = column_ranges(row_block_mask(keep, lx, bm), start_y)
    start_x = torch.zeros(keep.shape[0] + 1, dtype=torch.int32, device="cuda")
    start_x[1:] = torch.cumsum(torch.bincount(lx, minlength=keep.shape[0]), 0).to(torch.int32)
    direct = lambda: kernel_ops.lse_blocksparse(X, Y, g_old, prm, rng, "float32", logw_in=lb,  # noqa: E731
                                                pold=f_new, compute_err=True, fold=True)
    out_direct = direct()[0]
    row = {"n": args.n, "clusters": list(keep.shape)}
    row["direct_ms"] = statistics.median(cuda_median_ms(direct, reps=7)[1])
    tay = TaylorLSE(X.x, Y.x, start_x, start_y, keep, eps)
    row.update(pairs=tay.pairs, kept_cluster_fraction=tay.pairs / keep.numel(), t_max=tay.t_max, p=tay.p,
               trunc_bound=tay.trunc_bound, max_cluster=tay.max_cluster,
               m_buffer_gib=tay.m.numel() * 4 / 2 ** 30)
    out_t = tay(f_new, g_old, lb)
    row["taylor_ms"] = statistics.median(cuda_median_ms(lambda: tay(f_new, g_old, lb), reps=7)[1])
    row["moments_ms"] = statistics.median(cuda_median_ms(lambda: tay.moments(g_old, lb), reps=7)[1])
    row["evaluate_ms"] = statistics.median(cuda_median_ms(lambda: tay.lse(f_new), reps=7)[1])
    # the moments kernel writing its pairs contiguously (l-major slots; the evaluation would then
    # read the wrong pairs): how much of its time is the k-major scatter of M
    slot = tay.slot
    tay.slot = torch.arange(tay.pairs, dtype=torch.int32, device="cuda")
    row["moments_contiguous_ms"] = statistics.median(cuda_median_ms(lambda: tay.moments(g_old, lb), reps=7)[1])
    tay.slot = slot
    row["finite"] = bool(torch.isfinite(out_t).all())
    rows = torch.randint(0, X.n, (256,), generator=torch.Generator().manual_seed(0)).cuda()
    ref_c = float64_update(X.x, Y.x, f_new, g_old, lb, eps, rows, cluster_cols(keep, lx, start_y))
    def block_cols(i):
        return torch.cat([torch.arange(int(a), int(b), device="cuda") for a, b in rng[i // bm].tolist() if b > a])
    ref_b = float64_update(X.x, Y.x, f_new, g_old, lb, eps, rows, block_cols)
    row["taylor_max_err_over_eps_vs_float64"] = float((out_t[rows].double() - ref_c).abs().max() / eps)
    row["direct_max_err_over_eps_vs_float64"] = float((out_direct[rows].double() - ref_b).abs().max() / eps)
    row["pairs_streamed_direct"] = float((rng[..., 1] - rng[..., 0]).clamp_min(0).double().sum()) * bm
    sweep = []
    if args.sweep:  # (BLOCK_K, BLOCK_J, RS, stages, warps) of the "dot" moments kernel, M against this run's
        global MOMENT_BK, MOMENT_BJ, MOMENT_RS, MOMENT_STAGES, MOMENT_WARPS
        tay.moments(g_old, lb)
        m_ref, s_ref = tay.m.clone(), tay.sig.clone()
        for bk, bj, rs, st, wp in [(64, 16, 1, 1, 4), (64, 32, 1, 1, 4), (128, 16, 1, 1, 8), (64, 16, 1, 2, 4),
                                   (128, 32, 1, 1, 8), (64, 16, 1, 1, 8)]:
            MOMENT_BK, MOMENT_BJ, MOMENT_RS, MOMENT_STAGES, MOMENT_WARPS = bk, bj, rs, st, wp
            cfg = {"BLOCK_K": bk, "BLOCK_J": bj, "RS": rs, "stages": st, "warps": wp, "f16": F16}
            try:
                tay.m.zero_()
                tay.moments(g_old, lb)
                cfg["m_rel_diff"] = float((tay.m - m_ref).norm() / m_ref.norm())
                cfg["sig_max_diff"] = float((tay.sig - s_ref).abs().max())
                cfg["ms"] = statistics.median(cuda_median_ms(lambda: tay.moments(g_old, lb), reps=5)[1])
            except Exception as exc:  # a configuration that does not compile or run: recorded
                cfg["failure"] = repr(exc)[:200]
            print(json.dumps(cfg), flush=True)
            sweep.append(cfg)
        MOMENT_BK, MOMENT_BJ, MOMENT_RS, MOMENT_STAGES, MOMENT_WARPS = 64, 16, 1, 1, 4
        global EVAL_BI, EVAL_BL, STAGES, EVAL_WARPS
        tay.moments(g_old, lb)
        for bi, bl, st, wp in [(128, 64, 2, 8), (128, 64, 3, 8), (128, 128, 2, 8), (64, 64, 3, 4), (64, 128, 2, 4),
                               (128, 64, 2, 4), (64, 64, 2, 8), (128, 32, 3, 8)]:
            EVAL_BI, EVAL_BL, STAGES, EVAL_WARPS = bi, bl, st, wp
            cfg = {"eval_BLOCK_I": bi, "eval_BLOCK_L": bl, "stages": st, "warps": wp, "f16": F16}
            try:
                o = tay.lse(f_new)
                cfg["out_max_diff_over_eps"] = float((o - out_t).abs().max() / eps)
                cfg["ms"] = statistics.median(cuda_median_ms(lambda: tay.lse(f_new), reps=5)[1])
            except Exception as exc:
                cfg["failure"] = repr(exc)[:200]
            print(json.dumps(cfg), flush=True)
            sweep.append(cfg)
    print(json.dumps(row, indent=1), flush=True)
    name = torch.cuda.get_device_name().lower().replace(" ", "-")
    with open(os.path.join(HERE, "results", f"probe_taylor_lse_{name}.json"), "w") as fh:
        json.dump({"env": environment(), "rows": [row], "moments_sweep": sweep}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
