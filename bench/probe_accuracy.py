"""GPU probe: where the float32 LSE loses accuracy against OTT-JAX's float32 pipeline, and what
the fixed-shift loop (FOLD) gains at d = 64 with one column range per row block.

1. Cross-term schemes. A probe kernel computes the whole n x n matrix <x_i, y_j> on the
   tensor cores with several schemes built from the pre-split TF32 operands (the library's
   is S0); each is compared with float64 (rms, mean, slope of the error against <x, y>).
2. Solver-level effect. The points never change during a solve, so each scheme's <x, y>
   matrix is computed once and 100 OTT-convention iterations (eps = 0.1, uniform weights)
   are run in float32 torch arithmetic that follows lse_update_kernel step by step
   (t = c <x,y> + b_j, running max, exp2, log2); errors of f, g (also with the free shift
   removed) and of the cost against float64 iterations, as bench_jax_sinkhorn.py reports
   them. Rows: the real kernels (check of the emulation), the emulation with each scheme,
   with the exactly rounded <x, y>, with the float32 epilogue of the kernels before
   this probe, and OTT's float32 formation (C = |x|^2 + |y|^2 - 2 x y^T
   from an SGEMM, then (g - C)/eps and logsumexp).
3. kappa: the library's cross term against float64 for d from 3 to 256 and three point
   distributions (the truncating tensor-core accumulation shrinks <x, y> by a relative kappa).
4. FOLD at d = 64 with SPLIT = 1 (several tiles): one f-update (CUDA graph, 10 calls) and a
   whole 100-iteration torch_api.sinkhorn, against the default plan.

    python bench/probe_accuracy.py [--n 8192] [--parts accuracy,kappa,fold] [--tag T]
        -> bench/results/probe_accuracy[_T]_<device>.json
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch
import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_median_ms, environment, graph_ms, f64_sinkhorn, write  # noqa: E402

import torch_api  # noqa: E402
from ot_triton_jax.core import launch_plans  # noqa: E402
from ot_triton_jax.core.kernels.tiles import cross_tile_dot, dot_x3, load_rows  # noqa: E402
from torch_api.kernel_ops import Cloud, clouds, lse_update, params  # noqa: E402

EPS = 0.1
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
DEV = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: interpreter smoke run
SCHEMES = {
    0: "x3 chained from 0 (library)",
    1: "ieee FMA",
    2: "x3 chained from a constant B (one binade), minus B",
    3: "hi*hi and the two tails in separate accumulators, summed",
    4: "x3 plus lo*lo",
    5: "hi*hi in two K halves and the tails, three accumulators summed",
    6: "hi*hi first, then the tails",
}


@triton.jit
def xy_kernel(X, XH, XL, Y, YH, YL, OUT, n, m, B,
              SCHEME: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              BLOCK_K: tl.constexpr, D: tl.constexpr):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mm, mn = offs_m < n, offs_n < m
    zero = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SCHEME == 0:  # the library's tile, chunks of BLOCK_K columns
        acc = cross_tile_dot(XH, XL, YH, YL, offs_m, offs_n, mm, mn, D, BLOCK_M, BLOCK_N, BLOCK_K, "tf32x3")
    elif SCHEME == 5:
        H: tl.constexpr = BLOCK_K // 2
        xa, xb = load_rows(XH, offs_m, mm, D, 0, H), load_rows(XH, offs_m, mm, D, H, H)
        ya, yb = load_rows(YH, offs_n, mn, D, 0, H), load_rows(YH, offs_n, mn, D, H, H)
        h1 = tl.dot(xa, tl.trans(ya), zero, input_precision="tf32")
        h2 = tl.dot(xb, tl.trans(yb), zero, input_precision="tf32")
        xh, xl = load_rows(XH, offs_m, mm, D, 0, BLOCK_K), load_rows(XL, offs_m, mm, D, 0, BLOCK_K)
        yh, yl = load_rows(YH, offs_n, mn, D, 0, BLOCK_K), load_rows(YL, offs_n, mn, D, 0, BLOCK_K)
        c = tl.dot(xl, tl.trans(yh), zero, input_precision="tf32")
        c = tl.dot(xh, tl.trans(yl), c, input_precision="tf32")
        acc = (h1 + h2) + c
    else:
        xh, xl = load_rows(XH, offs_m, mm, D, 0, BLOCK_K), load_rows(XL, offs_m, mm, D, 0, BLOCK_K)
        yh, yl = load_rows(YH, offs_n, mn, D, 0, BLOCK_K), load_rows(YL, offs_n, mn, D, 0, BLOCK_K)
        if SCHEME == 1:
            x, y = load_rows(X, offs_m, mm, D, 0, BLOCK_K), load_rows(Y, offs_n, mn, D, 0, BLOCK_K)
            acc = tl.dot(x, tl.trans(y), zero, input_precision="ieee")
        elif SCHEME == 2:
            acc = dot_x3(xh, xl, yh, yl, zero + B) - B
        elif SCHEME == 3:
            hh = tl.dot(xh, tl.trans(yh), zero, input_precision="tf32")
            c = tl.dot(xl, tl.trans(yh), zero, input_precision="tf32")
            c = tl.dot(xh, tl.trans(yl), c, input_precision="tf32")
            acc = hh + c
        elif SCHEME == 4:
            acc = dot_x3(xh, xl, yh, yl, tl.dot(xl, tl.trans(yl), zero, input_precision="tf32"))
        else:
            acc = tl.dot(xh, tl.trans(yh), zero, input_precision="tf32")
            acc = tl.dot(xl, tl.trans(yh), acc, input_precision="tf32")
            acc = tl.dot(xh, tl.trans(yl), acc, input_precision="tf32")
    tl.store(OUT + offs_m[:, None] * m + offs_n[None, :], acc, mask=mm[:, None] & mn[None, :])


def xy_matrix(X: Cloud, Y: Cloud, scheme: int) -> torch.Tensor:
    n, m, d = X.n, Y.n, X.d
    bound = float(X.x.norm(dim=1).max() * Y.x.norm(dim=1).max())
    B = 1.5 * 2.0 ** (math.ceil(math.log2(bound)) + 1)
    out = torch.empty(n, m, device=DEV)
    bk = max(16, min(64, triton.next_power_of_2(d)))
    xy_kernel[(triton.cdiv(n, 128), triton.cdiv(m, 128))](
        X.x, X.hi, X.lo, Y.x, Y.hi, Y.lo, out, n, m, B, SCHEME=scheme, BLOCK_M=128, BLOCK_N=128,
        BLOCK_K=bk, D=d, num_warps=8, num_stages=1)
    return out


def xy_stats(v: torch.Tensor, ref: torch.Tensor) -> dict:
    e = v.double() - ref
    kappa = -float((e * ref).sum() / (ref * ref).sum())  # e ~ -kappa <x, y>
    resid = e + kappa * ref
    return {"rms": float(e.pow(2).mean().sqrt()), "mean": float(e.mean()), "max": float(e.abs().max()),
            "kappa": kappa, "rms_after_slope": float(resid.pow(2).mean().sqrt()),
            "corr_with_xy": float((e * ref).mean() / (e.std() * ref.std()))}


# ---- float32 emulation of one half-step (lse_update_kernel, online loop) -------------------

def f32(v):
    return torch.tensor(v, dtype=torch.float32, device=DEV)


def ours_half(xy, src_n, tgt_n, pot, logw, eps, epi64=True, chunk=1024):
    """xy is (src rows, tgt cols). Follows kernels/lse.py: float32 ops, t by one FMA, the
    epilogue in float64 (``epi64=False``: the float32 epilogue of the earlier kernels)."""
    inv_eps = f32(1.0) / f32(eps)
    coef2 = f32(2.0) * f32(1.0) * inv_eps * f32(LOG2E)
    bias2 = ((pot - tgt_n) * inv_eps) * f32(LOG2E)
    out = torch.empty(xy.shape[0], device=DEV)
    for i in range(0, xy.shape[0], chunk):
        t = (xy[i:i + chunk].double() * coef2.double() + bias2.double()[None]).float()
        mx = t.max(1).values
        l2s = torch.log2(torch.exp2(t - mx[:, None]).sum(1))
        xn, lw = src_n[i:i + chunk], logw[i:i + chunk]
        if epi64:
            lse = (mx.double() + l2s.double()) * LN2 - xn.double() * inv_eps.double()
            out[i:i + chunk] = (-float(f32(eps)) * lse + float(f32(eps)) * lw.double()).float()
        else:
            lse = (mx + l2s) * f32(LN2) - xn * inv_eps
            out[i:i + chunk] = -f32(eps) * lse + f32(eps) * lw
    return out


def ott_half(C, pot, logw, eps, chunk=1024):
    """OTT 0.6's float32 formation: logsumexp((g - C) / eps) on an SGEMM-built C."""
    out = torch.empty(C.shape[0], device=DEV)
    for i in range(0, C.shape[0], chunk):
        z = (pot[None] - C[i:i + chunk]) / f32(eps)
        out[i:i + chunk] = f32(eps) * logw[i:i + chunk] - f32(eps) * torch.logsumexp(z, 1)
    return out


