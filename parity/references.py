"""Float64 references: OTT-JAX 0.6.0 (subprocess), a dense float64 fallback, GeomLoss 0.3.1.

* OTT-JAX: ``tests/ott_reference.py`` computes every OTT quantity of a case in ONE subprocess
  with ``jax_enable_x64`` (never in this process, where our JAX frontend runs in float32):
  Sinkhorn at threshold 1e-12 (or at ours where ours is raised to the float32 floor), implicit differentiation (``use_danskin=False``) with linear
  solves at 1e-13; for a relaxed case OTT's default first derivatives (``use_danskin=True``: those at
  fixed potentials, which ours follow; OTT's relaxed cost is not stationary at its own fixed point). On a GPU machine :mod:`parity.ott_worker` runs the same code on the GPU.
* A label cost: OTT's dense ``Geometry`` of |x - y|^2 + W[label_x, label_y] (tests/ott_reference.py).
* Dense float64 fallback: where OTT produces no number (exception, NaN, out of memory) the
  rows of that case say so and are compared against ``tests/reference.py`` /
  ``tests/implicit_reference.py`` (float64 torch, the implicit function theorem on dense
  matrices; small n only).
* GeomLoss: ``geomloss.SamplesLoss("sinkhorn", backend="tensorized")`` in float64 on the same
  (float32-valued) inputs and options as ours.
* The true marginal error ``||P^T 1 - b||_1`` of given potentials, in float64 (row blocks).
"""

from __future__ import annotations

import os
import subprocess
import sys
from typing import Callable

import numpy as np
import torch

from .cases import Case, Inputs
from .quantities import OTT_KEYS
from .solve_settings import geomloss_options, relaxation
from .thresholds import OTT_THRESHOLD

TESTS_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests")
if TESTS_DIR not in sys.path:
    sys.path.insert(0, TESTS_DIR)

import ott_reference  # noqa: E402  (tests/ott_reference.py: numpy + stdlib in this process)

OTT_LABEL = "OTT-JAX 0.6.0 float64"
DENSE_LABEL = "dense float64"
GEOMLOSS_LABEL = "GeomLoss 0.3.1 float64"
MARGINAL_LABEL = "float64 marginal of our potentials"
OTT_TIMEOUT_S = 900.0


def ott(case: Case, inp: Inputs, groups: tuple[str, ...], on_gpu: bool,
        threshold: float = OTT_THRESHOLD) -> dict[str, np.ndarray]:
    """OTT-JAX's float64 values of the groups' quantities (one subprocess) with its Sinkhorn
    stopped at ``threshold`` (``thresholds.reference_threshold``). Raises on failure."""
    keys = sorted({k for g in groups for k in OTT_KEYS.get(g, ())})
    if not keys:
        return {}
    # a relaxed case's HVPs: the Hessian of the dual value (the envelope gradient differentiated
    # with OTT's potentials moving; tests/ott_reference.py), which ours computes
    env = {} if case.balanced else {f"{k[:-2]}_env{k[-2:]}": k for k in keys
                                    if k in ("hvp_x", "hvp_y", "div_hvp_x", "div_hvp_y")}
    keys = sorted(set(keys) - set(env.values()) | set(env))
    arrays = dict(inp.as_float64(), eps=inp.eps, threshold=threshold, max_iterations=50000, **inp.labels())
    if not case.balanced:  # OTT's default (Danskin) first derivatives: its relaxed cost is not stationary
        arrays.update(relaxation(case), use_danskin=1)  # at its own fixed point, so they differ from use_danskin=False
    out = ott_reference.ott_reference(keys, timeout=OTT_TIMEOUT_S, **arrays) if not on_gpu \
        else _ott_on_gpu(keys, arrays)
    return {env.get(k, k): v for k, v in out.items()}


