"""Tiles of the x side's fused pass (apply_plan_blocksparse with TGT_MEAN: the LSE update and the
gradient's softmin mean in one pass) at n = m (uniform d = 3, blur 0.05; its arguments captured from a
default loss + gradient with the Taylor MODE "never"), timed per (BLOCK_N, warps, stages) of
launch_plans.GPU_BLOCKSPARSE["k16"] (CUDA events, median of 7), with the mean's and the update's
largest differences from the first plan's. Prints JSON lines (bench/NOTES.md 104).

    python3 bench/sweep_fused_mean.py 1048576
"""
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
from bench_multiscale import clouds  # noqa: E402
from common import cuda_median_ms  # noqa: E402
from probe_taylor_mean import captured_call  # noqa: E402

from ot_triton_jax.core import kernel_calls as kc, launch_plans as lp  # noqa: E402
from torch_api import kernel_ops, launch, multiscale_solve  # noqa: E402

CONFIGS = [(128, 4, 1), (64, 4, 1), (64, 4, 2), (128, 4, 2), (32, 4, 1), (256, 4, 1), (64, 8, 1)]


def main() -> int:
    n = int(sys.argv[1])
    x, y = clouds(n, "uniform")
    (da, dk), fused, _ = captured_call(x, y, "never", multiscale_solve, "_update_and_mean", lambda a, k: True)
    ref = None
    for bn, w, st in CONFIGS:
        lp.GPU_BLOCKSPARSE["k16"].update(BLOCK_N=bn, num_warps=w, num_stages=st)
        for mod in (kc, lp):  # every cached plan and description goes
            for v in vars(mod).values():
                if hasattr(v, "cache_clear"):
                    v.cache_clear()
        launch.clear()
        kernel_ops._STEPS.clear()
        try:
            (f, _), mean, _ = fused(*da, **dk)
            ref = (f, mean) if ref is None else ref
            t = cuda_median_ms(lambda: fused(*da, **dk), reps=7)[0]
            print(json.dumps({"n": n, "BLOCK_N": bn, "warps": w, "stages": st, "ms": round(t, 3),
                              "mean_max_diff": float((mean - ref[1]).abs().max()),
                              "update_max_diff": float((f - ref[0]).abs().max())}), flush=True)
        except Exception as e:  # noqa: BLE001 (a plan that does not compile or fit is reported, not fatal)
            print(json.dumps({"n": n, "BLOCK_N": bn, "warps": w, "stages": st, "error": repr(e)[:300]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
