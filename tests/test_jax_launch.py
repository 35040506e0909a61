"""ot_triton_jax.jax_frontend.launch on the CPU: backend choice, the callback launch against a
direct torch launch of the same kernel, the jax_triton import side effect, and the launch's
batching rule (jax.vmap as a loop over the batch; tests/test_jax_vmap.py checks every operation)."""

import os
import sys
import textwrap

import functools

import numpy as np
import pytest
import torch

import jax
import jax.extend.core  # jaxprs_in_params
import jax.numpy as jnp

from ot_triton_jax.core import launch_plans
from ot_triton_jax.jax_frontend import launch as jax_launch
from ot_triton_jax.jax_frontend.launch import launch, resolve_backend


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv(jax_launch.ENV_VAR, raising=False)
    assert not jax_launch.has_gpu()
    assert resolve_backend() == "callback" and resolve_backend("auto") == "callback"
    monkeypatch.setenv(jax_launch.ENV_VAR, "callback")
    assert resolve_backend() == "callback"
    monkeypatch.setenv(jax_launch.ENV_VAR, "triton_call")
    with pytest.raises(ValueError, match="OT_TRITON_JAX_BACKEND.*needs a GPU"):
        resolve_backend()
    assert resolve_backend("callback") == "callback"  # the argument wins over the variable
    monkeypatch.setenv(jax_launch.ENV_VAR, "cuda")
    with pytest.raises(ValueError, match="environment variable OT_TRITON_JAX_BACKEND must be one of"):
        resolve_backend()
    monkeypatch.delenv(jax_launch.ENV_VAR)
    with pytest.raises(ValueError, match="backend= must be one of"):
        resolve_backend("pallas")
    with pytest.raises(ValueError, match="needs a GPU"):
        resolve_backend("triton_call")


def test_callback_launch_is_the_torch_launch_bit_for_bit():
    # The same kernels through both frontends' wrappers (jax_ops: launch() with the
    # callback backend; torch_api.kernel_ops: kernel[grid](...) on tensors), same
    # launch plans: bit-identical results. Tails in every dimension, p > 8 (tl.dot).
    from ot_triton_jax.jax_frontend import kernel_ops as jax_ops
    from torch_api import kernel_ops as kernel_calls

    rng = np.random.default_rng(49)
    n, m, d, p = 37, 45, 11, 20
    x, y = rng.standard_normal((n, d)).astype(np.float32), rng.standard_normal((m, d)).astype(np.float32)
    f, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(m).astype(np.float32)
    v = rng.standard_normal((m, p)).astype(np.float32)
    lb = np.log(rng.uniform(0.5, 1.5, m) / m).astype(np.float32)

    # torch side (the clouds' centre and squared norms come from the same kernels on both sides)
    TX, TY = kernel_calls.clouds(torch.from_numpy(x), torch.from_numpy(y))
    tprm = kernel_calls.params(0.7, 0.5, "cpu")
    t_out, t_rows = kernel_calls.apply_plan(TX, TY, torch.from_numpy(f), torch.from_numpy(g), tprm, "float32",
                                            torch.from_numpy(v))
    t_lse, t_err = kernel_calls.lse_update(TY, TX, torch.from_numpy(f), tprm, "float32",
                                           logw_out=torch.from_numpy(lb), pold=torch.from_numpy(g))

    @jax.jit
    def run(x, y, f, g, v, lb):
        X, Y = jax_ops.clouds(x, y)
        prm = jax_ops.make_params(0.7, 0.5)
        out, rows = jax_ops.apply_plan(X, Y, f, g, prm, precision="float32", v=v)
        lse, err = jax_ops.lse_update(Y, X, f, prm, precision="float32", logw_out=lb, pold=g)
        return out, rows, lse, err

    res = run(*(jnp.asarray(a) for a in (x, y, f, g, v, lb)))
    for u, w in zip(res, (t_out, t_rows, t_lse, t_err)):
        np.testing.assert_array_equal(np.asarray(u), w.numpy())
    # and they are the plan's P V, P 1 against float64
    C = ((x[:, None].astype(np.float64) - y[None]) ** 2).sum(-1) * 0.5
    P = np.exp((f[:, None] + g[None] - C) / 0.7)
    assert np.abs(np.asarray(res[0]) - P @ v).max() / np.abs(P @ v).max() < 1e-5
    assert np.abs(np.asarray(res[1]) - P.sum(1)).max() / P.sum(1).max() < 1e-5


