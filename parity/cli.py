"""Command line of ``python -m parity``: arguments, progress bar, report, exit status.

Exit status: 0 when every row passes, 1 when any row fails, 2 for usage errors (argparse).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Sequence

import torch_api  # noqa: F401  (configures the GPU / Triton interpreter switch before jax is imported)
import torch

from . import report, runner
from .quantities import QUANTITIES
from .suites import SUITES

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "reports")


def _non_negative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {v}")
    return v


def _positive_int(text: str) -> int:
    v = _non_negative_int(text)
    if v == 0:
        raise argparse.ArgumentTypeError("must be >= 1, got 0")
    return v


def _pattern(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("the pattern is empty")
    return text


def parser() -> argparse.ArgumentParser:
    default_suite = "full" if torch.cuda.is_available() else "small"
    ap = argparse.ArgumentParser(
        prog="python -m parity",
        description="Both frontends (torch_api, ot_triton_jax) against OTT-JAX 0.6.0 (float64) and GeomLoss 0.3.1: "
                    "potentials, costs, gradients, HVPs, Hessians, divergences, SamplesLoss. Writes "
                    "<device>-<date>.md/.json/.png and exits 1 when any row fails.")
    ap.add_argument("--suite", choices=sorted(SUITES), default=default_suite,
                    help="small: CPU / Triton interpreter, < 5 min; full: GPU, up to n = 8192 "
                         f"(default here: {default_suite})")
    ap.add_argument("--out", default=DEFAULT_OUT, help="report folder (default: parity/reports/)")
    ap.add_argument("--only", type=_pattern, default=None,
                    help="run only cases / rows whose name 'case:frontend:quantity' contains PATTERN or matches it "
                         "as a glob (e.g. 'tiny-d1', '*:jax:hvp_*')")
    ap.add_argument("--frontend", choices=("both", "torch", "jax"), default="both", help="frontends to check")
    ap.add_argument("--seed", type=_non_negative_int, default=0, help="seed of the case generator (default 0)")
    ap.add_argument("--max-n", type=_positive_int, default=None,
                    help="skip cases with n or m above this (default: none skipped)")
    ap.add_argument("--list", action="store_true", help="list the suite's cases and quantities, run nothing")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        ap.error(f"--out {args.out!r} exists and is not a folder")
    cases = [c for c in SUITES[args.suite] if args.max_n is None or max(c.n, c.m) <= args.max_n]
    frontends = ("torch", "jax") if args.frontend == "both" else (args.frontend,)
    todo = runner.plan(cases, frontends, args.only)
    if args.list:
        for case, groups, fes in todo:
            print(f"{case.name}: n={case.n} m={case.m} d={case.d} eps_rel={case.eps_rel} {case.weights} "
                  f"{case.cloud} {case.precision}; groups {', '.join(groups)}; {', '.join(fes)}")
        print("quantities:", ", ".join(q.name for q in QUANTITIES))
        return 0
    if not todo:
        ap.error(f"--only {args.only!r} selects nothing in suite {args.suite!r} "
                 f"(cases: {', '.join(c.name for c in cases)})")

    from tqdm import tqdm

    device = report.device_name()
    print(f"parity: suite {args.suite} on {device}, {len(todo)} cases, frontends {', '.join(frontends)}", flush=True)
    start = time.perf_counter()
    with tqdm(total=sum(len(f) for _, _, f in todo), unit="step", file=sys.stderr, dynamic_ncols=True) as bar:
        def progress(label: str, done: bool) -> None:
            if done:
                bar.update(1)
            else:
                bar.set_postfix_str(label)

        rows: list = []
        incomplete = None
        signal.signal(signal.SIGTERM, _interrupt)  # e.g. `timeout`: still write what is done
        try:
            runner.run(cases, frontends, args.only, args.seed, progress, rows=rows)
        except KeyboardInterrupt:
            done = len({r.case for r in rows})
            incomplete = f"interrupted after {done} of {len(todo)} cases: the report holds the finished cases only"
            print(f"\n{incomplete}", file=sys.stderr, flush=True)
    elapsed = time.perf_counter() - start
    paths = report.write(rows, args.out, args.suite, elapsed, incomplete=incomplete)
    print(report.summary(rows))
    print(f"{elapsed:.0f} s; report: {paths['md']} (+ .json, .png)")
    return 1 if incomplete or any(not r.passed for r in rows) else 0


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt
