"""ot_triton_jax.distributed.hvp on 2 and 4 host devices (``--xla_force_host_platform_device_count``)
against the single-device ot_triton_jax.hvp: the HVP of reg_ot_cost in x and in y, and of the Sinkhorn
divergence, to float32 rounding, with n, m not multiples of the device count (zero-weight padding),
n != m, non-uniform weights with zeros, a converged forward solve; bad input. The devices need
XLA_FLAGS before jax is imported, so the checks run in a fresh interpreter (real kernels, Triton
interpreter)."""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = textwrap.dedent('''
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import numpy as np, jax, jax.numpy as jnp, pytest
    from jax.sharding import Mesh, PartitionSpec
    import ot_triton_jax as otj

    rng = np.random.default_rng(5)
    n, m, d = 13, 10, 3
    x = jnp.asarray(0.5 * rng.standard_normal((n, d)), jnp.float32)  # small spread: few forward iterations
    y = jnp.asarray(0.5 * rng.standard_normal((m, d)) + 0.3, jnp.float32)
    a = rng.uniform(0.2, 1, n); a[2] = 0; a /= a.sum()
    b = rng.uniform(0.2, 1, m); b[-1] = 0; b /= b.sum()
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    v = {"x": jnp.asarray(rng.standard_normal((n, d)), jnp.float32),
         "y": jnp.asarray(rng.standard_normal((m, d)), jnp.float32)}
    kw = dict(epsilon=0.3, threshold=1e-6, inner_iterations=5, max_iterations=2000)
    meshes = {P: Mesh(np.array(jax.devices()[:P]), ("points",)) for P in (2, 4)}

    def check(P, wrt, loss):
        ref, rinfo = otj.hvp(x, y, v[wrt], a=a, b=b, wrt=wrt, loss=loss, **kw)
        got, info = otj.distributed.hvp(x, y, v[wrt], a, b, mesh=meshes[P], wrt=wrt, loss=loss, **kw)
        what = (P, wrt, loss)
        assert bool(rinfo.solve_converged) and bool(info.solve_converged) and bool(info.cg_converged), what
        assert got.shape == v[wrt].shape and got.dtype == jnp.float32, what
        ref, got = np.asarray(ref, np.float64), np.asarray(got, np.float64)
        scale = np.abs(ref).max()
        assert scale > 1e-2 and np.isfinite(got).all(), what  # not trivially zero
        err = np.abs(got - ref).max()
        assert err <= 1e-5 * scale, (what, err, scale)
        return info

    for P in (2, 4):
        for wrt in ("x", "y"):
            check(P, wrt, "reg_ot_cost")
    check(2, "x", "sinkhorn_divergence")
    check(4, "y", "sinkhorn_divergence")

    # m = 10 is a multiple of 2: the result is sharded like y
    out, _ = otj.distributed.hvp(x, y, v["y"], a, b, mesh=meshes[2], wrt="y", **kw)
    assert out.sharding.spec == PartitionSpec("points"), out.sharding

    # bad input
    with pytest.raises(NotImplementedError, match="tau_a = tau_b = 1"):
        otj.distributed.hvp(x, y, v["x"], a, b, mesh=meshes[2], tau_a=0.5, **kw)
    with pytest.raises(ValueError, match="v must have the shape of y"):
        otj.distributed.hvp(x, y, v["x"], a, b, mesh=meshes[2], wrt="y", **kw)
    with pytest.raises(ValueError, match="wrt must be"):
        otj.distributed.hvp(x, y, v["x"], a, b, mesh=meshes[2], wrt="a", **kw)
    print("OK")
''')


def test_sharded_hvp_equals_single_device_on_2_and_4_devices():
    """ot_triton_jax.distributed.hvp against ot_triton_jax.hvp: reg_ot_cost in x and y on 2 and 4
    devices, the divergence in x (2 devices) and y (4 devices); unsupported options raise."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout[-3000:] + run.stderr[-6000:]
