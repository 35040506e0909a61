"""Shared helpers for the benchmark scripts: timing, environment record, JSON output."""

from __future__ import annotations

import json
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


def write(name: str, payload: dict) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, f"{name}_{device_tag()}.json")
    with open(path, "w") as fh:
        json.dump(payload, fh, indent=1)
    return path
