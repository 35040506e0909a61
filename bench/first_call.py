"""First-call latency: what a user waits for before the first result of a new process or shape.

Each case runs in a fresh process with empty Triton and Inductor caches (a new machine, a new
Python environment), so every kernel it launches is compiled during the call:

* ``eager``: ``torch_api.sinkhorn(x, y, epsilon=0.1)`` at n = 3000, m = 2000, d = 7 (forward, then
  ``reg_ot_cost.backward()``), then a second shape of the same dimension (2500 x 1700), then the
  first shape again (warm).
* ``compile``: ``torch.compile(lambda x: torch_api.sinkhorn(x, y, epsilon=0.1).reg_ot_cost,
  fullgraph=True)`` at 4096 x 4096, d = 16: first and second call. ``compile_warm_triton`` runs the
  same after one eager call in the process, so the difference is torch.compile's own time.
* ``jax``: jitted ``ot_triton_jax.sinkhorn(...).reg_ot_cost`` at 3000 x 2000, d = 7, then the
  second shape.

For each step: wall seconds of the synchronous call and the number of kernels Triton compiled
(entries added to the cache directory). ``--profile`` adds the top entries of a cProfile of the
first eager call. Writes JSON (device, versions, per-case steps).

    python bench/first_call.py [--cases eager,compile,compile_warm_triton,jax] [--out FILE] [--profile]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def _kernels_in(cache: str) -> int:
    n = 0
    for _root, _dirs, files in os.walk(cache):
        n += sum(f.endswith((".cubin", ".hsaco")) for f in files)
    return n


def _profile_text(prof) -> str:
    import io
    import pstats
    out = []
    for key in ("cumulative", "tottime"):
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats(key).print_stats(45)
        out.append(s.getvalue()[-9000:])
    return "\n".join(out)


def _child(case: str, profile: bool) -> dict:
    t_import = time.perf_counter()
    import torch
    cache = os.environ["TRITON_CACHE_DIR"]
    steps = []

    def step(name, fn):
        k0 = _kernels_in(cache)
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        steps.append({"step": name, "seconds": round(time.perf_counter() - t, 4),
                      "kernels_compiled": _kernels_in(cache) - k0})

    gen = torch.Generator(device="cpu").manual_seed(0)

    def cloud(n, d):
        return torch.randn(n, d, generator=gen).cuda()

    if case in ("eager", "compile", "compile_warm_triton"):
        import torch_api
        step("import torch_api", lambda: torch_api.sinkhorn)
    if case == "eager":
        x, y = cloud(3000, 7), cloud(2000, 7)
        x2, y2 = cloud(2500, 7), cloud(1700, 7)
        prof = None
        if profile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        step("forward 3000x2000 d=7", lambda: torch_api.sinkhorn(x, y, epsilon=0.1).reg_ot_cost.item())
        if prof is not None:
            prof.disable()
        xg = x.clone().requires_grad_(True)

        def grad():
            torch_api.sinkhorn(xg, y, epsilon=0.1).reg_ot_cost.backward()
        step("forward+backward 3000x2000 d=7", grad)
        step("forward 2500x1700 d=7 (new shape)", lambda: torch_api.sinkhorn(x2, y2, epsilon=0.1).reg_ot_cost.item())
        step("forward 3000x2000 d=7 (warm)", lambda: torch_api.sinkhorn(x, y, epsilon=0.1).reg_ot_cost.item())
        if prof is not None:
            steps.append({"profile_first_forward": _profile_text(prof)})
    elif case in ("compile", "compile_warm_triton"):
        x, y = cloud(4096, 16), cloud(4096, 16)
        if case == "compile_warm_triton":
            step("eager forward 4096x4096 d=16", lambda: torch_api.sinkhorn(x, y, epsilon=0.1).reg_ot_cost.item())
        f = torch.compile(lambda x: torch_api.sinkhorn(x, y, epsilon=0.1).reg_ot_cost, fullgraph=True)
        prof = None
        if profile:
            import cProfile
            prof = cProfile.Profile()
            prof.enable()
        step("compiled first call 4096x4096 d=16", lambda: f(x).item())
        if prof is not None:
            prof.disable()
            steps.append({"profile_first_compiled": _profile_text(prof)})
        step("compiled second call", lambda: f(x).item())
        x3 = cloud(4096, 16)
        step("compiled call, new values", lambda: f(x3).item())
    elif case == "jax":
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        import jax
        import jax.numpy as jnp
        import ot_triton_jax as otj
        step("import ot_triton_jax", lambda: otj.sinkhorn)
        f = jax.jit(lambda x, y: otj.sinkhorn(x, y, epsilon=0.1).reg_ot_cost)
        x, y = jnp.asarray(cloud(3000, 7).cpu().numpy()), jnp.asarray(cloud(2000, 7).cpu().numpy())
        x2, y2 = jnp.asarray(cloud(2500, 7).cpu().numpy()), jnp.asarray(cloud(1700, 7).cpu().numpy())
        step("jit first call 3000x2000 d=7", lambda: f(x, y).block_until_ready())
        step("jit new shape 2500x1700 d=7", lambda: f(x2, y2).block_until_ready())
        step("jit warm", lambda: f(x, y).block_until_ready())
    else:
        raise SystemExit(f"unknown case {case!r}")
    return {"case": case, "process_start_to_end_s": round(time.perf_counter() - t_import, 3), "steps": steps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="eager,compile,compile_warm_triton,jax")
    p.add_argument("--out", default=None)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--warm-python", action="store_true", help="fill Python's bytecode cache first")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print("RESULT " + json.dumps(_child(args.child, args.profile)), flush=True)
        return
    import torch
    import triton
    results = []
    if args.warm_python:
        # Python's own bytecode cache, as an installed environment has it: without it the first
        # import of torch._dynamo / inductor compiles thousands of sources (machine set-up, not ours)
        os.environ.setdefault("PYTHONPYCACHEPREFIX", tempfile.mkdtemp(prefix="pyc_"))
        subprocess.run([sys.executable, "-c", "import torch, torch._dynamo, torch._inductor.compile_fx, sympy, "
                        "triton.compiler, torch.distributed.fsdp, torch._higher_order_ops.triton_kernel_wrap; "
                        "import jax, jax.numpy"], check=False)
    for case in args.cases.split(","):
        env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="cold_triton_"),
                   TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix="cold_inductor_"),
                   XLA_PYTHON_CLIENT_PREALLOCATE="false")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [env.get("PYTHONPATH"), ROOT]))
        t = time.perf_counter()
        cmd = [sys.executable, os.path.abspath(__file__), "--child", case] + (["--profile"] if args.profile else [])
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        wall = time.perf_counter() - t
        line = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
        if r.returncode != 0 or not line:
            results.append({"case": case, "error": (r.stderr or r.stdout)[-3000:], "process_wall_s": round(wall, 2)})
        else:
            res = json.loads(line[-1][7:])
            res["process_wall_s"] = round(wall, 2)
            results.append(res)
        print(json.dumps(results[-1], indent=1)[:6000], flush=True)
    out = {"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "triton": triton.__version__,
           "cases": results}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
