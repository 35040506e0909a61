"""Anderson acceleration of the multiscale solve's finishing steps (the (f_ba, g_ab) pair at blur^2).

The alternating Sinkhorn map on f, T(f) = softmin_y(softmin_x(f)), converges slowly where the clouds
have long tails (Gaussian data at small blur: the marginal error decays about as 1/k; docs/performance.md).
Anderson mixing of depth m keeps the last m pairs (T(f_k), r_k = T(f_k) - f_k) and steps to

    f_{k+1} = T(f_k) - sum_i gamma_i (T(f_{i+1}) - T(f_i)),
    gamma = argmin || r_k - sum_i gamma_i (r_{i+1} - r_i) ||_2,

with the residuals centred (T(f + c) = T(f) + c: the constant is the potentials' gauge, not an
error). The least squares run in float64 on the (m-1) x (m-1) normal equations, lightly
regularised (solved without a host read). The caller restarts the history when the marginal error jumps (solve).
"""

from __future__ import annotations

import torch
from torch import Tensor


class AndersonMixer:
    """History of (T(f), centred residual) pairs, at most ``depth``."""

    def __init__(self, depth: int):
        self.depth = depth
        self.tf: list[Tensor] = []
        self.res: list[Tensor] = []

    def reset(self) -> None:
        self.tf.clear()
        self.res.clear()

    def step(self, f: Tensor, tf: Tensor) -> tuple[Tensor, Tensor | None]:
        """(the next f, gamma (float64, on f's device: no host read) or None when the history holds
        one pair: then the next f is T(f))."""
        r = tf - f
        self.tf.append(tf)
        self.res.append(r - r.mean())
        del self.tf[:-self.depth], self.res[:-self.depth]
        if len(self.res) < 2:
            return tf, None
        gamma = mixing(torch.stack(self.res, 1))
        return extrapolate(self.tf, gamma), gamma


def mixing(res: Tensor) -> Tensor:
    """gamma for the residual history ``res`` (n, k), oldest first (float64, length k - 1)."""
    r = res.double()
    dr = r[:, 1:] - r[:, :-1]
    gram = dr.T @ dr
    ridge = 1e-10 * torch.diagonal(gram).sum() + torch.finfo(torch.float64).tiny
    eye = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    # solve_ex: no error check, so no wait for the device (linalg.solve reads its info flag); the
    # ridge keeps the system regular, and a non-finite gamma (never seen) falls back to 0: T(f)
    gamma = torch.linalg.solve_ex(gram + ridge * eye, dr.T @ r[:, -1])[0]
    return torch.where(torch.isfinite(gamma).all(), gamma, torch.zeros_like(gamma))


def extrapolate(tf: list[Tensor], gamma: Tensor) -> Tensor:
    """T(f_k) - sum_i gamma_i (T(f_{i+1}) - T(f_i)) over the history ``tf`` (oldest first)."""
    t = torch.stack(tf, 1)
    dt = (t[:, 1:] - t[:, :-1]).double()
    return (t[:, -1].double() - dt @ gamma.to(dt.device)).to(t.dtype)
