"""Where the JAX twin of the multiscale SamplesLoss spends its time beside the torch call it wraps
(bench/NOTES.md 92): wall-clock medians of jax.value_and_grad(ot_triton_jax.samples_loss(...,
backend="multiscale")) and of torch_api's loss + gradient on the same clouds in one process, then
cProfile of one call of each (cumulative, top entries).

    python3 bench/probe_jax_multiscale.py [n]      # default 262144
"""
import sys, time, cProfile, pstats, io, os
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
import torch, jax
from bench_multiscale import clouds, BLUR, SCALING
import ot_triton_jax as otj
from ot_triton_jax import from_torch
import torch_api
n = int(sys.argv[1]) if len(sys.argv) > 1 else 262144
x, y = clouds(n, "uniform")
xj, yj = from_torch(x.contiguous()), from_torch(y.contiguous())
f = jax.value_and_grad(lambda z: otj.samples_loss(z, yj, blur=BLUR, scaling=SCALING, backend="multiscale"))
jax.block_until_ready(f(xj)); jax.block_until_ready(f(xj))
ts = []
for _ in range(5):
    t0 = time.perf_counter(); jax.block_until_ready(f(xj)); ts.append(1e3 * (time.perf_counter() - t0))
loss = torch_api.SamplesLoss("sinkhorn", blur=BLUR, scaling=SCALING, backend="multiscale")
def tcall():
    xg = x.clone().requires_grad_(True)
    v = loss(xg, y); g, = torch.autograd.grad(v, xg); torch.cuda.synchronize()
tcall(); tt = []
for _ in range(5):
    t0 = time.perf_counter(); tcall(); tt.append(1e3 * (time.perf_counter() - t0))
print("jax wall ms", sorted(ts), "torch wall ms", sorted(tt))
pr = cProfile.Profile(); pr.enable(); jax.block_until_ready(f(xj)); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(45); print(s.getvalue()[:9000])
pr = cProfile.Profile(); pr.enable(); tcall(); pr.disable()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("cumulative").print_stats(25); print(s.getvalue()[:5000])
