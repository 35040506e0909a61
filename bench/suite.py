"""Benchmark suite (issue 16, item 4): ours against the peers, one process, same inputs, one command.

Workloads (randn clouds from fixed CPU seeds, uniform weights; each row times the call a user makes
with default options; the non-default precision="tf32" is a row of its own beside it):

* ``sinkhorn_10it``: torch_api.sinkhorn, eps 0.1, min = max = inner_iterations = 10, n = m in
  {8192, 65536} x d in {3, 64} and 262144 x 3; peers: flash-sinkhorn 0.4.1 alternating (allow_tf32
  matching), at n <= 8192 OTT-JAX 0.6.0 dense and online (``batch_size`` 1024, with the runtime patch
  OTT's online mode needs on this JAX; matmul precision "highest" / "tensorfloat32").
* ``jax_sinkhorn_100it``: jitted ot_triton_jax.sinkhorn, 8192 x 64, min = max = 100; peers: OTT dense and
  online, "highest".
* ``samples_loss_grad``: torch_api.SamplesLoss loss + gradient in x (scaling 0.5, debias), 8192 x 3 at
  blur 0.05, 16384 x 16 at blur 0.1; peers: flash-sinkhorn SamplesLoss (fp32, tf32), GeomLoss tensorized.

Errors (relative): Sinkhorn f on 512 sampled rows against float64 of the same iterations;
SamplesLoss gradient and loss against GeomLoss tensorized in float64. Times: medians of CUDA events
(JAX: wall time around block_until_ready) after warm-up; a non-finite output is a failure, never a
time. No workload starts once ~540 s are gone. Writes bench/results/suite_<device>.json and plots.

Peers' autotuning: flash-sinkhorn autotunes each new shape (~590 s of a run without its results,
bench/NOTES.md 66). The suite turns Triton's autotuning cache on and keeps the results in
bench/results/flash_autotune (restored before a run, new ones added after it), so the
whole suite fits one 10-minute device call on the machine that made them.

Floors (``floor_ms``): per LSE half-step the largest of n m exponentials at the exp2 rate, 2 n m d
flop per tensor-core product (3 products for "float32", a split; 1 for "tf32") at the FP16 rate (the
kernels' operands, launch_plans.fp16_operands; the TF32 rate for TF32 parts), one FP32 add per pair, and the clouds
and potentials read once from HBM; times the half-steps.

    python bench/suite.py [--quick] [--dry-run] [--only PATTERN]
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from dataclasses import dataclass
from typing import Callable

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
# flash-sinkhorn autotunes its kernels at each new shape (most of the suite's time): its choices are
# kept on disk and reused (autotune_cache below), so the whole suite fits one device call
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:  # torch_api, ot_triton_jax without PYTHONPATH
    sys.path.append(os.path.dirname(HERE))
from common import cuda_median_ms, environment, f64_sinkhorn, wall_median_ms, write  # noqa: E402

from ot_triton_jax.core.launch_plans import fp16_operands  # noqa: E402  (no framework)
from ot_triton_jax.core.schedules import epsilon_schedule  # noqa: E402  (numpy only)

# Measured on the H100: ../shared/gpu/README.md, "Hardware floors measured on the H100" (2026-11-22).
EXP2_RATE = 4.17e12   # exp2 per s (special-function units, Triton kernel)
TF32_RATE = 369e12    # TF32 flop per s (cuBLAS TF32 GEMM 8192^3)
FP16_RATE = 686e12    # FP16 flop per s (cuBLAS BF16 GEMM 8192^3; FP16 runs at the same rate)
FMA_RATE = 32.6e12    # FP32 FMA per s (Triton kernel)
HBM_RATE = 3.03e12    # bytes per s (HBM copy)
CONSTANTS = {"exp2_per_s": EXP2_RATE, "tf32_flop_per_s": TF32_RATE, "fp16_flop_per_s": FP16_RATE,
             "fp32_fma_per_s": FMA_RATE,
             "hbm_bytes_per_s": HBM_RATE, "source": "../shared/gpu/README.md, H100 micro-benchmarks 2026-11-22"}
# "float32" runs the cross term as three tensor-core products of split operands, "tf32" as one;
# on FP16 parts (twice the TF32 rate; TF32 parts where launch_plans.fp16_operands says no)
TF32_PRODUCTS = {"float32": 3, "tf32": 1}
FP32_OPS_PER_PAIR = 1  # the running sum's add: the exp2 argument can come out of the tensor cores
WORKLOADS = ("sinkhorn_10it", "jax_sinkhorn_100it", "samples_loss_grad")
PRECISIONS = {**dict.fromkeys(WORKLOADS, ("float32", "tf32")), "jax_sinkhorn_100it": ("float32",)}
CALLS = {"sinkhorn_10it": "torch_api.sinkhorn(x, y, epsilon={eps}, min_iterations=10, max_iterations=10, "
                          "inner_iterations=10{prec})",
         "jax_sinkhorn_100it": "jax.jit(lambda x, y: ot_triton_jax.sinkhorn(x, y, epsilon={eps}, min_iterations=100, "
                               "max_iterations=100))",
         "samples_loss_grad": 'torch.autograd.grad(torch_api.SamplesLoss("sinkhorn", p=2, blur={blur}, '
                              'scaling={scaling}{prec})(x, y), x)'}
FLASH_CALL = "sinkhorn_flashstyle_alternating(x, y, a, b, eps={eps}, n_iters=10, allow_tf32={tf32}, " \
             "ott_convention=True)"
EPS, SCALING, SMALL, BUDGET_S = 0.1, 0.5, 8192, 540.0
OTT_PRECISION = {"float32": "highest", "tf32": "tensorfloat32"}
OTT_ONLINE_BATCH = 1024  # PointCloud(batch_size=...): OTT's online (streamed) cost, never n x m
GEOMLOSS_10IT_NOTE = ("not timed: GeomLoss has no fixed-iteration alternating (OTT-convention) solve; its "
                      "loop is symmetric averaged updates with eps-scaling, a different computation")


def half_step_seconds(n: int, m: int, d: int, precision: str) -> dict[str, float]:
    """Lower bounds in seconds of one LSE half-step over n x m pairs, one per unit."""
    pairs = n * m
    rate = FP16_RATE if fp16_operands(d) else TF32_RATE
    return {"exp2": pairs / EXP2_RATE, "tensor": TF32_PRODUCTS[precision] * 2.0 * pairs * d / rate,
            "fp32_fma": FP32_OPS_PER_PAIR * pairs / FMA_RATE, "hbm": (n + m) * (d + 2) * 4 / HBM_RATE}


def floor_ms(workload: str, n: int, m: int, d: int, precision: str, half_steps: int) -> tuple[float, str]:
    """(floor in ms, the unit that bounds it) of ``half_steps`` LSE half-steps (half_step_seconds).
    samples_loss_grad's self terms (x-x, y-y) are counted as n x m pairs: it needs n == m."""
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}")
    if workload == "samples_loss_grad" and n != m:
        raise ValueError("samples_loss_grad floors assume n == m")
    terms = half_step_seconds(n, m, d, precision)
    unit = max(terms, key=terms.__getitem__)
    return half_steps * terms[unit] * 1e3, unit


