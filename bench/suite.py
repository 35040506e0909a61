"""The benchmark suite: ours against the peers, area by area, one command.

Areas (one script each in bench/areas/, run in a process of its own so that a crash or a JAX/torch
memory quarrel stays in its area; inside it the peers run in the same process on the same inputs):

====================  =================================  ==========================================  ===========  ==========
area                  script                             ours vs                                     full (H100)  ``--quick``
====================  =================================  ==========================================  ===========  ==========
sinkhorn              areas/sinkhorn.py                  flash-sinkhorn, OTT-JAX (dense, online)     ~150 s       ~40 s
samples_loss          areas/samples_loss.py              flash-sinkhorn, GeomLoss                    ~45 s        ~25 s
jax                   areas/jax_sinkhorn.py              OTT-JAX; torch_api; jax.vmap vs loops       ~60 s        ~20 s
mhc                   areas/mhc.py                       torch eager, torch.compile                  ~150 s       ~60 s
multiscale            areas/multiscale.py                flash-sinkhorn multiscale; dense solver     ~200 s       ~90 s
hvp                   areas/hvp.py                       flash-sinkhorn, OTT-JAX                     ~250 s       ~200 s
unbalanced            areas/unbalanced.py                balanced twin, flash-sinkhorn, OTT-JAX      ~90 s        ~45 s
batched               areas/batched.py                   a loop of single solves, OTT-JAX jax.vmap   ~400 s       ~30 s
ott_geometry          areas/ott_geometry.py              OTT's own PointCloud (dense, online)        ~160 s       ~160 s
batched_samples_loss  areas/batched_samples_loss.py      a loop of single calls, GeomLoss batch,     ~300 s       ~40 s
                                                         flash-sinkhorn batch
batched_hvp           areas/batched_hvp.py               a loop of single HVPs, JAX jax.vmap         ~300 s       ~90 s
batched_divergence    areas/batched_divergence.py        a loop of single calls, JAX vmap, OTT vmap  ~150 s       ~60 s
====================  =================================  ==========================================  ===========  ==========

Durations: one H100 80GB HBM3, from the areas' earlier runs, with flash-sinkhorn's autotuning
results kept in bench/peer_autotune_cache/ (restored into Triton's cache before each area, new ones
copied back after it; without them flash-sinkhorn autotunes every new shape first, several minutes
more). Each area's docstring states its workloads, peers, float64 gate, floors and timing method.

Every area writes bench/results/<area>/<device-slug>.json (device, versions, commit, sizes, times,
errors, gate verdicts, floors) after each workload, then <device-slug>.png (bench/plot.py). A row
passes only with a finite time and a finite float64 error within its tolerance; the suite exits 1
when one of our rows fails, and 2 without a CUDA device.

On the GPU machine (bench/run_gpu.sh does this with the wheels installed):

    python bench/suite.py --quick                                   # every area, ~400 s: one 10-minute call
    python bench/suite.py --area sinkhorn samples_loss jax mhc      # full, ~410 s: first call
    python bench/suite.py --area multiscale hvp                     # full, ~450 s: second call
    python bench/suite.py --dry-run [--quick]                       # anywhere: the planned rows and floors
    python -m bench.areas.mhc --tiny                                # anywhere: an area's code paths at toy sizes

An area whose estimate does not fit the remaining ``--budget-s`` (default 560 s) is skipped and listed.
"""

from __future__ import annotations

import argparse
import importlib
import os
import subprocess
import sys
import time

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

from bench.areas import AREAS  # noqa: E402

EST_S = {"sinkhorn": (150, 40), "samples_loss": (45, 25), "jax": (60, 20), "mhc": (150, 60),
         "multiscale": (200, 90), "hvp": (250, 200), "unbalanced": (90, 45),
         "batched": (400, 30), "ott_geometry": (160, 160), "batched_samples_loss": (300, 40),
         "batched_hvp": (300, 90), "batched_divergence": (150, 60)}  # (full, --quick) seconds on the H100


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--area", nargs="+", choices=list(AREAS), default=list(AREAS), metavar="NAME",
                    help=f"areas to run, in this order (default: all of {', '.join(AREAS)})")
    ap.add_argument("--quick", action="store_true", help="each area's reduced set of workloads")
    ap.add_argument("--dry-run", action="store_true", help="print the planned rows and floors; measure nothing")
    ap.add_argument("--budget-s", type=float, default=560.0, help="seconds for all areas together")
    args = ap.parse_args(argv)
    flags = ["--quick"] if args.quick else []
    if args.dry_run:  # in this process: planning imports no peer
        from bench import harness
        for area in args.area:
            rows = importlib.import_module(f"bench.areas.{AREAS[area]}").plan(args.quick)
            print(f"\n== {area}: {len(rows)} planned rows, ~{EST_S[area][args.quick]} s on the H100")
            harness.print_rows(rows)
        return 0
    import torch
    if not torch.cuda.is_available():
        print("bench/suite.py: no CUDA device; run it on the GPU machine, or pass --dry-run", file=sys.stderr)
        return 2
    t0, status, summary = time.perf_counter(), 0, []
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for area in args.area:
        left, est = args.budget_s - (time.perf_counter() - t0), EST_S[area][args.quick]
        if est > left:
            summary.append(f"{area}: skipped (~{est} s needed, {left:.0f} s left)")
            print(summary[-1], flush=True)
            continue
        print(f"\n== {area} (~{est} s)", flush=True)
        start = time.perf_counter()
        try:
            rc = subprocess.run([sys.executable, "-m", f"bench.areas.{AREAS[area]}", *flags, "--budget-s",
                                 f"{left - 10:.0f}"], cwd=root, timeout=left).returncode
        except subprocess.TimeoutExpired:
            rc = 124
        summary.append(f"{area}: exit {rc} in {time.perf_counter() - start:.0f} s")
        status = max(status, 1 if rc else 0)
    print("\n" + "\n".join(summary), f"\nsuite: {time.perf_counter() - t0:.0f} s", flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
