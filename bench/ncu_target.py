"""A target for Nsight Compute (issue 16's profiler evidence): one default torch_api.sinkhorn solve.

    ncu --kernel-name regex:lse_update_kernel --launch-skip 4 --launch-count 1 \\
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \\
        python3 bench/ncu_target.py 65536 3 float32

bench/run_gpu.sh's ``ncu`` step runs it for the issue's workloads and keeps the reports' text.
"""

import sys

import torch

import torch_api

n, d, precision = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
gen = torch.Generator().manual_seed(n + d)
x, y = torch.randn(n, d, generator=gen).cuda(), torch.randn(n, d, generator=gen).cuda()
kw = {} if precision == "float32" else {"precision": precision}
torch_api.sinkhorn(x, y, epsilon=0.1, min_iterations=3, max_iterations=3, inner_iterations=1, **kw)
torch.cuda.synchronize()