def _ott_on_gpu(keys: list[str], arrays: dict) -> dict[str, np.ndarray]:
    """tests/ott_reference.py's computation, run by parity/ott_worker.py on the GPU."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="parity_ott_") as tmp:
        fin, fout = os.path.join(tmp, "in.npz"), os.path.join(tmp, "out.npz")
        payload = {k: np.asarray(v, np.float64) for k, v in arrays.items()}
        payload["__quantities__"] = np.array(keys, dtype=np.str_)
        np.savez(fin, **payload)
        env = dict(os.environ, JAX_ENABLE_X64="1")
        env.pop("JAX_PLATFORMS", None)
        proc = subprocess.run([sys.executable, "-m", "parity.ott_worker", fin, fout], env=env,
                              capture_output=True, text=True, timeout=OTT_TIMEOUT_S,
                              cwd=os.path.dirname(TESTS_DIR))
        if proc.returncode != 0 or not os.path.exists(fout):
            raise RuntimeError(f"OTT worker failed (rc={proc.returncode}):\n{proc.stderr[-4000:]}")
        with np.load(fout) as z:
            return {k: np.asarray(z[k], np.float64) for k in z.files}


def dense(inp: Inputs, groups: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The fallback: the same keys as :func:`ott`, from dense float64 formulas (small n; balanced
    problems only: a relaxed case without OTT's numbers has no reference)."""
    from implicit_reference import Problem

    if not inp.balanced or inp.label_cost is not None:
        raise NotImplementedError("the dense float64 fallback covers balanced problems without a label cost only")

    t = {k: torch.from_numpy(v) for k, v in inp.as_float64().items()}
    x, y, a, b = t["x"], t["y"], t["a"], t["b"]
    p = Problem(x, y, a, b, inp.eps)
    out: dict[str, np.ndarray] = {}
    npy: Callable[[torch.Tensor], np.ndarray] = lambda v: v.detach().double().numpy()
    if "solve" in groups:
        out.update(cost=npy(p.cost), f=npy(p.f), g=npy(p.g))
    if "grad" in groups:
        out.update({f"grad_{k}": npy(v) for k, v in zip("xyab", p.grads())})
    if "hvp" in groups:
        out.update(hvp_x=npy(p.hvp(vx=t["vx"])[0]), hvp_y=npy(p.hvp(vy=t["vy"])[1]))
    if "hvp_default" in groups:
        out.update(hvp_default_x=npy(p.hvp(vx=t["vx"])[0]), hvp_default_y=npy(p.hvp(vy=t["vy"])[1]))
    if "pot_vjp" in groups:
        out.update({f"pot_vjp_{k}": npy(v) for k, v in zip("xyab", p.potentials_vjp(t["wf"], t["wg"]))})
    if "hess" in groups:
        n, d = x.shape
        basis = torch.eye(n * d, dtype=torch.float64).reshape(n * d, n, d)
        out["hess_xx"] = npy(torch.stack([p.hvp(vx=e)[0] for e in basis]).reshape(n, d, n, d).permute(2, 3, 0, 1))
    if "div" in groups:
        pxx, pyy = Problem(x, x, a, a, inp.eps), Problem(y, y, b, b, inp.eps)
        gxx, gyy = pxx.grads(), pyy.grads()
        out["div"] = npy(p.cost - 0.5 * pxx.cost - 0.5 * pyy.cost)
        out["div_grad_x"] = npy(p.grads()[0] - 0.5 * (gxx[0] + gxx[1]))
        out["div_grad_y"] = npy(p.grads()[1] - 0.5 * (gyy[0] + gyy[1]))
        hxx = pxx.hvp(vx=t["vx"], vy=t["vx"])
        hyy = pyy.hvp(vx=t["vy"], vy=t["vy"])
        out["div_hvp_x"] = npy(p.hvp(vx=t["vx"])[0] - 0.5 * (hxx[0] + hxx[1]))
        out["div_hvp_y"] = npy(p.hvp(vy=t["vy"])[1] - 0.5 * (hyy[0] + hyy[1]))
    return out


def geomloss(case: Case, inp: Inputs) -> dict[str, np.ndarray]:
    """GeomLoss's float64 value, potentials and gradient in x (tensorized backend)."""
    import geomloss as gl

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    t = {k: torch.from_numpy(v.astype(np.float64)).to(dev)
         for k, v in (("x", inp.x), ("y", inp.y), ("a", inp.a), ("b", inp.b))}
    t["a"], t["b"] = t["a"] / t["a"].sum(), inp.mass_b * t["b"] / t["b"].sum()
    opts = dict(geomloss_options(case, inp), backend="tensorized")
    x = t["x"].clone().requires_grad_()
    value = gl.SamplesLoss("sinkhorn", **opts)(t["a"], x, t["b"], t["y"])
    (gx,) = torch.autograd.grad(value, x)
    F, G = gl.SamplesLoss("sinkhorn", potentials=True, **opts)(t["a"], t["x"], t["b"], t["y"])
    npy = lambda v: v.detach().cpu().numpy()
    return {"sl_value": npy(value), "sl_grad_x": npy(gx), "sl_f": npy(F).reshape(-1), "sl_g": npy(G).reshape(-1)}


def marginal_error(inp: Inputs, f: np.ndarray, g: np.ndarray, block: int = 1024) -> float:
    """||P^T 1 - b||_1 in float64 for potentials (f, g), P_ij = exp((f_i + g_j - C_ij) / eps)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.from_numpy(inp.x.astype(np.float64)).to(dev)
    y = torch.from_numpy(inp.y.astype(np.float64)).to(dev)
    fd, gd = torch.from_numpy(f).to(dev), torch.from_numpy(g).to(dev)
    col = torch.zeros(y.shape[0], dtype=torch.float64, device=dev)
    for s in range(0, x.shape[0], block):
        xs = x[s:s + block]
        c = (xs * xs).sum(1)[:, None] + (y * y).sum(1)[None, :] - 2.0 * xs @ y.T
        col += torch.exp((fd[s:s + block, None] + gd[None, :] - c) / inp.eps).sum(0)
    b = torch.from_numpy(inp.b.astype(np.float64)).to(dev)
    return float((col - b).abs().sum())
