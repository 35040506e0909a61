"""GPU checks of the JAX frontend (H100): the triton_call and callback backends agree,
zero-copy interop on the device, the torch path still compiles kernels after jax_triton
is imported, and the JAX and torch frontends agree. Run by bench/run_gpu.sh (-m gpu)."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch and JAX share the GPU

import subprocess  # noqa: E402
import sys  # noqa: E402
import textwrap  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

pytestmark = pytest.mark.gpu

jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402

EPS = 0.1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _need_jax_gpu():
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend in this environment")


def _need_jax_triton():
    _need_jax_gpu()
    # Through the library's own import: a bare ``import jax_triton`` (0.3.1) would set
    # TRITON_CACHE_DIR="" for the rest of the session and break every later compile.
    from ot_triton_jax.jax_frontend.launch import _jax_triton_available

    assert _jax_triton_available(), "jax_triton must be installed on the GPU machine (bench/run_gpu.sh)"


def rel(u, v) -> float:
    u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
    if np.isnan(u).any():
        return float("inf")
    return float(np.linalg.norm(u - v) / np.linalg.norm(v))


def clouds(n, m, d, seed=0):
    kx, ky, ka = jax.random.split(jax.random.PRNGKey(seed), 3)
    x = jax.random.normal(kx, (n, d), jnp.float32) / d ** 0.5
    y = jax.random.normal(ky, (m, d), jnp.float32) / d ** 0.5 + 0.1
    a = jax.random.uniform(ka, (n,), jnp.float32) + 0.1
    return x, y, a / a.sum(), jnp.full((m,), 1.0 / m, jnp.float32)


@pytest.mark.parametrize("n,m,d", [(4096, 3000, 64), (5000, 4096, 3), (2048, 2048, 130)])
def test_backends_agree(n, m, d):
    _need_jax_triton()
    import ot_triton_jax as otj

    x, y, a, b = clouds(n, m, d)
    kw = dict(epsilon=EPS, threshold=1e-3, inner_iterations=10, max_iterations=300)
    res = {}
    for backend in ("triton_call", "callback"):
        solve = jax.jit(lambda x, y, a, b, backend=backend: otj.sinkhorn(x, y, a, b, backend=backend, **kw))
        grad = jax.jit(jax.grad(lambda x, y, a, b, backend=backend:
                                otj.sinkhorn(x, y, a, b, backend=backend, **kw).reg_ot_cost,
                                argnums=(0, 1, 2, 3)))
        res[backend] = (solve(x, y, a, b), grad(x, y, a, b))
    (o1, g1), (o2, g2) = res["triton_call"], res["callback"]
    assert int(o1.n_iters) == int(o2.n_iters) and bool(o1.converged)
    assert rel(o1.f, o2.f) < 1e-6 and rel(o1.g, o2.g) < 1e-6
    assert rel(o1.reg_ot_cost, o2.reg_ot_cost) < 1e-6
    for u, v in zip(g1, g2):
        assert rel(u, v) < 1e-6
    # and against the torch frontend on the same device arrays (zero-copy)
    import torch_api

    t = torch_api.sinkhorn(*(otj.to_torch(v) for v in (x, y, a, b)), **kw)
    assert t.n_iters == int(o1.n_iters)
    assert rel(o1.reg_ot_cost, t.reg_ot_cost.cpu()) < 1e-5
    assert rel(o1.f, t.f.detach().cpu()) < 1e-4  # up to the free shift (f + c, g - c): see test_jax_sinkhorn


def test_matches_float64_and_tf32():
    _need_jax_gpu()
    import ot_triton_jax as otj

    n, m, d, iters = 4096, 4096, 64, 20
    x, y, a, b = clouds(n, m, d, seed=3)
    X, Y = (torch.from_dlpack(v).double() for v in (x, y))
    A, B = (torch.from_dlpack(v).double() for v in (a, b))
    C = (X * X).sum(1)[:, None] + (Y * Y).sum(1)[None] - 2 * X @ Y.T
    f = torch.zeros(n, dtype=torch.float64, device="cuda")
    for _ in range(iters):
        g = EPS * B.log() - EPS * torch.logsumexp((f[:, None] - C) / EPS, 0)
        f = EPS * A.log() - EPS * torch.logsumexp((g[None, :] - C) / EPS, 1)
    for precision, tol in (("float32", 2e-5), ("tf32", 5e-3)):
        out = jax.jit(lambda x, y, a, b: otj.sinkhorn(x, y, a, b, epsilon=EPS, min_iterations=iters,
                                                      max_iterations=iters, precision=precision))(x, y, a, b)
        assert rel(out.f, f.cpu()) < tol and rel(out.g, g.cpu()) < tol, precision


def test_float32_cost_carries_no_tensor_core_truncation_bias():
    # as tests/test_torch_sinkhorn_gpu.py for torch_api: the cost's mass term from the unbiased
    # pass makes it the float64 dual objective at the returned potentials (d = 128, where the
    # tensor cores' truncation shrinks <x, y> by ~1e-6 relative)
    _need_jax_triton()
    import ot_triton_jax as otj
    from reference import reg_ot_cost_uniform

    kx, ky = jax.random.split(jax.random.PRNGKey(12))
    x, y = (jax.random.normal(k, (2048, 128), jnp.float32) for k in (kx, ky))
    out = jax.jit(lambda x, y: otj.sinkhorn(x, y, epsilon=EPS, min_iterations=50, max_iterations=50,
                                            backend="triton_call"))(x, y)
    ref = reg_ot_cost_uniform(*(torch.from_dlpack(v) for v in (x, y, out.f, out.g)), EPS)
    assert abs(float(out.reg_ot_cost) - ref) / abs(ref) < 1.5e-7


def test_zero_copy_on_the_gpu():
    _need_jax_gpu()
    import ot_triton_jax as otj

    a = jnp.arange(4096, dtype=jnp.float32).reshape(64, 64) * 0.5
    t = otj.to_torch(a)
    assert t.is_cuda and t.data_ptr() == a.unsafe_buffer_pointer()
    u = torch.randn(128, 32, device="cuda")
    j = otj.from_torch(u)
    assert j.unsafe_buffer_pointer() == u.data_ptr()
    assert list(j.devices())[0].platform == "gpu"
    # stream handshake: torch work queued before from_torch is visible to JAX
    v = torch.empty(1 << 22, device="cuda")
    v.fill_(3.0)
    assert float(jnp.sum(otj.from_torch(v))) == 3.0 * (1 << 22)
    # and JAX work is visible to torch after to_torch
    w = jnp.ones(1 << 22) * 2.0
    assert float(otj.to_torch(w).sum()) == 2.0 * (1 << 22)


def test_torch_compiles_kernels_after_jax_triton_import(tmp_path):
    """In a fresh process with a fresh Triton cache: a JAX solve through triton_call
    (imports jax_triton) and then a torch solve that must compile its kernels."""
    _need_jax_triton()
    script = textwrap.dedent("""
        import os
        os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
        import jax, jax.numpy as jnp, torch
        import ot_triton_jax as otj
        x = jax.random.normal(jax.random.PRNGKey(0), (1000, 19))
        out = otj.sinkhorn(x, x + 0.5, epsilon=0.5, max_iterations=20, backend="triton_call")
        import jax_triton  # noqa: F401  (already imported by the launch above)
        assert os.environ.get("TRITON_CACHE_DIR", None) != "", "jax_triton's empty TRITON_CACHE_DIR leaked"
        import torch_api
        xt = torch.randn(999, 23, device="cuda")
        t = torch_api.sinkhorn(xt, xt + 0.5, epsilon=0.5, max_iterations=20)
        assert torch.isfinite(t.f).all() and bool(jnp.isfinite(out.f).all())
        print("OK", os.environ.get("TRITON_CACHE_DIR"))
    """)
    env = dict(os.environ, TRITON_HOME=str(tmp_path), PYTHONPATH=os.pathsep.join(
        [ROOT] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    env.pop("TRITON_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "OK" in proc.stdout
    assert any(tmp_path.rglob("*.cubin")), "torch should have compiled into the fresh cache"


def test_jit_new_epsilon_no_retrace_on_gpu():
    _need_jax_triton()
    import ot_triton_jax as otj

    x, y, a, b = clouds(2048, 2048, 16, seed=5)
    traces = []

    @jax.jit
    def cost(x, eps):
        traces.append(1)
        return otj.sinkhorn(x, y, a, b, epsilon=eps, backend="triton_call").reg_ot_cost

    vals = [float(cost(x, e)) for e in (0.05, 0.1, 0.2)]
    assert len(traces) == 1 and len(set(vals)) == 3 and all(np.isfinite(vals))


def test_divergence_and_samples_loss_on_gpu():
    _need_jax_gpu()
    import ot_triton_jax as otj
    import torch_api

    x, y, a, b = clouds(4096, 3000, 3, seed=7)
    div, out = jax.jit(lambda x, y: otj.sinkhorn_divergence(x, y, a, b, epsilon=EPS))(x, y)
    assert all(bool(c) for c in out.converged) and float(div) > 0
    gx = jax.jit(jax.grad(lambda x: otj.samples_loss(x, y, a, b, blur=0.05)))(x)
    xt, yt, at, bt = (otj.to_torch(v).clone() for v in (x, y, a, b))
    xt.requires_grad_(True)
    lt = torch_api.SamplesLoss(blur=0.05)(at, xt, bt, yt)
    (gt,) = torch.autograd.grad(lt, xt)
    assert rel(otj.samples_loss(x, y, a, b, blur=0.05), lt.detach().cpu()) < 1e-5
    assert rel(gx, gt.cpu()) < 1e-4


@pytest.mark.parametrize("d", [3, 64])
def test_vmap_folds_into_one_packed_loop_on_gpu(d):
    """jax.vmap(sinkhorn) on the GPU (triton_call, the block-sparse kernel) against single solves:
    ragged-free batch of 4 problems of different spreads (different iteration counts), n != m."""
    _need_jax_triton()
    import ot_triton_jax as otj

    probs = [clouds(3000, 2100, d, seed=k) for k in range(4)]
    x, y, a, b = (jnp.stack([p[i] * (1.0 + 0.3 * k if i < 2 else 1.0) for k, p in enumerate(probs)])
                  for i in range(4))
    kw = dict(epsilon=EPS, threshold=1e-3, inner_iterations=10, max_iterations=400)

    def fields(x, y, a, b):
        o = otj.sinkhorn(x, y, a, b, **kw)
        return o.f, o.g, o.reg_ot_cost, o.n_iters, o.converged

    got = jax.jit(jax.vmap(fields))(x, y, a, b)
    single = jax.jit(fields)
    for k in range(4):
        want = single(x[k], y[k], a[k], b[k])
        assert int(got[3][k]) == int(want[3]) and bool(got[4][k]) == bool(want[4]), (k, got[3], want[3])
        assert rel(got[0][k], want[0]) < 1e-5 and rel(got[1][k], want[1]) < 1e-5
        assert rel(got[2][k], want[2]) < 1e-5
    assert len(set(np.asarray(got[3]).tolist())) > 1
