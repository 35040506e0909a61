"""Shared helpers for the benchmark scripts: timing, environment record, JSON output."""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import time

import torch

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def cuda_median_ms(fn, reps: int = 5, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of fn() in ms, measured with CUDA events (synchronised per rep)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times), times


def wall_median_ms(fn, reps: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of fn() in ms (fn must block until its result is ready), and all times."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def graph_ms(fn, calls: int = 10, reps: int = 10) -> float:
    """GPU time of one fn() in ms: ``calls`` calls captured in a CUDA graph, median of ``reps`` replays."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    t, _ = cuda_median_ms(graph.replay, reps=reps)
    return t / calls


def environment() -> dict:
    import triton
    env = {
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    # Versions from package metadata: importing jax_triton here would clear TRITON_CACHE_DIR.
    from importlib import metadata
    for name in ("flash-sinkhorn", "jax", "ott-jax", "geomloss", "jax-triton"):
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # peer not installed: recorded as absent
            env[name] = None
    return env


def device_tag() -> str:
    name = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    return "h100" if "H100" in name else ("h200" if "H200" in name else name.split()[-1].lower())


def write(name: str, payload: dict, full_device_name: bool = False) -> str:
    """Write bench/results/<name>_<device>.json; <device> is device_tag() ("h100"), or with
    ``full_device_name`` the whole lower-cased device name ("nvidia-h100-80gb-hbm3", the later probes' files)."""
    os.makedirs(RESULTS, exist_ok=True)
    tag = torch.cuda.get_device_name().lower().replace(" ", "-") if full_device_name else device_tag()
    path = os.path.join(RESULTS, f"{name}_{tag}.json")
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)
    return path


def f64_sinkhorn(x, y, iters: int, eps: float, chunk: int = 2048):
    """OTT-convention alternating iterations in float64 (uniform weights, zero init), dense in
    row chunks on the inputs' device. Returns (f, g, reg_ot_cost)."""
    n, m = x.shape[0], y.shape[0]
    X, Y = x.double(), y.double()
    xn, yn = (X * X).sum(1), (Y * Y).sum(1)
    la, lb = math.log(1.0 / n), math.log(1.0 / m)

    def half(src, srcn, tgt, tgtn, pot, logw):
        out = torch.empty(src.shape[0], dtype=torch.float64, device=src.device)
        for i in range(0, src.shape[0], chunk):
            C = srcn[i:i + chunk, None] + tgtn[None] - 2 * src[i:i + chunk] @ tgt.T
            out[i:i + chunk] = eps * logw - eps * torch.logsumexp((pot[None] - C) / eps, 1)
        return out

    f = torch.zeros(n, dtype=torch.float64, device=x.device)
    g = torch.zeros(m, dtype=torch.float64, device=x.device)
    for _ in range(iters):
        g = half(Y, yn, X, xn, f, lb)
        f = half(X, xn, Y, yn, g, la)
    cost = (f.mean() - eps * la) + (g.mean() - eps * lb)  # + eps (1 - sum P), sum P = sum a = 1
    return f, g, float(cost)
