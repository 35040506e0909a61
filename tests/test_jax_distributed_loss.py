"""ot_triton_jax.distributed.samples_loss on 2 and 4 host devices
(``--xla_force_host_platform_device_count``) against the single-device ot_triton_jax.samples_loss:
the loss, the potentials and jax.grad in x and y to float32 rounding, with and without debias; n, m
not multiples of the device count (zero-weight padding), non-uniform weights with zeros, n != m;
bad input. With ``reach`` (KL-relaxed marginals, unequal masses): the loss and its gradient in x, y,
a, b, the potentials and their gradient in x, y. The devices need XLA_FLAGS before jax is imported,
so the checks run in a fresh interpreter (real kernels, Triton interpreter)."""

from host_devices import run

SCRIPT = '''
    rng, n, m, d, x, y, a, b = problem(5)
    opt = dict(blur=0.3, scaling=0.5)

    def close(u, v, what, tol=2e-6):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        assert u.shape == v.shape and np.isfinite(u).all() and np.isfinite(v).all(), what
        err = np.abs(u - v).max()
        assert err <= tol * max(np.abs(v).max(), 1.0), (what, err)

    def outputs(fn, **kw):
        """loss, grads in (x, y), potentials (F, G) and the grad of <u, F> + <v, G> in (x, y)."""
        loss = lambda x, y: fn(x, y, a, b, **opt, **kw)
        pots = lambda x, y: fn(x, y, a, b, potentials=True, **opt, **kw)
        u, v = jnp.linspace(-1, 1, n), jnp.linspace(0.5, 2, m)
        lin = lambda x, y: jnp.sum(u * pots(x, y)[0]) + jnp.sum(v * pots(x, y)[1])
        run = jax.jit(lambda x, y: (jax.value_and_grad(loss, (0, 1))(x, y), pots(x, y), jax.grad(lin, (0, 1))(x, y)))
        (val, g), (F, G), gp = run(x, y)
        return dict(loss=val, gx=g[0], gy=g[1], F=F, G=G, px=gp[0], py=gp[1])

    refs = {debias: outputs(otj.samples_loss, debias=debias) for debias in (True, False)}
    cases = [(2, True), (4, True), (4, False)]
    for P, debias in cases:
        mesh = Mesh(np.array(jax.devices()[:P]), ("points",))
        got = outputs(otj.distributed.samples_loss, mesh=mesh, debias=debias)
        for key, ref in refs[debias].items():
            close(got[key], ref, f"{P}:{debias}:{key}")
        assert np.abs(np.asarray(got["gx"])).max() > 1e-3

    # eager (host schedule) equals the single-device eager call; outputs sharded like the points
    mesh = Mesh(np.array(jax.devices()[:2]), ("points",))
    close(otj.distributed.samples_loss(x, y, a, b, mesh=mesh, **opt), otj.samples_loss(x, y, a, b, **opt), "eager")
    xe, ye = x[:12], y
    F, G = otj.distributed.samples_loss(xe, ye, mesh=mesh, potentials=True, **opt)
    assert F.sharding.spec == PartitionSpec("points") and F.shape == (12,), F.sharding
    close(F, otj.samples_loss(xe, ye, potentials=True, **opt)[0], "uniform F", tol=1e-5)  # loop rounding

    # bad input
    with pytest.raises(ValueError, match="mesh must be a 1-D"):
        otj.distributed.samples_loss(x, y, mesh=Mesh(np.array(jax.devices()).reshape(2, 2), ("i", "j")))
    with pytest.raises(ValueError, match="axis 'other' is not an axis"):
        otj.distributed.samples_loss(x, y, mesh=mesh, axis="other")
    with pytest.raises(NotImplementedError, match="reach_x=0.5, reach_y=None"):
        otj.distributed.samples_loss(x, y, mesh=mesh, reach_x=0.5)
    with pytest.raises(ValueError, match="either reach"):
        otj.distributed.samples_loss(x, y, mesh=mesh, reach=0.5, reach_y=0.5)
    with pytest.raises(ValueError, match="same total mass"):
        otj.distributed.samples_loss(x, y, a, 2 * b, mesh=mesh)
    with pytest.raises(NotImplementedError, match="second derivatives of ot_triton_jax.distributed.samples_loss"):
        jax.hessian(lambda x: otj.distributed.samples_loss(x, y, a, b, mesh=mesh, **opt))(x)
    bad = jax.jit(lambda x: otj.distributed.samples_loss(x, y, a, b, mesh=mesh, **opt))(x.at[0, 0].set(jnp.nan))
    assert np.isnan(float(bad))
    print("OK")
'''

RELAXED = '''
    rng, n, m, d, x, y, a, b = problem(11, n=15, m=10, d=2)
    b = 1.6 * b  # unequal masses: allowed once the marginals are relaxed
    opt = dict(blur=0.25, scaling=0.3)  # diameter ~ 5: a few eps-scaling steps

    def close(u, v, what, tol=2e-6):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        assert u.shape == v.shape and np.isfinite(u).all() and np.isfinite(v).all(), what
        err = np.abs(u - v).max()
        assert err <= tol * max(np.abs(v).max(), 1.0), (what, err)

    def outputs(fn, pots: bool, **kw):
        """loss and its grads in (x, y, a, b); with ``pots`` the potentials (F, G) (the damped ones)
        and the grad of <u, F> + <v, G> in (x, y)."""
        loss = lambda x, y, a, b: fn(x, y, a, b, **opt, **kw)
        val, g = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(x, y, a, b)
        out = dict(loss=val, gx=g[0], gy=g[1], ga=g[2], gb=g[3])
        if pots:
            u, v = jnp.linspace(-1, 1, n), jnp.linspace(0.5, 2, m)

            def lin(x, y):
                F, G = fn(x, y, a, b, potentials=True, **opt, **kw)
                return jnp.sum(u * F) + jnp.sum(v * G)

            out["F"], out["G"] = fn(x, y, a, b, potentials=True, **opt, **kw)  # eager: the host schedule
            out["px"], out["py"] = jax.jit(jax.grad(lin, (0, 1)))(x, y)
        return out

    # (devices, reach, debias, potentials checked); reach_x = reach_y is the same problem as reach
    cases = [(2, dict(reach=0.5), True, True), (4, dict(reach=2.0), True, False),
             (4, dict(reach_x=0.5, reach_y=0.5), False, False)]
    for P, rk, debias, pots in cases:
        ref = outputs(otj.samples_loss, pots, reach=rk.get("reach", rk.get("reach_x")), debias=debias)
        mesh = Mesh(np.array(jax.devices()[:P]), ("points",))
        got = outputs(otj.distributed.samples_loss, pots, mesh=mesh, debias=debias, **rk)
        for key in ref:
            close(got[key], ref[key], f"{P}:{rk}:{debias}:{key}")
        assert np.abs(np.asarray(got["gx"])).max() > 1e-3 and np.abs(np.asarray(got["gb"])).max() > 1e-3
    print("OK")
'''


def test_sharded_samples_loss_equals_single_device_on_2_and_4_devices():
    run(SCRIPT)


def test_sharded_samples_loss_with_reach_equals_single_device_on_2_and_4_devices():
    run(RELAXED)
