"""torch_api.SamplesLoss on the real kernels (Triton interpreter on CPU) vs GeomLoss 0.3.1.

The reference is ``geomloss.SamplesLoss("sinkhorn", p=2, backend="tensorized")`` run
in float64 on float64 copies of the same inputs, with the same blur / scaling /
debias: both run the identical eps-schedule and iteration count, so the only
difference is float32 arithmetic in our kernels.

Tolerances. Values and gradients in x, y: 1e-5 relative (observed <= 1e-6): float32
rounding of log-sum-exps of terms of size |C|/eps over ~10 annealing steps.
Gradients in a, b and the potentials themselves (grad_a = F, grad_b = G): GeomLoss's
symmetric update leaves the shift (f_ba + c, g_ab - c) neutral (eigenvalue 1), so
float32 rounding random-walks along it and nothing pulls it back (observed |c| up to
7e-6, i.e. ~1e-5 relative). The value and the x/y gradients are exactly invariant
under that shift (equal masses), so it only shows in F, G: we compare their
mean-free parts at 1e-5 (observed <= 5e-7) and the raw vectors at 5e-5.
"""

import math

import pytest
import torch

import geomloss  # noqa: E402  (CI installs it; a missing peer must fail, not skip)
from geomloss._legacy.sinkhorn_divergence import epsilon_schedule as gl_schedule  # noqa: E402
from geomloss._legacy.sinkhorn_divergence import max_diameter as gl_diameter  # noqa: E402

import torch_api  # noqa: E402
from ot_triton_jax.core.schedules import epsilon_schedule  # noqa: E402
from reference import rel_err, weights  # noqa: E402

TOL = 1e-5
TOL_SHIFT = 5e-5  # raw potentials / weight gradients: see the module docstring


def assert_potential_close(u, ref, name=""):
    """u = ref up to float32 rounding, allowing the neutral shift of the symmetric updates."""
    u, ref = u.double(), ref.double()
    assert rel_err(u - u.mean(), ref - ref.mean()) < TOL, name
    assert rel_err(u, ref) < TOL_SHIFT, name


def cloud(n, d, seed, shift=0.0, dup=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g) * 0.7 + shift
    if dup:  # repeated points inside the cloud
        x[1] = x[0]
        x[5] = x[2]
        x[6] = x[2]
    return x




def reference(a, x, b, y, cotangents=None, **kw):
    """GeomLoss tensorized in float64: value (or potentials) and gradients in (a, x, b, y)."""
    ts = [t.detach().double().clone().requires_grad_() for t in (a, x, b, y)]
    out = geomloss.SamplesLoss("sinkhorn", p=2, backend="tensorized", **kw)(*ts)
    if kw.get("potentials"):
        F, G = out
        F, G = F.reshape(a.shape), G.reshape(b.shape)
        uF, uG = cotangents
        ((F * uF.double()).sum() + (G * uG.double()).sum()).backward()
        return (F.detach(), G.detach()), [t.grad for t in ts]
    out.sum().backward()
    return out.detach(), [t.grad for t in ts]


def ours(a, x, b, y, cotangents=None, **kw):
    ts = [t.detach().clone().requires_grad_() for t in (a, x, b, y)]
    out = torch_api.SamplesLoss(**kw)(*ts)
    if kw.get("potentials"):
        F, G = out
        uF, uG = cotangents
        ((F * uF).sum() + (G * uG).sum()).backward()
        return (F.detach(), G.detach()), [t.grad for t in ts]
    out.sum().backward()
    return out.detach(), [t.grad for t in ts]


def make_problem(n, m, d, kind, seed=0):
    x = cloud(n, d, seed + 1, dup=kind == "duplicates")
    y = cloud(m, d, seed + 2, shift=0.4)
    if kind == "duplicates":
        y[0] = x[3]  # a point shared by both clouds
        y[1] = x[3]
    if kind == "uniform":
        a, b = torch.full((n,), 1 / n), torch.full((m,), 1 / m)
    elif kind == "zeros":
        a, b = weights(n, seed + 3, zeros=(0, 5)), weights(m, seed + 4, zeros=(7,))
    else:
        a, b = weights(n, seed + 3), weights(m, seed + 4)
    return a, x, b, y


