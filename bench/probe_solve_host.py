"""Where the host time of one default torch_api.sinkhorn call goes (n = m = 8192, d = 3,
the Sinkhorn benchmark's 10 fixed iterations): cProfile over repeated calls, each followed
by a synchronization, after the warm-up that captures the loop's CUDA graphs.

    python bench/probe_solve_host.py [d]
"""

import cProfile
import pstats
import sys
import time

import torch

import torch_api

d = int(sys.argv[1]) if len(sys.argv) > 1 else 3
x = torch.randn(8192, d, device="cuda")
y = torch.randn(8192, d, device="cuda")


def call():
    return torch_api.sinkhorn(x, y, epsilon=0.1, min_iterations=10, max_iterations=10, inner_iterations=10)


for _ in range(3):
    call()
torch.cuda.synchronize()
t0 = time.perf_counter()
for _ in range(50):
    call()
    torch.cuda.synchronize()
print(f"d = {d}: {(time.perf_counter() - t0) / 50 * 1e3:.3f} ms per call (wall, synchronized)")
prof = cProfile.Profile()
prof.enable()
for _ in range(50):
    call()
    torch.cuda.synchronize()
prof.disable()
stats = pstats.Stats(prof)
stats.sort_stats("cumulative").print_stats(45)
stats.sort_stats("tottime").print_stats(25)
