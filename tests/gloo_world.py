"""Tests of ``torch_api.distributed`` on CPU processes: one Gloo world per size, spawned once.

``Worlds(body)``: ``worlds(P, tmp_path_factory)`` spawns P processes (Triton interpreter: the
children start with ``TRITON_INTERPRET=1``; the parent's environment is left as it was, so a GPU
run that only collects these tests keeps compiling its own kernels), runs
``body(rank, world) -> dict`` on every rank inside an initialized Gloo group, and returns what
each rank saw (a rank that raised fails the test with its traceback). ``shard`` and ``sizes``
cut a global tensor into a rank's rows as the tests lay them out.
"""

from __future__ import annotations

import os
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ot_triton_jax.core.sharding import ShardLayout, split_sizes


def sizes(given, n: int, world: int) -> tuple[int, ...]:
    """The shard sizes of n rows: ``given[world]`` when given, else numpy.array_split's."""
    return given[world] if given is not None else split_sizes(n, world)


def shard(t, row_sizes, rank: int):
    """Rank ``rank``'s rows of ``t`` (None stays None)."""
    if t is None:
        return None
    start, stop = ShardLayout(tuple(row_sizes)).rows(rank)
    return t[start:stop].clone()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, world: int, port: int, outdir: str, body) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)  # the ranks share a few cores
    try:
        results = body(rank, world)
    except Exception:  # noqa: BLE001 (reported to the parent, which fails the test)
        results = {"crash": traceback.format_exc()}
    finally:
        dist.destroy_process_group()
    torch.save(results, os.path.join(outdir, f"rank{rank}.pt"))


class Worlds:
    """The runs of ``body`` per world size, each spawned at its first use."""

    def __init__(self, body):
        self.body, self.runs = body, {}

    def __call__(self, world: int, tmp_path_factory) -> list[dict]:
        if world not in self.runs:
            outdir = str(tmp_path_factory.mktemp(f"world{world}"))
            saved = os.environ.get("TRITON_INTERPRET")
            os.environ["TRITON_INTERPRET"] = "1"  # read by the children at their import of torch_api
            try:
                mp.spawn(_rank, args=(world, _free_port(), outdir, self.body), nprocs=world, join=True)
            finally:
                if saved is None:
                    del os.environ["TRITON_INTERPRET"]
                else:
                    os.environ["TRITON_INTERPRET"] = saved
            runs = [torch.load(os.path.join(outdir, f"rank{r}.pt"), weights_only=False) for r in range(world)]
            for r, res in enumerate(runs):
                assert "crash" not in res, f"rank {r} failed:\n{res.get('crash')}"
            self.runs[world] = runs
        return self.runs[world]
