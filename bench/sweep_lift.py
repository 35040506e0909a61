"""Tile sweep of the truncated lift (kernels/lift_gathered.py): one multiscale loss + gradient at n = m
(uniform d = 3, blur 0.05; the lifts' arguments captured), then the four lifts timed under each
(BLOCK_I, BLOCK_L, warps, stages) plan (CUDA events, median of 7) with their largest difference from
the first plan's outputs. Prints JSON lines (logs_h100_session24/lift_gathered_sweep.log).

    python3 bench/sweep_lift.py 1048576
"""
import os, sys, json, torch
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
from bench_multiscale import BLUR, SCALING, clouds
from common import cuda_median_ms
import torch_api
from torch_api import multiscale_solve as ms, kernel_ops, launch
from ot_triton_jax.core import launch_plans, kernel_calls as kc
from ot_triton_jax.core.launch_plans import LaunchPlan
n = int(sys.argv[1])
x, y = clouds(n, "uniform")
CAP = []
orig = ms.lift_gathered
def hook(*a):
    CAP.append(a); return orig(*a)
ms.lift_gathered = hook
loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale")
xg = x.clone().requires_grad_(True); loss(xg, y).backward()
ms.lift_gathered = orig
ref = [orig(*a) for a in CAP]
base_plan = launch_plans.lift_plan
for bi, bl, w, st in [(32, 64, 4, 1), (16, 64, 4, 1), (32, 128, 4, 1), (64, 64, 4, 1), (16, 128, 4, 1), (32, 64, 8, 1), (64, 128, 8, 1), (16, 256, 4, 1), (32, 128, 4, 2), (32, 256, 8, 1)]:
    def plan(k_rows, d, on_gpu, bi=bi, bl=bl, w=w, st=st):
        return LaunchPlan(grid=(max(k_rows, 1),), num_warps=w, num_stages=st, constexprs={"BLOCK_I": bi, "BLOCK_L": bl, "D": d})
    launch_plans.lift_plan = plan
    kc.lift_gathered.cache_clear(); launch.clear(); kernel_ops._STEPS.clear()
    try:
        outs = [orig(*a) for a in CAP]
        err = max(float((o - r).abs().max()) for o, r in zip(outs, ref))
        t = cuda_median_ms(lambda: [orig(*a) for a in CAP], reps=7)[0]
        print(json.dumps({"n": n, "BLOCK_I": bi, "BLOCK_L": bl, "warps": w, "stages": st, "ms_4_lifts": round(t, 3), "max_diff": err}), flush=True)
    except Exception as e:
        print(json.dumps({"BLOCK_I": bi, "BLOCK_L": bl, "warps": w, "error": repr(e)[:300]}), flush=True)
