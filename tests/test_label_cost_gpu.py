"""The label cost on the GPU: ``sinkhorn(..., label_x, label_y, label_cost)`` in both frontends against
a float64 dense loop of the same iterations, and out-of-range labels under ``jax.jit``.

The solve sorts each cloud by label and its half-steps run the GROUPED kernel (one unlabelled pass per
label of a row block, kernels/lse_update.py), compiled here; the CPU tests run it in the interpreter.
Labels arrive in random order (the frontends sort), n != m, non-uniform weights with zeros.
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

import torch_api

pytestmark = pytest.mark.gpu

ITERS = 30


def _problem(d: int, n: int = 3000, m: int = 2000, kx: int = 7, ky: int = 5):
    gen = torch.Generator().manual_seed(d)
    spread = 1.0 if d <= 8 else 0.25
    x = spread * torch.randn(n, d, generator=gen, dtype=torch.float64)
    y = spread * (torch.randn(m, d, generator=gen, dtype=torch.float64) + 0.3)
    a, b = torch.rand(n, generator=gen, dtype=torch.float64) + 0.1, torch.rand(m, generator=gen, dtype=torch.float64) + 0.1
    a[::97], b[::89] = 0.0, 0.0
    lx = torch.randint(0, kx, (n,), generator=gen, dtype=torch.int32)
    ly = torch.randint(0, ky, (m,), generator=gen, dtype=torch.int32)
    w = 2.0 * torch.rand(kx, ky, generator=gen, dtype=torch.float64)
    eps = 0.1 if d <= 8 else 0.5
    return {k: v.cuda() if torch.is_tensor(v) else v for k, v in dict(x=x, y=y, a=a / a.sum(), b=b / b.sum(),
                                                                      lx=lx, ly=ly, w=w, eps=eps).items()}


def _reference_f(p) -> torch.Tensor:
    """f after ITERS of OTT's loop (g then f, from zero) with C = |x - y|^2 + W[lx, ly], in float64."""
    c = torch.cdist(p["x"], p["y"]) ** 2 + p["w"][p["lx"].long()][:, p["ly"].long()]
    eps, la, lb = p["eps"], torch.log(p["a"]), torch.log(p["b"])
    f = torch.where(p["a"] > 0, 0.0, -torch.inf).double()
    for _ in range(ITERS):
        g = eps * lb - eps * torch.logsumexp((f[:, None] - c) / eps, dim=0)
        f = eps * la - eps * torch.logsumexp((g[None, :] - c) / eps, dim=1)
    return f


def _close(f, ref, tol: float = 1e-4) -> float:
    f = torch.as_tensor(np.asarray(f), dtype=torch.float64, device=ref.device)
    assert torch.equal(torch.isneginf(f), torch.isneginf(ref)) and not torch.isnan(f).any()
    fin = torch.isfinite(ref)
    err = float((f[fin] - ref[fin]).abs().max() / ref[fin].abs().max())
    assert err < tol, err
    return err


@pytest.mark.parametrize("d", [3, 64])
def test_labelled_sinkhorn_matches_float64_in_both_frontends(d):
    p = _problem(d)
    ref = _reference_f(p)
    kw = dict(epsilon=p["eps"], min_iterations=ITERS, max_iterations=ITERS, inner_iterations=10)
    f32 = {k: p[k].float() for k in ("x", "y", "a", "b", "w")}
    out = torch_api.sinkhorn(f32["x"], f32["y"], f32["a"], f32["b"], label_x=p["lx"], label_y=p["ly"],
                             label_cost=f32["w"], **kw)
    err_torch = _close(out.f.cpu(), ref.cpu())
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend in this environment")
    import ot_triton_jax as otj
    if os.environ.get("TRITON_CACHE_DIR") == "":  # jax_triton 0.3.1 clears it: later torch compiles would fail
        del os.environ["TRITON_CACHE_DIR"]
    j = {k: otj.from_torch(v) for k, v in {**f32, "lx": p["lx"], "ly": p["ly"]}.items()}
    outj = jax.jit(lambda x, y, a, b, lx, ly, w: otj.sinkhorn(x, y, a, b, label_x=lx, label_y=ly, label_cost=w,
                                                               **kw).f)(j["x"], j["y"], j["a"], j["b"], j["lx"],
                                                                        j["ly"], j["w"])
    err_jax = _close(jax.device_get(outj), ref.cpu())
    print(f"\nlabelled sinkhorn d={d}: f vs float64 of the same {ITERS} iterations: torch {err_torch:.1e}, "
          f"jax {err_jax:.1e}")


def test_out_of_range_label_under_jit_gives_nan_on_the_gpu():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend in this environment")
    import ot_triton_jax as otj
    p = _problem(3, n=700, m=500)
    lx = p["lx"].clone()
    lx[123] = 7  # K_x = 7: out of range
    f32 = {k: otj.from_torch(p[k].float()) for k in ("x", "y", "a", "b", "w")}
    out = jax.jit(lambda lx: otj.sinkhorn(f32["x"], f32["y"], f32["a"], f32["b"], epsilon=0.1, label_x=lx,
                                          label_y=otj.from_torch(p["ly"]), label_cost=f32["w"]))(otj.from_torch(lx))
    assert not bool(out.converged) and bool(np.isnan(np.asarray(out.f)).any())
