"""A/B of the symmetric update's modes (core/pair_plans.PAIR_MODE, kernels/lse_pair.py), one process.

Kernel level: one symmetric update (both softmins of a pair, kernel_calls.lse_pair; and the
update of x against itself, kernel_calls.lse_self: online or the SELF sweep of j >= i) at
randn clouds near their fixed point (eps 0.1, cost |x - y|^2 / 2; 5 online updates from zero
first), timed in each mode: "online" (two online-max half-steps: SamplesLoss before the
fused pass), "fold" (two fixed-shift half-steps), "fused" (one sweep for both sides; the
default), and the fused sweep at other tiles (GPU_PAIR). Errors: both outputs against float64
on 512 rows / columns. Solve level: torch_api.SamplesLoss loss + gradient (bench/suite.py's
items) with the pair and the debiasing terms (pair_plans.SELF_MODE) online, the pair fused, and
both fused (the default), the loss and gradient against GeomLoss tensorized in float64.
Medians of CUDA events. Writes bench/results/probe_pair_<device>.json.

    python bench/probe_pair.py [--quick] [--tiles] [--samples-only]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

EPS, S = 0.1, 0.5
KERNEL_CASES = ((65536, 3, "float32"), (65536, 3, "tf32"), (65536, 16, "float32"), (65536, 64, "float32"),
                (65536, 64, "tf32"), (8192, 3, "float32"), (8192, 64, "float32"))
SELF_TILES = ((256, 32, 8, 2), (128, 32, 4, 2), (256, 64, 8, 2), (128, 64, 8, 2))
TILES = ((256, 32, 4, 2), (128, 64, 4, 2), (256, 64, 8, 2), (128, 32, 4, 3), (512, 32, 8, 2))
SAMPLES = ((8192, 3, 0.05), (16384, 16, 0.1))  # bench/suite.py's samples_loss_grad items


def set_mode(mode: str, self_mode: str = "triangle") -> None:
    from ot_triton_jax.core import kernel_calls, pair_plans
    import torch_api.cuda_graphs as graphs
    pair_plans.PAIR_MODE = mode
    pair_plans.SELF_MODE = self_mode
    pair_plans.clear_cache()
    kernel_calls.lse_pair.cache_clear()
    kernel_calls.lse_self.cache_clear()
    graphs.clear()


def softmin64(src, tgt, pot, logw, rows, chunk=128):
    """-eps LSE_j((pot_j - S|src_i - tgt_j|^2)/eps + logw_j) for the given rows, float64."""
    import torch
    out = []
    for k in range(0, rows.numel(), chunk):
        s = src[rows[k:k + chunk]].double()
        C = S * torch.cdist(s, tgt.double()) ** 2
        out.append(-EPS * torch.logsumexp((pot.double()[None] - C) / EPS + logw.double()[None], dim=1))
    return torch.cat(out)


def kernel_rows(quick: bool, tiles: bool, self_tiles: bool = False, pair_modes=("online", "fold", "fused")) -> list[dict]:
    import torch

    from common import cuda_median_ms
    from ot_triton_jax.core import pair_plans
    from torch_api.kernel_ops import clouds, lse_pair, lse_self, params
    rows = []
    for n, d, prec in KERNEL_CASES[:3] if quick else KERNEL_CASES:
        gen = torch.Generator().manual_seed(n + d)
        x, y = torch.randn(n, d, generator=gen).cuda(), (torch.randn(n, d, generator=gen) + 0.5).cuda()
        X, Y = clouds(x, y)
        la = lb = torch.full((n,), -float(torch.log(torch.tensor(float(n)))), device="cuda")
        prm = params(EPS, S, "cuda")
        set_mode("online", "online")
        f, g = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
        for _ in range(5):
            fn, gn = lse_pair(X, Y, f, g, la, lb, prm, prec)
            f, g = 0.5 * (f + fn), 0.5 * (g + gn)
        sample = torch.randperm(n, generator=torch.Generator().manual_seed(1))[:512].cuda()
        ref_f = softmin64(X.x, Y.x, g, lb, sample)
        ref_g = softmin64(Y.x, X.x, f, la, sample)
        path = "k16" if d <= 16 else "resident"
        variants = [(mode, None) for mode in pair_modes if mode]
        variants += [("fused", t) for t in TILES[1:] if tiles]
        default = dict(pair_plans.GPU_PAIR[(path, prec)])
        for mode, tile in variants:
            set_mode(mode)
            if tile:
                pair_plans.GPU_PAIR[(path, prec)] = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), tile))
                pair_plans.clear_cache()
            try:
                box = {}
                ms = cuda_median_ms(lambda: box.__setitem__("o", lse_pair(X, Y, f, g, la, lb, prm, prec)),
                                    reps=20, warmup=3)[0]
                fo, go = box["o"]
                ef = float((fo[sample].double() - ref_f).norm() / ref_f.norm())
                eg = float((go[sample].double() - ref_g).norm() / ref_g.norm())
                finite = bool(torch.isfinite(fo).all() and torch.isfinite(go).all())
                row = {"op": "pair", "n": n, "d": d, "precision": prec, "mode": mode,
                       "tile": tile or tuple(default.values()) if mode == "fused" else None,
                       "ms": ms, "f_error": ef, "g_error": eg, "finite": finite}
            except Exception as exc:  # a tile that does not compile (shared memory) is reported, not fatal
                row = {"op": "pair", "n": n, "d": d, "precision": prec, "mode": mode, "tile": tile, "error": repr(exc)[:300]}
            finally:
                pair_plans.GPU_PAIR[(path, prec)] = dict(default)
                pair_plans.clear_cache()
            rows.append(row)
            print(json.dumps(row), flush=True)
        ref_h = softmin64(X.x, X.x, f, la, sample)
        self_default = dict(pair_plans.GPU_SELF[(path, prec)])
        self_variants = [("online", None), ("triangle", None)] + [("triangle", t) for t in SELF_TILES if self_tiles]
        for self_mode, tile in self_variants:  # the debiasing update of x against itself
            set_mode("fused", self_mode)
            if tile:
                pair_plans.GPU_SELF[(path, prec)] = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), tile))
                pair_plans.clear_cache()
            box = {}
            ms = cuda_median_ms(lambda: box.__setitem__("h", lse_self(X, f, la, prm, prec)), reps=20, warmup=3)[0]
            h = box["h"]
            pair_plans.GPU_SELF[(path, prec)] = dict(self_default)
            pair_plans.clear_cache()
            row = {"op": "self", "n": n, "d": d, "precision": prec, "mode": self_mode, "ms": ms,
                   "tile": tile or (tuple(self_default.values()) if self_mode == "triangle" else None),
                   "f_error": float((h[sample].double() - ref_h).norm() / ref_h.norm()),
                   "finite": bool(torch.isfinite(h).all())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def samples_rows(quick: bool) -> list[dict]:
    import geomloss
    import torch

    from common import cuda_median_ms
    import torch_api
    rows = []
    for n, d, blur in SAMPLES[:1] if quick else SAMPLES:
        gen = torch.Generator().manual_seed(n + d)
        x, y = torch.randn(n, d, generator=gen).cuda(), (torch.randn(n, d, generator=gen) + 0.5).cuda()

        def loss_grad(loss, x, y):
            xg = x.detach().clone().requires_grad_(True)
            value = loss(xg, y)
            return value.detach(), torch.autograd.grad(value, xg)[0]

        ref = loss_grad(geomloss.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=0.5, debias=True,
                                             backend="tensorized"), x.double(), y.double())
        for prec in ("float32", "tf32"):
            for mode, self_mode in (("online", "online"), ("fused", "online"), ("fused", "triangle")):
                set_mode(mode, self_mode)
                loss = torch_api.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=0.5, precision=prec)
                box = {}
                ms = cuda_median_ms(lambda: box.__setitem__("o", loss_grad(loss, x, y)), reps=10, warmup=2)[0]
                value, grad = box["o"]
                finite = bool(torch.isfinite(grad).all())
                rows.append({"workload": "samples_loss_grad", "n": n, "d": d, "blur": blur, "precision": prec,
                             "mode": mode, "self_mode": self_mode, "ms": ms, "finite": finite,
                             "grad_error": float((grad.double() - ref[1]).norm() / ref[1].norm()) if finite else None,
                             "loss_error": abs(float(value) - float(ref[0])) / abs(float(ref[0]))})
                print(json.dumps(rows[-1]), flush=True)
    set_mode("fused", "triangle")
    return rows


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="three kernel cases, one SamplesLoss item")
    ap.add_argument("--name", default="probe_pair")
    ap.add_argument("--samples-only", action="store_true", help="only the SamplesLoss rows")
    ap.add_argument("--tiles", action="store_true", help="also the fused sweep at the other TILES")
    ap.add_argument("--self-tiles", action="store_true", help="also the SELF sweep at SELF_TILES")
    ap.add_argument("--pair-modes", default="online,fold,fused", help="the pair modes timed at kernel level")
    args = ap.parse_args()
    from common import environment, write
    from ot_triton_jax.core import pair_plans
    default = pair_plans.PAIR_MODE
    kernel = [] if args.samples_only else kernel_rows(args.quick, args.tiles, args.self_tiles, args.pair_modes.split(','))
    samples = samples_rows(args.quick)
    for r in kernel + samples:
        if r.get("mode") in ("fold", "fused", "triangle") and r.get("ms"):
            base = next((b for b in kernel + samples if b.get("mode") == "online" and b.get("ms") and all(
                b.get(k) == r.get(k) for k in ("op", "n", "d", "precision", "workload"))), None)
            r["speedup_vs_online"] = base["ms"] / r["ms"] if base else None
    path = write(args.name, {"env": environment(), "eps": EPS, "cost_scale": S, "default_mode": default,
                             "kernel_rows": kernel, "samples_rows": samples})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
