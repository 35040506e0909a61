"""Streaming Sinkhorn in PyTorch: ``torch_api.sinkhorn`` against flash-sinkhorn and OTT-JAX.

Workload ``sinkhorn_10it``: randn clouds x, y (n = m points in d dimensions, CPU seed n + d), uniform
weights, eps = 0.1, 10 fixed-eps alternating iterations: n = m in {8192, 65536} x d in {3, 64} and
262144 x 3 (``--quick``: n = 8192 only). Methods, in one process on the same inputs:

* ``ours``: the default call ``torch_api.sinkhorn(x, y, epsilon=0.1, min_iterations=10,
  max_iterations=10, inner_iterations=10)`` (float32); in OTT's convention it also measures the
  marginal error after the last iteration: 21 half-steps;
* ``ours_tf32``: the same with ``precision="tf32"`` (non-default, beside it);
* ``flash_sinkhorn_fp32`` / ``_tf32``: ``sinkhorn_flashstyle_alternating(x, y, a, b, eps=0.1,
  n_iters=10, allow_tf32=..., ott_convention=True)`` (20 half-steps), compared with ours of the same
  precision;
* at n = 8192: OTT-JAX dense and online (``batch_size`` 1024), jitted, under
  ``jax.default_matmul_precision("highest")`` (compared with ours) and ``"tensorfloat32"`` (with
  ``ours_tf32``).

GeomLoss is not timed here: it has no fixed-iteration alternating solve (its loop is symmetric
averaged updates with eps-scaling, a different computation); the samples_loss area times it.

Gate: f's relative error on 512 sampled rows against a float64 run of the same 10 iterations
(references.f64_sinkhorn), at most 1e-4 for float32 rows and 1e-1 for tf32 rows. Times: medians of
CUDA events (OTT: wall clock around block_until_ready) after two warm-up calls (a shape's first solve
compiles, its second captures the CUDA graphs); 10 / 5 / 3 repetitions at n = 8192 / 65536 / 262144.
Floors: floors.floor_ms("sinkhorn_10it", ..., 21 half-steps) on every row.

    python -m bench.areas.sinkhorn [--quick] [--dry-run] [--tiny]

Takes ~150 s on an H100 with the peers' kept autotuning results (``--quick`` ~40 s); without them
flash-sinkhorn autotunes each shape first (several minutes).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import harness, peers  # noqa: E402
from bench.floors import floor_ms, sinkhorn_half_steps  # noqa: E402
from bench.references import f64_sinkhorn, f_error, sample_rows  # noqa: E402

AREA, WORKLOAD = "sinkhorn", "sinkhorn_10it"
EPS, ITERS, SMALL = 0.1, 10, 8192
TOLERANCE = {"float32": 1e-4, "tf32": 1e-1}
ERROR_OF = "f on 512 sampled rows vs float64 of the same 10 iterations"
# (n, d, expected seconds on the H100 with the kept autotuning results): cheap first, so that a run
# over budget drops the largest sizes
ITEMS = ((8192, 3, 25), (8192, 64, 15), (65536, 3, 12), (65536, 64, 20), (262144, 3, 75))
OURS_CALL = ("torch_api.sinkhorn(x, y, epsilon=0.1, min_iterations=10, max_iterations=10, "
             "inner_iterations=10{prec})")
FLASH_CALL = ("sinkhorn_flashstyle_alternating(x, y, a, b, eps=0.1, n_iters=10, allow_tf32={tf32}, "
              "ott_convention=True)")


def methods(n: int) -> list[tuple[str, str, str | None]]:
    """(method, precision, the row it is compared with)."""
    out = [("ours", "float32", None), ("ours_tf32", "tf32", "ours"),
           ("flash_sinkhorn_fp32", "float32", "ours"), ("flash_sinkhorn_tf32", "tf32", "ours_tf32")]
    if n <= SMALL:
        for prec, ours in (("float32", "ours"), ("tf32", "ours_tf32")):
            out += [(f"ott_{kind}_{peers.OTT_PRECISION[prec]}", prec, ours) for kind in ("dense", "online")]
    return out


def call_of(method: str, prec: str) -> str:
    if method.startswith("ours"):
        return OURS_CALL.format(prec="" if prec == "float32" else f', precision="{prec}"')
    if method.startswith("flash"):
        return FLASH_CALL.format(tf32=prec == "tf32")
    return (f"jax.jit(Sinkhorn(min_iterations=10, max_iterations=10, inner_iterations=10)(LinearProblem(PointCloud("
            f"x, y, epsilon=0.1{', batch_size=1024' if 'online' in method else ''})))) under "
            f"jax.default_matmul_precision({peers.OTT_PRECISION[prec]!r})")


def rows_for(n: int, d: int, results: dict) -> list[dict]:
    rows = []
    for method, prec, compare in methods(n):
        fl, unit = floor_ms(WORKLOAD, n, n, d, prec, sinkhorn_half_steps(ITERS))
        res = results.get(method, {})
        rows.append(harness.row(WORKLOAD, f"n={n} d={d}", {"n": n, "m": n, "d": d, "eps": EPS, "iterations": ITERS},
                                method, call_of(method, prec), res, tolerance=TOLERANCE[prec], error_of=ERROR_OF,
                                ours=method.startswith("ours"), default=method == "ours", compare_to=compare,
                                precision=prec, floor_ms=fl, floor_unit=unit,
                                fraction_of_floor=fl / res["ms"] if res.get("ms") else None))
    return rows


def clouds(n: int, d: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n + d)
    return torch.randn(n, d, generator=gen).to(device), torch.randn(n, d, generator=gen).to(device)


def measure_item(n: int, d: int, device: str, reps: int, warmup: int = 2) -> dict:
    import torch_api
    x, y = clouds(n, d, device)
    a = torch.full((n,), 1.0 / n, device=device)
    ref, rows = f64_sinkhorn(x, y, ITERS, EPS)[0], sample_rows(n)
    check = lambda out: {"error": f_error(out[0], ref, rows)} if harness.finite(*out) else {  # noqa: E731
        "failure": "non-finite output"}
    results = {}
    for method, prec, _ in methods(n):
        if method.startswith("ours"):
            kw = {} if prec == "float32" else {"precision": prec}
            fn = lambda kw=kw: torch_api.sinkhorn(x, y, epsilon=EPS, min_iterations=ITERS,  # noqa: E731
                                                  max_iterations=ITERS, inner_iterations=ITERS, **kw)
            results[method] = harness.measure(fn, lambda o: check((o.f, o.g)), reps, warmup)
        elif method.startswith("flash"):
            try:
                flash = peers.flash_alternating()
            except Exception as exc:  # absent: its rows say so
                results[method] = harness.failed(exc)
                continue
            fn = lambda tf32=prec == "tf32": flash(x, y, a, a, eps=EPS, n_iters=ITERS, allow_tf32=tf32,  # noqa: E731
                                                   ott_convention=True)
            results[method] = harness.measure(fn, lambda o: check(tuple(o[:2])), reps, 1 if n > 65536 else warmup)
        else:
            results[method] = ott_measure(x, y, "online" in method, prec, check, reps, warmup)
    return results


def ott_measure(x, y, online: bool, prec: str, check, reps: int, warmup: int) -> dict:
    try:
        import jax
        solve, _ = peers.ott_sinkhorn(ITERS, EPS, online)
        xj, yj = peers.to_jax(x), peers.to_jax(y)
        with jax.default_matmul_precision(peers.OTT_PRECISION[prec]):  # traced and run under it
            return harness.measure(lambda: jax.block_until_ready(solve(xj, yj)),
                                   lambda o: check(tuple(peers.to_torch(v, x.device) for v in o)), reps, warmup,
                                   kind="wall")
    except Exception as exc:
        return harness.failed(exc)


def plan(quick: bool) -> list[dict]:
    return harness.planned([r for n, d, _ in ITEMS if not quick or n <= SMALL for r in rows_for(n, d, {})])


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    rows = []
    for n, d, est in ITEMS:
        if (quick and n > SMALL) or not budget.fits(f"{WORKLOAD} n={n} d={d}", est):
            continue
        reps = 10 if n <= SMALL else 5 if n <= 65536 else 3
        try:
            results = measure_item(n, d, "cuda", reps)
        except Exception as exc:  # the inputs or the reference failed: every row says so
            results = {m: harness.failed(exc) for m, _, _ in methods(n)}
        rows += rows_for(n, d, results)
        emit(rows)
        torch.cuda.empty_cache()
    return rows


def tiny() -> list[dict]:
    """n = m = 64, d = 3 on the CPU (Triton interpreter): every code path, one repetition."""
    return rows_for(64, 3, measure_item(64, 3, "cpu", reps=1, warmup=0))


main = harness.cli(AREA, __doc__, plan, run, tiny)

if __name__ == "__main__":
    sys.exit(main())
