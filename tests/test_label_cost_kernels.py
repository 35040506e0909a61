"""The label-augmented cost in the dense kernels (kernels/label_tiles.py; core/labels.py).

C_ij = s (|x_i - y_j|^2 + W[label_x_i, label_y_j]) through both frontends' kernel_ops, against
float64 dense references: the LSE update (online, fixed shift, column split + combine), the plan
times v and its row sums, the exact ("fixed4") mass pass, the weighted pass, both orientations
(the y cloud reads W^T), n != m, K_x != K_y, zero weights; a self problem; the symmetric update's
fall-back from the fused sweeps; out-of-range labels give NaN (also under jax.jit); the rules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from ot_triton_jax.core import kernel_calls, labels, launch_plans, pair_plans
from ot_triton_jax.core.kernels import lse_pair_kernel
from ot_triton_jax.jax_frontend import kernel_ops as jko
from torch_api import kernel_ops as tko

EPS, S = 0.3, 0.5
N, M, D, KX, KY = 37, 23, 3, 3, 4


def _problem(seed=0, grouped=False):
    rng = np.random.default_rng(seed)
    x, y = rng.normal(size=(N, D)), rng.normal(size=(M, D)) * 0.8 + 0.3
    lx, ly = rng.integers(0, KX, N), rng.integers(0, KY, M)
    lx[:KX], ly[:KY] = np.arange(KX), np.arange(KY)  # every class present
    if grouped:  # 16-row blocks of one label (the column-bias path) beside mixed ones
        lx[:16], lx[32:] = 0, KX - 1
        lx[16:32] = 1 + np.arange(16) % (KX - 1)
        ly[:16], ly[16:] = KY - 1, np.arange(M - 16) % (KY - 1)
    W = rng.uniform(0.0, 2.0, size=(KX, KY))
    a, b = rng.uniform(0.1, 1.0, N), rng.uniform(0.1, 1.0, M)
    a[5], b[2] = 0.0, 0.0  # a zero weight on each side
    return x, y, lx, ly, W, a / a.sum(), b / b.sum()


def _cost(x, y, lx, ly, W):
    return S * (((x[:, None, :] - y[None, :, :]) ** 2).sum(-1) + W[lx][:, ly])


def _log(w):
    with np.errstate(divide="ignore"):
        return np.log(w)


def _lse(t):
    mx = t.max(1, keepdims=True)
    return (mx + np.log(np.exp(t - mx).sum(1, keepdims=True)))[:, 0]


class _Torch:
    def clouds(self, *pts, labels=None, label_cost=None):
        lab = None if labels is None else tuple(torch.as_tensor(v) for v in labels)
        return tko.clouds(*(torch.as_tensor(p, dtype=torch.float32) for p in pts), labels=lab,
                          label_cost=None if label_cost is None else torch.as_tensor(label_cost))

    def arr(self, v):
        return None if v is None else torch.as_tensor(np.asarray(v), dtype=torch.float32)

    def params(self):
        return tko.params(EPS, S, "cpu")

    def lse(self, src, tgt, pot, **kw):
        return tko.lse_update(src, tgt, pot, self.params(), "float32", **kw)

    def apply(self, src, tgt, f, g, v=None):
        return tko.apply_plan(src, tgt, f, g, self.params(), "float32", v=v)

    def mass(self, src, tgt, f, g):
        return tko.exact_row_mass(src, tgt, f, g, self.params())

    def weighted(self, src, tgt, f, g, w, wa, wb):
        return tko.apply_weighted(src, tgt, f, g, self.params(), "float32", w, wa, wb)

    def self_(self, X, f, lw):
        return tko.lse_self(X, f, lw, self.params(), "float32")

    def pair(self, X, Y, f, g, la, lb):
        return tko.lse_pair(X, Y, f, g, la, lb, self.params(), "float32")


class _Jax(_Torch):
    def clouds(self, *pts, labels=None, label_cost=None):
        return jko.clouds(*(jnp.asarray(p, jnp.float32) for p in pts), labels=labels,
                          label_cost=None if label_cost is None else jnp.asarray(label_cost))

    def arr(self, v):
        return None if v is None else jnp.asarray(np.asarray(v), jnp.float32)

    def params(self):
        return jko.make_params(EPS, S)

    def lse(self, src, tgt, pot, **kw):
        return jko.lse_update(src, tgt, pot, self.params(), precision="float32", **kw)

    def apply(self, src, tgt, f, g, v=None):
        return jko.apply_plan(src, tgt, f, g, self.params(), precision="float32", v=v)

    def mass(self, src, tgt, f, g):
        return jko.exact_row_mass(src, tgt, f, g, self.params())

    def weighted(self, src, tgt, f, g, w, wa, wb):
        return jko.apply_weighted(src, tgt, f, g, self.params(), w, wa, wb, precision="float32")

    def self_(self, X, f, lw):
        return jko.lse_self(X, f, lw, self.params(), precision="float32")

    def pair(self, X, Y, f, g, la, lb):
        return jko.lse_pair(X, Y, f, g, la, lb, self.params(), precision="float32")


FRONTENDS = {"torch": _Torch(), "jax": _Jax()}


def _np(v):
    return np.asarray(v, dtype=np.float64)


def _close(out, ref, tol=2e-5):
    out = _np(out)
    assert np.array_equal(np.isneginf(out), np.isneginf(ref)) and not np.isnan(out).any()
    fin = np.isfinite(ref)
    scale = max(1.0, np.abs(ref[fin]).max())
    assert np.abs(out[fin] - ref[fin]).max() <= tol * scale, np.abs(out[fin] - ref[fin]).max()


@pytest.fixture
def small_tiles(monkeypatch):
    """16-wide interpreter tiles: at m <= 40 the plans split the columns (SPLIT = 2, combine kernel)."""
    def use(on: bool):
        if on:
            monkeypatch.setattr(launch_plans, "_interpreter_blocks", lambda n, m: dict(BLOCK_M=16, BLOCK_N=16))
        launch_plans.clear_cache()
        for name in ("lse_update", "apply_plan", "exact_row_mass", "apply_weighted", "lse_pair", "lse_self"):
            getattr(kernel_calls, name).cache_clear()
    yield use
    monkeypatch.undo()
    use(False)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
@pytest.mark.parametrize("split,grouped", [(False, False), (True, False), (True, True)])
def test_lse_update_with_labels(frontend, split, grouped, small_tiles):
    fe = FRONTENDS[frontend]
    small_tiles(split)
    x, y, lx, ly, W, a, b = _problem(grouped=grouped)
    X, Y = fe.clouds(x, y, labels=(lx, ly), label_cost=W)
    C = _cost(x, y, lx, ly, W)
    rng = np.random.default_rng(1)
    for src, tgt, Cs, lw_in, lw_out in ((X, Y, C, _log(b), None), (Y, X, C.T, _log(a), np.log(np.full(M, 0.7)))):
        n, m = Cs.shape
        pot = rng.normal(size=m) * 0.2
        L = _lse((pot[None] - Cs) / EPS + lw_in[None])
        ref = -EPS * L + (0.0 if lw_out is None else EPS * lw_out)
        pold = ref + rng.normal(size=n) * 0.05  # near: the fixed shift is accepted
        w_out = np.ones(n) if lw_out is None else np.exp(lw_out)
        err_ref = np.abs(np.exp(pold / EPS + L) - w_out)
        plan = launch_plans.lse_plan(n, m, D, "float32", False, fold=True)
        assert plan.constexprs["SPLIT"] == (2 if split else 1) and plan.constexprs["FOLD"]
        # kernel GROUPED (one unlabelled pass per label of a block): right in any label order
        for fold, kernel_grouped in ((False, False), (True, False), (False, True), (True, True)):
            out, err = fe.lse(src, tgt, fe.arr(pot), logw_in=fe.arr(lw_in), logw_out=fe.arr(lw_out),
                              pold=fe.arr(pold), fold=fold, grouped=kernel_grouped)
            _close(out, ref)
            _close(err, err_ref, 1e-4)
        far = ref + 40.0  # the fixed shift is rejected: the online loop redoes the blocks
        for kernel_grouped in (False, True):
            out, _ = fe.lse(src, tgt, fe.arr(pot), logw_in=fe.arr(lw_in), logw_out=fe.arr(lw_out),
                            pold=fe.arr(far), fold=True, grouped=kernel_grouped)
            _close(out, ref)


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_plan_passes_with_labels(frontend, small_tiles):
    fe = FRONTENDS[frontend]
    small_tiles(True)  # the exact mass pass splits its columns too
    x, y, lx, ly, W, a, b = _problem(2)
    X, Y = fe.clouds(x, y, labels=(lx, ly), label_cost=W)
    C = _cost(x, y, lx, ly, W)
    rng = np.random.default_rng(3)
    f = 0.4 + EPS * _log(a) + rng.normal(size=N) * 0.1  # -inf at the zero weight
    g = 0.4 + EPS * _log(b) + rng.normal(size=M) * 0.1
    P = np.exp((f[:, None] + g[None, :] - C) / EPS)
    for src, tgt, fs, gs, Ps, other in ((X, Y, f, g, P, y), (Y, X, g, f, P.T, x)):
        v = other - 0.2
        pv, rows = fe.apply(src, tgt, fe.arr(fs), fe.arr(gs), v=fe.arr(v))
        _close(pv, Ps @ v)
        _close(rows, Ps.sum(1))
        none, rows = fe.apply(src, tgt, fe.arr(fs), fe.arr(gs))
        assert none is None
        _close(rows, Ps.sum(1))
        _close(fe.mass(src, tgt, fe.arr(fs), fe.arr(gs)), Ps.sum(1))
        w, wa, wb = rng.normal(size=(Ps.shape[0], 2)), rng.normal(size=(Ps.shape[1], 2)), v[:, :2]
        _close(fe.weighted(src, tgt, fe.arr(fs), fe.arr(gs), fe.arr(w), fe.arr(wa), fe.arr(wb)),
               ((Ps * (w @ wa.T)) @ wb))


@pytest.mark.parametrize("frontend", ["torch", "jax"])
def test_self_and_pair_fall_back_from_fused(frontend, monkeypatch):
    fe = FRONTENDS[frontend]
    monkeypatch.setattr(pair_plans, "PAIR_MODE", "fused")
    monkeypatch.setattr(pair_plans, "SELF_MODE", "triangle")
    kernel_calls.lse_pair.cache_clear()
    kernel_calls.lse_self.cache_clear()
    try:
        for seq in (kernel_calls.lse_pair(N, M, D, "float32", False, (KX, KY)),
                    kernel_calls.lse_self(N, D, "float32", False, (KX, KX))):
            assert all(c.kernel is not lse_pair_kernel for c in seq.calls)
            assert all(c.constexprs.get("LABELS") for c in seq.calls if "y_ltab" in c.args)
        assert any(c.kernel is lse_pair_kernel for c in kernel_calls.lse_pair(N, M, D, "float32", False).calls)
        x, y, lx, ly, W, a, b = _problem(4)
        la, lb = _log(a), _log(b)
        rng = np.random.default_rng(5)
        f, g = rng.normal(size=N) * 0.2, rng.normal(size=M) * 0.2
        C = _cost(x, y, lx, ly, W)
        X, Y = fe.clouds(x, y, labels=(lx, ly), label_cost=W)
        fo, go = fe.pair(X, Y, fe.arr(f), fe.arr(g), fe.arr(la), fe.arr(lb))
        _close(fo, -EPS * _lse((g[None] - C) / EPS + lb[None]))
        _close(go, -EPS * _lse((f[None] - C.T) / EPS + la[None]))
        Wsq = np.random.default_rng(6).uniform(0, 2, (KX, KX))  # not symmetric: used as is
        (Xs,) = fe.clouds(x, labels=(lx,), label_cost=Wsq)
        Cxx = _cost(x, x, lx, lx, Wsq)
        _close(fe.self_(Xs, fe.arr(f), fe.arr(la)), -EPS * _lse((f[None] - Cxx) / EPS + la[None]))
    finally:
        kernel_calls.lse_pair.cache_clear()
        kernel_calls.lse_self.cache_clear()


@pytest.mark.parametrize("split", [False, True])
def test_out_of_range_labels_give_nan(split, small_tiles):
    fe = FRONTENDS["torch"]
    small_tiles(split)
    x, y, lx, ly, W, a, b = _problem(7)
    C = _cost(x, y, lx, ly, W)
    g, lb = np.zeros(M), _log(b)
    ref = -EPS * _lse((g[None] - C) / EPS + lb[None])
    bad_row, bad_col = lx.copy(), ly.copy()
    bad_row[4], bad_col[6] = KX, -1
    X, Y = fe.clouds(x, y, labels=(bad_row, ly), label_cost=W)
    for fold, kernel_grouped in ((False, False), (True, False), (True, True)):
        out, err = fe.lse(X, Y, fe.arr(g), logw_in=fe.arr(lb), pold=fe.arr(ref), fold=fold, grouped=kernel_grouped)
        out, err = _np(out), _np(err)
        assert np.isnan(out[4]) and np.isnan(err[4])
        _close(np.delete(out, 4), np.delete(ref, 4))
    _, rows = fe.apply(X, Y, fe.arr(np.zeros(N)), fe.arr(g))
    rows = _np(rows)
    assert np.isnan(rows[4]) and np.isfinite(np.delete(rows, 4)).all()
    X, Y = fe.clouds(x, y, labels=(lx, bad_col), label_cost=W)
    for fold, kernel_grouped in ((False, False), (True, False), (True, True)):
        out, _ = fe.lse(X, Y, fe.arr(g), logw_in=fe.arr(lb), pold=fe.arr(ref), fold=fold, grouped=kernel_grouped)
        assert np.isnan(_np(out)).all()
    assert np.isnan(_np(fe.apply(X, Y, fe.arr(np.zeros(N)), fe.arr(g))[1])).all()
    assert np.isnan(_np(fe.mass(X, Y, fe.arr(np.zeros(N)), fe.arr(g)))).all()


def test_out_of_range_labels_under_jit_give_nan():
    x, y, lx, ly, W, a, b = _problem(8)

    @jax.jit
    def update(lx, ly):
        X, Y = jko.clouds(jnp.asarray(x, jnp.float32), jnp.asarray(y, jnp.float32), labels=(lx, ly),
                          label_cost=jnp.asarray(W, jnp.float32))
        return jko.lse_update(X, Y, jnp.zeros(M), jko.make_params(EPS, S), precision="float32")[0]

    lx = lx.copy()
    lx[0] = 1000  # far outside the table: clamped for the load, NaN in the output
    out = np.asarray(update(jnp.asarray(lx, jnp.int32), jnp.asarray(ly, jnp.int32)))
    assert np.isnan(out[0]) and np.isfinite(out[1:]).all()


def test_rules_name_the_argument():
    x, y, lx, ly, W, a, b = _problem()
    assert labels.check_shapes(None, None, None, N, M) == (0, 0)
    assert labels.check_shapes(lx, ly, W, N, M) == (KX, KY)
    with pytest.raises(ValueError, match="label_y missing"):
        labels.check_shapes(lx, None, W, N, M)
    with pytest.raises(ValueError, match=r"label_y must have shape \(23,\)"):
        labels.check_shapes(lx, ly[:-1], W, N, M)
    with pytest.raises(TypeError, match="label_x must hold integer"):
        labels.check_shapes(lx.astype(np.float32), ly, W, N, M)
    with pytest.raises(ValueError, match="label_cost must be square"):
        labels.check_shapes(lx, None, W, N, N, self_problem=True)
    with pytest.raises(ValueError, match="label_cost must be a 2-D"):
        labels.check_shapes(lx, ly, W[0], N, M)
    labels.check_values(lx, ly, W, np)
    with pytest.raises(ValueError, match=r"label_y must index the label_cost table: values in \[0, 4\)"):
        labels.check_values(lx, np.where(ly == 0, 4, ly), W, np)
    with pytest.raises(ValueError, match="label_x must index"):
        labels.check_values(torch.as_tensor(lx - 1), None, torch.as_tensor(W), torch)
    with pytest.raises(ValueError, match="label_cost must be finite"):
        labels.check_values(lx, ly, np.where(W > 1, np.inf, W), np)
    fe = FRONTENDS["torch"]
    X, Y = fe.clouds(x, y, labels=(lx, ly), label_cost=W)
    assert X.labels.dtype == torch.int32 and tuple(Y.label_table.shape) == (KY, KX)
    assert torch.equal(Y.label_table, X.label_table.t()) and Y.label_table.is_contiguous()
    P, Q = fe.clouds(x, y)
    with pytest.raises(ValueError, match="both clouds of a kernel call must carry labels"):
        fe.lse(X, Q, fe.arr(np.zeros(M)))
    with pytest.raises(ValueError, match="square label table"):
        fe.self_(X, fe.arr(np.zeros(N)), fe.arr(np.zeros(N)))
    with pytest.raises(ValueError, match="one label tensor per cloud"):
        fe.clouds(x, y, labels=(lx,), label_cost=W)
    with pytest.raises(ValueError, match="no label cost"):
        tko.lse_blocksparse(X, Y, fe.arr(np.zeros(M)), fe.params(), None, "float32")


def test_block_order_lists_mixed_blocks_first():
    """label_block_order_kernel: a permutation of the row blocks, mixed-label (or out-of-range)
    blocks first, each group in increasing order; several chunks and a partial last block."""
    from ot_triton_jax.core.kernels import label_block_order_kernel
    lab = np.array([0] * 4 + [1] * 4 + [1, 2, 2, 2] + [2] * 4 + [3, 3, 9, 3] + [3, 0, 0, 0] + [0] * 4 + [5, 5],
                   dtype=np.int32)  # k_src = 6: the label 9 is out of range
    n, bm = len(lab), 4
    order = torch.full((-(-n // bm),), -1, dtype=torch.int32)
    label_block_order_kernel[(1,)](torch.from_numpy(lab), n, 6, order, BLOCK_M=bm, CHUNK=4)
    assert order.tolist() == [2, 4, 5, 0, 1, 3, 6, 7]
