"""The sharded Sinkhorn on 2 GPUs against the single-device solve (NCCL), with timings.

    NCCL_NVLS_ENABLE=0 torchrun --nproc_per_node=2 tests/distributed_gpu_check.py

Every rank builds the same problems (n = m = 2^16 points, d = 64 and d = 3, float32, fixed
seeds) and keeps its array_split shards; ``torch_api.distributed.sinkhorn`` solves them sharded
(rank r on cuda:r), with each exchange ("gather" and "ring"). Rank 0 then solves each full
problem alone with ``torch_api.sinkhorn`` and compares the gathered f, g, the gradients in x and
y, reg_ot_cost, n_iters and converged, and times both: the median of a few runs of 10 fixed
iterations (min_iterations = max_iterations = 10) and of the default early-stopping call; then
``SamplesLoss()`` at d = 3 (loss and gradients) with each exchange. It prints one JSON line per
problem and exits 1 on a mismatch (f, g, gradients: max error over max |value| above 1e-4; cost
and loss: relative error above 1e-5; n_iters or converged different).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import torch_api  # noqa: E402
from ot_triton_jax.core.sharding import ShardLayout  # noqa: E402
from torch_api import distributed  # noqa: E402

N = M = 2 ** 16
PROBLEMS = [dict(d=64, epsilon=0.05), dict(d=3, epsilon=0.01)]
REPEATS = 5
FIXED = dict(threshold=1e-3, inner_iterations=10, min_iterations=10, max_iterations=10)
TOL_FIELDS, TOL_COST = 1e-4, 1e-5


def _problem(d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(N, d, generator=gen) / d ** 0.5
    y = (torch.randn(M, d, generator=gen) + 0.3) / d ** 0.5
    return x, y


def _timed(fn, repeats: int, sync_group: bool) -> tuple[float, object]:
    """Median wall time of ``fn()`` (seconds) after one warm-up call, and its last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        if sync_group:
            dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


