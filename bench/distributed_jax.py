"""Sharded Sinkhorn in JAX on the GPUs of one host: ``ot_triton_jax.distributed.sinkhorn`` over a
1-D mesh of P devices against ``ot_triton_jax.sinkhorn`` on one, one process, same inputs as
bench/distributed.py (its workload, modes and gate; the clouds drawn with jax.random).

    python bench/distributed_jax.py [--sizes 20 22] [--dims 3 64] [--gpus 2 4] [--iters 10]
        [--single-up-to 22] [--default-up-to 20] [--loss]

Every call is compiled ahead of the timing (``jax.jit(...).lower(...).compile()``, kernels
included) and timed once, synchronously (``block_until_ready``), the calls being seconds to
minutes long; below 2^20 points the median of 3. ``--loss`` times the default
``samples_loss`` call instead (bench/distributed.py's loss workload and gate). Per iteration the
communication of a sharded row is measured alone: one jitted ``shard_map`` running 20 rounds of
the loop's two tiled all-gathers of n / P floats per device (each round's pieces depend on the
last round's gathered vector, so XLA neither merges nor drops them), its time / 20. The single-device solve runs for
n <= 2^``--single-up-to``; the efficiency of a sharded row is against it. ``peak_gib_per_gpu`` is
the process's peak so far (``memory_stats`` has no reset): a row after a larger one repeats its
peak, so run one size and dimension per process to read it per workload. Writes the ``jax`` rows
of bench/results/distributed/<device>-x<P_max>.json (the torch rows are kept) and its plot.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import NamedTuple

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec  # noqa: E402

import ot_triton_jax  # noqa: E402
from bench.distributed_report import merge_rows  # noqa: E402
from ot_triton_jax import distributed  # noqa: E402

EPS, REPS, GATE = 0.1, 3, 1e-5


def clouds(n: int, d: int):
    kx, ky = jax.random.split(jax.random.PRNGKey(n + d))
    x = jax.random.normal(kx, (n, d), jnp.float32) / d ** 0.5
    y = (jax.random.normal(ky, (n, d), jnp.float32) + 0.3) / d ** 0.5
    return x, y


class LossOut(NamedTuple):
    """A samples_loss value in the shape of a solve's output (``f``: the loss, one 'iteration')."""

    f: jax.Array
    n_iters: int


def solve(x, y, mode: str, opts: dict, mesh: Mesh | None = None):
    """The single-device call (``mesh`` None) or the sharded one, of the workload ``mode``."""
    if mode == "samples_loss":
        value = ot_triton_jax.samples_loss(x, y) if mesh is None else distributed.samples_loss(x, y, mesh=mesh)
        return LossOut(value.reshape(1), 1)
    if mesh is None:
        return ot_triton_jax.sinkhorn(x, y, epsilon=EPS, **opts)
    return distributed.sinkhorn(x, y, mesh=mesh, epsilon=EPS, **opts)


def timed(compiled, args, reps: int):
    times, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = jax.block_until_ready(compiled(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def comm_seconds(n: int, mesh: Mesh) -> float:
    """One iteration's communication on ``mesh``: two tiled all-gathers of n / P floats per device."""
    P = mesh.devices.size
    width = -(-n // P)

    def rounds(piece):
        def body(_, v):
            for _ in range(2):
                v = 0.5 * (v + jax.lax.all_gather(v, "p", tiled=True)[:width])
            return v
        return jax.lax.fori_loop(0, 20, body, piece)

    fn = jax.jit(jax.shard_map(rounds, mesh=mesh, in_specs=PartitionSpec("p"), out_specs=PartitionSpec("p")))
    v = jax.device_put(jnp.ones(width * P, jnp.float32), NamedSharding(mesh, PartitionSpec("p")))
    compiled = fn.lower(v).compile()
    t, _ = timed(compiled, (v,), REPS)
    return t / 20


def peak_gib(devices) -> float:
    stats = [dv.memory_stats() or {} for dv in devices]
    return max(s.get("peak_bytes_in_use", 0) for s in stats) / 2 ** 30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[20, 22])
    ap.add_argument("--dims", type=int, nargs="+", default=[3, 64])
    ap.add_argument("--gpus", type=int, nargs="+", default=None)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--single-up-to", type=int, default=22)
    ap.add_argument("--default-up-to", type=int, default=20)
    ap.add_argument("--loss", action="store_true", help="time the default samples_loss call instead of sinkhorn")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "distributed"))
    args = ap.parse_args()
    devs = jax.devices()
    sizes = args.gpus or [p for p in (2, 4, 8, 16) if p <= len(devs)]
    env = dict(device=devs[0].device_kind, gpus=len(devs), jax=jax.__version__)
    rows = []
    for k in args.sizes:
        n = 2 ** k
        reps = REPS if n < 2 ** 20 else 1
        for d in args.dims:
            x, y = clouds(n, d)
            fixed = dict(threshold=1e-3, inner_iterations=10, min_iterations=args.iters, max_iterations=args.iters)
            workloads = [(f"{args.iters}it", fixed)] + ([("default", {})] if k <= args.default_up_to else [])
            for mode, opts in [("samples_loss", {})] if args.loss else workloads:
                single = None
                if k <= args.single_up_to:
                    fn = jax.jit(lambda x, y: solve(x, y, mode, opts))
                    t1, one = timed(fn.lower(x, y).compile(), (x, y), reps)
                    single = dict(frontend="jax", n=n, m=n, d=d, eps=EPS, mode=mode, gpus=1, sharded=False,
                                  n_iters=int(one.n_iters), ms=1e3 * t1, peak_gib_per_gpu=peak_gib(devs[:1]))
                    f1 = np.asarray(one.f)
                    rows.append(single)
                    print(single, flush=True)
                    merge_rows(args.out, env, "jax", __doc__, rows)
                for P in sizes:
                    mesh = Mesh(np.array(devs[:P]), ("p",))
                    sh = NamedSharding(mesh, PartitionSpec("p"))
                    xs, ys = jax.device_put(x, sh), jax.device_put(y, sh)
                    fn = jax.jit(lambda x, y: solve(x, y, mode, opts, mesh))
                    tp, out = timed(fn.lower(xs, ys).compile(), (xs, ys), reps)
                    row = dict(frontend="jax", n=n, m=n, d=d, eps=EPS, mode=mode, gpus=P, sharded=True,
                               n_iters=int(out.n_iters), ms=1e3 * tp, peak_gib_per_gpu=peak_gib(devs[:P]))
                    if mode != "samples_loss":
                        comm = comm_seconds(n, mesh)
                        row.update(comm_ms_per_iteration=1e3 * comm,
                                   compute_ms_per_iteration=1e3 * (tp / max(row["n_iters"], 1) - comm))
                    if single is not None:
                        row.update(efficiency=single["ms"] / (P * row["ms"]), ms_single=single["ms"],
                                   same_iterations=row["n_iters"] == single["n_iters"])
                        if mode != "default":
                            f = np.asarray(out.f)
                            row["f_error_vs_single"] = float(np.abs(f - f1).max() / np.abs(f1).max())
                    rows.append(row)
                    print(row, flush=True)
                    merge_rows(args.out, env, "jax", __doc__, rows)  # after every row: a run cut short keeps it
                    del xs, ys, out
            del x, y
    return 0


if __name__ == "__main__":
    sys.exit(main())
