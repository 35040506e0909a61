"""Shared helpers of the benchmark areas: environment set-up, timing, the environment record, result
rows with their float64 gate, JSON writing, the table printout and the command line every area shares.

A result row is one method timed on one workload::

    {"workload", "label", "sizes", "method", "ours", "default", "call", "ms", "times_ms", "wall_s",
     "error", "error_of", "tolerance", "passed", "failure", "compare_to", "speedup", ...}

``ms`` is the median of the timed calls; ``error`` the relative error against a float64 reference
(``error_of`` says of what); ``passed`` is True only for a finite time and a finite error within
``tolerance`` (NaN never passes). Rows other than our default call name the row they are compared
with (``compare_to``: our default call, or our row of the same precision) and carry ``speedup``, their
ms over that row's ms: above 1, ours is faster. A row that failed the gate gets no speedup.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU
# flash-sinkhorn autotunes its kernels at each new shape: its choices are kept on disk
# (autotune_cache), so that the suite fits its device calls
os.environ.setdefault("TRITON_CACHE_AUTOTUNING", "1")

BENCH = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(BENCH)
if ROOT not in sys.path:  # torch_api, ot_triton_jax, tests' references without PYTHONPATH
    sys.path.append(ROOT)
RESULTS = os.path.join(BENCH, "results")
AUTOTUNE_DIR = os.path.join(BENCH, "peer_autotune_cache")
PEER_PACKAGES = ("flash-sinkhorn", "jax", "jaxlib", "ott-jax", "geomloss", "jax-triton")

import torch  # noqa: E402

CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------------------- timing

def cuda_median_ms(fn, reps: int = 5, warmup: int = 1) -> tuple[float, list[float]]:
    """Median time of fn() in ms from CUDA events around each call (synchronised per call)."""
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


def wall_median_ms(fn, reps: int = 5, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of fn() in ms (fn must block until its result is ready, e.g. JAX's
    block_until_ready); the GPU is synchronised before and after each call when there is one."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        if CUDA:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if CUDA:
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times), times


def median_ms(fn, reps: int, warmup: int, kind: str = "cuda") -> tuple[float, list[float]]:
    """CUDA events for kind "cuda" on a GPU, wall clock otherwise (JAX calls, CPU runs)."""
    return (cuda_median_ms if kind == "cuda" and CUDA else wall_median_ms)(fn, reps, warmup)


def finite(*tensors) -> bool:
    import numpy as np
    return all(bool(torch.isfinite(t).all()) if isinstance(t, torch.Tensor) else bool(np.isfinite(np.asarray(t)).all())
               for t in tensors)


def rel(u, v) -> float:
    """||u - v|| / ||v|| in float64 (torch tensors or arrays)."""
    u, v = (torch.as_tensor(_np(t)).double().cpu() for t in (u, v))
    return float((u - v).norm() / v.norm())


def _np(t):
    if isinstance(t, torch.Tensor):
        return t.detach()
    import numpy as np
    return np.asarray(t)


def measure(fn, check, reps: int, warmup: int, kind: str = "cuda") -> dict:
    """Time fn() (median of ``reps`` after ``warmup`` calls; first calls compile), then check(its last
    result) -> {"error": ..., more}; check raises or returns {"failure": ...} for a wrong result.
    Never raises: a failure is the row's result."""
    box, t0 = {}, time.perf_counter()
    try:
        ms, times = median_ms(lambda: box.__setitem__("out", fn()), reps, warmup, kind)
        res = {"ms": ms, "times_ms": times, "wall_s": time.perf_counter() - t0}
        res.update(check(box["out"]))
        return res
    except Exception as exc:  # recorded in the row, never fatal
        return {"ms": None, "failure": repr(exc)[:500], "wall_s": time.perf_counter() - t0}


def failed(exc) -> dict:
    return {"ms": None, "failure": repr(exc)[:500]}


# ------------------------------------------------------------------------------------- environment

