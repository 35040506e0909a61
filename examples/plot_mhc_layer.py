"""
A manifold-constrained hyper-connection (mHC) layer
===================================================

Hyper-connections widen the residual stream of a network into :math:`n` parallel
streams and mix them between layers with an :math:`n \\times n` matrix. mHC constrains
that matrix to be **doubly stochastic** (non-negative, every row and column summing to
one), which keeps the mixing a convex combination of the streams: the signal's mean is
preserved through depth. The matrix is obtained from free logits :math:`M` by
Sinkhorn-Knopp: :math:`P = \\exp(M)`, then alternately normalise columns and rows.

``torch_api.FusedMHC`` does those iterations for a whole batch of small matrices in one
fused kernel and differentiates through them (``backward="unrolled"``: the exact gradient
of the iterations, recomputed on chip). Here a small residual MLP with 4 streams and
learnable mixing logits per layer is trained on a toy regression task.
"""

# %%
# The model
# ---------

import argparse
import time

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn

import torch_api

parser = argparse.ArgumentParser(description="A manifold-constrained hyper-connection (mHC) layer")
parser.add_argument("--small", action="store_true", help="tiny sizes for a CPU run")
args, _ = parser.parse_known_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
if args.small:
    streams, width, depth, batch, steps = 4, 16, 3, 128, 15
else:
    streams, width, depth, batch, steps = 4, 256, 12, 1024, 2000
torch.manual_seed(0)


class HyperConnectedMLP(nn.Module):
    """Residual MLP whose residual stream is ``streams`` copies mixed by doubly-stochastic matrices."""

    def __init__(self, streams, width, depth):
        super().__init__()
        self.embed = nn.Linear(2, width)
        self.mix_logits = nn.Parameter(torch.randn(depth, streams, streams))   # one (n, n) per layer
        self.read = nn.Parameter(torch.zeros(depth, streams))    # which streams feed each layer
        self.write = nn.Parameter(torch.zeros(depth, streams))   # where each layer writes back
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU(), nn.Linear(width, width))
            for _ in range(depth))
        self.head = nn.Linear(width, 1)
        self.mhc = torch_api.FusedMHC(iters=20)                 # (..., n, n) logits -> doubly stochastic

    def mixing(self):
        return self.mhc(self.mix_logits)                         # all layers' matrices in one launch

    def forward(self, inputs):
        h = self.embed(inputs)[:, None, :].expand(-1, self.mix_logits.shape[1], -1)   # (B, n, width)
        mixes = self.mixing()
        for layer, mix, read, write in zip(self.layers, mixes, self.read, self.write):
            out = layer(torch.einsum("k,bkw->bw", torch.softmax(read, 0), h))
            h = torch.einsum("jk,bkw->bjw", mix, h) + torch.sigmoid(write)[None, :, None] * out[:, None, :]
        return self.head(h.mean(dim=1)).squeeze(-1)


def target(z):
    return torch.sin(3 * z[:, 0]) * torch.cos(2 * z[:, 1])


model = HyperConnectedMLP(streams, width, depth).to(device)
with torch.no_grad():
    initial_mix = model.mixing().cpu().numpy()
lr = 2e-2 if args.small else 1e-3
others = [p for name, p in model.named_parameters() if name != "mix_logits"]
optimizer = torch.optim.Adam([{"params": others}, {"params": [model.mix_logits], "lr": 10 * lr}], lr=lr)

# %%
# Training
# --------
# The gradient reaches the mixing logits through the Sinkhorn-Knopp iterations. The logits
# get a larger learning rate than the weights, so that the mixing visibly adapts in a few
# steps.

start = time.perf_counter()
losses = []
for step in range(steps):
    z = torch.rand(batch, 2, device=device) * 2 - 1
    loss = torch.mean((model(z) - target(z)) ** 2)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    losses.append(loss.item())
print(f"{steps} steps in {time.perf_counter() - start:.1f} s; loss {losses[0]:.4f} -> {losses[-1]:.4f}")

with torch.no_grad():
    final_mix = model.mixing().cpu().numpy()
print("row sums", np.round(final_mix.sum(-1), 5).tolist())
print("column sums", np.round(final_mix.sum(-2), 5).tolist())

# %%
# Loss curve
# ----------

fig, ax = plt.subplots(figsize=(5, 3.2))
ax.semilogy(losses)
ax.set_xlabel("step")
ax.set_ylabel("mean squared error")
ax.set_title(f"{depth} layers, {streams} streams of width {width}")
fig.tight_layout()

# %%
# The mixing matrices
# -------------------
# Top: at initialisation; bottom: after training. Each matrix is doubly stochastic (the
# printed row and column sums are 1 to float32 accuracy) whatever the logits became.

shown = min(depth, 4)
fig, axes = plt.subplots(2, shown, figsize=(2.6 * shown, 5.2))
axes = np.asarray(axes).reshape(2, shown)
for row, (mats, label) in enumerate(((initial_mix, "initial"), (final_mix, "trained"))):
    for col in range(shown):
        ax = axes[row, col]
        im = ax.imshow(mats[col], vmin=0, vmax=1, cmap="viridis")
        for i in range(streams):
            for j in range(streams):
                ax.text(j, i, f"{mats[col][i, j]:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if mats[col][i, j] < 0.5 else "black")
        ax.set_title(f"{label}, layer {col + 1}", fontsize=9)
        ax.set_xticks([])
        ax.set_yticks([])
fig.colorbar(im, ax=axes, shrink=0.8)
plt.show()
