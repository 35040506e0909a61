"""Sinkhorn divergences of many problems per call, value and gradient: ``torch_api.sinkhorn_divergence`` on (B, n, d).

Workload ``batched_divergence_grad``: B problems of randn clouds x_k, y_k + 0.5 (n = m = 1024 points,
d = 3, CPU seed n + d + B), uniform weights, OTT's conventions (``sinkhorn_divergence`` with its
default symmetric self solves), eps = 0.1, the library's default stopping (threshold 1e-3): the
divergences and their gradient in x, a training step's work, for B in {16, 64, 256} (``--quick``:
B = 256). Methods, in one process on the same inputs:

* ``ours``: the default call ``torch_api.sinkhorn_divergence(x, y, epsilon=0.1)`` on x, y (B, n, d)
  and ``torch.autograd.grad(div.sum(), x)``: one packed loop for the B (x, y) problems, one for the
  2B self problems (one launch per half-step each), the gradients one block-sparse pass per term;
* ``ours_loop``: the same per problem, ``sinkhorn_divergence(x[k], y[k], ...)`` for k = 0..B-1 and
  one backward of their sum (the gain of packing);
* ``ours_jax_vmap``: ``jax.jit(jax.vmap(jax.value_and_grad(lambda x, y: ot_triton_jax.sinkhorn_divergence(x, y,
  epsilon=0.1)[0])))`` (the solves fold into packed loops);
* ``ott_vmap_dense``: the same with OTT-JAX's ``ott.tools.sinkhorn_divergence.sinkhorn_divergence(PointCloud,
  x, y, epsilon=0.1)`` (dense geometry), under ``jax.default_matmul_precision("highest")``.

Gate: the divergence of the first and the last problem against float64 (dense alternating iterations
of each of its three terms to an L1 marginal error below 1e-4, 10x below the default threshold), the larger relative error, at most
1e-2 (the default threshold bounds each term's marginal error by 1e-3); the gradient must be finite.
Times: medians of 5 CUDA-event timings (JAX: wall clock around block_until_ready) after two warm-ups.

    python -m bench.areas.batched_divergence [--quick] [--dry-run] [--tiny]
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a file: import through the package, not this folder
    sys.path[0] = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench import harness, peers  # noqa: E402
from bench.references import f64_sinkhorn  # noqa: E402

AREA, WORKLOAD, TOLERANCE, N, D, EPS = "batched_divergence", "batched_divergence_grad", 1e-2, 1024, 3, 0.1
ERROR_OF = "divergence of the first and last problems vs float64 (the larger)"
ITEMS = (16, 64, 256)
METHODS = (("ours", None), ("ours_loop", "ours"), ("ours_jax_vmap", "ours"), ("ott_vmap_dense", "ours"))
CALLS = {"ours": f"torch_api.sinkhorn_divergence(x, y, epsilon={EPS}) on (B, n, d), grad in x",
         "ours_loop": f"[torch_api.sinkhorn_divergence(x[k], y[k], epsilon={EPS}) for k in range(B)], grad in x",
         "ours_jax_vmap": f"jax.jit(jax.vmap(jax.value_and_grad(lambda x, y: ot_triton_jax.sinkhorn_divergence("
                          f"x, y, epsilon={EPS})[0])))",
         "ott_vmap_dense": f"jax.jit(jax.vmap(jax.value_and_grad(lambda x, y: sinkhorn_divergence(PointCloud, x, y, "
                           f"epsilon={EPS})[0]))) under highest precision"}


def inputs(n: int, B: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(n + D + B)
    x, y = torch.randn(B, n, D, generator=gen), torch.randn(B, n, D, generator=gen) + 0.5
    return x.to(device), y.to(device)


def rows_for(n: int, B: int, results: dict) -> list[dict]:
    sizes = {"B": B, "n": n, "m": n, "d": D, "eps": EPS}
    return [harness.row(WORKLOAD, f"B={B} n={n} d={D}", sizes, method, CALLS[method], results.get(method, {}),
                        tolerance=TOLERANCE, error_of=ERROR_OF, ours=method.startswith("ours"),
                        default=method == "ours", compare_to=compare, precision="float32")
            for method, compare in METHODS]


def _f64_divergence(x: torch.Tensor, y: torch.Tensor) -> float:
    """The divergence in float64: each term's alternating iterations run until converged."""
    def cost(u, v):
        for iters in (500, 2000, 8000):
            f, g, c = f64_sinkhorn(u, v, iters, EPS)
            C = torch.cdist(u.double(), v.double()) ** 2
            plan = torch.exp((f[:, None] + g[None] - C) / EPS)  # OTT potentials: P = exp((f + g - C) / eps)
            if float((plan.sum(0) - 1.0 / v.shape[0]).abs().sum()) < 1e-4:
                return c
        raise RuntimeError("the float64 reference did not converge")
    return cost(x, y) - 0.5 * (cost(x, x) + cost(y, y))


