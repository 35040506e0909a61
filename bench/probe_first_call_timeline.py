"""Timeline of the first multiscale call with a cold Triton cache (issue 15's first-call target):
SamplesLoss(backend="multiscale") loss + gradient at n = m (default 2^20, uniform d = 3 clouds),
with the wall-clock times at which the solve's steps start and end (compile workers spawned,
clustering, the prewarm and its worker step, the fine passes); then each kernel job of the
prewarm compiled alone in one fresh process (per-job compile seconds), and 16 empty compile
workers started at once (their start-up). Prints JSON and text; logs in bench/results/logs_h100_session24.

    python3 bench/probe_first_call_timeline.py [n]
"""
import json, os, sys, tempfile, time, subprocess
os.environ["TRITON_CACHE_DIR"] = tempfile.mkdtemp(prefix="cold_triton_")
T0 = time.perf_counter()
EV = []
def mark(name): EV.append((name, round(time.perf_counter() - T0, 4)))
import torch
import triton
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
if os.path.dirname(HERE) not in sys.path:
    sys.path.append(os.path.dirname(HERE))
import torch_api
from torch_api import kernel_ops, launch, multiscale_solve as ms
from bench_multiscale import clouds

SPECS = []
def wrap(mod, name, tag, keep=None):
    f = getattr(mod, name)
    def g(*a, **k):
        mark(tag + ">")
        out = f(*a, **k)
        mark(tag + "<")
        if keep is not None: keep.append(out)
        return out
    setattr(mod, name, g)
wrap(launch, "_specializations", "specs", SPECS)
wrap(launch, "_compile_in_processes", "workers")
wrap(kernel_ops, "launch_prewarm", "prewarm")
wrap(ms, "spawn_compile_workers", "spawn")
wrap(ms, "cluster_pair", "cluster")
wrap(ms, "clouds", "clouds")
wrap(ms.mb, "keep_pairs", "keep_pairs")
wrap(ms, "direction", "direction")
wrap(ms.taylor, "lse", "taylor")
wrap(ms, "_update_and_mean", "update_mean")
n = int(sys.argv[1]) if len(sys.argv) > 1 else 1 << 20
x, y = clouds(n, "uniform")
torch.cuda.synchronize()
loss = torch_api.SamplesLoss("sinkhorn", blur=0.05, scaling=0.5, backend="multiscale")
def call():
    xg = x.clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(loss(xg, y), xg)
    torch.cuda.synchronize()
mark("call>"); t = time.perf_counter(); call(); cold = time.perf_counter() - t; mark("call<")
t = time.perf_counter(); call(); warm = time.perf_counter() - t
base = dict(EV)["call>"]
print(json.dumps({"cold_s": cold, "warm_s": warm,
                  "timeline": [(k, round(v - base, 4)) for k, v in EV if v >= base]}, indent=0))
# per-job compile times, one process, fresh cache
from triton.runtime import driver
tgt = driver.active.get_current_target()
jobs = [j[:3] for j in SPECS[0]]
script = r'''
import json, sys, time, importlib
from ot_triton_jax.core import compile_worker as cw
req = json.loads(sys.stdin.read())
t = time.perf_counter(); cw._preload_modules(); print("preload", round(time.perf_counter() - t, 3), flush=True)
from triton.backends.compiler import GPUTarget
from triton.runtime import driver
driver.set_active(cw._StandInDriver(GPUTarget(*req["target"])))
for mod, name, spec in req["jobs"]:
    t = time.perf_counter()
    getattr(importlib.import_module(mod), name).preload(spec)
    print(name, round(time.perf_counter() - t, 3), json.loads(spec).get("constants", {}) if False else "", flush=True)
'''
env = dict(os.environ, TRITON_CACHE_DIR=tempfile.mkdtemp(prefix="cold2_"), PYTHONPATH=os.pathsep.join(p or os.getcwd() for p in sys.path))
r = subprocess.run([sys.executable, "-c", script], input=json.dumps({"target": [tgt.backend, tgt.arch, tgt.warp_size], "jobs": jobs}),
                   capture_output=True, text=True, env=env)
print(r.stdout); print(r.stderr[-3000:])
# worker start: 16 concurrent empty workers
t = time.perf_counter()
ps = [subprocess.Popen([sys.executable, "-m", "ot_triton_jax.core.compile_worker"], stdin=subprocess.PIPE, env=env) for _ in range(16)]
for p in ps: p.stdin.close()
for p in ps: p.wait()
print("16 empty workers", round(time.perf_counter() - t, 3))
