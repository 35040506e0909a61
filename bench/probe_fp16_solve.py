"""Solve-level A/B of the FP16 cross-term operands (launch_plans.FP16_MIN_D, kernels/split.py).

The same default calls as bench/suite.py, each in a fresh subprocess with the product's parts
and with TF32 parts (``launch_plans.FP16_MIN_D`` raised in that process only, the code of the
product before the change): torch_api.sinkhorn 10 iterations (eps 0.1, float32 and tf32) and the
jitted ot_triton_jax.sinkhorn 100 iterations, randn clouds; f's relative error on 512 rows
against float64 of the same iterations (bench/common.f64_sinkhorn). Medians of CUDA events
(JAX: wall time around block_until_ready). Writes bench/results/probe_fp16_solve_<device>.json.

    python bench/probe_fp16_solve.py            # both modes, every size (d = 64)
    python bench/probe_fp16_solve.py --dims 3 16 --sizes 65536 --samples --name probe_fp16_low_d
    python bench/probe_fp16_solve.py --mode tf32_parts --sizes 8192   # one mode (what the subprocesses run)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

EPS, SCALING = 0.1, 0.5
SAMPLES = ((8192, 3, 0.05), (16384, 16, 0.1))  # bench/suite.py's samples_loss_grad items


def samples_rows(mode: str) -> list[dict]:
    """torch_api.SamplesLoss loss + gradient in x (debias, scaling 0.5), the gradient's error
    against GeomLoss tensorized in float64 (as bench/suite.py)."""
    import geomloss
    import torch

    from common import cuda_median_ms
    import torch_api
    rows = []
    for n, d, blur in SAMPLES:
        gen = torch.Generator().manual_seed(n + d)
        x, y = torch.randn(n, d, generator=gen).cuda(), (torch.randn(n, d, generator=gen) + 0.5).cuda()

        def loss_grad(loss, x, y):
            xg = x.detach().clone().requires_grad_(True)
            value = loss(xg, y)
            return value.detach(), torch.autograd.grad(value, xg)[0]

        ref = loss_grad(geomloss.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=SCALING, debias=True,
                                             backend="tensorized"), x.double(), y.double())
        for prec in ("float32", "tf32"):
            loss = torch_api.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=SCALING, precision=prec)
            box = {}
            ms = cuda_median_ms(lambda: box.__setitem__("o", loss_grad(loss, x, y)), reps=10, warmup=2)[0]
            value, grad = box["o"]
            finite = bool(torch.isfinite(grad).all())
            rows.append({"mode": mode, "frontend": "torch_samples_loss", "n": n, "d": d, "blur": blur,
                         "precision": prec, "ms": ms, "finite": finite,
                         "grad_error": float((grad.double() - ref[1]).norm() / ref[1].norm()) if finite else None,
                         "loss_error": abs(float(value) - float(ref[0])) / abs(float(ref[0]))})
            print(json.dumps(rows[-1]), flush=True)
    return rows


def one_mode(mode: str, sizes: list[int], dims: list[int], samples: bool) -> list[dict]:
    import torch

    from common import cuda_median_ms, f64_sinkhorn, wall_median_ms
    from ot_triton_jax.core import launch_plans
    if mode == "tf32_parts":
        launch_plans.FP16_MIN_D = 10 ** 9  # this process only: TF32 parts at every d
    import torch_api
    rows = []
    for n, D in ((n, D) for D in dims for n in sizes):
        gen = torch.Generator().manual_seed(n + D)
        xc, yc = torch.randn(n, D, generator=gen), torch.randn(n, D, generator=gen)
        x, y = xc.cuda(), yc.cuda()
        sample = torch.randperm(n, generator=torch.Generator().manual_seed(0))[:512].cuda()
        for iters, frontend in ((10, "torch"), (100, "jax")):
            if frontend == "jax" and (n > 8192 or D != 64):
                continue
            ref = f64_sinkhorn(x, y, iters, EPS)[0][sample]
            for prec in ("float32", "tf32") if frontend == "torch" else ("float32",):
                kw = {} if prec == "float32" else {"precision": prec}
                if frontend == "torch":
                    box = {}
                    ms = cuda_median_ms(lambda: box.__setitem__("f", torch_api.sinkhorn(
                        x, y, epsilon=EPS, min_iterations=iters, max_iterations=iters, inner_iterations=10, **kw).f),
                        reps=5, warmup=2)[0]
                    f = box["f"]
                else:
                    import jax
                    import numpy as np

                    import ot_triton_jax as otj
                    xj, yj = jax.numpy.asarray(xc.numpy()), jax.numpy.asarray(yc.numpy())
                    fn = jax.jit(lambda a, b: otj.sinkhorn(a, b, epsilon=EPS, min_iterations=iters,
                                                           max_iterations=iters).f)
                    box = {}
                    ms = wall_median_ms(lambda: box.__setitem__("f", jax.block_until_ready(fn(xj, yj))), reps=10,
                                        warmup=2)[0]
                    f = torch.from_numpy(np.array(box["f"])).cuda()
                finite = bool(torch.isfinite(f).all())
                err = float((f[sample].double() - ref).norm() / ref.norm()) if finite else None
                rows.append({"mode": mode, "frontend": frontend, "n": n, "d": D, "iterations": iters,
                             "precision": prec, "ms": ms, "f_error": err, "finite": finite})
                print(json.dumps(rows[-1]), flush=True)
    return rows + (samples_rows(mode) if samples else [])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("fp16_parts", "tf32_parts"))
    ap.add_argument("--sizes", type=int, nargs="+", default=[8192, 65536])
    ap.add_argument("--dims", type=int, nargs="+", default=[64])
    ap.add_argument("--samples", action="store_true", help="also the suite's SamplesLoss loss + gradient items")
    ap.add_argument("--name", default="probe_fp16_solve")
    args = ap.parse_args()
    if args.mode:
        print("ROWS " + json.dumps(one_mode(args.mode, args.sizes, args.dims, args.samples)), flush=True)
        return 0
    from common import environment, write
    rows, t0 = [], time.perf_counter()
    for mode in ("fp16_parts", "tf32_parts"):
        proc = subprocess.run([sys.executable, __file__, "--mode", mode, "--sizes", *map(str, args.sizes),
                               "--dims", *map(str, args.dims)] + (["--samples"] if args.samples else []),
                              capture_output=True, text=True)
        sys.stdout.write(proc.stdout[-4000:])
        sys.stderr.write(proc.stderr[-4000:])
        rows += next((json.loads(line[5:]) for line in proc.stdout.splitlines() if line.startswith("ROWS ")), [])
    for r in rows:
        if r["mode"] == "fp16_parts":
            base = next((b for b in rows if b["mode"] == "tf32_parts" and all(
                b.get(k) == r.get(k) for k in ("frontend", "n", "d", "iterations", "precision"))), None)
            r["speedup_vs_tf32_parts"] = base["ms"] / r["ms"] if base and base["ms"] and r["ms"] else None
    from ot_triton_jax.core.launch_plans import FP16_MIN_D
    path = write(args.name, {"env": environment(), "eps": EPS, "fp16_min_d": FP16_MIN_D, "rows": rows,
                                      "elapsed_s": time.perf_counter() - t0})
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
