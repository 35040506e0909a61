"""launch.prewarm compiles a multiscale solve's kernels in parallel through Triton's JIT path
(tests/prewarm_check.py: a stand-in sm_90 driver, in a subprocess without TRITON_INTERPRET):
every distinct kernel once, nothing on a second prewarm, and Triton's own lookup
(what a launch does) finds each of them compiled. Under the interpreter it does nothing."""

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


def test_prewarm_is_a_no_op_under_the_interpreter():
    assert launch.prewarm([(None, (), {}, 4, 1)]) == 0