CASES = [
    # n, m, d, weights, debias, blur, scaling
    (37, 23, 1, "random", True, 0.25, 0.6),
    (40, 31, 3, "uniform", True, 0.3, 0.6),
    (29, 44, 8, "zeros", True, 0.5, 0.5),
    (33, 27, 3, "duplicates", True, 0.3, 0.7),
    (25, 35, 3, "zeros", False, 0.3, 0.6),
    (30, 20, 8, "random", False, 0.4, 0.5),
    (21, 26, 12, "random", True, 0.6, 0.5),  # d > 8: tl.dot path of the kernels
]


@pytest.mark.parametrize("n,m,d,kind,debias,blur,scaling", CASES)
def test_value_and_gradients_match_geomloss(n, m, d, kind, debias, blur, scaling):
    a, x, b, y = make_problem(n, m, d, kind)
    kw = dict(blur=blur, scaling=scaling, debias=debias)
    v, grads = ours(a, x, b, y, **kw)
    v_ref, grads_ref = reference(a, x, b, y, **kw)
    assert v.dtype == torch.float32 and v.shape == ()
    assert rel_err(v, v_ref) < TOL
    for name, g, g_ref in zip("axby", grads, grads_ref):
        assert g.dtype == torch.float32
    assert_potential_close(grads[0], grads_ref[0], "a")
    assert_potential_close(grads[2], grads_ref[2], "b")
    assert rel_err(grads[1], grads_ref[1]) < TOL
    assert rel_err(grads[3], grads_ref[3]) < TOL
    if kind == "zeros":  # zero-weight points get no spatial gradient, but a finite weight gradient
        assert torch.all(grads[1][[0, 5]] == 0) and torch.all(grads[3][7] == 0)
        assert torch.isfinite(grads[0]).all() and torch.isfinite(grads[2]).all()


@pytest.mark.parametrize("n,m,d,kind,debias", [(31, 22, 3, "zeros", True), (18, 27, 1, "random", False),
                                               (24, 24, 8, "duplicates", True)])
def test_potentials_and_their_vjp_match_geomloss(n, m, d, kind, debias):
    a, x, b, y = make_problem(n, m, d, kind, seed=10)
    g = torch.Generator().manual_seed(5)
    cot = (torch.randn(n, generator=g), torch.randn(m, generator=g))
    kw = dict(blur=0.35, scaling=0.6, debias=debias, potentials=True)
    (F, G), grads = ours(a, x, b, y, cotangents=cot, **kw)
    (F_ref, G_ref), grads_ref = reference(a, x, b, y, cotangents=cot, **kw)
    assert F.shape == (n,) and G.shape == (m,)
    assert_potential_close(F, F_ref, "F")
    assert_potential_close(G, G_ref, "G")
    # F, G are differentiable in x, y (as in GeomLoss), not in a, b (GeomLoss detaches them)
    assert rel_err(grads[1], grads_ref[1]) < TOL
    assert rel_err(grads[3], grads_ref[3]) < TOL
    assert grads[0] is None and grads[2] is None
    assert grads_ref[0] is None and grads_ref[2] is None


def test_two_argument_call_uses_uniform_weights():
    _, x, _, y = make_problem(26, 19, 3, "uniform", seed=20)
    xs, ys = x.clone().requires_grad_(), y.clone().requires_grad_()
    v = torch_api.SamplesLoss(blur=0.3, scaling=0.6)(xs, ys)
    v.backward()
    xd, yd = x.double().requires_grad_(), y.double().requires_grad_()
    v_ref = geomloss.SamplesLoss("sinkhorn", p=2, blur=0.3, scaling=0.6, backend="tensorized")(xd, yd)
    v_ref.backward()
    assert rel_err(v.detach(), v_ref.detach()) < TOL
    assert rel_err(xs.grad, xd.grad) < TOL and rel_err(ys.grad, yd.grad) < TOL


