"""Repeat launches of Triton kernels from torch at a fraction of Triton's host cost.

``kernel[grid](*args, **constexprs)`` re-derives, on every call, the argument
specialization and the cache key of the compiled kernel (tens of microseconds
for the LSE kernel's ~30 parameters). At n <= 8192 a Sinkhorn half-step runs
for ~50 us on the GPU, so that host time would decide the solve time
(docs/performance.md). :func:`launch` goes through Triton once per *launch
signature*, keeps the ``CompiledKernel`` Triton returns, and afterwards calls
its launcher directly.

The launch signature separates every case Triton specializes on, so a kept
kernel is only reused where Triton would have picked the same one: tensors by
dtype and 16-byte alignment of the data pointer, integers by ``== 1``,
divisibility by 16 and 32/64-bit range, floats as float32, and the constexprs,
``num_warps``, ``num_stages`` and the current device by value.

Kernels run on the current CUDA device and stream, as with ``kernel[grid]``.
Triton's launch hooks (``triton.knobs.runtime.launch_enter_hook``, used by
profilers) still fire. Under the Triton interpreter this is ``kernel[grid]``.
"""

from __future__ import annotations

import atexit
import inspect
import json
import os
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import torch
import triton

from ot_triton_jax.core import runtime

_I32 = (-(2 ** 31), 2 ** 31)
_I64 = (-(2 ** 63), 2 ** 63)
_kept: dict = {}
_warmed: set = set()  # prewarm's launch keys
_get_stream = None


def _arg_key(v):
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.data_ptr() % 16 == 0)
    if isinstance(v, bool):
        return ("b", v)
    if isinstance(v, int):
        return ("i", v == 1, v % 16 == 0, _I32[0] <= v < _I32[1], _I64[0] <= v < _I64[1])
    if isinstance(v, float):
        return "f"
    raise TypeError(f"fast_launch: unsupported kernel argument type {type(v).__name__}")


class _Kept:
    """A compiled kernel and the constexpr tail of its argument list."""

    __slots__ = ("compiled", "tail")

    def __init__(self, compiled, tail: tuple):
        self.compiled, self.tail = compiled, tail


def _is_constexpr(param: inspect.Parameter) -> bool:
    ann = param.annotation
    return ann is triton.language.constexpr or "constexpr" in str(ann)


def _constexpr_tail(kernel, n_args: int, constexprs: dict) -> tuple:
    """Values of the parameters after the ``n_args`` positional ones, in signature order
    (the compiled launcher takes every parameter, constexprs included); defaults fill
    the constexprs not given."""
    params = list(inspect.signature(kernel.fn).parameters.values())
    name = kernel.fn.__name__
    if any(_is_constexpr(p) for p in params[:n_args]) or not all(_is_constexpr(p) for p in params[n_args:]):
        raise TypeError(f"fast_launch: {name} must get its run-time arguments positionally, then only constexprs")
    unknown = set(constexprs) - {p.name for p in params[n_args:]}
    if unknown:
        raise TypeError(f"fast_launch: {name} has no constexpr {sorted(unknown)}")
    tail = []
    for p in params[n_args:]:
        if p.name in constexprs:
            tail.append(constexprs[p.name])
        elif p.default is not inspect.Parameter.empty:
            tail.append(p.default)
        else:
            raise TypeError(f"fast_launch: constexpr {p.name} of {name} not given")
    return tuple(tail)


