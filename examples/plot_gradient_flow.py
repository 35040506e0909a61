"""
Gradient flow of a point cloud onto another
===========================================

A cloud of points :math:`x_1, \\dots, x_n` follows the gradient of the debiased
Sinkhorn divergence :math:`S_\\varepsilon(\\alpha, \\beta)` between its uniform measure
:math:`\\alpha = \\frac1n \\sum_i \\delta_{x_i}` and a fixed target :math:`\\beta`.
With GeomLoss's conventions (cost :math:`|x - y|^2 / 2`, :math:`\\varepsilon =
\\mathrm{blur}^2`) the gradient in :math:`x_i` is :math:`\\frac1n` times a displacement
towards the target, so a step of length ``lr`` on :math:`n \\nabla_{x_i} S` moves every
point a fraction ``lr`` of the way along that displacement.

``torch_api.SamplesLoss`` computes the loss and its gradient with streaming kernels:
nothing of size :math:`n \\times m` is ever stored.

Run ``python examples/plot_gradient_flow.py`` on a GPU for the full-size flow; the
documentation build runs it with ``--small`` (a few dozen points, every kernel under the
Triton interpreter).
"""

# %%
# Sizes
# -----
# ``--small`` keeps the clouds tiny so that the CPU build stays fast.

import argparse
import time

import matplotlib.pyplot as plt
import numpy as np
import torch

import torch_api

parser = argparse.ArgumentParser(description="Gradient flow of a point cloud onto another")
parser.add_argument("--small", action="store_true", help="tiny sizes for a CPU run")
args, _ = parser.parse_known_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
if args.small:
    n, blur, lr, t_end = 64, 0.1, 0.5, 4.0
else:
    n, blur, lr, t_end = 4000, 0.02, 0.05, 4.0
snapshots = [0.0, 0.5, 1.0, 2.0, 4.0]
torch.manual_seed(0)

# %%
# Two clouds
# ----------
# The source is a Gaussian blob on the left; the target a ring with a gap on the right.


def ring(n):
    theta = torch.rand(n) * 1.7 * np.pi + 0.3 * np.pi
    radius = 1.0 + 0.08 * torch.randn(n)
    return torch.stack([radius * torch.cos(theta), radius * torch.sin(theta)], dim=1) + torch.tensor([1.2, 0.0])


x = (0.35 * torch.randn(n, 2) + torch.tensor([-1.5, 0.0])).to(device)
y = ring(n).to(device)

# %%
# The flow
# --------
# Explicit Euler steps of :math:`\dot x_i = -n \nabla_{x_i} S_\varepsilon`. The loss
# module is built once; every call solves a new problem from scratch (GeomLoss's
# :math:`\varepsilon`-scaling from the diameter down to ``blur``).

loss = torch_api.SamplesLoss("sinkhorn", p=2, blur=blur, scaling=0.5)
x = x.clone().requires_grad_(True)
steps = int(round(t_end / lr))
frames, values = {}, []
start = time.perf_counter()
for k in range(steps + 1):
    t = k * lr
    if any(abs(t - s) < 1e-9 for s in snapshots):
        frames[t] = x.detach().cpu().numpy().copy()
    value = loss(x, y)
    values.append(value.item())
    if k == steps:
        break
    (grad,) = torch.autograd.grad(value, x)
    with torch.no_grad():
        x -= lr * n * grad
print(f"{steps} steps of {n} points in {time.perf_counter() - start:.1f} s; "
      f"loss {values[0]:.4f} -> {values[-1]:.2e}")

# %%
# Snapshots
# ---------
# Blue: the moving cloud; red: the target. The mass first travels as a whole, then
# spreads along the ring.

yn = y.cpu().numpy()
fig, axes = plt.subplots(1, len(frames), figsize=(3.0 * len(frames), 3.2), sharex=True, sharey=True)
for ax, (t, pts) in zip(axes, sorted(frames.items())):
    ax.scatter(yn[:, 0], yn[:, 1], s=6, c="tab:red", alpha=0.5, label="target")
    ax.scatter(pts[:, 0], pts[:, 1], s=6, c="tab:blue", label="flow")
    ax.set_title(f"t = {t:g}")
    ax.set_aspect("equal")
    ax.set_xticks([])
    ax.set_yticks([])
axes[0].legend(loc="lower left", fontsize=8)
fig.tight_layout()

# %%
# The loss along the flow decreases towards zero (the divergence of a measure with itself).

fig, ax = plt.subplots(figsize=(5, 3.2))
ax.semilogy(np.arange(len(values)) * lr, values, "o-")
ax.set_xlabel("time t")
ax.set_ylabel("Sinkhorn divergence")
ax.set_title(f"n = {n}, blur = {blur}")
fig.tight_layout()
plt.show()
