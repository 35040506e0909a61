"""A/B of two code trees on the multiscale loss + gradient (issue 15), one process per tree.

    PYTHONPATH=<tree A> python3 bench/ab_multiscale.py base 262144,1048576,4194304
    PYTHONPATH=<tree B> python3 bench/ab_multiscale.py new 262144,1048576,4194304
    python3 bench/ab_multiscale.py --compare 262144,1048576,4194304

Per size: x, y ~ U[0, 1]^3 (seeded), SamplesLoss("sinkhorn", blur=0.05, scaling=0.5,
backend="multiscale") with default options, loss + gradient in x; two warm-up calls, then the
median of 7 (CUDA events), the report (kept fraction, dropped-mass bound, marginal error), peak
memory; the value and gradient are saved to $OUT (default /tmp) for ``--compare`` (relative
differences between the trees). Alternate the trees' processes (A B A B) on one machine: the
solve's time moves by ~5% between processes and machines (bench/NOTES.md 95).
"""
import json
import os
import statistics
import sys

import torch

OUT = os.environ.get("OUT", "/tmp")


def measure(tag: str, sizes: list[int]) -> None:
    import torch_api
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        x, y = torch.rand(n, 3, generator=g).cuda(), torch.rand(n, 3, generator=g).cuda()
        loss = torch_api.SamplesLoss("sinkhorn", blur=0.05, scaling=0.5, backend="multiscale")

        def call():
            xg = x.detach().requires_grad_(True)
            v = loss(xg, y)
            return v.detach(), torch.autograd.grad(v, xg)[0]
        for _ in range(2):
            call()
        torch.cuda.synchronize()
        ts = []
        for _ in range(7):
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record()
            v, gr = call()
            e.record()
            torch.cuda.synchronize()
            ts.append(s.elapsed_time(e))
        res = loss.last_multiscale
        torch.save({"v": v.cpu(), "g": gr.cpu()}, f"{OUT}/ab_{tag}_{n}.pt")
        print(json.dumps({"tag": tag, "n": n, "ms": statistics.median(ts), "times": [round(t, 1) for t in ts],
                          "value": float(v), "kept": res.kept, "bound": res.dropped_mass_bound,
                          "err": res.marginal_error, "peak_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
        torch.cuda.reset_peak_memory_stats()


def compare(sizes: list[int]) -> None:
    for n in sizes:
        a, b = torch.load(f"{OUT}/ab_base_{n}.pt"), torch.load(f"{OUT}/ab_new_{n}.pt")
        print(json.dumps({"n": n, "value_rel": abs(float(a["v"]) - float(b["v"])) / abs(float(a["v"])),
                          "grad_rel": float((a["g"] - b["g"]).norm() / a["g"].norm())}), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare([int(s) for s in sys.argv[2].split(",")])
    else:
        measure(sys.argv[1], [int(s) for s in sys.argv[2].split(",")])
