"""ot_triton_jax.distributed.sinkhorn and .sinkhorn_divergence on 2 and 4 host devices
(``--xla_force_host_platform_device_count``) against the single-device ot_triton_jax.sinkhorn and
sinkhorn_divergence: iterations exactly, potentials, costs and the gradients in x, y, a, b, epsilon
and scale_cost to float32 rounding; n, m not multiples of the device count (zero-weight padding), non-uniform weights with
zeros, n != m; bad input. The devices need XLA_FLAGS before jax is imported, so the checks run in a
fresh interpreter (real kernels, Triton interpreter)."""

from host_devices import run

SCRIPT = '''
    rng, n, m, d, x, y, a, b = problem(7)
    kw = dict(epsilon=0.3, threshold=1e-4, inner_iterations=3, max_iterations=200)
    ref = otj.sinkhorn(x, y, a, b, **kw)

    def cost_of(fn, **more):  # reg_ot_cost in (x, y, a, b, epsilon, scale_cost)
        return lambda x, y, a, b, e, s: fn(x, y, a, b, **dict(kw, epsilon=e, scale_cost=s), **more).reg_ot_cost
    primals = (x, y, a, b, jnp.float32(0.3), jnp.float32(1.0))
    gref = jax.grad(cost_of(otj.sinkhorn), tuple(range(6)))(*primals)

    def close(u, v, what, tol=2e-6):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        fin = np.isfinite(v)
        assert np.array_equal(fin, np.isfinite(u)) and not np.isnan(u).any(), what
        err = np.abs(u[fin] - v[fin]).max()
        assert err <= tol * max(np.abs(v[fin]).max(), 1.0), (what, err)

    for P in (2, 4):
        mesh = Mesh(np.array(jax.devices()[:P]), ("points",))
        out = otj.distributed.sinkhorn(x, y, a, b, mesh=mesh, **kw)
        assert int(out.n_iters) == int(ref.n_iters) and bool(out.converged) and bool(ref.converged)
        for name in ("f", "g", "reg_ot_cost", "errors"):
            close(getattr(out, name), getattr(ref, name), f"{P}:{name}")
        grads = jax.jit(jax.grad(cost_of(otj.distributed.sinkhorn, mesh=mesh), tuple(range(6))))(*primals)
        for g, rg, what in zip(grads, gref, "xyabes"):  # e, s: epsilon, scale_cost (float32 partial sums)
            close(g, rg, f"{P}:grad {what}", tol={"x": 2e-6, "y": 2e-6, "e": 1e-4, "s": 1e-4}.get(what, 1e-5))
            assert np.abs(np.asarray(g)).max() > 1e-3

    mesh = Mesh(np.array(jax.devices()[:2]), ("points",))
    even = otj.distributed.sinkhorn(x[:12], y, a[:12] / a[:12].sum(), b, mesh=mesh, **kw)
    assert even.f.sharding.spec == jax.sharding.PartitionSpec("points")  # sharded like the points
    cost_a = lambda a: otj.distributed.sinkhorn(x, y, a, b, mesh=mesh, **kw).reg_ot_cost
    with pytest.raises(NotImplementedError, match="second derivatives of ot_triton_jax.distributed.sinkhorn"):
        jax.grad(lambda a: jax.grad(cost_a)(a).sum())(a)
    cost_e = lambda e: otj.distributed.sinkhorn(x, y, a, b, mesh=mesh, **dict(kw, epsilon=e)).reg_ot_cost
    with pytest.raises(NotImplementedError, match="second derivatives of ot_triton_jax.distributed.sinkhorn"):
        jax.grad(jax.grad(cost_e))(0.3)
    with pytest.raises(NotImplementedError, match="f, g are not implemented"):
        jax.grad(lambda x: otj.distributed.sinkhorn(x, y, a, b, mesh=mesh, **kw).f.sum())(x)
    with pytest.raises(ValueError, match="pass axis="):
        otj.distributed.sinkhorn(x, y, mesh=Mesh(np.array(jax.devices()).reshape(2, 2), ("i", "j")), **kw)
    with pytest.raises(ValueError, match="same total mass"):
        otj.distributed.sinkhorn(x, y, a, 2 * b, mesh=mesh, **kw)
    bad = jax.jit(lambda x: otj.distributed.sinkhorn(x, y, a, b, mesh=mesh, **kw).reg_ot_cost)(x.at[0, 0].set(jnp.nan))
    assert np.isnan(float(bad))
    print("OK")
'''


def test_sharded_solve_equals_single_device_on_2_and_4_devices():
    run(SCRIPT)


