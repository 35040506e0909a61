"""Hessian-vector products of many problems per call: ``torch_api.hvp`` on (B, n, d) against a loop of single calls.

Workload ``batched_hvp_x``: B problems of randn clouds x_k, y_k + 0.5 (n = m = 1024 points, CPU seed
n + d + B), uniform weights, OTT's conventions, the HVP in x of reg_ot_cost along a randn direction
v_k, with the library's defaults (forward threshold 1e-3, CG rtol 1e-4, no preconditioner):
B in {16, 64, 256} x d in {3, 64}, eps = 0.1 at d = 3 and 1.0 at d = 64 (``--quick``: d = 3).
Every time includes the forward solves. Methods, in one process on the same inputs:

* ``ours``: the default batched call ``torch_api.hvp(x, y, v, epsilon=eps)`` on x, y, v (B, n, d): the
  forward solves as one packed loop, then every problem's CG in one loop, each plan pass one
  block-sparse launch for the batch;
* ``ours_loop``: ``torch_api.hvp(x[k], y[k], v[k], epsilon=eps)`` for k = 0..B-1 (the gain of batching);
* ``ours_jax_vmap``: ``jax.jit(jax.vmap(lambda x, y, v: ot_triton_jax.hvp(x, y, v, epsilon=eps)[0]))``
  (the forward and the plan passes fold into packed launches; inputs converted outside the timing).

Gate: the HVP of the first and the last problem against the exact float64 HVP (tests/hvp_reference_gpu.py:
dense float64 potentials at an L1 marginal error of 1e-10, then the implicit-function HVP), the larger
relative error, at most 5e-2 as in the ``hvp`` area (at the default forward threshold the forward
solve's accuracy dominates). Times: medians of 5 CUDA-event timings (JAX: wall clock around
block_until_ready) after two warm-up calls.

    python -m bench.areas.batched_hvp [--quick] [--dry-run] [--tiny]
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import harness, peers  # noqa: E402
from bench.references import hvp_reference_module  # noqa: E402

AREA, WORKLOAD, TOLERANCE, N = "batched_hvp", "batched_hvp_x", 5e-2, 1024
EPS = {3: 0.1, 64: 1.0}
ERROR_OF = "HVP in x of the first and last problems vs the exact float64 HVP (the larger)"
ITEMS = tuple((d, B) for d in (3, 64) for B in (16, 64, 256))
METHODS = (("ours", None), ("ours_loop", "ours"), ("ours_jax_vmap", "ours"))
CALLS = {"ours": "torch_api.hvp(x, y, v, epsilon=eps) on (B, n, d)",
         "ours_loop": "[torch_api.hvp(x[k], y[k], v[k], epsilon=eps) for k in range(B)]",
         "ours_jax_vmap": "jax.jit(jax.vmap(lambda x, y, v: ot_triton_jax.hvp(x, y, v, epsilon=eps)[0]))"}


def inputs(n: int, d: int, B: int, device: str) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(n + d + B)
    x, y = torch.randn(B, n, d, generator=gen), torch.randn(B, n, d, generator=gen) + 0.5
    return tuple(t.to(device) for t in (x, y, torch.randn(B, n, d, generator=gen)))


def rows_for(n: int, d: int, B: int, results: dict) -> list[dict]:
    sizes = {"B": B, "n": n, "m": n, "d": d, "eps": EPS[d]}
    return [harness.row(WORKLOAD, f"B={B} n={n} d={d}", sizes, method, CALLS[method], results.get(method, {}),
                        tolerance=TOLERANCE, error_of=ERROR_OF, ours=True, default=method == "ours",
                        compare_to=compare, precision="float32")
            for method, compare in METHODS]


def _method(method: str, eps: float):
    """fn(x, y, v) -> the (B, n, d) HVPs (a tensor, a list or a JAX array)."""
    import torch_api
    if method == "ours":
        return lambda x, y, v: torch_api.hvp(x, y, v, epsilon=eps)[0]
    if method == "ours_loop":
        return lambda x, y, v: [torch_api.hvp(x[k], y[k], v[k], epsilon=eps)[0] for k in range(x.shape[0])]
    import jax
    import ot_triton_jax as otj
    vmapped = jax.jit(jax.vmap(lambda x, y, v: otj.hvp(x, y, v, epsilon=eps)[0]))
    converted = {}

    def run(x, y, v):
        key = (id(x), id(y), id(v))
        if key not in converted:  # once per input, outside the timed calls
            converted.clear()
            converted[key] = tuple(peers.to_jax(t) for t in (x, y, v))
        return vmapped(*converted[key]).block_until_ready()
    return run


def measure_item(n: int, d: int, B: int, device: str, reps: int, warmup: int = 2) -> dict:
    x, y, v = inputs(n, d, B, device)
    ref = hvp_reference_module()
    eps = EPS[d]
    want = {k: ref.hvp_reference(ref.solve_potentials(x[k], y[k], eps), vx=v[k])[0] for k in (0, B - 1)}

    def check(out):
        got = {k: (out[k] if isinstance(out, (list, torch.Tensor)) else peers.to_torch(out[k], device)) for k in want}
        if not harness.finite(*got.values()):
            return {"failure": "non-finite output"}
        return {"error": max(harness.rel(got[k], want[k]) for k in want)}

    results = {}
    for method, _ in METHODS:
        kind = "wall" if "jax" in method or device != "cuda" else "cuda"
        try:
            fn = _method(method, eps)
        except Exception as exc:  # JAX absent
            results[method] = harness.failed(exc)
            continue
        results[method] = harness.measure(lambda: fn(x, y, v), check, reps, warmup, kind)
    return results


def _items(quick: bool):
    return [i for i in ITEMS if i[0] == 3] if quick else ITEMS


def plan(quick: bool) -> list[dict]:
    return harness.planned([r for d, B in _items(quick) for r in rows_for(N, d, B, {})])


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    return harness.run_items(_items(quick), lambda d, B: f"{WORKLOAD} B={B} n={N} d={d}", 30,
                             lambda d, B: measure_item(N, d, B, "cuda", reps=5),
                             lambda d, B, results: rows_for(N, d, B, results), METHODS, budget, emit)


def tiny() -> list[dict]:
    """B = 3 problems of n = m = 24, d = 3 on the CPU (Triton interpreter), one repetition."""
    return rows_for(24, 3, 3, measure_item(24, 3, 3, "cpu", reps=1, warmup=0))


main = harness.cli(AREA, __doc__, plan, run, tiny)

if __name__ == "__main__":
    sys.exit(main())