def test_launch_checks_its_inputs():
    from ot_triton_jax.core.kernels import apply_plan_kernel

    plan = launch_plans.apply_plan(4, 4, 2, 0, "float32", False)
    out = [jax.ShapeDtypeStruct((4,), jnp.float32)]
    with pytest.raises(TypeError, match=r"inputs\[0\] is a Python float"):
        launch(apply_plan_kernel, plan, [0.5], out)
    with pytest.raises(TypeError, match=r"inputs\[1\] must be a jax.Array or an int"):
        launch(apply_plan_kernel, plan, [jnp.ones(2), "x"], out)
    with pytest.raises(ValueError, match="out_shapes is empty"):
        launch(apply_plan_kernel, plan, [jnp.ones(2)], [])


def test_jax_triton_import_keeps_triton_cache_dir(tmp_path, monkeypatch):
    # A stand-in jax_triton that does what 0.3.1 does on import (TRITON_CACHE_DIR="")
    # with the 0.3.x keyword (out_shape=); the real one is exercised by tests/test_jax_gpu.py.
    pkg = tmp_path / "jax_triton"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent("""
        import os
        os.environ["TRITON_CACHE_DIR"] = ""
        def triton_call(*args, kernel, out_shape, grid, num_warps=4, num_stages=2, **metaparams):
            raise AssertionError("not called in this test")
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "jax_triton", raising=False)
    monkeypatch.setattr(jax_launch, "_JT", None)
    monkeypatch.setattr(jax_launch, "_JT_OUT_KW", None)

    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    jax_launch._jax_triton()
    assert "TRITON_CACHE_DIR" not in os.environ  # removed again, not left as ""
    assert jax_launch._JT_OUT_KW == "out_shape"

    monkeypatch.delitem(sys.modules, "jax_triton")
    monkeypatch.setattr(jax_launch, "_JT", None)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    jax_launch._jax_triton()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "cache")  # the user's value is kept
    monkeypatch.delitem(sys.modules, "jax_triton")


def test_unused_outputs_are_removed_under_jit():
    from ot_triton_jax.jax_frontend import kernel_ops as jax_ops

    n = 8
    x = jnp.ones((n, 2))

    def rows(x):
        (X,) = jax_ops.clouds(x)
        return jax_ops.apply_plan(X, X, jnp.zeros(n), jnp.zeros(n), jax_ops.make_params(1.0, 1.0),
                                  precision="float32")[1]

    # pure: a launch whose outputs are unused is dropped by XLA
    assert jax.jit(lambda x: (rows(x), x)[1]).lower(x).compile().as_text().lower().count("callback") == 0
    assert jax.jit(rows).lower(x).compile().as_text().lower().count("callback") > 0
    # exp(-|x_i - x_j|^2) with identical points: every row sums to n
    np.testing.assert_allclose(np.asarray(jax.jit(rows)(x)), np.full(n, n, np.float32), rtol=1e-6)


@pytest.mark.parametrize("d", [5, 70])  # one chunk of columns; two chunks (d > 64)
def test_exact_row_mass_is_the_same_launch_in_both_frontends_and_matches_float64(d):
    # reg_ot_cost's mass term: P 1 with the "fixed4" cross term (four TF32 products on
    # fixed-point heads and tails, launch_plans.exact_mass_plan). Heads alone would be ~1e-3 off.
    from ot_triton_jax.jax_frontend import kernel_ops as jax_ops
    from torch_api import kernel_ops as kernel_calls

    rng = np.random.default_rng(149)
    n, m = 29, 90  # two column tiles under the interpreter: two column ranges (SPLIT = 2)
    assert launch_plans.exact_mass_plan(n, m, d, False).constexprs["SPLIT"] == 2
    x, y = rng.standard_normal((n, d)).astype(np.float32), rng.standard_normal((m, d)).astype(np.float32)
    f, g = rng.standard_normal(n).astype(np.float32), rng.standard_normal(m).astype(np.float32)
    eps, s = 0.7, 1.0 / d
    TX, TY = kernel_calls.clouds(torch.from_numpy(x), torch.from_numpy(y))
    t_rows = kernel_calls.exact_row_mass(TX, TY, torch.from_numpy(f), torch.from_numpy(g),
                                         kernel_calls.params(eps, s, "cpu"))

    @jax.jit
    def run(x, y, f, g):
        X, Y = jax_ops.clouds(x, y)
        return jax_ops.exact_row_mass(X, Y, f, g, jax_ops.make_params(eps, s))

    rows = run(*(jnp.asarray(a) for a in (x, y, f, g)))
    np.testing.assert_array_equal(np.asarray(rows), t_rows.numpy())
    C = ((x[:, None].astype(np.float64) - y[None]) ** 2).sum(-1) * s
    ref = np.exp((f[:, None] + g[None] - C) / eps).sum(1)
    assert np.abs(np.asarray(rows) - ref).max() / ref.max() < 2e-6


def _eqns(jaxpr):
    """Every equation of a jaxpr, those of its sub-jaxprs (scan bodies, custom_vmap calls) included."""
    for eqn in jaxpr.eqns:
        yield eqn
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            yield from _eqns(sub)


def test_vmap_of_a_launch_is_a_loop_with_the_unbatched_operands_closed_over():
    # launch()'s custom_vmap rule: one launch per batch element in a lax.map (scan);
    # operands with in_axes=None are scan constants, never broadcast to the batch.
    from ot_triton_jax.jax_frontend import kernel_ops as jax_ops

    rng = np.random.default_rng(184)
    B, n, m, d = 3, 6, 7, 2
    x, y = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((n, d), (m, d)))
    f = jnp.asarray(rng.standard_normal((B, n)), jnp.float32)
    g = jnp.asarray(rng.standard_normal(m), jnp.float32)
    prm = jnp.stack([jnp.asarray([0.5, 1.0], jnp.float32), jnp.asarray([0.8, 1.0], jnp.float32),
                     jnp.asarray([1.3, 0.5], jnp.float32)])

    def rows(x, y, f, g, prm):
        X, Y = jax_ops.clouds(x, y)
        return jax_ops.apply_plan(X, Y, f, g, prm, precision="float32")[1]

    axes = (None, None, 0, None, 0)
    got = jax.jit(jax.vmap(rows, in_axes=axes))(x, y, f, g, prm)
    single = jax.jit(rows)
    want = np.stack([np.asarray(single(x, y, f[k], g, prm[k])) for k in range(B)])
    np.testing.assert_array_equal(np.asarray(got), want)

    jaxpr = jax.make_jaxpr(jax.vmap(rows, in_axes=axes))(x, y, f, g, prm).jaxpr
    top = [e.primitive.name for e in jaxpr.eqns]
    scans = [e for e in _eqns(jaxpr) if e.primitive.name == "scan"]
    # the two clouds (unbatched) are prepared once, outside the loop (one call of the preparation,
    # its centre, scale and split launches inside); the plan pass (batched params) loops
    assert top.count("custom_vmap_call") == 1 and len(scans) == 1 and scans[0].params["length"] == B
    consts = scans[0].invars[:scans[0].params["num_consts"]]
    dp = launch_plans.operand_stride(d)  # the clouds' parts the kernel reads: (n, dp)
    assert {tuple(v.aval.shape) for v in consts} >= {(n, dp), (m, dp), (m,)}  # clouds and g, as they are
    shapes = {tuple(v.aval.shape) for e in _eqns(jaxpr) for v in e.outvars}
    assert not shapes & {(B, n, dp), (B, m, dp), (B, m)}  # nothing unbatched was copied per element


def test_vmap_of_a_launch_nests_and_composes_with_grad():
    from ot_triton_jax.jax_frontend import kernel_ops as jax_ops

    rng = np.random.default_rng(217)
    n, d = 5, 2
    xs = jnp.asarray(rng.standard_normal((2, 3, n, d)), jnp.float32)

    def mass(x):
        # the kernel sees a stop_gradient'ed value (as in the solvers); the derivative
        # comes from the JAX code around it
        (X,) = jax_ops.clouds(jax.lax.stop_gradient(x))
        r = jax_ops.apply_plan(X, X, jnp.zeros(n), jnp.zeros(n), jax_ops.make_params(1.0, 1.0),
                               precision="float32")[1]
        return jnp.sum(r * jnp.sum(x * x, 1))

    # the inner vmap packs its problems (kernel_ops: one cloud preparation and one block-sparse
    # plan pass for the batch; each problem centred on its own centre), the outer one loops over
    # that: equal to the single calls to float32 rounding
    close = functools.partial(np.testing.assert_allclose, rtol=2e-5, atol=0)
    single = jax.jit(mass)
    want = np.array([[float(single(xs[i, j])) for j in range(3)] for i in range(2)])
    close(np.asarray(jax.jit(jax.vmap(jax.vmap(mass)))(xs)), want)
    gsingle = jax.jit(jax.grad(mass))
    gwant = np.stack([np.stack([np.asarray(gsingle(xs[i, j])) for j in range(3)]) for i in range(2)])
    close(np.asarray(jax.jit(jax.vmap(jax.vmap(jax.grad(mass))))(xs)), gwant)
    total = jax.jit(jax.grad(lambda xs: jnp.sum(jax.vmap(jax.vmap(mass))(xs))))
    close(np.asarray(total(xs)), gwant)
    assert np.abs(gwant).max() > 0


def test_loop_over_batch_maps_a_whole_loop_per_problem():
    # loop_over_batch around a whole solver-style loop (pytree arguments, a while_loop with
    # a per-problem trip count, launches inside): under vmap each problem runs its own loop
    # (no batched stopping test) and its launches see unsliced, unbatched operands.
    from ot_triton_jax.jax_frontend import kernel_ops as jax_ops
    from ot_triton_jax.jax_frontend.batching import loop_over_batch

    rng = np.random.default_rng(247)
    B, n, d = 3, 6, 2
    xs = jnp.asarray(rng.standard_normal((B, n, d)), jnp.float32)
    limits = jnp.asarray([1, 4, 2], jnp.int32)

    def solve(X, limit):
        def body(c):
            f, k = c
            r = jax_ops.apply_plan(X, X, f, f, jax_ops.make_params(1.0, 1.0), precision="float32")[1]
            return 0.5 * f - 0.5 * jnp.log(r), k + 1
        return jax.lax.while_loop(lambda c: c[1] < limit, body, (jnp.zeros(n, jnp.float32), jnp.int32(0)))

    wrapped = loop_over_batch(solve)
    run = lambda solver: jax.vmap(lambda x, lim: solver(*jax_ops.clouds(x), lim))  # noqa: E731
    single = jax.jit(lambda x, lim: solve(*jax_ops.clouds(x), lim))
    want = [single(xs[k], limits[k]) for k in range(B)]
    for solver in (solve, wrapped):
        f, k = jax.jit(run(solver))(xs, limits)
        np.testing.assert_array_equal(np.asarray(k), np.asarray(limits))
        # the vmapped clouds are prepared for the batch at once (kernel_ops: each problem centred on
        # its own centre, one float16 scale): the single solves' numbers to float32 rounding
        np.testing.assert_allclose(np.asarray(f), np.stack([np.asarray(w[0]) for w in want]), rtol=2e-5, atol=1e-6)
    # structure: launch by launch, one batched while_loop holds the loop over the batch;
    # wrapped, one loop over the batch holds each problem's own while_loop
    # (the clouds are prepared for the whole batch at the top in both)
    def loops(solver):
        eqns = jax.make_jaxpr(run(solver))(xs, limits).jaxpr.eqns
        in_scans = [s.primitive.name for e in eqns if e.primitive.name == "scan"
                    for s in _eqns(e.params["jaxpr"].jaxpr)]
        return [e.primitive.name for e in eqns].count("while"), in_scans.count("while")

    assert loops(solve) == (1, 0) and loops(wrapped) == (0, 1)


def test_constexpr_defaults_are_passed():
    """jax_triton compiles a constexpr it is not given as None (a flag defaulting to True would read
    as false there): every launch passes the kernels' defaults, here under the interpreter too."""
    from ot_triton_jax.core.kernels import lse_pair_kernel, lse_update_kernel, pair_prep_kernel
    assert jax_launch.constexpr_defaults(pair_prep_kernel) == {"TWO": True}
    assert jax_launch.constexpr_defaults(lse_pair_kernel) == {"SELF": False, "N16": False, "M16": False}
    assert jax_launch.constexpr_defaults(lse_update_kernel) == {"FOLD": False, "N16": False, "M16": False, "COL_BIAS": False,
                                                               "PAIRED": False, "RELAX_AT": 0, "LABELS": 0, "ORDERED": False,
                                                               "GROUPED": False}