def launch(kernel, grid: tuple, args: tuple, constexprs: dict, *, num_warps: int, num_stages: int) -> None:
    """``kernel[grid](*args, num_warps=..., num_stages=..., **constexprs)``, cheaper when repeated.

    ``args``: every non-constexpr parameter, in order (tensors, ints, floats);
    ``constexprs``: the constexpr parameters by name (defaults fill the rest).
    """
    if not runtime.on_gpu():
        kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
        return
    device = torch.cuda.current_device()
    key = (kernel, device, num_warps, num_stages, tuple(constexprs.items()), tuple(map(_arg_key, args)))
    kept = _kept.get(key)
    if kept is None:
        compiled = kernel[grid](*args, num_warps=num_warps, num_stages=num_stages, **constexprs)
        _kept[key] = _Kept(compiled, _constexpr_tail(kernel, len(args), constexprs))
        return
    compiled = kept.compiled
    stream = _current_stream(device)
    full = args + kept.tail
    hooks = triton.knobs.runtime
    g1 = grid[1] if len(grid) > 1 else 1
    g2 = grid[2] if len(grid) > 2 else 1
    compiled.run(grid[0], g1, g2, stream, compiled.function, compiled.packed_metadata,
                 compiled.launch_metadata(grid, stream, *full),
                 hooks.launch_enter_hook, hooks.launch_exit_hook, *full)


def prewarm(items: list, workers: int | None = None) -> int:
    """Compile kernels before their first :func:`launch`, all at once.

    ``items``: (kernel, args, constexprs, num_warps, num_stages) as :func:`launch` takes them
    (stand-in tensors of the right dtype do: only what Triton specializes on matters). Triton
    compiles one kernel at a time on first launch (~0.5-1.7 s each on the H100 host). Here:

    1. each item's specialization is read through Triton's ``jit_cache_hook`` (no compile) and
       the distinct ones are compiled into Triton's on-disk cache by separate interpreters
       (:mod:`ot_triton_jax.core.compile_worker`; Triton's frontend and passes hold the GIL, so
       threads alone gain ~2x at most); meanwhile this process builds their host launchers
       (a C build each) into Triton's cache.
    2. the items are then warmed through Triton's own JIT path under ``AsyncCompileMode`` on a
       thread pool (cache loads now; a compile where a worker failed) and loaded into the
       current device's context with their launchers, as their first launch would.

    Kernels compiled already cost one cache lookup. Returns how many kernels step 2 loaded or
    compiled. A failure here is left to the real launch to report (it compiles the kernel
    again and raises); nothing runs on the GPU. Under the Triton interpreter: nothing to do (0)."""
    if not runtime.on_gpu() or not items:
        return 0
    _join_parent_warm()
    try:
        from triton.runtime import driver
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:  # an older Triton: first launches compile one by one
        return 0
    todo, device = [], driver.active.get_current_device()
    for kernel, args, constexprs, warps, stages in items:
        key = (kernel, device, warps, stages, tuple(constexprs.items()), tuple(map(_arg_key, args)))
        if key not in _warmed:  # one lookup per item: repeat calls (new sizes, same kernels) stay cheap
            _warmed.add(key)
            todo.append((kernel, args, constexprs, warps, stages))
    if not todo:
        return 0
    cpus = os.cpu_count() or 1
    workers = workers or max(1, min(len(todo), cpus, 16))
    try:
        _compile_in_processes(todo, driver.active.get_current_target(), min(cpus, 32),
                              getattr(driver.active, "launcher_cls", None))
    except Exception:  # noqa: BLE001 - step 2 compiles whatever is missing
        pass
    try:
        with ThreadPoolExecutor(workers) as pool:
            with AsyncCompileMode(pool):
                handles = [kernel.warmup(*args, grid=(1,), num_warps=warps, num_stages=stages, **constexprs)
                           for kernel, args, constexprs, warps, stages in todo]
            # a FutureKernel was loaded or compiled here; anything else was in Triton's in-process cache already
            # (items that differ only in unspecialized integers share one kernel: counted once)
            fresh = list({id(k): k for k in (h.result() for h in handles if hasattr(h, "future"))}.values())
            # each into this device's context with its launcher (built in step 1: a cache load)
            list(pool.map(lambda k: _load(k, device), fresh))
    except Exception:  # noqa: BLE001 - the launch itself compiles and reports
        return 0
    return len(fresh)


