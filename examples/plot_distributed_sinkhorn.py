r"""
Sinkhorn on several GPUs with ``torchrun``
==========================================

``torch_api.distributed`` solves one problem whose clouds are split by points over the
processes of a ``torch.distributed`` group: rank r holds rows :math:`x_r` of x and
:math:`y_r` of y (with their weights), and the result is the single-device solve's on
:math:`x = \mathrm{concat}_r\, x_r`, :math:`y = \mathrm{concat}_r\, y_r`. Every rank
gathers the clouds once; each half-step updates the potential of the rank's own rows
against the full other cloud and all-gathers the new pieces (O(n + m) numbers, nothing
n × m); the gradient of ``reg_ot_cost`` in a rank's points needs no communication. Clouds
too large for one device stay sharded with ``exchange="ring"``: every pass streams the other
side's shards around the ring of ranks, for the same numbers.

Launch one process per GPU::

    torchrun --nproc_per_node=4 examples/plot_distributed_sinkhorn.py   # NCCL, n = m = 2^20

Run as a plain script (or with ``--small``) it launches itself under ``torchrun`` with two
CPU processes (Gloo) on a small problem, then gathers the shards and compares them with
the single-device solve.
"""

# %%
# The worker: what every rank runs
# --------------------------------

import argparse
import os
import subprocess
import sys
import tempfile
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import torch_api
from ot_triton_jax.core.sharding import split_sizes


def problem(n: int, m: int, d: int):
    """The same clouds on every rank (one seed); each rank keeps its rows."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=gen)
    y = 0.7 * torch.randn(m, d, generator=gen) + torch.tensor([1.5] + [0.0] * (d - 1))
    return x, y


def shard(t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    sizes = split_sizes(t.shape[0], world)
    start = sum(sizes[:rank])
    return t[start:start + sizes[rank]]


def worker(n: int, m: int, d: int, epsilon: float, out_dir: str) -> None:
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    x, y = problem(n, m, d)
    xr = shard(x, rank, world).to(device).requires_grad_()
    yr = shard(y, rank, world).to(device)
    t0 = time.perf_counter()
    out = torch_api.distributed.sinkhorn(xr, yr, epsilon=epsilon)
    out.reg_ot_cost.backward()  # every rank: the gradient of its own points
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    ring = torch_api.distributed.sinkhorn(xr.detach(), yr, epsilon=epsilon, exchange="ring")  # clouds stay sharded
    torch.save({"f": out.f.detach().cpu(), "grad": xr.grad.cpu(), "cost": float(out.reg_ot_cost.detach()),
                "n_iters": int(out.n_iters), "seconds": seconds, "world": world},
               os.path.join(out_dir, f"rank{rank}.pt"))
    if rank == 0:
        cost, cost_ring = float(out.reg_ot_cost.detach()), float(ring.reg_ot_cost)
        print(f"{world} processes: reg_ot_cost {cost:.6f} after {int(out.n_iters)} iterations, {seconds:.2f} s "
              f"(solve and gradient); with the ring exchange {cost_ring:.6f} (relative difference "
              f"{abs(cost_ring - cost) / abs(cost):.1e})")
    dist.destroy_process_group()


# %%
# The launcher: ``torchrun`` with two CPU processes
# -------------------------------------------------

parser = argparse.ArgumentParser()
parser.add_argument("--small", action="store_true", help="a small problem on two CPU processes")
parser.add_argument("--out", default=None, help="where the ranks write their shards")
args = parser.parse_args()
n, m, d, epsilon = (48, 40, 2, 0.3) if args.small else (2 ** 20, 2 ** 20, 3, 0.1)

if "RANK" in os.environ:  # started by torchrun: this process is one rank
    worker(n, m, d, epsilon, args.out or tempfile.gettempdir())
    sys.exit(0)

NAME = "plot_distributed_sinkhorn.py"
try:
    script = os.path.abspath(__file__)
except NameError:  # run by the documentation build (no __file__): the repository's examples/
    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(torch_api.__file__))), "examples", NAME)
out_dir = tempfile.mkdtemp()
env = dict(os.environ, OMP_NUM_THREADS="1")
cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
       script, "--out", out_dir] + (["--small"] if args.small else [])
subprocess.run(cmd, env=env, check=True)

# %%
# The shards against the single-device solve
# ------------------------------------------
# Rank r returned its rows of f and of the gradient; concatenated in rank order they are the
# single-device solve's, to float32 rounding.

shards = [torch.load(os.path.join(out_dir, f"rank{r}.pt")) for r in range(2)]
f = torch.cat([s["f"] for s in shards])
grad = torch.cat([s["grad"] for s in shards])
x, y = problem(n, m, d)
if args.small:
    xs = x.clone().requires_grad_()
    ref = torch_api.sinkhorn(xs, y, epsilon=epsilon)
    ref.reg_ot_cost.backward()
    print(f"single device: reg_ot_cost {float(ref.reg_ot_cost.detach()):.6f} after {int(ref.n_iters)} iterations; "
          f"max |f - f_single| = {float((f - ref.f.detach()).abs().max()):.2e}, "
          f"max |grad - grad_single| = {float((grad - xs.grad).abs().max()):.2e}")

k = min(n, 4000)
owner = torch.cat([torch.full((s["f"].shape[0],), r) for r, s in enumerate(shards)])
fig, axes = plt.subplots(1, 2, figsize=(10, 4.2))
axes[0].scatter(y[:k, 0], y[:k, 1], s=8, c="lightgray", label="y")
for r in range(2):
    sel = (owner[:k] == r).nonzero().squeeze(1)
    axes[0].scatter(x[sel, 0], x[sel, 1], s=10, label=f"x rows of rank {r}")
axes[0].quiver(x[:k, 0], x[:k, 1], -grad[:k, 0], -grad[:k, 1], angles="xy", width=0.003, alpha=0.6)
axes[0].set_title("the shards of x and -grad reg_ot_cost")
axes[0].legend(loc="upper left", fontsize=8)
axes[1].scatter(x[:k, 0], f[:k], s=8, c=owner[:k], cmap="coolwarm")
axes[1].set_xlabel("x (first coordinate)")
axes[1].set_ylabel("f (gathered from the ranks)")
axes[1].set_title("the potential f, coloured by rank")
fig.tight_layout()
plt.show()