def test_gradients_agree_with_finite_differences():
    """GeomLoss's gradient is the envelope gradient, exact only at convergence; with
    annealing the potentials lag the optimum by O(1 - scaling). A near-stationary
    schedule (diameter 1.1 blur, scaling 0.998: ~48 steps at eps ~ blur^2) converges,
    and central differences of the float32 loss (h = 1e-2: O(h^2) truncation, ~3e-5
    rounding noise) then agree per input to < 1e-3 |grad| |dir| (observed <= 2e-4; a wrong factor
    or sign in any of the four gradients would be O(1))."""
    a, x, b, y = make_problem(16, 12, 2, "random", seed=30)
    loss = torch_api.SamplesLoss(blur=0.7, scaling=0.998, diameter=0.77)
    ts = [t.clone().requires_grad_() for t in (a, x, b, y)]
    loss(*ts).backward()
    g = torch.Generator().manual_seed(31)
    dirs = [torch.randn(t.shape, generator=g) for t in (a, x, b, y)]
    dirs[0], dirs[2] = 0.1 * (dirs[0] - dirs[0].mean()), 0.1 * (dirs[2] - dirs[2].mean())  # equal masses
    h = 1e-2
    for k, name in enumerate("axby"):
        def at(t):
            args = [a, x, b, y]
            args[k] = args[k] + t * h * dirs[k]
            with torch.no_grad():
                return float(loss(*args))
        fd = (at(1.0) - at(-1.0)) / (2 * h)
        an = float((ts[k].grad * dirs[k]).sum())
        scale = float(ts[k].grad.norm() * dirs[k].norm())  # |an| <= scale; a random direction gives ~scale/sqrt(dim)
        assert abs(fd - an) < 1e-3 * scale, (name, fd, an, scale)


def test_batch_matches_geomloss_batch_and_shares_one_schedule():
    B, n, m, d = 3, 17, 13, 3
    x = torch.stack([cloud(n, d, 40 + k) for k in range(B)])
    y = torch.stack([cloud(m, d, 50 + k, shift=0.3 * k) for k in range(B)])
    a = torch.stack([weights(n, 60 + k, zeros=(2,) if k == 1 else ()) for k in range(B)])
    b = torch.stack([weights(m, 70 + k) for k in range(B)])
    kw = dict(blur=0.3, scaling=0.6)
    v, grads = ours(a, x, b, y, **kw)
    v_ref, grads_ref = reference(a, x, b, y, **kw)
    assert v.shape == (B,)
    assert rel_err(v, v_ref) < TOL
    for name, g, g_ref in zip("axby", grads, grads_ref):
        assert g.shape == g_ref.shape, name
    for k in range(B):
        assert_potential_close(grads[0][k], grads_ref[0][k], "a")
        assert_potential_close(grads[2][k], grads_ref[2][k], "b")
    assert rel_err(grads[1], grads_ref[1]) < TOL
    assert rel_err(grads[3], grads_ref[3]) < TOL
    # GeomLoss takes the diameter over the whole batch: one schedule for every item
    diam = gl_diameter(x.reshape(-1, d).double(), y.reshape(-1, d).double())
    single = torch_api.SamplesLoss(diameter=diam, **kw)(a[2], x[2], b[2], y[2])
    assert rel_err(single, v[2]) < 1e-6
    F, G = torch_api.SamplesLoss(potentials=True, **kw)(a, x, b, y)
    assert F.shape == (B, n) and G.shape == (B, m)


@pytest.mark.parametrize("kw", [dict(reach=0.8), dict(debias=False)], ids=["reach", "no_debias"])
def test_packed_batch_equals_single_solves(kw):
    """A (B, N, D) batch runs packed (one launch per softmin for the batch): each problem's loss,
    potentials, gradients in x and y and double backward (the HVP along a direction in x) are its
    single solve's (with the batch's diameter)."""
    B, n, m, d = 3, 14, 9, 2
    far = 5.0 * torch.arange(float(B))[:, None, None]  # far-apart problems: each is packed around its own centre
    x = (torch.stack([cloud(n, d, 90 + k) for k in range(B)]) + far).requires_grad_()
    y = (torch.stack([cloud(m, d, 95 + k, shift=0.4) for k in range(B)]) + far).requires_grad_()
    a = torch.stack([weights(n, 100 + k, zeros=(3,) if k == 0 else ()) for k in range(B)])
    b = torch.stack([weights(m, 105 + k, zeros=(1,) if k == 2 else ()) for k in range(B)])
    loss = torch_api.SamplesLoss(blur=0.2, scaling=0.6, **kw)
    v = loss(a, x, b, y)
    gx, gy = torch.autograd.grad(v.sum(), (x, y), create_graph=True)
    vx = torch.randn(x.shape, generator=torch.Generator().manual_seed(7))
    (hx,) = torch.autograd.grad((gx * vx).sum(), x)
    gx, gy = gx.detach(), gy.detach()
    F, G = torch_api.SamplesLoss(blur=0.2, scaling=0.6, potentials=True, **kw)(a, x, b, y)
    diam = gl_diameter(x.detach().reshape(-1, d).double(), y.detach().reshape(-1, d).double())
    single = torch_api.SamplesLoss(blur=0.2, scaling=0.6, diameter=float(diam), **kw)
    for k in range(B):
        xk, yk = x[k].detach().clone().requires_grad_(), y[k].detach().clone().requires_grad_()
        vk = single(a[k], xk, b[k], yk)
        gxk, gyk = torch.autograd.grad(vk, (xk, yk), create_graph=True)
        (hxk,) = torch.autograd.grad((gxk * vx[k]).sum(), xk)
        Fk, Gk = torch_api.SamplesLoss(blur=0.2, scaling=0.6, diameter=float(diam), potentials=True, **kw)(
            a[k], x[k], b[k], y[k])
        assert rel_err(v[k], vk) < TOL
        assert rel_err(gx[k], gxk) < 1e-4 and rel_err(gy[k], gyk) < 1e-4
        assert rel_err(hx[k], hxk) < 1e-4 and float(hxk.norm()) > 0
        assert_potential_close(F[k], Fk, "F")
        assert_potential_close(G[k], Gk, "G")