DIVERGENCE_SCRIPT = '''
    rng, n, m, d, x, y, a, b = problem(11, shift=0.4, zero_a=4, zero_b=0)
    kw = dict(epsilon=0.5, threshold=1e-3, inner_iterations=3, max_iterations=45)

    def close(u, v, what, tol=2e-6):
        u, v = np.asarray(u, np.float64), np.asarray(v, np.float64)
        fin = np.isfinite(v)
        assert np.array_equal(fin, np.isfinite(u)) and not np.isnan(u).any(), what
        err = np.abs(u[fin] - v[fin]).max()
        assert err <= tol * max(np.abs(v[fin]).max(), 1.0), (what, err)

    def value_and_grads(fn, x, y, a, b, **opt):  # gradients in x, y, a, b, epsilon, scale_cost
        opt = {**kw, **opt}
        div = lambda x, y, a, b, e, s: fn(x, y, a, b, **dict(opt, epsilon=e, scale_cost=s))
        return jax.jit(jax.value_and_grad(div, tuple(range(6)), has_aux=True))(
            x, y, a, b, jnp.float32(opt["epsilon"]), jnp.float32(1.5))

    def same(got, ref, what):
        (div, out), grads = got
        (rdiv, rout), rgrads = ref
        close(div, rdiv, f"{what}:divergence")
        for k in range(3):
            if rout.costs[k] is not None:
                close(out.costs[k], rout.costs[k], f"{what}:cost {k}")
            if rout.n_iters[k] is not None:
                assert int(out.n_iters[k]) == int(rout.n_iters[k]), (what, k, out.n_iters, rout.n_iters)
                assert bool(out.converged[k]) == bool(rout.converged[k]), (what, k)
                close(out.errors[k], rout.errors[k], f"{what}:errors {k}")
                for f, rf in zip(out.potentials[k], rout.potentials[k]):  # rounding accumulated over the loop
                    close(f, rf, f"{what}:potential {k}", tol=1e-5)
        for g, rg, name in zip(grads, rgrads, "xyabes"):
            close(g, rg, f"{what}:grad {name}", tol={"x": 2e-6, "y": 2e-6, "e": 1e-4, "s": 1e-4}.get(name, 1e-5))
            assert np.abs(np.asarray(g)).max() > 1e-3

    meshes = {P: Mesh(np.array(jax.devices()[:P]), ("points",)) for P in (2, 4)}
    ref = value_and_grads(otj.sinkhorn_divergence, x, y, a, b)  # symmetric self terms (OTT's default)
    assert all(bool(c) for c in ref[0][1].converged)
    for P, mesh in meshes.items():
        same(value_and_grads(otj.distributed.sinkhorn_divergence, x, y, a, b, mesh=mesh), ref, f"{P}:symmetric")

    # alternating self terms (n, m odd), 2 devices, a fixed budget of iterations
    small = (x[:7], y[:5], a[:7] / a[:7].sum(), b[:5] / b[:5].sum())
    opt = dict(symmetric_sinkhorn=False, max_iterations=15)
    ref = value_and_grads(otj.sinkhorn_divergence, *small, **opt)
    same(value_and_grads(otj.distributed.sinkhorn_divergence, *small, mesh=meshes[2], **opt), ref, "2:alternating")

    # static_b with an offset; n, m multiples of 2: the outputs are sharded like the points
    xe, ae, ye, be = x[:8], a[:8] / a[:8].sum(), y[:6], b[:6] / b[:6].sum()
    opt = dict(static_b=True, offset_static_b=0.25)
    rdiv, rout = otj.sinkhorn_divergence(xe, ye, ae, be, **opt, **kw)
    div, out = otj.distributed.sinkhorn_divergence(xe, ye, ae, be, mesh=meshes[2], **opt, **kw)
    close(div, rdiv, "static_b"), close(out.costs[1], rout.costs[1], "static_b:cost xx")
    assert float(out.costs[2]) == 0.25 and out.potentials[2] is None and out.n_iters[2] is None
    for f in (*out.potentials[0], out.potentials[1][0]):
        assert f.sharding.spec == PartitionSpec("points"), f.sharding

    # bad input
    mesh = meshes[2]
    with pytest.raises(NotImplementedError, match="tau_a is not supported"):
        otj.distributed.sinkhorn_divergence(x, y, a, b, mesh=mesh, tau_a=0.5, **kw)
    with pytest.raises(NotImplementedError, match="label_x is not supported"):
        otj.distributed.sinkhorn_divergence(x, y, mesh=mesh, label_x=jnp.zeros(n, jnp.int32), **kw)
    div_b = lambda b: otj.distributed.sinkhorn_divergence(x, y, a, b, mesh=mesh, **kw)[0]
    with pytest.raises(NotImplementedError, match="second derivatives of ot_triton_jax.distributed.sinkhorn_div"):
        jax.grad(lambda b: jax.grad(div_b)(b).sum())(b)
    div_e = lambda e: otj.distributed.sinkhorn_divergence(x, y, a, b, mesh=mesh, **dict(kw, epsilon=e))[0]
    with pytest.raises(NotImplementedError, match="second derivatives of ot_triton_jax.distributed.sinkhorn_div"):
        jax.grad(jax.grad(div_e))(0.5)
    with pytest.raises(ValueError, match="offset_static_b is only used"):
        otj.distributed.sinkhorn_divergence(x, y, a, b, mesh=mesh, offset_static_b=1.0, **kw)
    with pytest.raises(ValueError, match="same total mass"):
        otj.distributed.sinkhorn_divergence(x, y, a, 2 * b, mesh=mesh, **kw)
    print("OK")
'''


def test_sharded_divergence_equals_single_device_on_2_and_4_devices():
    """ot_triton_jax.distributed.sinkhorn_divergence against ot_triton_jax.sinkhorn_divergence: the
    divergence, each term's cost, iterations, errors and potentials, and jax.grad in x, y, a, b, with
    symmetric and alternating self terms, static_b, n != m not multiples of the device count,
    weights with zeros; unsupported options and derivatives raise."""
    run(DIVERGENCE_SCRIPT)
