"""launch.prewarm without a GPU: a stand-in Triton driver with an H100 target (sm_90), so that
Triton's JIT path (specialization, AsyncCompileMode, the thread pool) runs as on the GPU up to
the cubin; the launchers' C builds, which link the CUDA driver, are skipped.

    python tests/prewarm_check.py        (TRITON_INTERPRET must not be set)

Prints one JSON line: the distinct kernels of the multiscale solve's list at 2^20 points, the
kernels the first prewarm loaded or compiled in-process, those a second prewarm did (0: cache
hits), seconds; the cubins in Triton's cache after the worker processes (step 1 of prewarm) and
after the whole prewarm (equal: the in-process step only loaded what the workers compiled); the
distinct launcher sources built while the workers compiled, and how many compiled kernels' own
launcher sources were not among them (0: their first launches find them in the cache).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

if os.environ.get("TRITON_INTERPRET", "0") == "1":
    sys.exit("prewarm_check.py: unset TRITON_INTERPRET")
os.environ["TRITON_CACHE_DIR"] = os.environ.get("PWC_DIR") or tempfile.mkdtemp(prefix="prewarm_check_")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

from ot_triton_jax.core import runtime  # noqa: E402


LAUNCHERS: list = []  # the C source of every launcher the prewarm asked for (not built: no CUDA here)


def _launcher_source(src, metadata):
    from triton.backends.nvidia.driver import make_launcher
    arg_idx = lambda x: (src.fn.arg_names.index(x), ) if isinstance(x, str) else x  # noqa: E731 - as CudaLauncher
    constants = {arg_idx(k): v for k, v in src.constants.items()}
    return make_launcher(constants, dict(src.signature), getattr(metadata, "tensordesc_meta", None))


class StandIn:
    """What Triton's JIT asks the active driver for, answered for one sm_90 device; its launcher
    class records the launcher's C source instead of building it."""

    def __init__(self):
        self.launcher_cls = type("Launcher", (), {"__init__": lambda _, src, metadata:
                                                  LAUNCHERS.append(_launcher_source(src, metadata))})

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0


driver.set_active(StandIn())
runtime.configure(True)

from torch_api import launch, kernel_ops  # noqa: E402
from torch_api.multiscale import prewarm as ms  # noqa: E402


def _cubins() -> int:
    return sum(name.endswith(".cubin") for _, _, names in os.walk(os.environ["TRITON_CACHE_DIR"]) for name in names)


def main() -> int:
    seqs = ms.kernel_descriptions(1 << 20, 1 << 20, 15625, 15625, 3, "float32", True, True, (True, False), True)
    # what Triton specializes on: the integers it is not told to leave unspecialized
    distinct = {(c.kernel, c.plan.num_warps, c.plan.num_stages, tuple(c.constexprs.items()),
                 tuple(launch._arg_key(a) for a, p in zip(c.args, c.kernel.params)
                       if not isinstance(a, str) and not p.do_not_specialize))
                for s in seqs for c in s.calls}
    cubins = []
    step1 = launch._compile_in_processes

    def counted(*args, **kwargs):
        sent = step1(*args, **kwargs)
        cubins.append(_cubins())
        return sent

    launch._compile_in_processes = counted
    fresh = []
    load = launch._load
    launch._load = lambda kernel, device: fresh.append(kernel)
    t0 = time.perf_counter()
    first = kernel_ops.prewarm(seqs, "cpu")
    seconds = time.perf_counter() - t0
    launch._load = load
    early = set(LAUNCHERS)  # built while the workers compiled, from the argument types alone
    # a compiled kernel's own launcher source (what its first launch builds) was among them
    missing = sum(_launcher_source(k.src, k.metadata) not in early for k in fresh)
    second = kernel_ops.prewarm(seqs, "cpu")
    # Triton's own JIT lookup (what a launch does) with fresh arrays of the launch's dtypes: no compile
    from triton.runtime.jit import JITFunction
    late, do_compile = [], JITFunction._do_compile
    JITFunction._do_compile = lambda self, *a, **k: late.append(self.fn.__name__) or do_compile(self, *a, **k)
    for s in seqs:
        for c in s.calls:
            args = [torch.empty(4, dtype=kernel_ops.input_dtype(c, a)) if isinstance(a, str) else a
                    for a in c.args] + [torch.empty(4, dtype=kernel_ops._DTYPES[o.dtype]) for o in c.outputs]
            c.kernel.warmup(*args, grid=(1,), num_warps=c.plan.num_warps, num_stages=c.plan.num_stages, **c.constexprs)
    JITFunction._do_compile = do_compile
    print(json.dumps({"distinct": len(distinct), "first": first, "second": second, "seconds": seconds,
                      "compiled_at_lookup": late, "cubins_after_workers": cubins[0] if cubins else None,
                      "cubins_after_prewarm": _cubins(), "launchers_early": len(early),
                      "launchers_missing": missing}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