def samples_loss_half_steps(diameter: float, blur: float, scaling: float) -> int:
    """GeomLoss's debiased anneal + gradient in x: with L = len(epsilon_schedule(2, diameter, blur,
    scaling)), L + 2 sweeps (initialisation, one per eps, the final extrapolation) of 4 softmins
    (x<-y, y<-x, x<-x, y<-y), then 2 backward passes (the plans P y and Q x), each counted as one
    half-step (a lower bound: a plan pass also multiplies by the points): 4 (L + 2) + 2."""
    return 4 * (len(epsilon_schedule(2, diameter, blur, scaling)) + 2) + 2


@dataclass(frozen=True)
class Item:
    workload: str
    n: int
    d: int
    est_s: float  # expected seconds on the H100, first-call compiles included (the budget check)
    blur: float = 0.0

    @property
    def label(self) -> str:
        return f"{self.workload} n={self.n} d={self.d}"


# cheap first, so that a run over budget drops the largest sizes; est_s: the item wall times of the
# session-16 H100 run (bench/results/suite_h100.json, item_wall_s; the first item carries the imports),
# not guesses. Most of each is flash-sinkhorn's first-call autotuning (bench/NOTES.md 66): without its
# kept results (autotune_cache) the whole plan takes ~700 s, two device calls (--only ... --merge).
PLAN = (Item("sinkhorn_10it", 8192, 3, 65), Item("sinkhorn_10it", 8192, 64, 60),
        Item("jax_sinkhorn_100it", 8192, 64, 10), Item("samples_loss_grad", 8192, 3, 120, 0.05),
        Item("samples_loss_grad", 16384, 16, 125, 0.1), Item("sinkhorn_10it", 65536, 3, 28),
        Item("sinkhorn_10it", 65536, 64, 40), Item("sinkhorn_10it", 262144, 3, 235))