def _method(method: str):
    """fn(x, y) -> (divergences (B,), gradient in x (B, n, d))."""
    import torch_api
    if method == "ours":
        def ours(x, y):
            xg = x.detach().requires_grad_()
            div = torch_api.sinkhorn_divergence(xg, y, epsilon=EPS)[0]
            return div.detach(), torch.autograd.grad(div.sum(), xg)[0]
        return ours
    if method == "ours_loop":
        def loop(x, y):
            xs = [x[k].detach().requires_grad_() for k in range(x.shape[0])]
            div = torch.stack([torch_api.sinkhorn_divergence(xk, y[k], epsilon=EPS)[0] for k, xk in enumerate(xs)])
            return div.detach(), torch.stack(torch.autograd.grad(div.sum(), xs))
        return loop
    import jax
    if method == "ours_jax_vmap":
        import ot_triton_jax as otj
        fn = jax.jit(jax.vmap(jax.value_and_grad(lambda x, y: otj.sinkhorn_divergence(x, y, epsilon=EPS)[0])))
    else:
        from ott.geometry import pointcloud
        from ott.tools import sinkhorn_divergence
        fn = jax.jit(jax.vmap(jax.value_and_grad(lambda x, y: sinkhorn_divergence.sinkhorn_divergence(
            pointcloud.PointCloud, x, y, epsilon=EPS)[0])))
    converted = {}

    def run(x, y):
        key = (id(x), id(y))
        if key not in converted:  # once per input, outside the timed calls
            converted.clear()
            converted[key] = (peers.to_jax(x), peers.to_jax(y))
        with jax.default_matmul_precision("highest"):
            return jax.block_until_ready(fn(*converted[key]))
    return run


def measure_item(n: int, B: int, device: str, reps: int, warmup: int = 2) -> dict:
    x, y = inputs(n, B, device)
    want = {k: _f64_divergence(x[k], y[k]) for k in (0, B - 1)}

    def check(out):
        div, grad = (peers.to_torch(o, "cpu") if not isinstance(o, torch.Tensor) else o.cpu() for o in out)
        if not harness.finite(div, grad):
            return {"failure": "non-finite output"}
        return {"error": max(abs(float(div[k]) - w) / abs(w) for k, w in want.items())}

    results = {}
    for method, _ in METHODS:
        kind = "wall" if "jax" in method or "ott" in method or device != "cuda" else "cuda"
        try:
            fn = _method(method)
        except Exception as exc:  # JAX or OTT absent
            results[method] = harness.failed(exc)
            continue
        results[method] = harness.measure(lambda: fn(x, y), check, reps, warmup, kind)
    return results


def _items(quick: bool):
    return (256,) if quick else ITEMS


def plan(quick: bool) -> list[dict]:
    return harness.planned([r for B in _items(quick) for r in rows_for(N, B, {})])


def run(quick: bool, budget: harness.Budget, emit) -> list[dict]:
    return harness.run_items([(B,) for B in _items(quick)], lambda B: f"{WORKLOAD} B={B} n={N} d={D}", 40,
                             lambda B: measure_item(N, B, "cuda", reps=5), lambda B, res: rows_for(N, B, res),
                             METHODS, budget, emit)


def tiny() -> list[dict]:
    """B = 3 problems of n = m = 24 on the CPU (Triton interpreter), one repetition."""
    return rows_for(24, 3, measure_item(24, 3, "cpu", reps=1, warmup=0))


main = harness.cli(AREA, __doc__, plan, run, tiny)

if __name__ == "__main__":
    sys.exit(main())
