"""Many problems per call: ``torch_api.sinkhorn_batch`` against a loop of single solves and OTT-JAX's ``jax.vmap``.

Workload ``batched_50it``: B problems of randn clouds x_k, y_k + 0.5 (n = m points in d dimensions,
CPU seed n + d + B), uniform weights, OTT's conventions, eps = 0.1, 50 fixed alternating iterations
(``min_iterations = max_iterations = 50``): B in {16, 64, 256} x n in {256, 1024, 4096} x d in {3, 64}
(``--quick``: d = 3, n = 1024). Methods, in one process on the same inputs:

* ``ours``: the default batched call, ``torch_api.sinkhorn_batch(x, y, epsilon=0.1, min_iterations=50,
  max_iterations=50)`` on x (B, n, d), y (B, n, d) (one launch per half-step for the whole batch);
* ``ours_loop``: ``torch_api.sinkhorn(x[k], y[k], ...)`` for k = 0..B-1, the same options (compared with
  ``ours``: the gain of batching);
* ``ours_jax_vmap``: the JAX frontend's ``jax.jit(jax.vmap(lambda x, y: ot_triton_jax.sinkhorn(x, y,
  epsilon=0.1, min_iterations=50, max_iterations=50).f))`` (the vmap folds into the same packed loop);
* ``ott_vmap_dense``: ``jax.jit(jax.vmap(solve))`` of OTT-JAX's ``Sinkhorn(min_iterations=50,
  max_iterations=50)(LinearProblem(PointCloud(x, y, epsilon=0.1)))`` (dense geometry), under
  ``jax.default_matmul_precision("highest")``;
* ``ours_segment``: ``ot_triton_jax.segment_sinkhorn(x, y, num_segments=B, num_per_segment_x=(n,) * B, ...)``
  on the concatenated clouds (B n, d), jitted: OTT's ragged form (the per-problem costs);
* ``ott_segment``: OTT-JAX's ``ott.tools.segment_sinkhorn.segment_sinkhorn`` on the same concatenated
  clouds (dense geometry per segment, ``max_measure_size=n``), under ``"highest"`` precision.

The JAX methods get their inputs converted once, outside the timed calls. Gate: f of the first and
the last problem against 50 float64 iterations of the same updates (references.f64_sinkhorn), the
larger relative error, at most 1e-4 (the segment methods, which return costs: their reg_ot_cost). Times: medians of 5 CUDA-event
timings (OTT: wall clock around block_until_ready) after two warm-up calls.

    python -m bench.areas.batched [--quick] [--dry-run] [--tiny]
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import harness, peers  # noqa: E402
from bench.references import f64_sinkhorn  # noqa: E402

AREA, WORKLOAD = "batched", "batched_50it"
EPS, ITERS, TOLERANCE = 0.1, 50, 1e-4
ERROR_OF = "f of the first and last problems vs float64 of the same 50 iterations (the larger)"
ITEMS = tuple((n, d, B) for d in (3, 64) for n in (256, 1024, 4096) for B in (16, 64, 256))
METHODS = (("ours", None), ("ours_loop", "ours"), ("ours_jax_vmap", "ours"), ("ott_vmap_dense", "ours"),
           ("ours_segment", "ours"), ("ott_segment", "ours_segment"))
SEGMENT = ("ours_segment", "ott_segment")  # methods returning the (B,) costs
CALLS = {"ours": f"torch_api.sinkhorn_batch(x, y, epsilon={EPS}, min_iterations={ITERS}, max_iterations={ITERS})",
         "ours_loop": f"[torch_api.sinkhorn(x[k], y[k], epsilon={EPS}, min_iterations={ITERS}, "
                      f"max_iterations={ITERS}) for k in range(B)]",
         "ours_jax_vmap": f"jax.jit(jax.vmap(lambda x, y: ot_triton_jax.sinkhorn(x, y, epsilon={EPS}, "
                          f"min_iterations={ITERS}, max_iterations={ITERS}).f))",
         "ott_vmap_dense": f"jax.jit(jax.vmap(Sinkhorn(min_iterations={ITERS}, max_iterations={ITERS})(LinearProblem("
                           f"PointCloud(x, y, epsilon={EPS}))))) under highest precision",
         "ours_segment": f"jax.jit(ot_triton_jax.segment_sinkhorn(x, y, num_segments=B, num_per_segment_x=(n,) * B, "
                         f"num_per_segment_y=(n,) * B, epsilon={EPS}, min_iterations={ITERS}, max_iterations={ITERS}))",
         "ott_segment": f"jax.jit(ott.tools.segment_sinkhorn.segment_sinkhorn(x, y, num_segments=B, max_measure_size=n, "
                        f"num_per_segment_x=(n,) * B, num_per_segment_y=(n,) * B, epsilon={EPS}, sinkhorn_kwargs="
                        f"dict(min_iterations={ITERS}, max_iterations={ITERS}, inner_iterations=10))) under highest "
                        "precision"}


def clouds(n: int, d: int, B: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n + d + B)
    return (torch.randn(B, n, d, generator=gen).to(device), (torch.randn(B, n, d, generator=gen) + 0.5).to(device))


def rows_for(n: int, d: int, B: int, results: dict) -> list[dict]:
    rows = []
    for method, compare in METHODS:
        res = dict(results.get(method, {}))
        res.pop("call", None)
        rows.append(harness.row(WORKLOAD, f"B={B} n={n} d={d}", {"B": B, "n": n, "m": n, "d": d, "eps": EPS,
                                                                 "iterations": ITERS},
                                method, CALLS[method], res, tolerance=TOLERANCE, error_of=ERROR_OF,
                                ours=method.startswith("ours"), default=method == "ours", compare_to=compare,
                                precision="float32"))
    return rows


def _solver(method: str, iters: int):
    """fn(x, y) -> the f of every problem (a list of B tensors or a (B, n) array)."""
    import torch_api
    kw = dict(epsilon=EPS, min_iterations=iters, max_iterations=iters)
    if method == "ours":
        return lambda x, y: torch_api.sinkhorn_batch(x, y, **kw).f
    if method == "ours_loop":
        return lambda x, y: [torch_api.sinkhorn(x[k], y[k], **kw).f for k in range(x.shape[0])]
    import jax
    converted = {}

    def as_jax(x, y):  # once per input, outside the timed calls
        key = (id(x), id(y))
        if key not in converted:
            converted.clear()
            converted[key] = (peers.to_jax(x), peers.to_jax(y))
        return converted[key]

    if method in SEGMENT:
        return _segment(method, iters, as_jax)
    if method == "ours_jax_vmap":
        import ot_triton_jax as otj
        vours = jax.jit(jax.vmap(lambda x, y: otj.sinkhorn(x, y, **kw).f))
        return lambda x, y: vours(*as_jax(x, y)).block_until_ready()
    solve, _ = peers.ott_sinkhorn(iters, EPS)
    vsolve = jax.jit(jax.vmap(solve))

    def run(x, y):
        with jax.default_matmul_precision("highest"):
            f, _ = vsolve(*as_jax(x, y))
            return f.block_until_ready()
    return run


def _segment(method: str, iters: int, as_jax):
    """fn(x (B, n, d), y) -> the (B,) costs of the segment solve on the concatenated clouds."""
    import jax
    if method == "ours_segment":
        import ot_triton_jax as otj
        solve = lambda u, v, B, n: otj.segment_sinkhorn(  # noqa: E731
            u, v, num_segments=B, num_per_segment_x=(n,) * B, num_per_segment_y=(n,) * B, epsilon=EPS,
            min_iterations=iters, max_iterations=iters)
    else:
        from ott.tools import segment_sinkhorn
        solve = lambda u, v, B, n: segment_sinkhorn.segment_sinkhorn(  # noqa: E731
            u, v, num_segments=B, max_measure_size=n, num_per_segment_x=(n,) * B, num_per_segment_y=(n,) * B,
            epsilon=EPS, sinkhorn_kwargs=dict(min_iterations=iters, max_iterations=iters, inner_iterations=10))
    jitted = jax.jit(solve, static_argnums=(2, 3))

    def run(x, y):
        B, n, d = x.shape
        u, v = as_jax(x, y)
        with jax.default_matmul_precision("highest"):
            return jitted(u.reshape(B * n, d), v.reshape(B * y.shape[1], d), B, n).block_until_ready()
    return run


def measure_item(n: int, d: int, B: int, device: str, reps: int, warmup: int = 2, iters: int = ITERS) -> dict:
    x, y = clouds(n, d, B, device)
    full = {k: f64_sinkhorn(x[k], y[k], iters, EPS) for k in (0, B - 1)}
    refs = {k: r[0] for k, r in full.items()}

    def check_costs(costs):
        got = {k: float(costs[k]) for k in full}
        if not harness.finite(torch.tensor(list(got.values()))):
            return {"failure": "non-finite output"}
        return {"error": max(abs(got[k] - full[k][2]) / abs(full[k][2]) for k in full)}

    def check(fs):
        out = {k: (fs[k] if isinstance(fs, list) else peers.to_torch(fs[k], "cpu")) for k in refs}
        if not harness.finite(*out.values()):
            return {"failure": "non-finite output"}
        return {"error": max(harness.rel(out[k], refs[k]) for k in refs)}

    results = {}
    for method, _ in METHODS:
        kind = "wall" if method.startswith("ott") or "jax" in method or method in SEGMENT else ("cuda" if device == "cuda" else "wall")
        try:
            fn = _solver(method, iters)
        except Exception as exc:  # an absent peer
            results[method] = harness.failed(exc)
            continue
        results[method] = harness.measure(lambda: fn(x, y), check_costs if method in SEGMENT else check, reps,
                                          warmup, kind)
    return results


def _items(quick: bool) -> list[tuple[int, int, int]]:
    return [i for i in ITEMS if i[1] == 3 and i[0] == 1024] if quick else list(ITEMS)


def plan(quick: bool) -> list[dict]:
    return harness.planned([r for n, d, B in _items(quick) for r in rows_for(n, d, B, {})])


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    return harness.run_items(_items(quick), lambda n, d, B: f"{WORKLOAD} B={B} n={n} d={d}", 15,
                             lambda n, d, B: measure_item(n, d, B, "cuda", reps=5), rows_for, METHODS, budget, emit)


def tiny() -> list[dict]:
    """B = 3 problems of n = m = 24, d = 3, 10 iterations on the CPU (Triton interpreter), one repetition."""
    return rows_for(24, 3, 3, measure_item(24, 3, 3, "cpu", reps=1, warmup=0, iters=10))


main = harness.cli(AREA, __doc__, plan, run, tiny)

if __name__ == "__main__":
    sys.exit(main())
