"""Batched small-matrix Sinkhorn-Knopp (mHC): ``torch_api.mhc_sinkhorn`` against the PyTorch loop, eager and compiled.

Workloads: B x n x n float32 logits (randn, CUDA generator seed 0), T = 20 iterations; B in {4096,
65536, 2^20} x n in {4, 8, 16} (``--quick``: B in {4096, 65536} and the B = 2^20, n = 4 row).

* ``mhc_fwd``: the forward under ``torch.no_grad()``;
* ``mhc_fwd_bwd``: forward + backward, ``torch.autograd.grad(P, logits, W)`` with a fixed randn W;
* ``mhc_chain`` (not in ``--quick``): a stack of 4 layers x_{l+1} = mhc(x_l) at B = 2^20, n = 4, one
  forward through all and one ``autograd.grad`` for all (per-layer host overhead, as in a model);
  times per layer.

Methods, in one process on the same inputs: ``ours``, the default call ``torch_api.mhc_sinkhorn(m, 20)``
(unrolled exact backward, no host sync); ``eager``, the loop P = exp(M), 20 x (P / colsum,
P / rowsum) with autograd; ``compile``, ``torch.compile(loop, dynamic=False)``, compiled afresh per
(B, n) (static shapes, what a model with fixed shapes gets). Peers whose autograd tape would not fit
in 60% of free memory are skipped and say so.

Gate: over the first 4096 matrices, the Frobenius relative error of the result (forward) or of the
gradient against the same loop in float64, at most 1e-4. Times: ``ms``, the median of
``triton.testing.do_bench`` (L2 flushed between calls; host time included, so a call that launches
slower than the GPU runs is timed by its host side); ``graph_ms`` beside it, the median of
``do_bench_cudagraph`` (the call captured in a CUDA graph: GPU time only). Floor: memory
(floors.mhc_floor_bytes: 2 x 4 n^2 bytes per matrix forward, 5 x 4 n^2 forward + backward) at the
HBM rate; ``achieved_GBps`` = those bytes over the time.

    python -m bench.areas.mhc [--quick] [--dry-run] [--tiny]

Takes ~150 s on an H100, most of it torch.compile (``--quick`` ~60 s).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.floors import mhc_floor_bytes, mhc_floor_ms  # noqa: E402

AREA, ITERS, CHECK_B, LAYERS, TOLERANCE = "mhc", 20, 4096, 4, 1e-4
SIZES_B, SIZES_N = (4096, 65536, 1 << 20), (4, 8, 16)
ERROR_OF = "result (fwd) or gradient (fwd_bwd) of the first 4096 matrices vs the float64 loop"
CALLS = {"ours": f"torch_api.mhc_sinkhorn(m, {ITERS})", "eager": "loop(m): P = exp(M); 20 x (P / colsum, P / rowsum)",
         "compile": "torch.compile(loop, dynamic=False)(m)"}


def loop(m: torch.Tensor, iters: int = ITERS) -> torch.Tensor:
    p = torch.exp(m)
    for _ in range(iters):
        p = p / p.sum(-2, keepdim=True)
        p = p / p.sum(-1, keepdim=True)
    return p


def errors(x: torch.Tensor, ref: torch.Tensor) -> dict:
    """error: Frobenius norm of the error over that of ref; worst_matrix_err: the largest per-matrix
    error over the mean per-matrix norm of ref."""
    x = x.detach().double().reshape(-1, *x.shape[-2:])
    diff = (x - ref.reshape(x.shape)).flatten(1).norm(dim=1)
    if not torch.isfinite(diff).all():
        return {"failure": "non-finite output"}
    return {"error": float(diff.norm() / ref.norm()),
            "worst_matrix_err": float(diff.max() / ref.reshape(x.shape).flatten(1).norm(dim=1).mean())}


def sizes(quick: bool) -> list[tuple[int, int]]:
    return [(b, n) for n in SIZES_N for b in SIZES_B if not quick or b < (1 << 20) or n == 4]


def rows_for(workload: str, batch: int, n: int, results: dict) -> list[dict]:
    rows = []
    for method in ("ours", "eager", "compile"):
        res = results.get(method, {})
        extra = {}
        if workload != "mhc_chain":
            mode = workload[4:]
            extra = dict(floor_ms=mhc_floor_ms(batch, n, mode), floor_unit="hbm",
                         floor_bytes_per_matrix=mhc_floor_bytes(n, mode),
                         achieved_GBps=batch * mhc_floor_bytes(n, mode) / (res["ms"] * 1e-3) / 1e9 if res.get("ms") else None)
        label = f"B={batch} n={n}" + (f" layers={LAYERS}" if workload == "mhc_chain" else "")
        rows.append(harness.row(workload, label, {"B": batch, "n": n, "iters": ITERS}, method, CALLS[method], res,
                                tolerance=TOLERANCE, error_of=ERROR_OF, ours=method == "ours", default=method == "ours",
                                compare_to=None if method == "ours" else "ours", **extra))
    return rows


def timer(fn, device: str) -> dict:
    if device != "cuda":  # CPU check: wall clock, 3 calls
        return {"ms": harness.wall_median_ms(fn, reps=3, warmup=1)[0]}
    from triton.testing import do_bench, do_bench_cudagraph
    out = {"ms": do_bench(fn, warmup=10, rep=40, return_mode="median")}
    try:
        out["graph_ms"] = do_bench_cudagraph(fn, rep=40, return_mode="median")
    except Exception as exc:  # recorded beside the time
        out["graph_error"] = str(exc).splitlines()[0][:200]
        torch.cuda.synchronize()
    return out


def fits(method: str, batch: int, n: int, mode: str, device: str) -> bool:
    """Rough memory guard for the loop (its autograd keeps ~4 tensors per iteration)."""
    if method == "ours" or device != "cuda":
        return True
    tensor = batch * n * n * 4
    live = (4 * ITERS + 4) * tensor if mode != "fwd" else 6 * tensor
    return live < 0.6 * torch.cuda.mem_get_info()[0]


def measure_size(batch: int, n: int, device: str, compile_peer: bool = True) -> dict:
    """{workload: {method: result}} for mhc_fwd and mhc_fwd_bwd at one (B, n)."""
    import time

    import torch_api
    gen = torch.Generator(device=device).manual_seed(0)
    m = torch.randn(batch, n, n, device=device, generator=gen).requires_grad_(True)
    w = torch.randn(batch, n, n, device=device, generator=gen)
    md = m.detach()[:CHECK_B].double().requires_grad_(True)
    ref = {"mhc_fwd": loop(md).detach()}
    ref["mhc_fwd_bwd"] = torch.autograd.grad(loop(md), md, w[:CHECK_B].double())[0]
    fns = {"ours": lambda v: torch_api.mhc_sinkhorn(v, ITERS), "eager": loop}
    if compile_peer:
        torch._dynamo.reset()
        fns["compile"] = torch.compile(loop, dynamic=False)
    out = {"mhc_fwd": {}, "mhc_fwd_bwd": {}}
    for method, f in fns.items():
        for workload in out:
            if not fits(method, batch, n, workload[4:], device):
                out[workload][method] = {"ms": None, "failure": "skipped: estimated memory above 60% of free GPU memory"}
                continue

            def call(f=f, workload=workload):
                if workload == "mhc_fwd":
                    with torch.no_grad():
                        return f(m)
                return torch.autograd.grad(f(m), m, w)[0]
            try:
                t0 = time.perf_counter()
                res = call()  # first call: compiles
                first = time.perf_counter() - t0
                out[workload][method] = dict(timer(call, device), first_call_s=first,
                                             **errors(res[:CHECK_B], ref[workload]))
            except Exception as exc:  # e.g. out of memory: the row says so
                out[workload][method] = harness.failed(exc)
                if device == "cuda":
                    torch.cuda.empty_cache()
    return out


def measure_chain(device: str = "cuda") -> dict:
    import torch_api
    batch, n = 1 << 20, 4
    gen = torch.Generator(device=device).manual_seed(1)
    m = torch.randn(batch, n, n, device=device, generator=gen).requires_grad_(True)
    w = torch.randn(batch, n, n, device=device, generator=gen)
    md = x = m.detach()[:CHECK_B].double().requires_grad_(True)
    for _ in range(LAYERS):
        x = loop(x)
    ref = torch.autograd.grad(x, md, w[:CHECK_B].double())[0]
    torch._dynamo.reset()
    out = {}
    for method, f in (("ours", lambda v: torch_api.mhc_sinkhorn(v, ITERS)), ("eager", loop),
                      ("compile", torch.compile(loop, dynamic=False))):
        def fwd_bwd(f=f):
            x = m
            for _ in range(LAYERS):
                x = f(x)
            return torch.autograd.grad(x, m, w)[0]
        if not fits(method, batch * LAYERS, n, "fwd_bwd", device):
            out[method] = {"ms": None, "failure": "skipped: estimated memory above 60% of free GPU memory"}
            continue
        try:
            res = fwd_bwd()
            t = timer(fwd_bwd, device)
            out[method] = dict({k: v / LAYERS for k, v in t.items() if k.endswith("ms")}, **errors(res[:CHECK_B], ref))
        except Exception as exc:
            out[method] = harness.failed(exc)
    return out


def plan(quick: bool) -> list[dict]:
    rows = [r for b, n in sizes(quick) for wl in ("mhc_fwd", "mhc_fwd_bwd") for r in rows_for(wl, b, n, {})]
    return harness.planned(rows + ([] if quick else rows_for("mhc_chain", 1 << 20, 4, {})))


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    rows = []
    for batch, n in sizes(quick):
        if not budget.fits(f"mhc B={batch} n={n}", 15):
            continue
        res = measure_size(batch, n, "cuda")
        rows += [r for wl in ("mhc_fwd", "mhc_fwd_bwd") for r in rows_for(wl, batch, n, res[wl])]
        emit(rows)
        torch.cuda.empty_cache()
    if not quick and budget.fits("mhc_chain", 30):
        rows += rows_for("mhc_chain", 1 << 20, 4, measure_chain())
    return rows


def tiny() -> list[dict]:
    """B = 64, n = 4 on the CPU (Triton interpreter), without torch.compile."""
    res = measure_size(64, 4, "cpu", compile_peer=False)
    return [r for wl in res for r in rows_for(wl, 64, 4, res[wl]) if r["method"] != "compile"]


main = harness.cli(AREA, __doc__, plan, run, tiny)

if __name__ == "__main__":
    sys.exit(main())