def peers_for(item: Item, precision: str) -> list[str]:
    if item.workload == "jax_sinkhorn_100it":
        return ["ott_dense_highest", "ott_online_highest"]
    peers = ["flash_sinkhorn_fp32" if precision == "float32" else "flash_sinkhorn_tf32"]
    if item.workload == "sinkhorn_10it" and item.n <= SMALL:
        peers += [f"ott_dense_{OTT_PRECISION[precision]}", f"ott_online_{OTT_PRECISION[precision]}"]
    if precision == "float32" and (item.workload == "samples_loss_grad" or item.n <= SMALL):
        peers.append("geomloss_tensorized")
    return peers


def item_clouds(item: Item) -> tuple[torch.Tensor, torch.Tensor]:
    gen, shift = torch.Generator().manual_seed(item.n + item.d), float(item.workload == "samples_loss_grad") / 2
    return torch.randn(item.n, item.d, generator=gen), torch.randn(item.n, item.d, generator=gen) + shift


def half_steps(item: Item) -> int:
    if item.workload != "samples_loss_grad":  # a g- and an f-update per iteration, then the final
        # marginal check (OTT's; the earlier checks ride on the g-updates)
        return 2 * (100 if item.workload == "jax_sinkhorn_100it" else 10) + 1
    pts = torch.cat(item_clouds(item)).double()  # GeomLoss's diameter: the joint bounding box's diagonal
    return samples_loss_half_steps(float((pts.max(0).values - pts.min(0).values).norm()), item.blur, SCALING)


def _failed(exc: BaseException, call: str | None = None) -> dict:
    return {"ms": None, "failure": repr(exc)[:400], "call": call}


def measure(fn: Callable, pick: Callable[..., tuple], errors: Callable[..., dict], kind: str, reps: int,
            warmup: int, call: str | None = None) -> dict:
    """Median ms of fn() after warm-up (kind "cuda": CUDA events; "wall": fn must block); then the
    tensors pick(last result) must be finite, and errors(*those tensors) is recorded."""
    box, t0 = {}, time.perf_counter()
    try:
        median = cuda_median_ms if kind == "cuda" else wall_median_ms
        ms = median(lambda: box.__setitem__("out", fn()), reps=reps, warmup=warmup)[0]
        wall = time.perf_counter() - t0  # first calls (compiles, autotune) and the repetitions
        outs = pick(box["out"])
        if not all(bool(torch.isfinite(t).all()) for t in outs):
            return {"ms": None, "failure": "non-finite output", "call": call, "wall_s": wall}
        return {"ms": ms, "call": call, "wall_s": wall, **errors(*outs)}
    except Exception as exc:  # recorded in the row, never fatal
        return dict(_failed(exc, call), wall_s=time.perf_counter() - t0)


def jax_pair(out) -> tuple[torch.Tensor, torch.Tensor]:
    return tuple(torch.from_numpy(np.array(v)).cuda() for v in out)


def f_errors(x: torch.Tensor, y: torch.Tensor, iters: int) -> Callable[..., dict]:
    """errors(f, g): f's relative error on 512 sampled rows against float64 of the same iterations."""
    ref = f64_sinkhorn(x, y, iters, EPS)[0]
    rows = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(0))[:512].cuda()
    return lambda f, g: {"error": float((f[rows].double() - ref[rows]).norm() / ref[rows].norm())}


