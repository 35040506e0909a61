"""The default multiscale loss + gradient (uniform d = 3, blur 0.05, scaling 0.5) under several
``cluster_scale`` values: median of 5 calls (CUDA events) after two warm-ups, the value, the clusters,
the kept fraction, the Taylor passes, the dropped-mass bound, the marginal error and the peak memory.
Prints JSON lines (bench/NOTES.md 110).

    python3 bench/probe_cluster_scale.py 1048576,4194304 default,0.045,0.05,0.035
"""
import json, statistics, sys
import torch, torch_api
sizes = [int(s) for s in sys.argv[1].split(",")]
scales = [None if s == "default" else float(s) for s in sys.argv[2].split(",")]
for n in sizes:
    g = torch.Generator().manual_seed(n)
    x, y = torch.rand(n, 3, generator=g).cuda(), torch.rand(n, 3, generator=g).cuda()
    for cs in scales:
        kw = {} if cs is None else {"cluster_scale": cs}
        loss = torch_api.SamplesLoss("sinkhorn", blur=0.05, scaling=0.5, backend="multiscale", **kw)
        def call():
            xg = x.detach().requires_grad_(True)
            v = loss(xg, y)
            return v.detach(), torch.autograd.grad(v, xg)[0]
        for _ in range(2):
            v, gr = call()
        torch.cuda.synchronize()
        ts = []
        for _ in range(5):
            s, e = torch.cuda.Event(True), torch.cuda.Event(True)
            s.record(); v, gr = call(); e.record(); torch.cuda.synchronize(); ts.append(s.elapsed_time(e))
        r = loss.last_multiscale
        print(json.dumps({"n": n, "cluster_scale": cs, "ms": statistics.median(ts), "times": [round(t, 1) for t in ts],
                          "value": float(v), "clusters": list(r.clusters), "kept": r.kept, "taylor_passes": r.taylor_passes,
                          "bound": r.dropped_mass_bound, "err": r.marginal_error,
                          "peak_gib": torch.cuda.max_memory_allocated() / 2**30}), flush=True)
        torch.cuda.reset_peak_memory_stats()