def solve(half_f, half_g, n, m, iters):
    f = torch.zeros(n, device=DEV)
    g = torch.zeros(m, device=DEV)
    for _ in range(iters):
        g = half_g(f)
        f = half_f(g)
    return f, g


def errors(f, g, ref, rows, la, lb):
    fr, gr, cr = ref
    f, g = f.double(), g.double()
    cost = float((f.mean() - EPS * la) + (g.mean() - EPS * lb))
    shift = float((f - fr).mean())
    rel = lambda u, v: float((u[rows] - v[rows]).norm() / v[rows].norm())  # noqa: E731
    return {"err_f": rel(f, fr), "err_g": rel(g, gr), "err_f_shift_removed": rel(f - shift, fr),
            "err_g_shift_removed": rel(g + shift, gr), "err_cost": abs(cost - cr) / abs(cr)}


def accuracy(n, d, iters, out):
    torch.manual_seed(0)
    x, y = torch.randn(n, d, device=DEV), torch.randn(n, d, device=DEV)
    X, Y = clouds(x, y)
    ref = f64_sinkhorn(x, y, iters, EPS)
    rows = torch.randperm(n, device=DEV)[:512]
    la = lb = math.log(1.0 / n)
    lav = torch.full((n,), la, device=DEV)
    exact = x.double() @ y.double().T

    prm = params(EPS, 1.0, DEV)
    f, g = solve(lambda g_: lse_update(X, Y, g_, prm, "float32", logw_out=lav)[0],
                 lambda f_: lse_update(Y, X, f_, prm, "float32", logw_out=lav)[0], n, n, iters)
    out.append(dict(part="solve", variant="kernel (library lse_update)", **errors(f, g, ref, rows, la, lb)))
    print(out[-1], flush=True)

    torch.backends.cuda.matmul.allow_tf32 = False
    sgemm = x @ y.T
    variants = {"exact <x,y> rounded to float32": exact.float(), "sgemm <x,y>": sgemm}
    for sch, name in SCHEMES.items():
        v = xy_matrix(X, Y, sch)
        st = xy_stats(v, exact)
        out.append(dict(part="xy", scheme=sch, name=name, d=d, **st))
        print(out[-1], flush=True)
        variants[f"S{sch}: {name}"] = v
        if sch == 0:
            variants[f"S0 scaled by 1 + kappa (kappa = {st['kappa']:.3g})"] = v * (1.0 + st["kappa"])
    out.append(dict(part="xy", scheme="sgemm", name="torch float32 matmul (no TF32)", d=d,
                    **xy_stats(sgemm, exact)))
    print(out[-1], flush=True)
    xn, yn = X.sqnorm, Y.sqnorm
    for name, v in variants.items():
        vt = v.T.contiguous()
        for epi64 in (True, False) if name.startswith(("exact", "S0:")) else (True,):
            f, g = solve(lambda g_: ours_half(v, xn, yn, g_, lav, EPS, epi64),
                         lambda f_: ours_half(vt, yn, xn, f_, lav, EPS, epi64), n, n, iters)
            label = "" if epi64 else ", float32 epilogue"
            out.append(dict(part="solve", variant=f"emulated kernel, {name}{label}", **errors(f, g, ref, rows, la, lb)))
            print(out[-1], flush=True)
    C = xn[:, None] + yn[None] - 2.0 * sgemm
    CT = C.T.contiguous()
    f, g = solve(lambda g_: ott_half(C, g_, lav, EPS), lambda f_: ott_half(CT, f_, lav, EPS), n, n, iters)
    out.append(dict(part="solve", variant="OTT float32 formation (SGEMM C, logsumexp)",
                    **errors(f, g, ref, rows, la, lb)))
    print(out[-1], flush=True)


