"""ot_triton_jax.distributed.hvp on 2 and 4 host devices (``--xla_force_host_platform_device_count``)
against the single-device ot_triton_jax.hvp: the HVP of reg_ot_cost in x and in y, and of the Sinkhorn
divergence, to float32 rounding, with n, m not multiples of the device count (zero-weight padding),
n != m, non-uniform weights with zeros, a converged forward solve; bad input. The devices need
XLA_FLAGS before jax is imported, so the checks run in a fresh interpreter (real kernels, Triton
interpreter)."""

from host_devices import run

SCRIPT = '''
    rng, n, m, d, x, y, a, b = problem(5, spread=0.5)
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
'''


def test_sharded_hvp_equals_single_device_on_2_and_4_devices():
    """ot_triton_jax.distributed.hvp against ot_triton_jax.hvp: reg_ot_cost in x and y on 2 and 4
    devices, the divergence in x (2 devices) and y (4 devices); unsupported options raise."""
    run(SCRIPT)