def ott_solve(x: torch.Tensor, y: torch.Tensor, iters: int, matmul_precision: str, errors, reps: int,
              online: bool = False) -> dict:
    """OTT-JAX PointCloud Sinkhorn, min = max = iters, jitted, on the same points: dense, or online
    (``batch_size``; OTT 0.6.0's online mode needs jax.interpreters.batching.is_vmappable, which
    newer JAX moved: restored from jax._src, the patch in ../shared/gpu/README.md)."""
    batch = OTT_ONLINE_BATCH if online else None
    call = (f"Sinkhorn(min_iterations={iters}, max_iterations={iters}, inner_iterations=10)(LinearProblem("
            f"PointCloud(x, y, epsilon={EPS}{f', batch_size={batch}' if online else ''}))), jitted, "
            f"jax.default_matmul_precision({matmul_precision!r})")
    try:
        import jax
        if online:
            import jax._src.interpreters.batching as batching_src
            import jax.interpreters.batching as batching
            if not hasattr(batching, "is_vmappable"):
                batching.is_vmappable = batching_src.is_vmappable
        from ott.geometry import pointcloud
        from ott.problems.linear import linear_problem
        from ott.solvers.linear import sinkhorn as ott_sinkhorn
        xj, yj = jax.numpy.asarray(x.cpu().numpy()), jax.numpy.asarray(y.cpu().numpy())
        solver = ott_sinkhorn.Sinkhorn(min_iterations=iters, max_iterations=iters, inner_iterations=10)

        @jax.jit
        def solve(x, y):
            out = solver(linear_problem.LinearProblem(pointcloud.PointCloud(x, y, epsilon=EPS, batch_size=batch)))
            return out.f, out.g

        with jax.default_matmul_precision(matmul_precision):  # traced and run under it
            return measure(lambda: jax.block_until_ready(solve(xj, yj)), jax_pair, errors, "wall", reps, 2, call)
    except Exception as exc:
        return _failed(exc, call)


def run_sinkhorn(item: Item) -> dict:
    import torch_api
    n, reps = item.n, (10 if item.n <= SMALL else 5 if item.n <= 65536 else 3)
    x, y = (t.cuda() for t in item_clouds(item))
    a = torch.full((n,), 1.0 / n, device="cuda")
    t0 = time.perf_counter()
    errors, out = f_errors(x, y, 10), {}
    print(f"  {item.label}: float64 reference in {time.perf_counter() - t0:.1f} s", flush=True)
    try:
        from flash_sinkhorn.sinkhorn_solvers import sinkhorn_flashstyle_alternating as flash
    except Exception as exc:  # absent: its rows say so
        flash = exc
    for prec in PRECISIONS[item.workload]:
        kw = {} if prec == "float32" else {"precision": prec}
        # two warm-ups: a shape's first solve compiles, its second captures the CUDA graphs
        out[prec, "ours"] = measure(lambda: torch_api.sinkhorn(x, y, epsilon=EPS, min_iterations=10, max_iterations=10,
                                                               inner_iterations=10, **kw),
                                    lambda o: (o.f, o.g), errors, "cuda", reps, 2)
        for peer in peers_for(item, prec):
            if peer.startswith("flash"):
                tf32 = prec == "tf32"
                call = FLASH_CALL.format(eps=EPS, tf32=tf32)
                out[prec, peer] = _failed(flash, call) if isinstance(flash, Exception) else measure(
                    lambda: flash(x, y, a, a, eps=EPS, n_iters=10, allow_tf32=tf32, ott_convention=True),
                    lambda o: tuple(o[:2]), errors, "cuda", reps, 1 if n > 65536 else 2, call)
            elif peer.startswith("ott"):
                out[prec, peer] = ott_solve(x, y, 10, OTT_PRECISION[prec], errors, reps, online="online" in peer)
    return out