def kappa_table(out, n=2048):
    """The library's cross term (S0) against float64 for several d and point distributions."""
    for d in (3, 8, 16, 32, 64, 128, 256):
        for dist in ("randn", "uniform01", "randn+3"):
            torch.manual_seed(d)
            x, y = torch.randn(n, d, device=DEV), torch.randn(n, d, device=DEV)
            if dist == "uniform01":
                x, y = torch.rand(n, d, device=DEV), torch.rand(n, d, device=DEV)
            elif dist == "randn+3":
                x, y = x + 3.0, y + 3.0
            X, Y = clouds(x, y)
            st = xy_stats(xy_matrix(X, Y, 0), x.double() @ y.double().T)
            out.append(dict(part="kappa", d=d, dist=dist, **st))
            print(out[-1], flush=True)


def fold_split1(n, d, out):
    torch.manual_seed(1)
    x, y = torch.randn(n, d, device=DEV), torch.randn(n, d, device=DEV)
    X, Y = clouds(x, y)
    prm = params(EPS, 1.0, DEV)
    la = torch.full((n,), -math.log(n), device=DEV)
    sol = torch_api.sinkhorn(x, y, epsilon=EPS, min_iterations=5, max_iterations=5, inner_iterations=5)
    f, g = sol.f.contiguous(), sol.g.contiguous()
    base_ref, _ = lse_update(X, Y, g, prm, "float32", logw_out=la)
    kw = dict(epsilon=EPS, min_iterations=100, max_iterations=100, inner_iterations=10)

    def solve_ms():
        return cuda_median_ms(lambda: torch_api.sinkhorn(x, y, **kw), reps=5)[0]

    out.append(dict(part="fold", plan="default (online, split)", n=n, d=d,
                    half_step_ms=graph_ms(lambda: lse_update(X, Y, g, prm, "float32", logw_out=la)),
                    solve_100_ms=solve_ms()))
    print(out[-1], flush=True)
    saved = (dict(launch_plans.GPU_LSE), launch_plans.FOLD_PATHS, launch_plans.SM_TARGET)
    for bm, bn, w, s in [(64, 128, 4, 3), (64, 128, 4, 4), (64, 64, 4, 4), (64, 64, 4, 3), (64, 128, 8, 3)]:
        cfg = dict(BLOCK_M=bm, BLOCK_N=bn, num_warps=w, num_stages=s)
        launch_plans.GPU_LSE[("resident", "float32", "fold")] = cfg
        launch_plans.GPU_LSE[("resident", "float32", "small")] = cfg
        launch_plans.FOLD_PATHS = ("k16", "resident")
        launch_plans.SM_TARGET = 1  # SPLIT = 1
        launch_plans.lse_plan.cache_clear()
        rec = dict(part="fold", plan=f"fold split=1 {bm}x{bn} w{w} s{s}", n=n, d=d)
        try:
            res, _ = lse_update(X, Y, g, prm, "float32", logw_out=la, pold=f, compute_err=False, fold=True)
            rec["max_diff_over_max_abs"] = float((res - base_ref).abs().max() / base_ref.abs().max())
            rec["half_step_ms"] = graph_ms(lambda: lse_update(X, Y, g, prm, "float32", logw_out=la, pold=f,
                                                              compute_err=False, fold=True))
            rec["solve_100_ms"] = solve_ms()
        except Exception as exc:  # recorded, not hidden
            rec["error"] = repr(exc)[:300]
        out.append(rec)
        print(rec, flush=True)
    launch_plans.GPU_LSE.clear()
    launch_plans.GPU_LSE.update(saved[0])
    launch_plans.FOLD_PATHS, launch_plans.SM_TARGET = saved[1], saved[2]
    launch_plans.lse_plan.cache_clear()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=8192)
    ap.add_argument("--iters", type=int, default=100)
    ap.add_argument("--skip-fold", action="store_true")
    ap.add_argument("--parts", default="accuracy,kappa,fold")
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    rows: list = []
    payload = {"env": environment(), "schemes": SCHEMES, "eps": EPS, "results": rows}
    try:
        parts = args.parts.split(",")
        if "accuracy" in parts:
            accuracy(args.n, 64, args.iters, rows)
        if "kappa" in parts:
            kappa_table(rows)
        if "fold" in parts and not args.skip_fold:
            fold_split1(args.n, 64, rows)
    finally:
        print("wrote", write("probe_accuracy" + (f"_{args.tag}" if args.tag else ""), payload))


if __name__ == "__main__":
    main()
