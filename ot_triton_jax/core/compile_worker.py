"""Compile Triton kernels into Triton's on-disk cache in a separate process (triton only: no GPU, no torch).

Why processes: Triton's frontend (Python AST -> TTIR) and its MLIR passes hold the GIL, so a
thread pool compiles only ~2x faster than one kernel at a time (H100 host, 16 cores: 14 kernels
in 5.8 s on threads, 11.9 s one by one; docs/performance.md). Separate interpreters compile truly
in parallel.

A job is ``(module, name, specialization_data)``: the kernel's module and name, and the JSON
that Triton's ``knobs.runtime.jit_cache_hook`` reports for one specialization (argument types,
alignment, constexprs, options). The worker imports the module, makes a stand-in driver answer
the parent's GPU target, and calls ``JITFunction.preload``, which compiles and writes the result
to the cache directory named by the inherited environment (``TRITON_CACHE_DIR``). The parent
then loads each kernel from the cache on its own (same source, options, target and
environment give the same cache key); a job that fails here only means the parent compiles it
itself, so nothing here can change what runs.

    python -m ot_triton_jax.core.compile_worker < request.json

``request.json``: ``{"target": [backend, arch, warp_size], "jobs": [[module, name,
specialization_data], ...], "triton_key": ..., "triton_file": ...}`` (the last two optional: the
parent's Triton cache-key hash, used where this worker's Triton is the same file); the kernels' modules are imported from the inherited PYTHONPATH
(the parent passes its sys.path there), Triton and this package's kernels before the request is
read (a worker may be started before its jobs are known); an empty request ends it. Exit status:
the number of failed jobs (capped at 100), each reported on stderr.
"""

from __future__ import annotations

import importlib
import json
import sys


class _StandInDriver:
    """What ``JITFunction.preload`` asks the active driver for: one device of the parent's target."""

    def __init__(self, target):
        self._target = target

    def get_current_target(self):
        return self._target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


def compile_jobs(target: list, jobs: list) -> int:
    """Compile ``jobs`` for ``target`` ([backend, arch, warp_size]); returns how many failed."""
    from triton.backends.compiler import GPUTarget
    from triton.runtime import driver

    driver.set_active(_StandInDriver(GPUTarget(*target)))
    failed = 0
    for module, name, spec in jobs:
        try:
            getattr(importlib.import_module(module), name).preload(spec)
        except Exception as exc:  # noqa: BLE001 - reported; the parent compiles it itself
            print(f"compile_worker: {module}.{name}: {exc!r}", file=sys.stderr)
            failed += 1
    return failed


def _preload_modules() -> None:
    """Import what a compile needs before the request arrives: a worker started early (the
    parent's ``spawn_compile_workers``) then spends its interpreter start and these imports while
    the parent is still clustering, not after the jobs are known."""
    import triton.compiler  # noqa: F401
    from triton.backends import backends  # noqa: F401

    importlib.import_module("ot_triton_jax.core.kernels")
    try:  # imported lazily by a first compile otherwise
        import triton.compiler.code_generator  # noqa: F401
    except ImportError:
        pass


def _use_parent_key(request: dict) -> None:
    """Take the parent's ``triton_key`` (the hash of Triton's sources and libtriton that every cache
    key includes; ~0.3 s of CPU per process, paid by each worker at its first compile otherwise)
    when the request carries it and this worker runs the same Triton (same installed file)."""
    import triton
    import triton.runtime.cache as cache

    key = request.get("triton_key")
    if key and request.get("triton_file") == triton.__file__ and hasattr(cache, "triton_key"):
        cache.triton_key = lambda: key


def main() -> int:
    try:
        _preload_modules()
    except Exception as exc:  # noqa: BLE001 - each job imports what it needs again and reports
        print(f"compile_worker: preload: {exc!r}", file=sys.stderr)
    text = sys.stdin.read()
    if not text.strip():  # a spare worker the parent did not need
        return 0
    request = json.loads(text)
    _use_parent_key(request)
    return min(compile_jobs(request["target"], request["jobs"]), 100)


if __name__ == "__main__":
    sys.exit(main())