def run_jax_sinkhorn(item: Item) -> dict:
    import jax
    import ot_triton_jax as otj
    xc, yc = item_clouds(item)
    errors = f_errors(xc.cuda(), yc.cuda(), 100)
    xj, yj = jax.numpy.asarray(xc.numpy()), jax.numpy.asarray(yc.numpy())
    fn = jax.jit(lambda x, y: otj.sinkhorn(x, y, epsilon=EPS, min_iterations=100, max_iterations=100))
    ours = measure(lambda: jax.block_until_ready(fn(xj, yj)), lambda o: jax_pair((o.f, o.g)), errors, "wall", 15, 2)
    return {("float32", "ours"): ours, ("float32", "ott_dense_highest"): ott_solve(xc, yc, 100, "highest", errors, 15),
            ("float32", "ott_online_highest"): ott_solve(xc, yc, 100, "highest", errors, 15, online=True)}


def loss_and_grad(loss, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xg = x.detach().clone().requires_grad_(True)
    value = loss(xg, y)
    (grad,) = torch.autograd.grad(value, xg)
    return value.detach(), grad


def samples_loss(who: str, blur: float, precision: str) -> tuple[torch.nn.Module, str | None]:
    """(loss module, its call for the row: None for ours); raises when the peer is absent."""
    if who == "ours":
        import torch_api
        return torch_api.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=SCALING, precision=precision), None
    kw = dict(p=2, blur=blur, scaling=SCALING, debias=True)
    if who == "geomloss_tensorized":
        import geomloss
        kw.update(backend="tensorized")
        return geomloss.SamplesLoss("sinkhorn", **kw), f"geomloss.SamplesLoss('sinkhorn', **{kw})"
    from flash_sinkhorn.samples_loss import SamplesLoss as FlashLoss
    kw.update(half_cost=True, allow_tf32=who.endswith("tf32"))
    return FlashLoss("sinkhorn", **kw), f"flash_sinkhorn.samples_loss.SamplesLoss('sinkhorn', **{kw})"


def run_samples_loss(item: Item) -> dict:
    x, y = (t.cuda() for t in item_clouds(item))
    t0 = time.perf_counter()
    try:  # the float64 reference: GeomLoss tensorized
        ref = loss_and_grad(samples_loss("geomloss_tensorized", item.blur, "float32")[0], x.double(), y.double())
    except Exception as exc:
        ref = exc
    print(f"  {item.label}: float64 reference in {time.perf_counter() - t0:.1f} s", flush=True)

    def errors(value, grad):
        if isinstance(ref, Exception):
            return {"error": None, "note": f"no float64 reference (GeomLoss): {ref!r}"[:300]}
        return {"error": float((grad.double() - ref[1]).norm() / ref[1].norm()),
                "error_loss": abs(float(value) - float(ref[0])) / abs(float(ref[0]))}

    out = {}
    for prec in PRECISIONS[item.workload]:
        for who in ["ours"] + peers_for(item, prec):
            try:
                loss, call = samples_loss(who, item.blur, prec)
            except Exception as exc:  # an absent peer
                out[prec, who] = _failed(exc)
                continue
            # two warm-ups: a shape's first solve compiles, its second captures the CUDA graph
            out[prec, who] = measure(lambda: loss_and_grad(loss, x, y), tuple, errors, "cuda", 10, 2, call)
    return out


RUNNERS = {"sinkhorn_10it": run_sinkhorn, "jax_sinkhorn_100it": run_jax_sinkhorn, "samples_loss_grad": run_samples_loss}


