"""launch.prewarm compiles a multiscale solve's kernels in parallel (tests/prewarm_check.py: a
stand-in sm_90 driver, in a subprocess without TRITON_INTERPRET): the worker processes compile
every distinct kernel once into Triton's cache, the in-process step adds no compile of its own
(same cache keys), nothing on a second prewarm, and Triton's own lookup (what a launch does)
finds each of them compiled. Under the interpreter it does nothing."""

import json
import os
import subprocess
import sys

from torch_api import launch


def test_prewarm_compiles_every_distinct_kernel_once():
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "TRITON_CACHE_DIR")}
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prewarm_check.py")
    run = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    res = json.loads(run.stdout.strip().splitlines()[-1])
    assert res["distinct"] >= 10
    assert res["first"] == res["distinct"] and res["second"] == 0
    assert res["compiled_at_lookup"] == []  # the JIT's own lookup finds every prewarmed kernel
    # the workers compiled each distinct kernel; the in-process step found them all in the cache
    assert res["cubins_after_workers"] == res["distinct"] == res["cubins_after_prewarm"]
    # the launchers built during the compiles are the compiled kernels' own
    assert res["launchers_early"] >= 1 and res["launchers_missing"] == 0


_KEY = r"""
import sys
from ot_triton_jax.core.kernels import lse
if sys.argv[1] == "callee_first":
    lse._write_potential.cache_key
print(lse.lse_combine_kernel.cache_key)
"""


def test_kernel_cache_keys_do_not_depend_on_the_order_of_first_use():
    """Triton 3.6 hashes a kernel differently when its jitted callee was hashed first; the kernels
    package settles the keys at import, so every process (and every prewarm worker) names a
    compile the same in the on-disk cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    keys = set()
    for order in ("caller_first", "callee_first"):
        run = subprocess.run([sys.executable, "-c", _KEY, order], env=env, cwd=root, capture_output=True,
                             text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-3000:]
        keys.add(run.stdout.strip())
    assert len(keys) == 1 and all(len(k) == 64 for k in keys), keys


def test_prewarm_is_a_no_op_under_the_interpreter():
    assert launch.prewarm([(None, (), {}, 4, 1)]) == 0


def test_compile_worker_reports_a_failed_job_and_goes_on():
    """A job the worker cannot compile is reported (stderr, exit status = failed jobs), never fatal:
    the prewarm's in-process step then compiles that kernel itself."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    request = {"target": ["cuda", 90, 32], "jobs": [["no_such_module_here", "kernel", "{}"],
                                                      ["ot_triton_jax.core.kernels.lse", "lse_combine_kernel", "{}"]]}
    run = subprocess.run([sys.executable, "-m", "ot_triton_jax.core.compile_worker"], input=json.dumps(request),
                         env=env, cwd=root, capture_output=True, text=True, timeout=300)
    assert run.returncode == 2, run.stderr[-3000:]
    assert "no_such_module_here" in run.stderr and "lse_combine_kernel" in run.stderr


def test_spare_workers_are_started_ahead_and_handed_out(monkeypatch):
    """spawn_compile_workers starts workers before their jobs are known (they import Triton and the
    kernels meanwhile); prewarm's step 1 takes those (same cache directory and import path) before
    starting new ones; one that gets an empty request exits cleanly. Without a GPU: no-op."""
    assert launch.spawn_compile_workers(2) == 0  # the interpreter: nothing to compile ahead for
    monkeypatch.setattr(launch.runtime, "on_gpu", lambda: True)
    monkeypatch.setattr(launch, "_spare", [])
    try:
        assert launch.spawn_compile_workers(2) == 2
        started = [proc for proc, _ in launch._spare]
        taken = launch._take_worker()
        assert taken in started and len(launch._spare) == 1
        monkeypatch.setenv("TRITON_CACHE_DIR", "/tmp/another_triton_cache_for_this_test")
        monkeypatch.setattr(launch.triton.knobs.cache, "dir", "/tmp/another_triton_cache_for_this_test")
        fresh = launch._take_worker()  # another cache directory: the spare does not match, a new one
        assert fresh not in started and launch._spare == []
        for proc in (taken, fresh):
            launch._close(proc)
            assert proc.returncode == 0
        # the unmatched spare got its empty request too and exits cleanly
        assert all(proc.wait(30) == 0 for proc in started)
    finally:
        launch._close_spares()


_PARENT_KEY = r"""
import triton, triton.runtime.cache as cache
from ot_triton_jax.core import compile_worker
own = cache.triton_key()
compile_worker._use_parent_key({"triton_key": "k-from-parent", "triton_file": "/elsewhere/triton/__init__.py"})
other_file = cache.triton_key()
compile_worker._use_parent_key({"target": ["cuda", 90, 32], "jobs": []})
no_key = cache.triton_key()
compile_worker._use_parent_key({"triton_key": "k-from-parent", "triton_file": triton.__file__})
print(other_file == own, no_key == own, cache.triton_key())
"""


def test_compile_worker_takes_the_parents_triton_key_only_for_the_same_triton():
    """The workers skip hashing Triton (~0.3 s each at their first compile) by taking the parent's
    triton_key from the request, and only where it names the same Triton file."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", _PARENT_KEY], env=env, cwd=root, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["True", "True", "k-from-parent"]