def device_name() -> str:
    return torch.cuda.get_device_name(0) if CUDA else "cpu"


def device_slug(name: str | None = None) -> str:
    """"NVIDIA H100 80GB HBM3" -> "nvidia-h100-80gb-hbm3": the results' file name."""
    name = device_name() if name is None else name
    return "-".join("".join(c if c.isalnum() else " " for c in name.lower()).split())


def environment() -> dict:
    import triton
    from importlib import metadata
    env = {"device": device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "cuda": torch.version.cuda, "python": platform.python_version(),
           "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    # versions from package metadata: importing jax_triton here would clear TRITON_CACHE_DIR
    for name in PEER_PACKAGES:
        try:
            env[name] = metadata.version(name)
        except metadata.PackageNotFoundError:  # not installed: its rows say so
            env[name] = None
    try:
        import subprocess
        # "-dirty" when the measured tree differs from the commit (uncommitted changes were measured)
        env["commit"] = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty", "--abbrev=7"],
                                       capture_output=True, text=True, timeout=10).stdout.strip() or None
    except Exception:
        env["commit"] = None
    return env


def after_jax_triton_import() -> None:
    """jax_triton 0.3.1 sets TRITON_CACHE_DIR="" on import, after which every PyTorch-side Triton
    compile fails: undo that (call after the first JAX-frontend import)."""
    if os.environ.get("TRITON_CACHE_DIR") == "":
        del os.environ["TRITON_CACHE_DIR"]


def autotune_cache(restore: bool) -> int:
    """Copy the peers' Triton autotuning results (``*.autotune.json``, under their cache key) from
    bench/peer_autotune_cache into Triton's cache directory (``restore``), or new ones back after a
    run. The key holds the Triton version, GPU target, kernel source and tuned configurations, so a
    result serves only the same software on the same GPU model; elsewhere the peer autotunes as on a
    first call. The timed calls run the configuration the peer's own autotuner picked either way.
    Returns the number of files copied."""
    import glob
    import shutil

    import triton
    cache = triton.knobs.cache.dir
    src, dst = (AUTOTUNE_DIR, cache) if restore else (cache, AUTOTUNE_DIR)
    copied = 0
    for path in glob.glob(os.path.join(src, "*", "*.autotune.json")):
        target = os.path.join(dst, os.path.relpath(path, src))
        if not os.path.exists(target):
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copyfile(path, target)
            copied += 1
    return copied


# ------------------------------------------------------------------------------------------- rows

def gate(error, tolerance) -> bool:
    """True for a finite error within the tolerance; NaN, inf and a missing error never pass."""
    return error is not None and math.isfinite(error) and tolerance is not None and error <= tolerance


def row(workload: str, label: str, sizes: dict, method: str, call: str, result: dict, *, tolerance: float | None,
        error_of: str, ours: bool = False, default: bool = False, compare_to: str | None = None,
        finite_only: bool = False, **extra) -> dict:
    """One result row (module docstring). ``result``: what measure() returned. ``finite_only``: no
    reference exists at this size; the row passes on a finite result (its check reports non-finite
    outputs as a failure) and says so in ``error_of``."""
    r = {"workload": workload, "label": label, "sizes": sizes, "method": method, "ours": ours, "default": default,
         "call": call, "ms": result.get("ms"), "error": result.get("error"), "error_of": error_of,
         "tolerance": tolerance, "failure": result.get("failure"), "compare_to": compare_to}
    r.update({k: v for k, v in result.items() if k not in r})
    r.update(extra)
    if finite_only:
        r["error_of"] = "no reference at this size: finite result only"
    r["passed"] = r["ms"] is not None and r["failure"] is None and (finite_only or gate(r["error"], tolerance))
    if r["ms"] is not None and r["failure"] is None and not r["passed"]:
        r["failure"] = f"error {r['error']} not within {tolerance} (float64 gate)"
    return r