def plan_rows(item: Item, results: dict | None = None) -> list[dict]:
    """The item's rows, one per (precision, peer); with results, their times and errors."""
    results, hs, rows = results or {}, half_steps(item), []
    for prec in PRECISIONS[item.workload]:
        fl, unit = floor_ms(item.workload, item.n, item.n, item.d, prec, hs)
        ours = results.get((prec, "ours"), {})
        call = CALLS[item.workload].format(eps=EPS, blur=item.blur, scaling=SCALING,
                                           prec="" if prec == "float32" else f', precision="{prec}"')
        for peer in peers_for(item, prec):
            res = results.get((prec, peer), {})
            if item.workload == "sinkhorn_10it" and peer == "geomloss_tensorized":
                res = {"ms": None, "note": GEOMLOSS_10IT_NOTE}
            ms, pms = ours.get("ms"), res.get("ms")
            row = {"workload": item.workload, "n": item.n, "m": item.n, "d": item.d, "precision": prec,
                   "eps": item.blur ** 2 if item.blur else EPS, "half_steps": hs, "ours_ms": ms,
                   "ours_failure": ours.get("failure"), "peer": peer, "peer_ms": pms, "peer_error": res.get("failure"),
                   "speedup": pms / ms if ms and pms else None, "floor_ms": fl, "floor_unit": unit,
                   "fraction_of_floor": fl / ms if ms else None, "error": ours.get("error"),
                   "peer_error_vs_f64": res.get("error"), "default_call": call,
                   "peer_call": res.get("call"), "note": res.get("note") or ours.get("note"),
                   "ours_wall_s": ours.get("wall_s"), "peer_wall_s": res.get("wall_s")}
            if item.workload == "samples_loss_grad":
                row.update(blur=item.blur, scaling=SCALING, error_loss=ours.get("error_loss"),
                           peer_error_loss_vs_f64=res.get("error_loss"))
            rows.append(row)
    return rows


