"""Benchmark: fused mHC Sinkhorn-Knopp vs the naive PyTorch loop (eager and torch.compile).

    python bench/bench_mhc.py                 # the issue's table -> bench/results/mhc_<device>.json
    python bench/bench_mhc.py --quick         # B = 4096 and 65536 only
    python bench/bench_mhc.py --headline      # B = 2^20, n = 4 only -> bench/results/mhc_headline_<device>.json
    python bench/bench_mhc.py --sweep         # launch-plan sweep -> bench/results/mhc_sweep_<device>.json
    python bench/bench_mhc.py --dry-run       # CPU/interpreter, tiny sizes: checks the script only

Sizes: B in {4096, 65536, 2^20}, n in {4, 8, 16}, T = 20 iterations, float32.
Modes: forward only, and forward + backward (gradient of sum(W * P) w.r.t. the
logits, W fixed). Methods, in the same process on the same inputs:

* ``fused``: the DEFAULT call ``torch_api.mhc_sinkhorn(m, 20)`` (no option
  switched off: unrolled backward, check_finite=False, which is the default
  and never synchronizes the host);
* ``fused_checked``: the same with check_finite=True (the on-request check: one
  isfinite reduction and a host sync per call);
* ``fused_implicit``: backward="implicit" (forward + backward only);
* ``eager``: the naive loop (P = exp(M); T x (P / colsum, P / rowsum)), autograd;
* ``compile``: torch.compile of the same function (default mode, static shapes, compiled afresh per size).

Times: ``ms``, the median of triton.testing.do_bench (L2 flushed between runs;
host time included: a call that launches faster than the GPU runs is timed by
its host side, e.g. the ~0.3 ms of autograd + launches of the fused
forward + backward at small B); ``graph_ms``, the median of
triton.testing.do_bench_cudagraph (the same call captured in a CUDA graph and
replayed: GPU time only, no L2 flush; every method but ``fused_checked``,
whose host sync cannot be captured).
Achieved bandwidth is counted against the memory floor: forward 2 x 4 n^2
bytes per matrix (read logits, write result), forward + backward 5 x 4 n^2
(plus read logits and output gradient, write input gradient) = 320 B at n = 4.
Errors over the first 4096 matrices against a float64 loop (result, or
gradient): Frobenius relative error, and the worst matrix's error over the
mean matrix norm. Peers that would not fit in memory are
skipped and recorded as such.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import torch_api  # noqa: E402,F401  (configures the runtime: before triton.testing, which
from torch_api import mhc_sinkhorn  # noqa: E402  # breaks the interpreter if imported first)

import triton  # noqa: E402
from triton.testing import do_bench, do_bench_cudagraph  # noqa: E402

ITERS = 20
SIZES_B = [4096, 65536, 1 << 20]
SIZES_N = [4, 8, 16]
CHECK_B = 4096
CHAIN_LAYERS = 4  # run_chain: torch.compile's autograd keeps ~80 tensors of B n^2 floats per layer
DEVICE = "cuda"


def naive(m: torch.Tensor, iters: int = ITERS) -> torch.Tensor:
    p = torch.exp(m)
    for _ in range(iters):
        p = p / p.sum(-2, keepdim=True)
        p = p / p.sum(-1, keepdim=True)
    return p


def ref64(m, iters=ITERS):
    return naive(m.double(), iters)


def floor_bytes(n: int, mode: str) -> int:
    return (2 if mode == "fwd" else 5) * 4 * n * n


def errors(x, ref) -> dict:
    """rel_err: Frobenius norm of the error over that of ref (the checked matrices together);
    worst_matrix_err: largest per-matrix error norm over the mean per-matrix norm of ref."""
    x = x.detach().double().reshape(-1, *x.shape[-2:])
    ref = ref.reshape(x.shape)
    diff = (x - ref).flatten(1).norm(dim=1)
    if not torch.isfinite(diff).all():
        return dict(rel_err=float("inf"), worst_matrix_err=float("inf"))
    return dict(rel_err=(diff.norm() / ref.norm()).item(),
                worst_matrix_err=(diff.max() / ref.flatten(1).norm(dim=1).mean()).item())


# what each method calls, recorded in the JSON ("fused" is the default call, nothing switched off)
TIMED_CALLS = {
    "fused": f"torch_api.mhc_sinkhorn(m, {ITERS})  # defaults: backward='unrolled', start='cols', "
             "eps=0.0, check_finite=False",
    "fused_checked": f"torch_api.mhc_sinkhorn(m, {ITERS}, check_finite=True)",
    "fused_implicit": f"torch_api.mhc_sinkhorn(m, {ITERS}, backward='implicit')",
    "eager": "naive(m): P = exp(M); 20 x (P / colsum, P / rowsum), autograd",
    "compile": "torch.compile(naive, dynamic=False)(m)",
}


def make_fns(method: str, compiled):
    """(forward fn, forward+backward fn) of one method; each takes (logits, weight)."""
    if method == "fused":
        def f(m):
            return mhc_sinkhorn(m, ITERS)  # the default call
    elif method == "fused_checked":
        def f(m):
            return mhc_sinkhorn(m, ITERS, check_finite=True)
    elif method == "fused_implicit":
        def f(m):
            return mhc_sinkhorn(m, ITERS, backward="implicit")
    elif method == "eager":
        f = naive
    elif method == "compile":
        f = compiled
    else:
        raise ValueError(method)

    def fwd(m, w):
        with torch.no_grad():
            return f(m)

    def fwd_bwd(m, w):
        return torch.autograd.grad(f(m), m, w)[0]

    return fwd, fwd_bwd


def peer_fits(method: str, batch: int, n: int, mode: str) -> bool:
    """Rough memory guard for the naive loop (autograd keeps ~4 tensors per iteration)."""
    if not method.startswith(("eager", "compile")) or DEVICE != "cuda":
        return True
    tensor = batch * n * n * 4
    live = (4 * ITERS + 4) * tensor if mode == "fwd_bwd" else 6 * tensor
    free, _ = torch.cuda.mem_get_info()
    return live < 0.6 * free


def sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def bench_one(fn, m, w, warmup, rep):
    if DEVICE == "cuda":
        return do_bench(lambda: fn(m, w), warmup=warmup, rep=rep, return_mode="median")
    times = []  # dry run: wall clock, 3 calls
    for _ in range(3):
        t0 = time.perf_counter()
        fn(m, w)
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[1]


def device_name():
    return torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu-interpreter-dry-run"


def run_table(args):
    dev = device_name()
    methods = ["fused", "fused_checked", "fused_implicit", "eager", "compile"]
    compiled = None
    if args.dry_run:
        methods.remove("compile")  # inductor on CPU is not what this script measures
        sizes_b, sizes_n = [64], [4, 8]
    else:
        sizes_b, sizes_n = (SIZES_B[:2] if args.quick else SIZES_B), SIZES_N
        if args.headline:
            sizes_b, sizes_n = [2 ** 20], [4]
    rows = []
    gen = torch.Generator(device=DEVICE)
    gen.manual_seed(0)
    t_start = time.time()
    for n in sizes_n:
        for batch in sizes_b:
            m = torch.randn(batch, n, n, device=DEVICE, generator=gen).requires_grad_(True)
            w = torch.randn(batch, n, n, device=DEVICE, generator=gen)
            msub = m.detach()[:CHECK_B]
            wsub = w[:CHECK_B]
            r_out = ref64(msub)
            md = msub.double().requires_grad_(True)
            (r_grad,) = torch.autograd.grad(ref64(md), md, wsub.double())
            if not args.dry_run:
                # A fresh static-shape compile per (B, n): what a user's model with fixed shapes
                # gets. dynamic=True (or the recompile limit falling back to it) produces generic
                # kernels several times slower, which would flatter the fused kernel.
                torch._dynamo.reset()
                compiled = torch.compile(naive, dynamic=False)
            for method in methods:
                fwd, fwd_bwd = make_fns(method, compiled)
                for mode, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                    if method == "fused_implicit" and mode == "fwd":
                        continue
                    row = dict(method=method, mode=mode, B=batch, n=n, iters=ITERS, dtype="float32")
                    if not peer_fits(method, batch, n, mode):
                        row.update(skipped="estimated memory above 60% of free GPU memory")
                        rows.append(row)
                        continue
                    try:
                        t0 = time.time()
                        res = fn(m, w)  # warm up / compile
                        sync()
                        row["first_call_s"] = round(time.time() - t0, 3)
                        ms = bench_one(fn, m, w, args.warmup, args.rep)
                    except torch.OutOfMemoryError as e:  # pragma: no cover - device dependent
                        torch.cuda.empty_cache()
                        row.update(skipped=f"OOM: {str(e).splitlines()[0]}")
                        rows.append(row)
                        continue
                    if DEVICE == "cuda" and method != "fused_checked":
                        try:
                            row["graph_ms"] = do_bench_cudagraph(lambda: fn(m, w), rep=args.rep,
                                                                 return_mode="median")
                        except Exception as e:  # pragma: no cover - device dependent
                            row["graph_error"] = str(e).splitlines()[0][:200]
                            torch.cuda.synchronize()
                    nbytes = floor_bytes(n, mode) * batch
                    row.update(
                        ms=ms,
                        floor_bytes_per_matrix=floor_bytes(n, mode),
                        achieved_GBps=nbytes / (ms * 1e-3) / 1e9,
                        **errors(res[:CHECK_B], r_out if mode == "fwd" else r_grad),
                    )
                    rows.append(row)
                    print(f"n={n:2d} B={batch:8d} {mode:7s} {method:15s} {ms:9.4f} ms "
                          f"(graph {row.get('graph_ms', float('nan')):9.4f} ms) "
                          f"{row['achieved_GBps']:8.1f} GB/s  err {row['rel_err']:.1e}", flush=True)
                    del res
            del m, w, msub, md, r_out, r_grad
            if DEVICE == "cuda":
                torch.cuda.empty_cache()
    # speedups of fused over the peers
    by = {(r["method"], r["mode"], r["B"], r["n"]): r for r in rows if "ms" in r}
    summary = []
    for (method, mode, batch, n), r in sorted(by.items()):
        if method != "fused":
            continue
        s = dict(mode=mode, B=batch, n=n, fused_ms=r["ms"])
        for peer in ("eager", "compile", "fused_checked", "fused_implicit"):
            p = by.get((peer, mode, batch, n))
            if p:
                s[f"{peer}_ms"] = p["ms"]
                if peer in ("eager", "compile"):
                    s[f"speedup_vs_{peer}"] = p["ms"] / r["ms"]
                    if p.get("graph_ms") and r.get("graph_ms"):
                        s[f"{peer}_graph_ms"] = p["graph_ms"]
                        s[f"graph_speedup_vs_{peer}"] = p["graph_ms"] / r["graph_ms"]
        summary.append(s)
    floor_row = by.get(("fused", "fwd_bwd", 1 << 20, 4))
    comp_row = by.get(("compile", "fwd_bwd", 1 << 20, 4))
    target = None
    if floor_row and comp_row:
        target = dict(
            requirement="forward+backward at B=2^20, n=4: at least 30x faster than torch.compile",
            timed_call=TIMED_CALLS["fused"], compile_call=TIMED_CALLS["compile"],
            fused_ms=floor_row["ms"], compile_ms=comp_row["ms"],
            speedup=comp_row["ms"] / floor_row["ms"], met=comp_row["ms"] / floor_row["ms"] >= 30,
        )
        if floor_row.get("graph_ms") and comp_row.get("graph_ms"):
            g = comp_row["graph_ms"] / floor_row["graph_ms"]
            target.update(fused_graph_ms=floor_row["graph_ms"], compile_graph_ms=comp_row["graph_ms"],
                          graph_speedup=g, met_gpu_time=g >= 30)
    return dict(device=dev, rows=rows, summary=summary, target=target,
                timed_calls={k: TIMED_CALLS[k] for k in methods},
                wall_s=round(time.time() - t_start, 1))


def run_sweep(args):
    """Launch-plan sweep at B = 2^20 (forward and unrolled backward kernels called directly)."""
    from ot_triton_jax.core.kernels.mhc import (mhc_backward_implicit_kernel,
                                           mhc_backward_unrolled_kernel, mhc_forward_kernel)
    from ot_triton_jax.core.mhc_plans import mhc_plan

    batch = 1 << 20
    kernels = {"forward": mhc_forward_kernel, "unrolled": mhc_backward_unrolled_kernel,
               "implicit": mhc_backward_implicit_kernel}
    grid_cfgs = {
        4: [dict(soa=True, num_warps=w, seg=s) for w in (1, 2, 4, 8) for s in (7, 20)]
           + [dict(soa=False, block_b=b, seg=20) for b in (16, 32, 64)],
        8: [dict(soa=False, block_b=b, seg=s, num_warps=w) for b in (16, 32, 64)
            for s in (5, 10) for w in (2, 4)] + [dict(soa=True, num_warps=w) for w in (2, 4)],
        16: [dict(soa=False, block_b=b, seg=s, num_warps=w) for b in (8, 16, 32)
             for s in (4, 5, 10) for w in (4, 8)],
    }
    rows = []
    params = torch.zeros(1, device="cuda")
    for n, cfgs in grid_cfgs.items():
        m = torch.randn(batch, n, n, device="cuda")
        g = torch.randn(batch, n, n, device="cuda")
        out = torch.empty_like(m)
        md = m[:CHECK_B].double().requires_grad_(True)
        (r_grad,) = torch.autograd.grad(ref64(md), md, g[:CHECK_B].double())
        for kind in ("forward", "unrolled", "implicit"):
            seen = set()
            for cfg in cfgs:
                if cfg.get("soa") and kind != "forward" and n > 4:
                    continue  # per-entry code at n = 8: minutes of compile, register-bound
                c = dict(cfg)
                if kind != "unrolled":
                    c.pop("seg", None)
                key = tuple(sorted(c.items()))
                if key in seen:
                    continue
                seen.add(key)
                plan = mhc_plan(kind, batch, n, ITERS, False, False, True, **c)
                args_in = (m, params, batch) if kind == "forward" else (m, g, params, batch)

                def call(plan=plan, kind=kind, args_in=args_in, out=out):
                    kernels[kind][plan.grid](*args_in, out, num_warps=plan.num_warps,
                                             num_stages=plan.num_stages, **plan.constexprs)
                try:
                    t0 = time.time()
                    call()
                    torch.cuda.synchronize()
                    compile_s = time.time() - t0
                    ms = do_bench(call, warmup=args.warmup, rep=args.rep, return_mode="median")
                except Exception as e:  # pragma: no cover - device dependent
                    rows.append(dict(n=n, kind=kind, cfg=c, error=str(e)[:300]))
                    continue
                err = errors(out[:CHECK_B], r_grad)["rel_err"] if kind == "unrolled" else None
                rows.append(dict(n=n, kind=kind, cfg=c, ms=ms, compile_s=round(compile_s, 2),
                                 constexprs=dict(plan.constexprs), num_warps=plan.num_warps,
                                 unrolled_rel_err=err))
                print(f"n={n:2d} {kind:9s} {c} {ms:.4f} ms (compile {compile_s:.1f}s)", flush=True)
        del m, g, out
        torch.cuda.empty_cache()
    return dict(device=torch.cuda.get_device_name(), B=batch, rows=rows)


def run_chain(args):
    """A stack of CHAIN_LAYERS mHC layers, x_{l+1} = mhc(x_l), at B = 2^20, n = 4: one forward
    through all layers and one torch.autograd.grad for all of them, as in a model that calls
    mHC at every layer. The autograd engine hands work to its device thread once per
    backward call, not once per layer, so per-layer host overhead is what a model pays.
    Fused and torch.compile (of the per-layer naive loop) on the same inputs; ms per layer."""
    batch, n, layers = 1 << 20, 4, CHAIN_LAYERS
    gen = torch.Generator(device="cuda")
    gen.manual_seed(1)
    m = torch.randn(batch, n, n, device="cuda", generator=gen).requires_grad_(True)
    w = torch.randn(batch, n, n, device="cuda", generator=gen)
    torch._dynamo.reset()
    compiled = torch.compile(naive, dynamic=False)
    md = m.detach()[:CHECK_B].double().requires_grad_(True)
    x = md
    for _ in range(layers):
        x = ref64(x)
    (r_grad,) = torch.autograd.grad(x, md, w[:CHECK_B].double())
    rows = []
    for method, f in (("fused", lambda v: mhc_sinkhorn(v, ITERS)), ("compile", compiled)):
        def fwd_bwd(m, w, f=f):
            x = m
            for _ in range(layers):
                x = f(x)
            return torch.autograd.grad(x, m, w)[0]
        res = fwd_bwd(m, w)
        sync()
        ms = do_bench(lambda: fwd_bwd(m, w), warmup=args.warmup, rep=args.rep, return_mode="median")
        graph_ms = do_bench_cudagraph(lambda: fwd_bwd(m, w), rep=args.rep, return_mode="median")
        row = dict(method=method, mode="fwd_bwd_chain", layers=layers, B=batch, n=n, iters=ITERS,
                   ms_per_layer=ms / layers, graph_ms_per_layer=graph_ms / layers,
                   **errors(res[:CHECK_B], r_grad))
        rows.append(row)
        print(row, flush=True)
        del res
    by = {r["method"]: r for r in rows}
    return dict(rows=rows, timed_calls={k: TIMED_CALLS[k] for k in ("fused", "compile")},
                speedup_per_layer=by["compile"]["ms_per_layer"] / by["fused"]["ms_per_layer"],
                graph_speedup_per_layer=by["compile"]["graph_ms_per_layer"] / by["fused"]["graph_ms_per_layer"])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="skip B = 2^20")
    ap.add_argument("--sweep", action="store_true", help="launch-plan sweep instead of the table")
    ap.add_argument("--warmup", type=int, default=10, help="do_bench warmup (ms)")
    ap.add_argument("--rep", type=int, default=40, help="do_bench repetition time (ms)")
    ap.add_argument("--chain-only", action="store_true", help="only the stacked-layers measurement")
    ap.add_argument("--headline", action="store_true", help="only B = 2^20, n = 4 (the issue's target row)")
    ap.add_argument("--out", default=None, help="output JSON path")
    ap.add_argument("--dry-run", action="store_true",
                    help="no GPU: tiny sizes on the Triton interpreter, to check the script")
    args = ap.parse_args()
    global DEVICE
    if args.dry_run:
        DEVICE = "cpu"
        if args.sweep:
            sys.exit("--sweep needs a CUDA GPU")
    elif not torch.cuda.is_available():
        sys.exit("bench_mhc.py needs a CUDA GPU (or --dry-run)")
    if args.sweep:
        result = run_sweep(args)
    elif args.chain_only:
        result = dict(device=device_name(), chain=run_chain(args))
    else:
        result = run_table(args)
        if not args.dry_run and not args.quick and not args.headline:
            result["chain"] = run_chain(args)
    result.update(
        torch=torch.__version__, triton=triton.__version__, python=platform.python_version(),
        cuda=torch.version.cuda, iters=ITERS, dry_run=bool(args.dry_run),
        timer="triton.testing.do_bench median, L2 flushed",
        floor="forward 2*4*n^2 B/matrix, forward+backward 5*4*n^2 B/matrix (320 B at n=4)",
    )
    name = device_name().replace(" ", "_").replace("/", "_")
    kind = "_sweep" if args.sweep else ("_chain" if args.chain_only else ("_headline" if args.headline else ""))
    out = args.out or os.path.join(HERE, "results", f"mhc{kind}_{name}.json")
    if args.dry_run and args.out is None:
        out = os.path.join("/tmp", f"mhc_{name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    print("wrote", out)
    if result.get("target"):
        print("target:", result["target"])


if __name__ == "__main__":
    main()