def test_weights_with_trailing_singleton_axis():
    a, x, b, y = make_problem(15, 11, 2, "random", seed=80)
    loss = torch_api.SamplesLoss(blur=0.4, scaling=0.6)
    assert rel_err(loss(a[:, None], x, b[:, None], y), loss(a, x, b, y)) < 1e-7


def test_bf16_and_float64_inputs():
    a, x, b, y = make_problem(22, 18, 3, "random", seed=90)
    xh, yh = x.bfloat16(), y.bfloat16()
    kw = dict(blur=0.3, scaling=0.6)
    v, grads = ours(a, xh, b, yh, **kw)
    v_ref, grads_ref = reference(a, xh, b, yh, **kw)  # float64 copies of the bf16 values
    assert v.dtype == torch.float32  # computed in float32, not rounded to bf16
    assert rel_err(v, v_ref) < TOL
    assert grads[1].dtype == torch.bfloat16 and grads[3].dtype == torch.bfloat16
    assert rel_err(grads[1], grads_ref[1]) < 1e-2  # bf16 rounding of the gradient itself
    v64, grads64 = ours(a.double(), x.double(), b.double(), y.double(), **kw)
    assert v64.dtype == torch.float64 and all(g.dtype == torch.float64 for g in grads64)
    v_ref64, _ = reference(a, x, b, y, **kw)
    assert rel_err(v64, v_ref64) < TOL


def test_inputs_are_not_modified():
    a, x, b, y = make_problem(20, 16, 3, "zeros", seed=100)
    ts = [t.clone().requires_grad_() for t in (a, x, b, y)]
    copies = [t.detach().clone() for t in ts]
    v = torch_api.SamplesLoss(blur=0.3, scaling=0.6)(*ts)
    v.backward()
    F, G = torch_api.SamplesLoss(blur=0.3, scaling=0.6, potentials=True)(*ts)
    (F.sum() + G.sum()).backward()
    for t, c in zip(ts, copies):
        assert torch.equal(t.detach(), c)


def test_gradient_of_one_input_only_and_unused_potential():
    a, x, b, y = make_problem(14, 12, 2, "random", seed=110)
    ys = y.clone().requires_grad_()
    torch_api.SamplesLoss(blur=0.4, scaling=0.6)(a, x, b, ys).backward()
    _, grads_ref = reference(a, x, b, y, blur=0.4, scaling=0.6)
    assert rel_err(ys.grad, grads_ref[3]) < TOL
    xs = x.clone().requires_grad_()
    F, _ = torch_api.SamplesLoss(blur=0.4, scaling=0.6, potentials=True)(a, xs, b, y)
    F.sum().backward()  # G unused: its backward pass is skipped
    assert torch.isfinite(xs.grad).all()


def test_schedule_and_diameter_match_geomloss():
    for diam, blur, scaling in [(3.7, 0.05, 0.5), (2.0, 0.3, 0.9), (0.2, 0.5, 0.5), (10.0, 0.01, 0.7)]:
        ours_ = epsilon_schedule(2, diam, blur, scaling)
        ref = gl_schedule(2, diam, blur, scaling)
        assert len(ours_) == len(ref)
        assert all(math.isclose(u, float(r), rel_tol=1e-12) for u, r in zip(ours_, ref))


