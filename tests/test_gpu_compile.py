"""The GPU plans' kernels compile for an H100 (sm_90) on this CPU machine
(tests/gpu_compile_check.py, in a subprocess without TRITON_INTERPRET): the interpreter alone
would not catch a kernel that only the compiler rejects."""

import os
import subprocess
import sys


def test_gpu_plans_compile_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if env.get("TRITON_CACHE_DIR") == "":  # jax_triton's import blanks it; Triton then compiles nothing
        del env["TRITON_CACHE_DIR"]
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_compile_check.py")
    run = subprocess.run([sys.executable, script], env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert run.stdout.splitlines()[-1] == "0 failed"
    assert run.stdout.count("ok   ") >= 20
