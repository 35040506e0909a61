"""The peers, loaded on demand (never at import: a dry run loads none). Each loader raises when its
package is absent or broken; the area records that in the peer's rows.

* flash-sinkhorn 0.4.1: ``sinkhorn_flashstyle_alternating`` (OTT's alternating iterations with
  ``ott_convention=True``), its ``SamplesLoss`` (GeomLoss-style, ``half_cost=True`` so that the cost
  is GeomLoss's |x - y|^2 / 2), its multiscale backend, its HVP (``flash_sinkhorn.hvp``).
* OTT-JAX 0.6.0: ``Sinkhorn`` on a ``PointCloud``, dense or online (``batch_size``); its online mode
  needs ``jax.interpreters.batching.is_vmappable``, which newer JAX moved: restored from jax._src.
* GeomLoss 0.3.1: ``SamplesLoss("sinkhorn", backend="tensorized")``.
"""

from __future__ import annotations

import numpy as np
import torch

OTT_PRECISION = {"float32": "highest", "tf32": "tensorfloat32"}
OTT_ONLINE_BATCH = 1024  # PointCloud(batch_size=...): OTT's streamed cost, never n x m


def flash_alternating():
    from flash_sinkhorn.sinkhorn_solvers import sinkhorn_flashstyle_alternating
    return sinkhorn_flashstyle_alternating


def flash_samples_loss(blur: float, scaling: float, tf32: bool, **kw):
    """(module, call string) of flash-sinkhorn's SamplesLoss with GeomLoss's cost."""
    from flash_sinkhorn.samples_loss import SamplesLoss
    kw = dict(p=2, blur=blur, scaling=scaling, debias=True, half_cost=True, allow_tf32=tf32, **kw)
    return SamplesLoss("sinkhorn", **kw), f"flash_sinkhorn.samples_loss.SamplesLoss('sinkhorn', **{kw})"


def flash_multiscale(blur: float, scaling: float):
    """flash-sinkhorn's multiscale SamplesLoss with its own defaults otherwise (tol 5e-3): forward only."""
    from flash_sinkhorn.samples_loss import SamplesLoss
    return SamplesLoss("sinkhorn", p=2, blur=blur, scaling=scaling, debias=True, half_cost=True, backend="multiscale")


def geomloss_samples_loss(blur: float, scaling: float):
    import geomloss
    kw = dict(p=2, blur=blur, scaling=scaling, debias=True, backend="tensorized")
    return geomloss.SamplesLoss("sinkhorn", **kw), f"geomloss.SamplesLoss('sinkhorn', **{kw})"


def patch_ott_online() -> None:
    import jax._src.interpreters.batching as batching_src
    import jax.interpreters.batching as batching
    if not hasattr(batching, "is_vmappable"):
        batching.is_vmappable = batching_src.is_vmappable


def ott_sinkhorn(iters: int, eps: float, online: bool = False):
    """(jitted solve(x, y) -> (f, g), call string): OTT's Sinkhorn, min = max = iters,
    inner_iterations 10, on PointCloud(x, y, epsilon=eps), dense or online."""
    import jax
    if online:
        patch_ott_online()
    from ott.geometry import pointcloud
    from ott.problems.linear import linear_problem
    from ott.solvers.linear import sinkhorn
    batch = OTT_ONLINE_BATCH if online else None
    solver = sinkhorn.Sinkhorn(min_iterations=iters, max_iterations=iters, inner_iterations=10)

    @jax.jit
    def solve(x, y):
        out = solver(linear_problem.LinearProblem(pointcloud.PointCloud(x, y, epsilon=eps, batch_size=batch)))
        return out.f, out.g

    call = (f"jax.jit(Sinkhorn(min_iterations={iters}, max_iterations={iters}, inner_iterations=10)(LinearProblem("
            f"PointCloud(x, y, epsilon={eps}{f', batch_size={batch}' if online else ''}))))")
    return solve, call


def to_jax(t: torch.Tensor):
    import jax.numpy as jnp
    return jnp.asarray(t.detach().cpu().numpy())


def to_torch(a, device: str) -> torch.Tensor:
    return torch.from_numpy(np.array(a)).to(device)