def add_speedups(rows: list[dict]) -> list[dict]:
    """speedup = ms / (ms of the compared row of the same workload and label), both passed."""
    by = {(r["workload"], r["label"], r["method"]): r for r in rows}
    for r in rows:
        ref = by.get((r["workload"], r["label"], r.get("compare_to")))
        # passed None: a row converted from a file without a float64 error (not a failure)
        ok = ref is not None and r["passed"] is not False and ref["passed"] is not False and r.get("ms") and ref.get("ms")
        r["speedup"] = r["ms"] / ref["ms"] if ok else None
    return rows


def status(r: dict) -> str:
    return "-" if "passed" not in r else ("ok" if r["passed"] else "FAIL")  # "-": a planned row


def print_rows(rows: list[dict]) -> None:
    fmt = lambda v, spec: ("-" if v is None else format(v, spec)).rjust(int(spec.split(".")[0]))  # noqa: E731
    print(f"{'workload':<22} {'label':<24} {'method':<28} {'ms':>10} {'error':>8} {'gate':>4} {'x ours':>7} "
          f"{'floor ms':>9}")
    for r in rows:
        print(f"{r['workload']:<22} {r['label']:<24} {r['method']:<28} {fmt(r.get('ms'), '10.3f')} "
              f"{fmt(r.get('error'), '8.1e')} {status(r):>4} "
              f"{fmt(r.get('speedup'), '7.2f')} {fmt(r.get('floor_ms'), '9.3f')}", flush=True)
        if r.get("failure"):
            print(f"    {r['failure'][:200]}", flush=True)


# ------------------------------------------------------------------------------------------- files

def result_path(area: str, slug: str | None = None) -> str:
    return os.path.join(RESULTS, area, f"{slug or device_slug()}.json")


def write(area: str, payload: dict, path: str | None = None) -> str:
    path = path or result_path(area)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        json.dump(payload, fh, indent=1, default=float)
    os.replace(path + ".tmp", path)
    return path


def payload(area: str, doc: str, rows: list[dict], env: dict, **extra) -> dict:
    return {"area": area, "env": env, "method": doc.strip(), "rows": add_speedups(rows), **extra}


class Budget:
    """Seconds left of an area's run; a workload whose estimate does not fit is skipped and listed."""

    def __init__(self, seconds: float, only: list[str] | None = None):
        self.t0, self.seconds, self.skipped, self.only = time.perf_counter(), seconds, [], only

    def selected(self, label: str) -> bool:
        """Whether ``--only`` (workload labels containing any of its strings) selects ``label``."""
        return not self.only or any(s in label for s in self.only)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def fits(self, label: str, est_s: float) -> bool:
        if not self.selected(label):
            return False
        if self.elapsed() + est_s <= self.seconds:
            return True
        self.skipped.append(f"{label}: time budget ({self.elapsed():.0f} of {self.seconds:.0f} s gone, "
                            f"~{est_s:.0f} s needed)")
        print("skipped", self.skipped[-1], flush=True)
        return False


def run_items(items, label, est_s: float, measure, rows_for, methods, budget: Budget, emit) -> list[dict]:
    """Measure each workload ``item`` (a tuple) that fits ``budget`` (``label(*item)``, ~``est_s``
    seconds): ``measure(*item)`` gives the methods' results (a failure of the whole item fails
    every one of ``methods``), ``rows_for(*item, results)`` its rows; ``emit`` gets the rows so
    far after each item (the JSON is written as the run goes)."""
    rows = []
    for item in items:
        if not budget.fits(label(*item), est_s):
            continue
        try:
            results = measure(*item)
        except Exception as exc:
            results = {m: failed(exc) for m, _ in methods}
        rows += rows_for(*item, results)
        emit(rows)
        torch.cuda.empty_cache()
    return rows