def _load(kernel, device: int) -> None:
    """Load a compiled kernel into ``device``'s context and build its launcher, as its first run
    would (Triton's ``CompiledKernel._init_handles``); where that is not available, only the
    launcher. A failure is left to the first run to raise."""
    try:
        if torch.cuda.is_available():
            torch.cuda.set_device(device)  # this pool thread: the caller's device, not device 0
            kernel._init_handles()
        else:  # a stand-in driver (tests/prewarm_check.py)
            triton.runtime.driver.active.launcher_cls(kernel.src, kernel.metadata)
    except Exception:  # noqa: BLE001
        pass


def _specializations(todo: list) -> list:
    """(module, name, specialization_data, (kernel, signature, constexprs, attrs)) of each distinct
    item Triton would compile now (none in its in-process cache), read through ``jit_cache_hook``
    in this thread without compiling. Empty where a user's hook is set (theirs is left alone)."""
    knobs = triton.knobs.runtime
    if knobs.jit_cache_hook is not None:
        return []
    me, found = threading.get_ident(), {}

    def hook(*, key, repr, fn, compile, is_manual_warmup, already_compiled):  # noqa: A002 - Triton's names
        if threading.get_ident() != me:
            return None  # another thread's launch: Triton compiles it as usual
        found.setdefault(compile["specialization_data"],
                         (fn.module, fn.name, (fn.jit_function, compile["signature"], compile["constants"],
                                               compile["configs"][0])))
        return True  # skip: a worker compiles it

    knobs.jit_cache_hook = hook
    try:
        for kernel, args, constexprs, warps, stages in todo:
            kernel.warmup(*args, grid=(1,), num_warps=warps, num_stages=stages, **constexprs)
    finally:
        knobs.jit_cache_hook = None
    return [[module, name, spec, source] for spec, (module, name, source) in found.items()]


def _compile_in_processes(todo: list, target, processes: int, launcher_cls=None, timeout_s: float = 120.0) -> int:
    """Step 1 of :func:`prewarm`: the distinct specializations of ``todo`` compiled into Triton's
    cache by up to ``processes`` worker interpreters at once; meanwhile this process builds their
    host launchers (``launcher_cls``, the driver's: a C compiler run each, outside the GIL) into
    the cache, from the argument types and constexprs alone. Returns how many were sent."""
    specs = _specializations(todo)
    if not specs:
        return 0
    request = {"target": [target.backend, target.arch, target.warp_size], **_parent_key()}
    procs = []
    try:
        for chunk in (specs[i::processes] for i in range(min(processes, len(specs)))):
            proc = _take_worker()
            procs.append(proc)
            proc.stdin.write(json.dumps(dict(request, jobs=[job[:3] for job in chunk])).encode())
            proc.stdin.close()
        if launcher_cls is not None:
            with ThreadPoolExecutor(min(len(specs), 16)) as pool:
                list(pool.map(lambda job: _build_launcher(launcher_cls, *job[3]), specs))
    finally:  # every worker started is waited for (or stopped), whatever failed here
        deadline = time.monotonic() + timeout_s
        for proc in procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return len(specs)


_spare: list = []  # (worker process, its environment key) started ahead by spawn_compile_workers


def _worker_env() -> tuple[dict, tuple]:
    """The workers' environment: this process's Triton cache, however it was set, and its import
    path (so that -m finds this package where the caller put it on sys.path by hand); and the key
    a spare worker must match to be used."""
    env = dict(os.environ, TRITON_CACHE_DIR=triton.knobs.cache.dir,
               PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
    return env, (env["TRITON_CACHE_DIR"], env["PYTHONPATH"], sys.executable)


def _start_worker(env: dict) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "ot_triton_jax.core.compile_worker"],
                            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def _take_worker() -> subprocess.Popen:
    """A compile worker waiting for its request: a spare one started for this environment if
    there is one still running, else a new one."""
    env, key = _worker_env()
    while _spare:
        proc, spare_key = _spare.pop()
        if spare_key == key and proc.poll() is None:
            return proc
        _close(proc, wait=False)  # it exits on its own; no wait here on the first call's path
    return _start_worker(env)