def plot(rows: list[dict], stem: str) -> list[str]:
    """Log-log time vs n of sinkhorn_10it, one figure per d: ours (float32, tf32), each peer, the floors."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for d in sorted({r["d"] for r in rows if r["workload"] == "sinkhorn_10it"}):
        series: dict[str, dict[int, float]] = {}
        for r in (r for r in rows if r["workload"] == "sinkhorn_10it" and r["d"] == d):
            for name, ms in ((f"ours {r['precision']}", r["ours_ms"]), (r["peer"], r["peer_ms"]),
                             (f"floor {r['precision']}", r["floor_ms"])):
                if ms is not None:
                    series.setdefault(name, {})[r["n"]] = ms
        fig, ax = plt.subplots(figsize=(6, 4.5))
        for name, pts in sorted(series.items()):
            ax.plot(sorted(pts), [pts[k] for k in sorted(pts)], "--x" if name[:5] == "floor" else "-o", label=name)
        ax.set(xscale="log", yscale="log", xlabel="n = m", ylabel="ms per solve (10 iterations)",
               title=f"sinkhorn, eps {EPS}, d = {d}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
        paths.append(f"{stem}_sinkhorn_d{d}.png")
        fig.savefig(paths[-1], dpi=120, bbox_inches="tight")
        plt.close(fig)
    return paths


def print_rows(rows: list[dict]) -> None:
    fmt = lambda v, spec: "-" if v is None else format(v, spec)  # noqa: E731
    print(f"{'workload':<19} {'n':>6} {'d':>3} {'prec':<7} {'peer':<26} {'steps':>5} {'floor ms':>9} {'unit':<8} "
          f"{'ours ms':>8} {'peer ms':>8} {'x':>5} {'of floor':>8} {'error':>7}")
    for r in rows:
        print(f"{r['workload']:<19} {r['n']:>6} {r['d']:>3} {r['precision']:<7} {r['peer']:<26} {r['half_steps']:>5} "
              f"{r['floor_ms']:>9.3f} {r['floor_unit']:<8} {fmt(r['ours_ms'], '8.2f'):>8} "
              f"{fmt(r['peer_ms'], '8.2f'):>8} {fmt(r['speedup'], '5.2f'):>5} "
              f"{fmt(r['fraction_of_floor'], '8.3f'):>8} {fmt(r['error'], '7.1e'):>7}", flush=True)


AUTOTUNE_DIR = os.path.join(HERE, "results", "flash_autotune")


def autotune_cache(restore: bool) -> int:
    """Copy the peers' Triton autotuning results (``*.autotune.json``, one per kernel and tuning key,
    under their cache key) from bench/results/flash_autotune into Triton's cache directory
    (``restore``), or back from it after a run. The cache key holds the Triton version, the GPU
    target, the kernel's source and the tuned configurations, so a result only serves the same
    software on the same GPU model; elsewhere the peer autotunes as on a first call. The timed calls
    run the configuration the peer's own autotuner picked on this device model either way.
    Returns the files copied."""
    import glob
    import shutil

    import triton
    cache = triton.knobs.cache.dir
    src, dst = (AUTOTUNE_DIR, cache) if restore else (cache, AUTOTUNE_DIR)
    copied = 0
    for path in glob.glob(os.path.join(src, "*", "*.autotune.json")):
        target = os.path.join(dst, os.path.relpath(path, src))
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(path, target)
            copied += 1
    return copied


def load_previous() -> dict:
    """The full suite JSON of this device (``--merge``), or {} when there is none."""
    import json

    from common import RESULTS, device_tag
    path = os.path.join(RESULTS, f"suite_{device_tag()}.json")
    if not os.path.exists(path):
        return {}
    with open(path) as fh:
        return json.load(fh)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="only the n <= 8192 rows")
    ap.add_argument("--dry-run", action="store_true", help="print the planned rows and floors; measure nothing")
    ap.add_argument("--only", metavar="PATTERN", help="regular expression searched in 'WORKLOAD n=N d=D'")
    ap.add_argument("--merge", action="store_true",
                    help="update the full suite JSON: its rows of the items run now are replaced, the others kept "
                         "(a suite split over several device calls); the JSON lists each part's run")
    args = ap.parse_args(argv)
    items = [it for it in PLAN if (not args.quick or it.n <= SMALL) and re.search(args.only or "", it.label)]
    if args.dry_run:
        rows = [r for it in items for r in plan_rows(it)]
        print(f"suite dry run (writes nothing): {len(items)} workloads, {len(rows)} rows; floors at the H100 rates")
        print_rows(rows)
        return 0
    if not torch.cuda.is_available():
        print("bench/suite.py: no CUDA device; run it on the GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    t0, rows, skipped, env = time.perf_counter(), [], [], environment()
    env["autotune_results_restored"] = autotune_cache(restore=True)
    name = "suite" if args.merge or not (args.quick or args.only) else "suite_partial"  # a partial run keeps the full one
    kept, runs = [], []
    if args.merge:
        old = load_previous()
        labels = {it.label for it in items}
        kept = [r for r in old.get("rows", []) if f"{r['workload']} n={r['n']} d={r['d']}" not in labels]
        runs = [run for run in old.get("runs", []) if set(run["items"]) - labels]

    def payload() -> dict:
        this = {"items": [it.label for it in items], "env": env, "elapsed_s": time.perf_counter() - t0,
                "skipped": skipped}
        return {"env": env, "constants": CONSTANTS, "budget_s": BUDGET_S, "elapsed_s": time.perf_counter() - t0,
                "skipped": skipped, "rows": kept + rows, "runs": runs + [this],
                "note": "floors use the H100 rates on any device; errors: relative, vs float64 (module docstring)"}

    for it in items:
        elapsed = time.perf_counter() - t0
        if elapsed + it.est_s > BUDGET_S:
            skipped.append(f"{it.label}: time budget ({elapsed:.0f} s gone, ~{it.est_s:.0f} s needed)")
            print("skipped", skipped[-1], flush=True)
            continue
        try:
            results = RUNNERS[it.workload](it)
        except Exception as exc:  # the inputs or the reference failed: every row of the item says so
            results = {(p, who): _failed(exc) for p in PRECISIONS[it.workload] for who in ["ours"] + peers_for(it, p)}
        new = [dict(r, item_wall_s=time.perf_counter() - t0 - elapsed) for r in plan_rows(it, results)]
        rows += new
        print_rows(new)
        torch.cuda.empty_cache()
        write(name, payload())  # after every workload: a run cut short still leaves its rows
    path = write(name, payload())
    print("autotuning results kept:", autotune_cache(restore=False), "new files in", AUTOTUNE_DIR, flush=True)
    try:
        figs = plot(kept + rows, path[:-5] if path.endswith(".json") else path)
    except Exception as exc:  # the JSON is written: a plotting failure is reported, not fatal
        figs = [f"plotting failed: {exc!r}"]
    print("wrote", path, *figs, f"in {time.perf_counter() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