def _gather(t: torch.Tensor, layout: ShardLayout) -> torch.Tensor:
    """The global rows of a sharded tensor (every rank receives them)."""
    width = layout.width
    piece = torch.zeros((width,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
    piece[:t.shape[0]] = t
    parts = [torch.empty_like(piece) for _ in range(layout.parts)]
    dist.all_gather(parts, piece)
    return torch.cat([p[:s] for p, s in zip(parts, layout.sizes)])


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| / max |want| over the finite entries (inf when the non-finite ones differ)."""
    got, want = got.double(), want.double()
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)):
        return float("inf")
    return float((got[fin] - want[fin]).abs().max() / want[fin].abs().max().clamp_min(1e-30))


def _sharded(x, y, lx, ly, rank, opts):
    xr = x[lx.rows(rank)[0]:lx.rows(rank)[1]].clone().requires_grad_()
    yr = y[ly.rows(rank)[0]:ly.rows(rank)[1]].clone().requires_grad_()
    out = distributed.sinkhorn(xr, yr, **opts)
    out.reg_ot_cost.backward()
    return out, xr.grad, yr.grad


def _single(x, y, opts):
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    out = torch_api.sinkhorn(xs, ys, **opts)
    cost = out.reg_ot_cost
    cost.backward()
    return out, cost.detach(), xs.grad, ys.grad


def check_problem(spec: dict, seed: int, rank: int, world: int, exchange: str) -> bool:
    dev = torch.device("cuda", torch.cuda.current_device())
    x, y = (t.to(dev) for t in _problem(spec["d"], seed))
    lx, ly = ShardLayout.even(N, world), ShardLayout.even(M, world)
    eps = dict(epsilon=spec["epsilon"])
    xr, yr = x[slice(*lx.rows(rank))], y[slice(*ly.rows(rank))]
    t_fixed, _ = _timed(lambda: distributed.sinkhorn(xr, yr, exchange=exchange, **eps, **FIXED), REPEATS, True)
    t_conv, _ = _timed(lambda: distributed.sinkhorn(xr, yr, exchange=exchange, **eps), max(REPEATS // 2, 1), True)
    out, gx, gy = _sharded(x, y, lx, ly, rank, dict(eps, exchange=exchange))
    f, g, gx, gy = _gather(out.f.detach(), lx), _gather(out.g.detach(), ly), _gather(gx, lx), _gather(gy, ly)
    ok = True
    if rank == 0:
        s_fixed, _ = _timed(lambda: torch_api.sinkhorn(x, y, **eps, **FIXED), REPEATS, False)
        s_conv, _ = _timed(lambda: torch_api.sinkhorn(x, y, **eps), max(REPEATS // 2, 1), False)
        ref, cost, rgx, rgy = _single(x, y, eps)
        errs = dict(f=_rel(f, ref.f.detach()), g=_rel(g, ref.g.detach()), grad_x=_rel(gx, rgx), grad_y=_rel(gy, rgy),
                    cost=abs(float(out.reg_ot_cost) - float(cost)) / max(abs(float(cost)), 1e-30))
        same = dict(n_iters=(int(out.n_iters), int(ref.n_iters)), converged=(bool(out.converged), bool(ref.converged)))
        ok = (max(errs[k] for k in ("f", "g", "grad_x", "grad_y")) <= TOL_FIELDS and errs["cost"] <= TOL_COST
              and all(a == b for a, b in same.values()))
        print(json.dumps(dict(n=N, m=M, d=spec["d"], epsilon=spec["epsilon"], world=world, exchange=exchange, ok=ok,
                              errors=errs, sharded_vs_single=same, device=torch.cuda.get_device_name(dev),
                              seconds=dict(sharded_10_iterations=t_fixed, single_10_iterations=s_fixed,
                                           sharded_converged=t_conv, single_converged=s_conv))), flush=True)
    flag = torch.tensor([int(ok)], device=dev)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def check_loss(rank: int, world: int, exchange: str) -> bool:
    """``SamplesLoss()`` (GeomLoss's defaults) sharded against the single-device call at N points,
    d = 3: the loss (relative error <= TOL_COST) and the gradient in x, y (<= TOL_FIELDS)."""
    dev = torch.device("cuda", torch.cuda.current_device())
    x, y = (t.to(dev) for t in _problem(3, 7))
    lx, ly = ShardLayout.even(N, world), ShardLayout.even(M, world)
    xr = x[slice(*lx.rows(rank))].clone().requires_grad_()
    yr = y[slice(*ly.rows(rank))].clone().requires_grad_()
    loss_fn = distributed.SamplesLoss(exchange=exchange)
    t_sharded, _ = _timed(lambda: loss_fn(xr.detach(), yr.detach()), REPEATS, True)
    value = loss_fn(xr, yr)
    value.backward()
    gx, gy = _gather(xr.grad, lx), _gather(yr.grad, ly)
    ok = True
    if rank == 0:
        xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
        t_single, _ = _timed(lambda: torch_api.SamplesLoss()(x, y), REPEATS, False)
        ref = torch_api.SamplesLoss()(xs, ys)
        ref.backward()
        errs = dict(loss=abs(float(value) - float(ref)) / abs(float(ref)), grad_x=_rel(gx, xs.grad),
                    grad_y=_rel(gy, ys.grad))
        ok = errs["loss"] <= TOL_COST and max(errs["grad_x"], errs["grad_y"]) <= TOL_FIELDS
        print(json.dumps(dict(n=N, m=M, d=3, call="SamplesLoss()", world=world, exchange=exchange, ok=ok,
                              errors=errs, seconds=dict(sharded=t_sharded, single=t_single))), flush=True)
    flag = torch.tensor([int(ok)], device=dev)
    dist.broadcast(flag, src=0)
    return bool(flag.item())


def main() -> int:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    dist.init_process_group("nccl")
    try:
        results = [check_problem(spec, seed, rank, world, ex) for seed, spec in enumerate(PROBLEMS)
                   for ex in ("gather", "ring")]
        results += [check_loss(rank, world, ex) for ex in ("gather", "ring")]
    finally:
        dist.destroy_process_group()
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