def test_coinciding_points_give_zero():
    x = torch.ones(4, 2)
    v = torch_api.SamplesLoss(blur=0.1)(x, x.clone())
    assert torch.isfinite(v) and abs(float(v)) < 1e-6


@pytest.mark.parametrize("n, m", [(1, 7), (7, 1)])
def test_single_point_clouds(n, m):
    """A one-point cloud's potential and squared norm are (1,) arrays: real outputs, never
    the launcher's shared 1-element scratch buffer (kernel_calls.scratch)."""
    a, x, b, y = make_problem(n, m, 3, "random", seed=120)
    a, b = (torch.ones(1), b) if n == 1 else (a, torch.ones(1))
    v, grads = ours(a, x, b, y, blur=0.3, scaling=0.6)
    v_ref, grads_ref = reference(a, x, b, y, blur=0.3, scaling=0.6)
    assert rel_err(v, v_ref) < TOL
    assert rel_err(grads[1], grads_ref[1]) < TOL and rel_err(grads[3], grads_ref[3]) < TOL


# ----------------------------------------------------------------------------- bad input

X, Y = torch.randn(6, 3), torch.randn(5, 3)
A, B = torch.full((6,), 1 / 6), torch.full((5,), 1 / 5)


def _nan(t, idx=0):
    t = t.clone()
    t.view(-1)[idx] = float("nan")
    return t


def _inf(t, idx=0):
    t = t.clone()
    t.view(-1)[idx] = float("inf")
    return t


BAD_INPUTS = [
    # (args, exception, match)
    ((X, torch.randn(5, 2)), ValueError, "x and y must have the same dimension"),
    ((torch.randn(6), Y), ValueError, r"x must have shape \(N, D\)"),
    ((X, torch.randn(2, 5, 3, 1)), ValueError, r"y must have shape \(N, D\)"),
    ((X[None], Y), ValueError, "x and y must both be unbatched"),
    ((torch.randn(2, 6, 3), torch.randn(3, 5, 3)), ValueError, "same batch size"),
    ((torch.randn(0, 6, 3), torch.randn(0, 5, 3)), ValueError, "batch size B = 0"),
    ((torch.randn(0, 3), Y), ValueError, "x is empty"),
    ((X, torch.randn(0, 3)), ValueError, "y is empty"),
    ((_nan(X), Y), ValueError, "x contains NaN or Inf"),
    ((X, _inf(Y, 4)), ValueError, "y contains NaN or Inf"),
    ((X, -_inf(Y, 4)), ValueError, "y contains NaN or Inf"),
    ((X.tolist(), Y), TypeError, "x must be a torch.Tensor"),
    ((X, Y.double()), TypeError, "x and y must have the same dtype"),
    ((X.int(), Y.int()), TypeError, "x must be float"),
    ((X, torch.empty(5, 3, device="meta")), ValueError, "x and y must be on the same device"),
    ((A, X, B.double(), Y), TypeError, "a and b must have the same dtype"),
    ((A.to("meta"), X, B, Y), ValueError, "a must be on the points' device"),
    ((A, X, B.to("meta"), Y), ValueError, "b must be on the points' device"),
    ((A[:5], X, B, Y), ValueError, r"a must have shape \(6,\)"),
    ((A[:, None].expand(6, 2), X, B, Y), ValueError, r"a must have shape \(6,\)"),
    ((A, X, B[None], Y), ValueError, r"b must have shape \(5,\)"),
    ((A - 0.5, X, B, Y), ValueError, "a has negative entries"),
    ((A, X, _nan(B), Y), ValueError, "b contains NaN or Inf"),
    ((_inf(A, 2), X, B, Y), ValueError, "a contains NaN or Inf"),
    ((A * 0, X, B, Y), ValueError, "a is all zeros"),
    ((A, X, B.int(), Y), TypeError, "b must be a floating array"),
    ((A, X, 2 * B, Y), ValueError, "a and b must have the same total mass"),
    ((torch.stack([A, 0 * A]), torch.stack([X, X]), torch.stack([B, B]), torch.stack([Y, Y])),
     ValueError, r"a\[1\] is all zeros"),
    ((X,), TypeError, r"expects \(x, y\) or \(a, x, b, y\)"),
    ((None, A, X, None, B, Y), NotImplementedError, "cluster labels"),
]


