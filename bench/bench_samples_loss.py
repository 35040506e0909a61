"""torch_api.SamplesLoss loss + gradient vs flash-sinkhorn 0.4.1 and GeomLoss 0.3.1, same process, same inputs.

Workloads (issue 16): GeomLoss's annealed debiased Sinkhorn, p = 2 (C = |x - y|^2 / 2),
scaling 0.5, randn clouds, uniform weights: n = m = 8192, d = 3, blur 0.05 and
n = m = 16384, d = 16, blur 0.1. Timed: ``loss(x, y)`` then ``backward()`` for x (the
call a user makes), medians of CUDA-event times after two warm-up calls (a shape's first
solve runs eagerly and compiles, its second captures the CUDA graph). Ours with default
options (float32) and, beside it, precision="tf32"; flash-sinkhorn's SamplesLoss
(backend "symmetric", debias, half_cost so that its cost is GeomLoss's) with fp32 and with
TF32 dot products; GeomLoss "tensorized" in float32.
Accuracy: loss and gradient against GeomLoss "tensorized" in float64 on the same inputs.

    python bench/bench_samples_loss.py [--quick]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_median_ms, environment, write  # noqa: E402

import torch_api  # noqa: E402

SCALING = 0.5


def loss_and_grad(loss, x, y):
    xg = x.detach().clone().requires_grad_(True)
    value = loss(xg, y)
    (grad,) = torch.autograd.grad(value, xg)
    return value.detach(), grad


def rel(u, v):
    u, v = u.double(), v.double()
    return float((u - v).norm() / v.norm())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first workload only")
    args = ap.parse_args()
    work = [(8192, 3, 0.05), (16384, 16, 0.1)][: 1 if args.quick else 2]
    peers = {}
    try:
        from flash_sinkhorn.samples_loss import SamplesLoss as FlashLoss
        for tf32 in (False, True):
            peers[f"flash_tf32{tf32}"] = lambda blur, tf32=tf32: FlashLoss(
                "sinkhorn", p=2, blur=blur, scaling=SCALING, debias=True, half_cost=True, allow_tf32=tf32)
    except Exception as exc:  # recorded, not hidden
        print("flash-sinkhorn unavailable:", exc)
    try:
        import geomloss
        peers["geomloss_tensorized"] = lambda blur: geomloss.SamplesLoss(
            "sinkhorn", p=2, blur=blur, scaling=SCALING, debias=True, backend="tensorized")
    except Exception as exc:
        print("geomloss unavailable:", exc)
        geomloss = None

    rows = []
    for n, d, blur in work:
        torch.manual_seed(n + d)
        x = torch.randn(n, d, device="cuda")
        y = torch.randn(n, d, device="cuda") + 0.5
        rec = {"n": n, "m": n, "d": d, "blur": blur, "scaling": SCALING, "debias": True, "clouds": "randn, y + 0.5"}
        ref = None
        if geomloss is not None:
            ref64 = geomloss.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=SCALING, debias=True,
                                         backend="tensorized")
            ref = loss_and_grad(ref64, x.double(), y.double())
            rec["reference"] = "GeomLoss 0.3.1 tensorized, float64"
            rec["reference_loss"] = float(ref[0])
        entries = {"ours_float32": torch_api.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=SCALING),
                   "ours_tf32": torch_api.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=SCALING, precision="tf32")}
        entries.update({k: make(blur) for k, make in peers.items()})
        for name, loss in entries.items():
            box = {}

            def call():
                box["out"] = loss_and_grad(loss, x, y)

            try:
                t, _ = cuda_median_ms(call, reps=10, warmup=2)
            except Exception as exc:
                rec[f"{name}_error"] = repr(exc)[:300]
                continue
            rec[f"{name}_ms"] = t
            value, grad = box["out"]
            if not (torch.isfinite(value).all() and torch.isfinite(grad).all()):
                rec[f"{name}_nonfinite"] = True
            if ref is not None:
                rec[f"{name}_err_loss"] = abs(float(value) - float(ref[0])) / abs(float(ref[0]))
                rec[f"{name}_err_grad"] = rel(grad, ref[1])
        for peer in ("flash_tf32False", "flash_tf32True", "geomloss_tensorized"):
            if f"{peer}_ms" in rec:
                rec[f"speedup_vs_{peer}"] = rec[f"{peer}_ms"] / rec["ours_float32_ms"]
        print(rec, flush=True)
        rows.append(rec)
        path = write("samples_loss_vs_flash", {"env": environment(), "results": rows,
                                               "note": "loss + grad in x, medians of 10 after 2 warm-up calls"})
        torch.cuda.empty_cache()
    print("wrote", path)
    names = ["ours_float32", "ours_tf32", "flash_tf32False", "flash_tf32True", "geomloss_tensorized"]
    print(f"{'n':>6} {'d':>3} " + " ".join(f"{k:>20}" for k in names))
    for r in rows:
        print(f"{r['n']:>6} {r['d']:>3} " + " ".join(
            f"{r.get(k + '_ms', float('nan')):>8.2f} ms {r.get(k + '_err_grad', float('nan')):>7.1e}" for k in names))


if __name__ == "__main__":
    main()
