"""Many GeomLoss problems per call: ``torch_api.SamplesLoss`` on (B, N, D) against a loop of single calls,
GeomLoss's tensorized batch and flash-sinkhorn's batch.

Workload ``batched_samples_loss_grad``: B problems of randn clouds x_k, y_k + 0.5 (n = m points in d
dimensions, CPU seed n + d + B), uniform weights, GeomLoss's debiased annealed Sinkhorn, p = 2
(C = |x - y|^2 / 2), blur 0.05 (eps = 0.0025), scaling 0.5: B in {16, 64, 256} x n in {256, 1024,
4096} x d in {3, 64} (``--quick``: d = 3, n = 1024). Timed: the per-problem losses (B,) and the
gradient of their sum in x, the call a training step makes. Every method solves the same B problems on
the same schedule: GeomLoss computes one diameter (the bounding box of all the batch's points) for a
batch, and the methods that loop over the problems are given that diameter. Methods, in one process on
the same inputs:

* ``ours``: the default call ``torch_api.SamplesLoss("sinkhorn", p=2, blur=0.05, scaling=0.5)(x, y)`` on
  x (B, n, d), y (B, n, d) (the problems packed: one launch per softmin for the whole batch);
* ``ours_loop``: the same module on x[k], y[k] for k = 0..B-1 with ``diameter`` set to the batch's
  (compared with ``ours``: the gain of packing);
* ``ours_jax``: the JAX frontend's ``jax.jit(jax.value_and_grad(sum of ot_triton_jax.samples_loss(x, y,
  blur=0.05, scaling=0.5)))`` on x (B, n, d) (the problems packed as in PyTorch; wall clock around
  ``block_until_ready``);
* ``geomloss_tensorized``: GeomLoss 0.3.1 ``backend="tensorized"`` on (B, n, d) in float32 (B dense
  n x n matrices per softmin);
* ``flash_sinkhorn``: flash-sinkhorn 0.4.1's ``SamplesLoss`` on (B, n, d) (it solves the problems one
  after another) with GeomLoss's cost (``half_cost=True``), float32 (``allow_tf32=False``), the
  batch's ``diameter``.

Gate: the gradient in x of the first and the last problem against GeomLoss tensorized in float64 on
that problem with the batch's diameter, the larger relative error, at most max(1e-4, 2 x the float32
floor of the item). The floor is the error of the same dense algorithm run in float32 on the same two
problems (GeomLoss tensorized, one problem at a time): at d = 64 and eps = 0.0025 the exponents C / eps
reach ~5e4 and float32 rounding alone leaves ~1.1e-4 in the gradient, whatever the solver. Times: medians
of 5 CUDA-event timings after two warm-up calls.

    python -m bench.areas.batched_samples_loss [--quick] [--dry-run] [--tiny]
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import harness, peers  # noqa: E402

AREA, WORKLOAD = "batched_samples_loss", "batched_samples_loss_grad"
BLUR, SCALING, TOLERANCE = 0.05, 0.5, 1e-4
ERROR_OF = "gradient in x of the first and last problems vs GeomLoss tensorized in float64 (the larger)"
ITEMS = tuple((n, d, B) for d in (3, 64) for n in (256, 1024, 4096) for B in (16, 64, 256))
QUICK = tuple(i for i in ITEMS if i[1] == 3 and i[0] == 1024)
METHODS = (("ours", None), ("ours_loop", "ours"), ("ours_jax", "ours"), ("geomloss_tensorized", "ours"),
           ("flash_sinkhorn", "ours"))
_OURS = f'torch_api.SamplesLoss("sinkhorn", p=2, blur={BLUR}, scaling={SCALING})'
CALLS = {"ours": f"{_OURS}(x, y) on (B, n, d)",
         "ours_loop": f"[{_OURS[:-1]}, diameter=D)(x[k], y[k]) for k in range(B)]",
         "ours_jax": f"jax.jit(jax.value_and_grad(lambda x: ot_triton_jax.samples_loss(x, y, blur={BLUR}, "
                     f"scaling={SCALING}).sum()))(x) on (B, n, d)",
         "geomloss_tensorized": f"geomloss.SamplesLoss('sinkhorn', p=2, blur={BLUR}, scaling={SCALING}, "
                                "backend='tensorized')(x, y) on (B, n, d)",
         "flash_sinkhorn": f"flash_sinkhorn.samples_loss.SamplesLoss('sinkhorn', p=2, blur={BLUR}, scaling={SCALING}, "
                           "half_cost=True, allow_tf32=False, diameter=D)(x, y) on (B, n, d)"}


def clouds(n: int, d: int, B: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n + d + B)
    return (torch.randn(B, n, d, generator=gen).to(device), (torch.randn(B, n, d, generator=gen) + 0.5).to(device))


def diameter(x: torch.Tensor, y: torch.Tensor) -> float:
    """GeomLoss's diameter of a batch: the diagonal of the bounding box of all its points."""
    pts = torch.cat((x.reshape(-1, x.shape[-1]), y.reshape(-1, y.shape[-1]))).double()
    return float((pts.max(0).values - pts.min(0).values).norm())


