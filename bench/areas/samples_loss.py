"""Debiased Sinkhorn divergence, loss + gradient: ``torch_api.SamplesLoss`` against flash-sinkhorn and GeomLoss.

Workload ``samples_loss_grad``: GeomLoss's annealed debiased Sinkhorn, p = 2 (C = |x - y|^2 / 2,
eps = blur^2), scaling 0.5, randn clouds x and y + 0.5 (CPU seed n + d), uniform weights:
n = m = 8192, d = 3, blur 0.05 and n = m = 16384, d = 16, blur 0.1 (``--quick``: the first). Timed:
``loss(x, y)`` and ``torch.autograd.grad`` of it in x, the call a user makes to train. Methods, in one
process on the same inputs:

* ``ours``: the default call ``torch_api.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=0.5)``
  (float32); ``ours_tf32``: the same with ``precision="tf32"`` (non-default, beside it);
* ``flash_sinkhorn_fp32`` / ``_tf32``: flash-sinkhorn's ``SamplesLoss`` (debias, ``half_cost=True``
  so that its cost is GeomLoss's, ``allow_tf32`` False / True), compared with ours of the same precision;
* ``geomloss_tensorized``: GeomLoss 0.3.1 ``backend="tensorized"`` in float32.

Gate: the gradient's relative error against GeomLoss tensorized in float64 on the same inputs (the
loss's error is recorded beside it), at most 1e-4 for float32 rows and 1e-1 for tf32 rows. Times:
medians of 10 CUDA-event timings after two warm-up calls (a shape's first solve compiles, its second
captures the CUDA graph). Floors: floors.floor_ms("samples_loss_grad", ...) with
floors.samples_loss_half_steps of GeomLoss's schedule from the clouds' diameter.

    python -m bench.areas.samples_loss [--quick] [--dry-run] [--tiny]

Takes ~45 s on an H100 with the peers' kept autotuning results (``--quick`` ~25 s).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import harness, peers  # noqa: E402
from bench.floors import floor_ms, samples_loss_half_steps  # noqa: E402
from bench.references import geomloss_f64, loss_and_grad  # noqa: E402

AREA, WORKLOAD = "samples_loss", "samples_loss_grad"
SCALING = 0.5
TOLERANCE = {"float32": 1e-4, "tf32": 1e-1}
ERROR_OF = "gradient in x vs GeomLoss tensorized in float64"
ITEMS = ((8192, 3, 0.05, 25), (16384, 16, 0.1, 20))  # (n, d, blur, expected seconds on the H100)
METHODS = (("ours", "float32", None), ("ours_tf32", "tf32", "ours"), ("flash_sinkhorn_fp32", "float32", "ours"),
           ("flash_sinkhorn_tf32", "tf32", "ours_tf32"), ("geomloss_tensorized", "float32", "ours"))


def clouds(n: int, d: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n + d)
    return torch.randn(n, d, generator=gen).to(device), (torch.randn(n, d, generator=gen) + 0.5).to(device)


def loss_of(method: str, blur: float):
    """(loss module, its call string); raises when a peer is absent."""
    if method.startswith("ours"):
        import torch_api
        kw = {} if method == "ours" else {"precision": "tf32"}
        call = f'torch_api.SamplesLoss("sinkhorn", p=2, blur={blur}, scaling={SCALING}' + (
            ', precision="tf32")' if kw else ")")
        return torch_api.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=SCALING, **kw), call
    if method.startswith("flash"):
        return peers.flash_samples_loss(blur, SCALING, tf32=method.endswith("tf32"))
    return peers.geomloss_samples_loss(blur, SCALING)


def half_steps(n: int, d: int, blur: float) -> int:
    pts = torch.cat(clouds(n, d, "cpu")).double()  # GeomLoss's diameter: the joint bounding box's diagonal
    return samples_loss_half_steps(float((pts.max(0).values - pts.min(0).values).norm()), blur, SCALING)


def rows_for(n: int, d: int, blur: float, results: dict) -> list[dict]:
    rows, hs = [], half_steps(n, d, blur)
    for method, prec, compare in METHODS:
        fl, unit = floor_ms(WORKLOAD, n, n, d, prec, hs)
        res = results.get(method, {})
        call = res.pop("call", None) or (f"{method}, blur={blur}, scaling={SCALING}")
        rows.append(harness.row(WORKLOAD, f"n={n} d={d} blur={blur}",
                                {"n": n, "m": n, "d": d, "blur": blur, "eps": blur ** 2, "scaling": SCALING},
                                method, call, res, tolerance=TOLERANCE[prec], error_of=ERROR_OF,
                                ours=method.startswith("ours"), default=method == "ours", compare_to=compare,
                                precision=prec, half_steps=hs, floor_ms=fl, floor_unit=unit,
                                fraction_of_floor=fl / res["ms"] if res.get("ms") else None))
    return rows


def measure_item(n: int, d: int, blur: float, device: str, reps: int, warmup: int = 2) -> dict:
    x, y = clouds(n, d, device)
    try:
        ref = geomloss_f64(x, y, blur, SCALING)
    except Exception as exc:  # no reference: no row can pass its gate
        ref = exc

    def check(out):
        value, grad = out
        if not harness.finite(value, grad):
            return {"failure": "non-finite output"}
        if isinstance(ref, Exception):
            return {"failure": f"no float64 reference (GeomLoss): {ref!r}"[:300]}
        return {"error": harness.rel(grad, ref[1]), "error_loss": abs(float(value) - float(ref[0])) / abs(float(ref[0]))}

    results = {}
    for method, _, _ in METHODS:
        try:
            loss, call = loss_of(method, blur)
        except Exception as exc:  # an absent peer
            results[method] = harness.failed(exc)
            continue
        results[method] = dict(harness.measure(lambda: loss_and_grad(loss, x, y), check, reps, warmup), call=call)
    return results


def plan(quick: bool) -> list[dict]:
    return harness.planned([r for n, d, blur, _ in ITEMS[: 1 if quick else None] for r in rows_for(n, d, blur, {})])


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    rows = []
    for n, d, blur, est in ITEMS[: 1 if quick else None]:
        if not budget.fits(f"{WORKLOAD} n={n} d={d}", est):
            continue
        try:
            results = measure_item(n, d, blur, "cuda", reps=10)
        except Exception as exc:
            results = {m: harness.failed(exc) for m, _, _ in METHODS}
        rows += rows_for(n, d, blur, results)
        emit(rows)
        torch.cuda.empty_cache()
    return rows


def tiny() -> list[dict]:
    """n = m = 64, d = 3, blur 0.1 on the CPU (Triton interpreter), one repetition."""
    return rows_for(64, 3, 0.1, measure_item(64, 3, 0.1, "cpu", reps=1, warmup=0))


main = harness.cli(AREA, __doc__, plan, run, tiny)

if __name__ == "__main__":
    sys.exit(main())
