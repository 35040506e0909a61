"""The default multiscale loss + gradient under several values of multiscale_rules.CELL_BLURS (the
default voxel side in blurs with a tolerance), on several workloads: median of 5 calls (CUDA events)
after two warm-ups, the clusters, fine sweeps, marginal error, kept fraction, Taylor passes, dropped-mass
bound and peak memory. Prints JSON lines (bench/NOTES.md 114).

    python3 bench/probe_cell_blurs.py 0.8,0.84 uniform:1048576:0.05,randn:1048576:0.05 [--seed S] [--coarse-frac F]

``--coarse-frac``: multiscale_rules.COARSE_TOL_FRACTION (how far the clusters are converged before the lift).
"""
import json
import os
import sys

import torch

import torch_api
from ot_triton_jax.core import multiscale_rules as rules

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import cuda_median_ms  # noqa: E402

cells = [float(c) for c in sys.argv[1].split(",")]
cases = [c.split(":") for c in sys.argv[2].split(",")]
seed = int(sys.argv[sys.argv.index("--seed") + 1]) if "--seed" in sys.argv else 0
if "--coarse-frac" in sys.argv:
    rules.COARSE_TOL_FRACTION = float(sys.argv[sys.argv.index("--coarse-frac") + 1])
for data, n, blur in cases:
    n, blur = int(n), float(blur)
    g = torch.Generator().manual_seed(n + seed)
    if data == "uniform":
        x, y = torch.rand(n, 3, generator=g).cuda(), torch.rand(n, 3, generator=g).cuda()
    else:
        x, y = torch.randn(n, 3, generator=g).cuda(), (torch.randn(n, 3, generator=g) + 0.5).cuda()
    for cell in cells:
        rules.CELL_BLURS = cell
        loss = torch_api.SamplesLoss("sinkhorn", blur=blur, scaling=0.5, backend="multiscale")

        def call():
            xg = x.detach().requires_grad_(True)
            v = loss(xg, y)
            return v.detach(), torch.autograd.grad(v, xg)[0]
        call()  # the first solve of a shape (compiles, the coarse phase's graphs captured at the second)
        torch.cuda.reset_peak_memory_stats()
        ms, ts = cuda_median_ms(call, reps=5, warmup=1)
        v, gr = call()
        r = loss.last_multiscale
        print(json.dumps({"data": data, "n": n, "blur": blur, "seed": seed, "cell_blurs": cell, "coarse_frac": rules.COARSE_TOL_FRACTION, "ms": ms,
                          "times": [round(t, 1) for t in ts], "value": float(v), "clusters": list(r.clusters),
                          "sweeps": r.sweeps, "finish": r.finish_sweeps, "coarse_finish": r.coarse_finish_sweeps,
                          "err": r.marginal_error, "kept": r.kept, "taylor_passes": r.taylor_passes,
                          "bound": r.dropped_mass_bound, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