def spawn_compile_workers(count: int | None = None) -> int:
    """Start up to ``count`` compile workers (default: one per CPU, at most 32) now, before the
    kernels to compile are known: their interpreter start and Triton imports (~0.5-1 s, in
    parallel) then overlap the caller's own work, and :func:`prewarm` hands them the jobs
    (a process's first call). No-op without a GPU. Returns how many are waiting."""
    if not runtime.on_gpu():
        return 0
    _start_parent_warm()
    count = min(os.cpu_count() or 1, 32) if count is None else count
    env, key = _worker_env()
    try:
        while len(_spare) < count:
            _spare.append((_start_worker(env), key))
    except OSError:  # no more processes: prewarm starts what it needs, or the launches compile
        pass
    return len(_spare)


_parent_warm: list = []  # the thread of _start_parent_warm, once per process


def _warm_parent() -> None:
    """This process's one-time Triton costs of its first compile or cache load: the driver's host
    utilities (a C build when the cache is cold, ~0.4 s on the H100 host) and ``triton_key``, the
    hash of Triton's sources and libtriton that every cache key includes (~0.3 s; cached per
    process, but the prewarm's load threads would each compute it at once). Private Triton
    functions: where they are missing, the prewarm pays these costs itself."""
    try:
        from triton.runtime import driver
        from triton.runtime.cache import triton_key

        driver.active.get_current_target()
        triton_key()
    except Exception:  # noqa: BLE001 - only a head start
        pass


def _parent_key() -> dict:
    """This process's ``triton_key`` for the workers (compile_worker takes it where its Triton is the
    same file), so that each does not hash Triton again; empty where Triton has no such function."""
    try:
        from triton.runtime.cache import triton_key

        return {"triton_key": triton_key(), "triton_file": triton.__file__}
    except Exception:  # noqa: BLE001
        return {}


def _start_parent_warm() -> None:
    """Run :func:`_warm_parent` on a thread now (once per process), so that it overlaps the
    caller's own work (the multiscale solve's clustering); file reads, the hash and the C build
    release the GIL."""
    if not _parent_warm:
        thread = threading.Thread(target=_warm_parent, name="ot_triton_jax-triton-warm", daemon=True)
        _parent_warm.append(thread)
        thread.start()


def _join_parent_warm() -> None:
    """Wait for :func:`_warm_parent` if it was started (the driver's lazy setup must not run on two
    threads at once)."""
    if _parent_warm:
        _parent_warm[0].join()


def _close(proc: subprocess.Popen, wait: bool = True) -> None:
    """End a worker that got no request (an empty one ends it); ``wait``: until it has exited."""
    try:
        proc.stdin.close()
        if wait:
            proc.wait(5.0)
    except Exception:  # noqa: BLE001
        proc.kill()
        proc.wait()


@atexit.register
def _close_spares() -> None:
    while _spare:
        _close(_spare.pop()[0])


# what a launcher build reads of a compiled kernel's metadata, for kernels without tensor descriptors
_LAUNCH_METADATA = dict(tensordesc_meta=None, num_ctas=1, global_scratch_size=0, global_scratch_align=1,
                        profile_scratch_size=0, profile_scratch_align=1, launch_cooperative_grid=False,
                        launch_pdl=False)


def _build_launcher(launcher_cls, kernel, signature, constexprs, attrs) -> None:
    """Build (and cache) the host launcher of one specialization before its compile ends: the
    launcher's C source depends only on the argument types and constexprs, and Triton caches
    the built module by that source, so the kernel's own launcher is a cache load later."""
    try:
        from triton.compiler import ASTSource
        launcher_cls(ASTSource(kernel, signature, constexprs, attrs), types.SimpleNamespace(**_LAUNCH_METADATA))
    except Exception:  # noqa: BLE001 - built at the first launch instead
        pass


def _current_stream(device: int) -> int:
    # the raw stream handle, as Triton's own launch path reads it
    global _get_stream
    if _get_stream is None:
        from triton.runtime import driver
        _get_stream = driver.active.get_current_stream
    return _get_stream(device)


def clear() -> None:
    """Forget the kept kernels (they are also dropped with the process)."""
    _kept.clear()
