"""Tile sweep of the Taylor pass's evaluation with the softmin mean (kernels/taylor_blocksparse.py,
G stacked monomial groups per row; ``--plain``: without it, G = 1): one multiscale loss + gradient at n = m (uniform d = 3, blur
0.05) with the Taylor MODE "always" to capture the x -> y plan's arguments, then that pass
(multiscale_taylor.lse with the mean) timed under each (BLOCK_I, BLOCK_L, warps, stages) plan of the
evaluation (CUDA events, median of 5), with its largest difference from the first plan's mean.
Prints JSON lines (bench/NOTES.md 103).

    python3 bench/sweep_taylor_mean.py 1048576 [--plain]
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
from probe_taylor_mean import ORDER, captured_call  # noqa: E402

from ot_triton_jax.core import kernel_calls as kc, launch_plans  # noqa: E402
from torch_api import kernel_ops, launch, multiscale_taylor as taylor  # noqa: E402

CONFIGS = [(32, 32, 8, 3), (16, 32, 4, 3), (16, 64, 4, 3), (32, 64, 8, 3), (32, 16, 8, 3), (32, 32, 8, 2),
           (16, 32, 8, 3), (32, 32, 4, 3), (16, 16, 4, 3), (32, 64, 8, 2), (32, 64, 4, 3), (64, 32, 8, 3)]
# ``--plain``: the evaluation without the mean (G = 1), BLOCK_I rows per chunk
CONFIGS_PLAIN = [(128, 32, 8, 3), (128, 32, 8, 2), (128, 32, 4, 3), (128, 64, 8, 3), (128, 16, 8, 3), (64, 32, 4, 3),
                 (128, 32, 8, 4), (64, 32, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2)]


def main() -> int:
    n, plain = int(sys.argv[1]), "--plain" in sys.argv
    x, y = clouds(n, "uniform")
    (ta, _), lse, _ = captured_call(x, y, "always", taylor, "lse", lambda a, k: a[8] if len(a) > 8 else k.get("mean"))
    ta = list(ta)
    ta[8] = not plain
    spec = launch_plans.taylor_plans(3, True, ORDER)[2 if plain else 3]
    ref = None
    for bi, bl, w, st in CONFIGS_PLAIN if plain else CONFIGS:
        spec["constexprs"].update(BLOCK_I=bi, BLOCK_L=bl)
        spec["num_warps"], spec["num_stages"] = w, st
        kc.taylor_evaluate.cache_clear()
        launch.clear()
        kernel_ops._STEPS.clear()
        try:
            mean = lse(*ta, p=ORDER)[0 if plain else 2]  # the updated potential (plain) or the mean
            ref = mean if ref is None else ref
            t = cuda_median_ms(lambda: lse(*ta, p=ORDER), reps=5)[0]
            print(json.dumps({"n": n, "plain": plain, "BLOCK_I": bi, "BLOCK_L": bl, "warps": w, "stages": st, "ms": round(t, 3),
                              "max_diff": float((mean - ref).abs().max())}), flush=True)
        except Exception as e:  # noqa: BLE001 (a plan that does not compile or fit is reported, not fatal)
            print(json.dumps({"n": n, "plain": plain, "BLOCK_I": bi, "BLOCK_L": bl, "warps": w, "stages": st, "error": repr(e)[:200]}),
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
