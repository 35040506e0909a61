"""
Training under ``jax.jit`` with an OT loss
==========================================

Fit an affine map :math:`T(x) = A x + t` so that the image of a source cloud matches a
target cloud in distribution. There are no correspondences between the two clouds: the
loss is the debiased Sinkhorn divergence of ``ot_triton_jax.samples_loss`` (GeomLoss's
conventions: cost :math:`|x-y|^2/2`, :math:`\\varepsilon = \\mathrm{blur}^2`), and the
whole training step (loss, gradient in :math:`(A, t)` by ``jax.value_and_grad``, an optax
Adam update) is one ``jax.jit``-compiled function.

On a GPU with jax-triton installed the kernels run as XLA custom calls inside the compiled
step; on a CPU the same kernels run under the Triton interpreter through a callback.
"""

# %%
# Data and sizes
# --------------

import argparse
import time

import jax
import jax.numpy as jnp
import matplotlib.pyplot as plt
import numpy as np
import optax

import ot_triton_jax as otj

parser = argparse.ArgumentParser(description="Training under ``jax.jit`` with an OT loss")
parser.add_argument("--small", action="store_true", help="tiny sizes for a CPU run")
args, _ = parser.parse_known_args()

if args.small:
    n, blur, steps, lr = 32, 0.25, 16, 0.15
else:
    n, blur, steps, lr = 8192, 0.02, 100, 0.05

# The target is the source through an unknown affine map, its points shuffled: the loss
# sees two unordered clouds, never which point went where.
kx, kp = jax.random.split(jax.random.key(0))
x = jax.random.normal(kx, (n, 2))                                   # source: standard normal
true_A = jnp.array([[1.2, 0.6], [-0.3, 0.5]])
true_t = jnp.array([1.0, -0.5])
y = jax.random.permutation(kp, x @ true_A.T + true_t)

# %%
# The compiled training step
# --------------------------
# Parameters are a pytree; ``blur`` is static (it fixes the ε-schedule's length), the
# clouds are traced, so a new batch never recompiles.

params = {"A": jnp.eye(2), "t": jnp.zeros(2)}
optimizer = optax.adam(learning_rate=optax.cosine_decay_schedule(lr, decay_steps=steps))   # decays to 0
opt_state = optimizer.init(params)


def loss_fn(params, x, y):
    mapped = x @ params["A"].T + params["t"]
    return otj.samples_loss(mapped, y, blur=blur)


@jax.jit
def train_step(params, opt_state, x, y):
    value, grads = jax.value_and_grad(loss_fn)(params, x, y)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, value


start = time.perf_counter()
history, snapshots = [], {0: params}
for step in range(steps):
    params, opt_state, value = train_step(params, opt_state, x, y)
    history.append(float(value))
    if step + 1 in (1, 3, steps):
        snapshots[step + 1] = params
final = float(jax.jit(loss_fn)(params, x, y))
history.append(final)
print(f"{steps} jitted steps in {time.perf_counter() - start:.1f} s (the first one compiles)")
print("loss", " ".join(f"{v:.3e}" for v in history[:4]), "...", f"{final:.3e}")
print("true A =", np.round(np.asarray(true_A), 3).tolist(), " t =", np.round(np.asarray(true_t), 3).tolist())
print("fit  A =", np.round(np.asarray(params["A"]), 3).tolist(), " t =", np.round(np.asarray(params["t"]), 3).tolist())

# %%
# Training curve
# --------------
# Adam on the six parameters (its rate decays to zero over the run); the loss, its
# gradient through the streaming kernels and the update are one compiled call per step.

fig, ax = plt.subplots(figsize=(5, 3.2))
ax.semilogy(range(len(history)), history, "o-")
ax.set_xlabel("step")
ax.set_ylabel("Sinkhorn divergence")
ax.set_title(f"n = {n}, blur = {blur}")
fig.tight_layout()

# %%
# The mapped cloud during training
# --------------------------------
# Grey: the source; red: the target; blue: the source through the current map, with the
# image of a square grid. The divergence is zero only when the two clouds coincide as sets,
# so the map that made the target is recovered (printed above) up to the blur's bias.

grid = np.linspace(-2.0, 2.0, 5)
fig, axes = plt.subplots(1, len(snapshots), figsize=(3.2 * len(snapshots), 3.3), sharex=True, sharey=True)
xn, yn = np.asarray(x), np.asarray(y)
for ax, (step, p) in zip(axes, sorted(snapshots.items())):
    A, t = np.asarray(p["A"]), np.asarray(p["t"])
    mapped = xn @ A.T + t
    ax.scatter(xn[:, 0], xn[:, 1], s=5, c="0.75")
    ax.scatter(yn[:, 0], yn[:, 1], s=5, c="tab:red", alpha=0.6)
    ax.scatter(mapped[:, 0], mapped[:, 1], s=5, c="tab:blue")
    for g in grid:
        line = np.stack([np.full_like(grid, g), grid], 1) @ A.T + t
        ax.plot(line[:, 0], line[:, 1], c="tab:blue", lw=0.5, alpha=0.5)
        line = np.stack([grid, np.full_like(grid, g)], 1) @ A.T + t
        ax.plot(line[:, 0], line[:, 1], c="tab:blue", lw=0.5, alpha=0.5)
    ax.set_title("start" if step == 0 else f"after {step} step{'s' if step > 1 else ''}")
    ax.set_aspect("equal")
fig.tight_layout()
plt.show()