def rows_for(n: int, d: int, B: int, results: dict) -> list[dict]:
    rows = []
    floor = results.get("float32_floor")
    tolerance = TOLERANCE if floor is None else max(TOLERANCE, 2.0 * floor)
    for method, compare in METHODS:
        res = dict(results.get(method, {}))
        rows.append(harness.row(WORKLOAD, f"B={B} n={n} d={d}", {"B": B, "n": n, "m": n, "d": d, "blur": BLUR,
                                                                 "eps": BLUR ** 2, "scaling": SCALING},
                                method, CALLS[method], res, tolerance=tolerance, float32_floor=floor,
                                error_of=ERROR_OF,
                                ours=method.startswith("ours"), default=method == "ours", compare_to=compare,
                                precision="float32"))
    return rows


def _loss(method: str, D: float):
    """fn(x, y) -> the B losses (B,) of a batch."""
    if method.startswith("ours"):
        import torch_api
        if method == "ours":
            return torch_api.SamplesLoss("sinkhorn", p=2, blur=BLUR, scaling=SCALING)
        single = torch_api.SamplesLoss("sinkhorn", p=2, blur=BLUR, scaling=SCALING, diameter=D)
        return lambda x, y: torch.stack([single(x[k], y[k]) for k in range(x.shape[0])])
    if method == "geomloss_tensorized":
        return peers.geomloss_samples_loss(BLUR, SCALING)[0]
    return peers.flash_samples_loss(BLUR, SCALING, tf32=False, diameter=D)[0]


def jax_value_and_grad():
    """fn(x, y) -> (the B losses, the gradient of their sum in x), JAX arrays, the inputs converted once."""
    import jax
    import ot_triton_jax as otj
    def total(x, y):
        values = otj.samples_loss(x, y, blur=BLUR, scaling=SCALING)
        return values.sum(), values

    vg = jax.jit(jax.value_and_grad(total, has_aux=True))
    converted = {}

    def run(x, y):
        key = (id(x), id(y))
        if key not in converted:  # outside the timed calls after the first
            converted.clear()
            converted[key] = (peers.to_jax(x), peers.to_jax(y))
        xj, yj = converted[key]
        (_, values), grad = vg(xj, yj)
        return jax.block_until_ready((values, grad))
    return run


def value_and_grad(loss, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    xg = x.detach().clone().requires_grad_(True)
    values = loss(xg, y)
    (grad,) = torch.autograd.grad(values.sum(), xg)
    return values.detach(), grad


def reference(x: torch.Tensor, y: torch.Tensor, D: float, k: int, dtype=torch.float64) -> torch.Tensor:
    """The gradient in x_k of problem k's loss, GeomLoss tensorized (float64: the reference; float32:
    the floor) with the batch's diameter."""
    import geomloss
    loss = geomloss.SamplesLoss("sinkhorn", p=2, blur=BLUR, scaling=SCALING, debias=True, backend="tensorized",
                                diameter=D)
    return value_and_grad(lambda u, v: loss(u, v).reshape(1), x[k].to(dtype), y[k].to(dtype))[1]


def measure_item(n: int, d: int, B: int, device: str, reps: int, warmup: int = 2) -> dict:
    x, y = clouds(n, d, B, device)
    D = diameter(x, y)
    try:
        refs = {k: reference(x, y, D, k) for k in (0, B - 1)}
        floor = max(harness.rel(reference(x, y, D, k, torch.float32), refs[k]) for k in refs)
    except Exception as exc:  # no reference: no row can pass its gate
        refs, floor = exc, None

    def check(out):
        values, grad = out
        if not harness.finite(values, grad):
            return {"failure": "non-finite output"}
        if isinstance(refs, Exception):
            return {"failure": f"no float64 reference (GeomLoss): {refs!r}"[:300]}
        return {"error": max(harness.rel(grad[k], refs[k]) for k in refs)}

    results = {}
    for method, _ in METHODS:
        try:
            if method == "ours_jax":
                run = jax_value_and_grad()
                results[method] = harness.measure(
                    lambda: run(x, y), lambda o: check(tuple(peers.to_torch(v, x.device) for v in o)), reps,
                    warmup, "wall")
                continue
            loss = _loss(method, D)
            results[method] = harness.measure(lambda: value_and_grad(loss, x, y), check, reps, warmup,
                                              "cuda" if device == "cuda" else "wall")
        except Exception as exc:  # an absent peer, or out of memory
            results[method] = harness.failed(exc)
        if device == "cuda":
            torch.cuda.empty_cache()
    results["float32_floor"] = floor
    return results


def plan(quick: bool) -> list[dict]:
    return harness.planned([r for n, d, B in (QUICK if quick else ITEMS) for r in rows_for(n, d, B, {})])


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    return harness.run_items(QUICK if quick else ITEMS, lambda n, d, B: f"{WORKLOAD} B={B} n={n} d={d}", 20,
                             lambda n, d, B: measure_item(n, d, B, "cuda", reps=5), rows_for, METHODS, budget, emit)


def tiny() -> list[dict]:
    """B = 3 problems of n = m = 24, d = 3 on the CPU (Triton interpreter), one repetition."""
    return rows_for(24, 3, 3, measure_item(24, 3, 3, "cpu", reps=1, warmup=0))


main = harness.cli(AREA, __doc__, plan, run, tiny)

if __name__ == "__main__":
    sys.exit(main())