@pytest.mark.parametrize("args,exc,match", BAD_INPUTS)
def test_bad_input_raises_naming_the_argument(args, exc, match):
    originals = [t.clone() for t in args if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    with pytest.raises(exc, match=match):
        torch_api.SamplesLoss(blur=0.5)(*args)
    after = [t for t in args if isinstance(t, torch.Tensor) and t.device.type != "meta"]
    for u, v in zip(after, originals):
        torch.testing.assert_close(u, v, rtol=0, atol=0, equal_nan=True)


BAD_OPTIONS = [
    (dict(loss="hausdorff"), NotImplementedError, "loss='hausdorff'"),
    (dict(loss="energy"), NotImplementedError, "loss='energy'"),
    (dict(loss="wasserstein"), ValueError, "loss must be 'sinkhorn'"),
    (dict(p=1), NotImplementedError, "p=1"),
    (dict(p=3), NotImplementedError, "p=3"),
    (dict(reach=0.0), ValueError, "reach must be a positive finite float"),
    (dict(cost=lambda x, y: x), NotImplementedError, "cost"),
    (dict(kernel="gaussian"), NotImplementedError, "kernel"),
    (dict(cluster_scale=0.1), ValueError, "cluster_scale=0.1 only has a meaning with backend='multiscale'"),
    (dict(backend="multiscale", cluster_scale=-1.0), ValueError, "cluster_scale must be"),
    (dict(backend="keops"), ValueError, "backend must be one of"),
    (dict(blur=0.0), ValueError, "blur must be"),
    (dict(blur=-0.1), ValueError, "blur must be"),
    (dict(blur=float("nan")), ValueError, "blur must be"),
    (dict(blur="x"), TypeError, "blur must be"),
    (dict(scaling=1.0), ValueError, "scaling must lie in"),
    (dict(scaling=0.0), ValueError, "scaling must lie in"),
    (dict(diameter=0.0), ValueError, "diameter must be"),
    (dict(diameter=float("inf")), ValueError, "diameter must be"),
    (dict(precision="fp8"), ValueError, "precision must be one of"),
]


@pytest.mark.parametrize("kw,exc,match", BAD_OPTIONS)
def test_unsupported_or_bad_options_raise_naming_the_option(kw, exc, match):
    with pytest.raises(exc, match=match):
        torch_api.SamplesLoss(**kw)


def test_options_changed_after_construction_are_checked_at_call():
    loss = torch_api.SamplesLoss()
    loss.blur = -1.0
    with pytest.raises(ValueError, match="blur must be"):
        loss(X, Y)
    loss.blur, loss.reach = 0.5, -0.3
    with pytest.raises(ValueError, match="reach must be a positive finite float"):
        loss(X, Y)


def test_accepted_geomloss_keywords():
    # truncate only matters for the multiscale backend, verbose for none: accepted, ignored
    base = torch_api.SamplesLoss(blur=0.5, scaling=0.6)(A, X, B, Y)
    for kw in (dict(truncate=3, verbose=True, backend="online"), dict(backend="tensorized"), dict(p=2.0)):
        v = torch_api.SamplesLoss("sinkhorn", blur=0.5, scaling=0.6, **kw)(A, X, B, Y)
        assert float(v) == float(base)
    # precision="tf32": one TF32 dot on GPU tensor cores (~1e-3); identical FMAs for d <= 8
    v = torch_api.SamplesLoss(blur=0.5, scaling=0.6, precision="tf32")(A, X, B, Y)
    assert abs(float(v) - float(base)) < 1e-3 * abs(float(base))


def test_clouds_far_from_origin():
    """The kernels expand |x - y|^2 = |x|^2 + |y|^2 - 2<x, y>; centring the clouds first
    keeps float32 accurate when they sit far from the origin."""
    a, x, b, y = make_problem(30, 25, 3, "random", seed=7)
    x, y = x + 1000.0, y + 1000.0
    v, grads = ours(a, x, b, y, blur=0.3, scaling=0.6)
    v_ref, grads_ref = reference(a, x, b, y, blur=0.3, scaling=0.6)
    assert rel_err(v, v_ref) < TOL
    assert rel_err(grads[1], grads_ref[1]) < TOL and rel_err(grads[3], grads_ref[3]) < TOL
