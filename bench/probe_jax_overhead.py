"""Where the JAX solve loses time against the bare kernels (issue 3, n = m = 8192, d = 64).

Times, in one process on the same inputs (float32 precision, eps = 0.1):
  torch_graph_half_step: one torch LSE half-step (kernel + combine), CUDA-graph replay of 50;
  jax_loop_*:            50 half-steps in one jitted fori_loop (triton_call), per half-step:
                         bare (no previous potential), fold (FOLD + pold), fold_err (+ error + sum);
  jax_solve / torch_solve: the 100-iteration solves of bench_jax_sinkhorn.py, per half-step.
Writes bench/results/probe_jax_overhead_<device>.json. XLA_FLAGS is recorded (run it twice with
different flags to compare command-buffer settings).

    python bench/probe_jax_overhead.py
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import torch  # noqa: E402
from triton.testing import do_bench_cudagraph  # noqa: E402

from common import environment, wall_median_ms, write  # noqa: E402

import ot_triton_jax as otj  # noqa: E402
import torch_api  # noqa: E402
from ot_triton_jax.jax_frontend import kernel_ops as jax_ops  # noqa: E402
from torch_api import kernel_ops as kernel_calls  # noqa: E402

N, D, EPS, K = 8192, 64, 0.1, 50


def wall_ms(fn, reps=7):
    return wall_median_ms(fn, reps)[0]


def main():
    rec = {"n": N, "d": D, "eps": EPS, "half_steps_per_loop": K, "xla_flags": os.environ.get("XLA_FLAGS", "")}
    kx, ky = jax.random.split(jax.random.PRNGKey(0))
    x = jax.random.normal(kx, (N, D), jnp.float32)
    y = jax.random.normal(ky, (N, D), jnp.float32)
    X, Y = jax_ops.clouds(x, y)
    prm = jax_ops.make_params(EPS, 1.0)
    la = jnp.full((N,), -jnp.log(N), jnp.float32)

    def loop(kind):
        def body(i, st):
            g, f = st
            if kind == "bare":
                out, _ = jax_ops.lse_update(X, Y, g, prm, precision="float32", logw_out=la)
                return out, f
            if kind == "fold":
                out, _ = jax_ops.lse_update(X, Y, g, prm, precision="float32", logw_out=la, pold=f,
                                            compute_err=False, fold=True)
                return out, f
            out, err = jax_ops.lse_update(X, Y, g, prm, precision="float32", logw_out=la, pold=f, fold=True)
            return out + 0.0 * jnp.sum(err), f
        return jax.jit(lambda g, f: jax.lax.fori_loop(0, K, body, (g, f)))

    g0 = jnp.zeros((N,), jnp.float32)
    f0 = jax_ops.lse_update(X, Y, g0, prm, precision="float32", logw_out=la)[0]
    for kind in ("bare", "fold", "fold_err"):
        fn = loop(kind)
        ms = wall_ms(lambda: jax.block_until_ready(fn(f0, f0)))
        rec[f"jax_loop_{kind}_ms_per_half_step"] = ms / K
        print(kind, ms / K, flush=True)

    # torch: the same half-step, CUDA graph of K launches
    xt, yt = otj.to_torch(x), otj.to_torch(y)
    Xt, Yt = kernel_calls.clouds(xt, yt)
    prmt = kernel_calls.params(EPS, 1.0, xt.device)
    lat = torch.full((N,), -float(torch.log(torch.tensor(float(N)))), device="cuda")
    gt = otj.to_torch(f0).clone()

    def torch_steps():
        for _ in range(K):
            kernel_calls.lse_update(Xt, Yt, gt, prmt, "float32", logw_out=lat)
    rec["torch_graph_ms_per_half_step"] = do_bench_cudagraph(torch_steps, rep=200) / K
    t = wall_ms(lambda: (torch_steps(), torch.cuda.synchronize()))
    rec["torch_eager_ms_per_half_step"] = t / K
    print("torch graph", rec["torch_graph_ms_per_half_step"], "eager", rec["torch_eager_ms_per_half_step"], flush=True)

    # whole solves, 100 fixed iterations (201 half-steps)
    kw = dict(epsilon=EPS, min_iterations=100, max_iterations=100, inner_iterations=10)
    solve = jax.jit(lambda x, y: otj.sinkhorn(x, y, **kw))
    rec["jax_solve_ms"] = wall_ms(lambda: jax.block_until_ready(solve(x, y)))
    rec["torch_solve_ms"] = wall_ms(lambda: (torch_api.sinkhorn(xt, yt, **kw), torch.cuda.synchronize()))
    print("solves jax", rec["jax_solve_ms"], "torch", rec["torch_solve_ms"], flush=True)
    tag = os.environ.get("PROBE_TAG", "")
    write("probe_jax_overhead" + (f"_{tag}" if tag else ""), {"env": environment(), "results": rec})


if __name__ == "__main__":
    main()
