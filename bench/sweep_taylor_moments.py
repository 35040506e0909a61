"""Tile sweep of the Taylor pass's moments kernel (kernels/taylor_blocksparse.py,
taylor_moments_kernel): one multiscale loss + gradient at n = m (uniform d = 3, blur 0.05) with the
Taylor MODE "always" to capture the x -> y plan's arguments, then the plain pass
(multiscale_taylor.lse without the mean) timed under each (BLOCK_J, BLOCK_K, warps, stages) plan of
the moments (CUDA events, median of 5), with the moments kernel's own GPU time (torch.profiler) and
the largest difference of the updated potential from the first plan's. Prints JSON lines
(bench/NOTES.md 107).

    python3 bench/sweep_taylor_moments.py 1048576
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
from probe_taylor_mean import ORDER, captured_call, kernel_ms  # noqa: E402

from ot_triton_jax.core import kernel_calls as kc, launch_plans  # noqa: E402
from torch_api import kernel_ops, launch, multiscale_taylor as taylor  # noqa: E402

# (BLOCK_J points per chunk, BLOCK_K kept row clusters per step, warps, stages); the first is the default (bench/NOTES.md 107)
CONFIGS = [(32, 128, 4, 1), (32, 64, 4, 1), (32, 64, 4, 2), (32, 64, 8, 1), (32, 128, 8, 1), (16, 64, 4, 1),
           (64, 64, 4, 1), (64, 64, 8, 1), (32, 32, 4, 1), (16, 128, 8, 1), (32, 64, 8, 2), (16, 128, 4, 1),
           (64, 128, 4, 1), (32, 256, 8, 1), (32, 128, 4, 2), (16, 64, 4, 2), (32, 32, 4, 2),
           (32, 256, 4, 1), (16, 256, 4, 1), (64, 256, 8, 1), (16, 256, 8, 1)]  # the last: for R = 64 (order 5)


def main() -> int:
    n = int(sys.argv[1])
    x, y = clouds(n, "uniform")
    (ta, _), lse, _ = captured_call(x, y, "always", taylor, "lse", lambda a, k: a[8] if len(a) > 8 else k.get("mean"))
    ta = list(ta)
    ta[8] = False
    spec = launch_plans.taylor_plans(3, True, ORDER)[1]
    ref = None
    for bj, bk, w, st in CONFIGS:
        spec["constexprs"].update(BLOCK_J=bj, BLOCK_K=bk)
        spec["num_warps"], spec["num_stages"] = w, st
        kc.taylor_moments.cache_clear()
        launch.clear()
        kernel_ops._STEPS.clear()
        row = {"n": n, "BLOCK_J": bj, "BLOCK_K": bk, "warps": w, "stages": st}
        try:
            f = lse(*ta, p=ORDER)[0]
            ref = f if ref is None else ref
            row["pass_ms"] = round(cuda_median_ms(lambda: lse(*ta, p=ORDER), reps=5)[0], 3)
            row["moments_ms"] = kernel_ms(lambda: lse(*ta, p=ORDER)).get("taylor_moments_kernel")
            row["max_diff"] = float((f - ref).abs().max())
        except Exception as e:  # noqa: BLE001 (a plan that does not compile or fit is reported, not fatal)
            row["error"] = repr(e)[:200]
        print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