def cli(area: str, doc: str, plan, run, tiny=None):
    """The command line every area shares:
    ``[--quick] [--dry-run] [--tiny] [--budget-s S] [--out PATH] [--only TEXT ...] [--merge]``.

    plan(quick) -> planned rows (no measurement, no peer import); run(quick, budget, emit) -> rows,
    where emit(rows so far) writes the JSON after each workload (a run cut short keeps what it has);
    tiny(): a CPU check of the script's code paths at toy sizes (Triton interpreter), writing nothing
    under bench/results. ``--only``: the workloads whose label ("<workload> B=.. n=.. d=..")
    contains one of the strings; ``--merge``: the JSON keeps the rows of the workloads not
    selected from its previous version (an area measured in several device calls). Exit status: 0, 1 when one of our rows failed its gate, 2 without CUDA."""

    def main(argv: list[str] | None = None) -> int:
        ap = argparse.ArgumentParser(description=doc.split("\n")[0])
        ap.add_argument("--quick", action="store_true", help="the reduced set of workloads")
        ap.add_argument("--dry-run", action="store_true", help="print the planned rows; measure nothing")
        ap.add_argument("--tiny", action="store_true", help="CPU check of the code paths at toy sizes")
        ap.add_argument("--budget-s", type=float, default=560.0, help="skip workloads that would end later")
        ap.add_argument("--out", default=None, help="JSON path (default bench/results/<area>/<device>.json)")
        ap.add_argument("--only", nargs="+", default=None, metavar="TEXT",
                        help="run only the workloads whose label contains one of these strings")
        ap.add_argument("--merge", action="store_true",
                        help="keep the previous JSON's rows of the workloads not run now")
        args = ap.parse_args(argv)
        if args.dry_run:
            rows = plan(args.quick)
            print(f"{area}: dry run, {len(rows)} planned rows (writes nothing)")
            print_rows(rows)
            return 0
        if args.tiny:
            if tiny is None:
                print(f"{area}: no --tiny mode", file=sys.stderr)
                return 2
            rows = tiny()
            print_rows(add_speedups(rows))
            return 1 if any(r["ours"] and not r["passed"] for r in rows) else 0
        if not CUDA:
            print(f"{area}: no CUDA device; run it on the GPU machine, or pass --dry-run / --tiny", file=sys.stderr)
            return 2
        env, budget = environment(), Budget(args.budget_s, args.only)
        env["peer_autotune_results_restored"] = autotune_cache(restore=True)
        out = {}
        kept, kept_skips = previous_rows(args.out or result_path(area), budget) if args.merge else ([], [])

        def emit(rows):
            out["path"] = write(area, payload(area, doc, kept + list(rows), env, quick=args.quick,
                                              skipped=kept_skips + budget.skipped, elapsed_s=budget.elapsed(),
                                              **({"merged": True} if args.merge else {})), args.out)

        rows = run(args.quick, budget, emit)
        emit(rows)
        env["peer_autotune_results_kept"] = autotune_cache(restore=False)
        emit(rows)
        print_rows(add_speedups(rows))
        try:
            from bench.plot import plot_file
            print("wrote", out["path"], plot_file(out["path"]))
        except Exception as exc:  # the JSON is written; a plotting failure is reported, not fatal
            print("wrote", out["path"], f"(plot failed: {exc!r})")
        return 1 if any(r["ours"] and not r["passed"] for r in rows) else 0

    return main


def previous_rows(path: str, budget: Budget) -> tuple[list[dict], list[str]]:
    """The rows (and skip notes) of the JSON at ``path`` for the workloads ``budget`` does not select."""
    if not os.path.exists(path):
        return [], []
    with open(path) as fh:
        old = json.load(fh)
    rows = [r for r in old["rows"] if not budget.selected(f"{r['workload']} {r['label']}")]
    skips = [s for s in old.get("skipped", []) if not budget.selected(s.split(":")[0])]
    return rows, skips


def planned(rows: list[dict]) -> list[dict]:
    """Rows built from no measurement (a dry run): without a gate verdict."""
    return [{k: v for k, v in r.items() if k not in ("passed", "failure")} for r in rows]
