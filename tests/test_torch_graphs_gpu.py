"""CUDA-graph replay of the torch alternating loop (torch_api.cuda_graphs): from a shape's
second solve on, each segment of the loop is one graph launch. The replay must give
bitwise the eager launches' results (same kernels, same order) for every kind of loop
options, on new inputs of the same shape, with and without early stopping."""

import pytest
import torch

import torch_api
from torch_api import cuda_graphs

pytestmark = pytest.mark.gpu

OPTIONS = [
    {},                                                            # default blocks, early stop
    {"threshold": 1e-12, "max_iterations": 37},                    # runs to the cap, partial last block
    {"inner_iterations": 1, "max_iterations": 9, "threshold": 1e-12},
    {"min_iterations": 25, "max_iterations": 57, "threshold": 1e-12},
    {"min_iterations": 10, "max_iterations": 10},                  # the benchmark's fixed 10 iterations
    {"precision": "tf32", "threshold": 1e-2},
]


def _solve(x, y, a, kw):
    out = torch_api.sinkhorn(x, y, a, epsilon=0.05, **kw)
    return out.f, out.g, out.errors, out.n_iters, out.converged


def _assert_same(got, want):
    for u, v in zip(got, want):
        assert torch.equal(u, v), (u, v)


def _replays_match_eager(run, inputs, monkeypatch) -> None:
    """``run`` on each input eagerly (graphs off), then with graphs from a cleared cache on the
    inputs forth and back (the first call of a shape eager, the rest replayed): bitwise equal."""
    monkeypatch.setenv("OT_TRITON_CUDA_GRAPHS", "0")
    want = [run(*p) for p in inputs]
    monkeypatch.delenv("OT_TRITON_CUDA_GRAPHS")
    cuda_graphs.clear()
    for p, w in zip(inputs + inputs[::-1], want + want[::-1]):
        _assert_same(run(*p), w)


@pytest.mark.parametrize("kw", OPTIONS)
def test_replay_equals_eager_launches(kw, monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(7)
    shape_x, shape_y = (700, 5), (600, 5)
    inputs = [(torch.randn(shape_x, device="cuda", generator=gen),
               torch.randn(shape_y, device="cuda", generator=gen) + 0.3,
               torch.rand(700, device="cuda", generator=gen) + 0.1) for _ in range(2)]
    inputs = [(x, y, a / a.sum()) for x, y, a in inputs]
    monkeypatch.setenv("OT_TRITON_CUDA_GRAPHS", "0")
    want = [_solve(*p, kw) for p in inputs]
    monkeypatch.delenv("OT_TRITON_CUDA_GRAPHS")
    cuda_graphs.clear()
    _assert_same(_solve(*inputs[0], kw), want[0])  # first solve of the shape: eager
    assert not cuda_graphs._sets
    for p, w in zip(inputs + inputs[::-1], want + want[::-1]):  # graphed, inputs alternating
        _assert_same(_solve(*p, kw), w)
    (graphs,) = cuda_graphs._sets.values()
    assert graphs._graphs, "the solve did not go through the graphs"
    assert int(want[0][3]) > 1


def test_no_graphs_inside_a_stream_capture_or_when_switched_off(monkeypatch):
    x = torch.randn(300, 3, device="cuda")
    cuda_graphs.clear()
    monkeypatch.setenv("OT_TRITON_CUDA_GRAPHS", "0")
    for _ in range(3):
        torch_api.sinkhorn(x, x + 0.1, epsilon=0.1)
    assert not cuda_graphs._sets


@pytest.mark.parametrize("debias", [True, False])
def test_samples_loss_replay_equals_eager(debias, monkeypatch):
    """SamplesLoss's whole annealed solve is one graph; loss and gradients as eager."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    loss = torch_api.SamplesLoss("sinkhorn", p=2, blur=0.05, scaling=0.5, debias=debias)

    def run(x, y):
        x = x.clone().requires_grad_(True)
        value = loss(x, y)
        (grad,) = torch.autograd.grad(value, x)
        return value.detach(), grad

    inputs = [(torch.rand(500, 3, device="cuda", generator=gen),
               torch.rand(400, 3, device="cuda", generator=gen) * 0.8 + 0.1) for _ in range(2)]
    _replays_match_eager(run, inputs, monkeypatch)
    assert any(s._graphs for s in cuda_graphs._sets.values()), "the solve did not go through the graphs"


def test_divergence_replay_equals_eager(monkeypatch):
    """sinkhorn_divergence: the cross term's alternating loop and the self terms' symmetric loop."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    inputs = [(torch.randn(640, 4, device="cuda", generator=gen),
               torch.randn(480, 4, device="cuda", generator=gen) * 0.7) for _ in range(2)]

    def run(x, y):
        value, out = torch_api.sinkhorn_divergence(x, y, epsilon=0.05)
        return (value,) + tuple(e for e in out.errors if e is not None) + tuple(
            k for k in out.n_iters if k is not None)

    _replays_match_eager(run, inputs, monkeypatch)
    kinds = {k[0] for k in cuda_graphs._sets}
    assert {"alternating", "symmetric"} <= kinds


def test_labelled_replays_equal_eager(monkeypatch):
    """A label cost: sinkhorn's alternating loop, the divergence's self terms (symmetric loop) and
    SamplesLoss's anneal are graphed with the labels and the table as static inputs; new labels, a
    new table and new points of the same shapes replay bitwise as the eager launches."""
    gen = torch.Generator(device="cuda").manual_seed(19)

    def labelled():
        w = torch.rand(3, 3, device="cuda", generator=gen)
        return (torch.randn(500, 3, device="cuda", generator=gen), torch.randn(420, 3, device="cuda", generator=gen),
                torch.randint(0, 3, (500,), device="cuda", generator=gen),
                torch.randint(0, 3, (420,), device="cuda", generator=gen), w + w.T)

    loss = torch_api.SamplesLoss("sinkhorn", p=2, blur=0.05, scaling=0.5)

    def run(x, y, lx, ly, w):
        lab = dict(label_x=lx, label_y=ly, label_cost=w)
        out = torch_api.sinkhorn(x, y, epsilon=0.05, **lab)
        fixed = torch_api.sinkhorn(x, y, epsilon=0.05, min_iterations=10, max_iterations=10, **lab)
        div, dout = torch_api.sinkhorn_divergence(x, y, epsilon=0.05, **lab)
        xg = x.clone().requires_grad_(True)
        value = loss(xg, y, **lab)
        (grad,) = torch.autograd.grad(value, xg)
        return (out.f, out.g, out.errors, fixed.f, div, value.detach(), grad) + tuple(
            e for e in dout.errors if e is not None)

    _replays_match_eager(run, [labelled(), labelled()], monkeypatch)
    kinds = {k[0] for k, s in cuda_graphs._sets.items() if "labels" in k and s._graphs}
    assert {"alternating", "symmetric", "samples_loss"} <= kinds, kinds


def test_whole_and_segmented_solves_alternate_on_one_shape(monkeypatch):
    """A fixed-length solve is one replay (centring included); an early-stopping solve replays
    the centring and its segments. Alternating them on one shape (one memory pool) changes no bit."""
    gen = torch.Generator(device="cuda").manual_seed(11)
    kws = [{"min_iterations": 10, "max_iterations": 10}, {}, {"threshold": 1e-12, "max_iterations": 23}]
    inputs = [(torch.randn(500, 3, device="cuda", generator=gen),
               torch.randn(450, 3, device="cuda", generator=gen) * 0.8, kw) for kw in kws]

    def run(x, y, kw):
        return _solve(x, y, None, kw)

    _replays_match_eager(run, inputs, monkeypatch)
    (graphs,) = cuda_graphs._sets.values()
    assert {k[0] for k in graphs._graphs if isinstance(k, tuple)} == {"whole", "segment"}


def test_symmetric_whole_solve_replay_equals_eager(monkeypatch):
    gen = torch.Generator(device="cuda").manual_seed(13)
    inputs = [(torch.randn(640, 4, device="cuda", generator=gen),
               torch.randn(480, 4, device="cuda", generator=gen) * 0.7) for _ in range(2)]

    def run(x, y):
        value, out = torch_api.sinkhorn_divergence(x, y, epsilon=0.05, min_iterations=10, max_iterations=10)
        return (value,) + tuple(e for e in out.errors if e is not None)

    _replays_match_eager(run, inputs, monkeypatch)
    symmetric = [s for key, s in cuda_graphs._sets.items() if key[0] == "symmetric"]
    assert symmetric and all(("whole", True, 10, "float32") in s._graphs for s in symmetric)


def test_weights_and_epsilon_changing_between_replays(monkeypatch):
    """The library's own weights and cached kernel parameters are not copied again when they
    are the very tensors last loaded (GraphSet.load's ``immutable``); user weights and a new
    epsilon always are."""
    gen = torch.Generator(device="cuda").manual_seed(17)
    x, y = torch.randn(400, 3, device="cuda", generator=gen), torch.randn(350, 3, device="cuda", generator=gen)
    a = torch.rand(400, device="cuda", generator=gen) + 0.1
    cases = [(None, 0.05), (a / a.sum(), 0.05), (None, 0.05), (None, 0.2), (a / a.sum(), 0.2), (None, 0.05)]

    def run(w, eps):
        out = torch_api.sinkhorn(x, y, w, epsilon=eps, threshold=1e-12, max_iterations=23)
        return out.f, out.g, out.errors

    _replays_match_eager(run, cases, monkeypatch)


@pytest.mark.parametrize("debias", [True, False])
def test_packed_samples_loss_replay_equals_eager(debias, monkeypatch):
    """A (B, N, D) batch's packing and packed anneal are one graph; losses and gradients in x
    and y of every problem as eager, on new values of the same batch shape."""
    gen = torch.Generator(device="cuda").manual_seed(5)
    loss = torch_api.SamplesLoss("sinkhorn", p=2, blur=0.05, scaling=0.5, debias=debias)

    def run(x, y, b):
        x, y = x.clone().requires_grad_(True), y.clone().requires_grad_(True)
        a = torch.full(x.shape[:2], 1.0 / x.shape[1], device="cuda")
        value = loss(a, x, b, y)
        gx, gy = torch.autograd.grad(value.sum(), (x, y))
        return value.detach(), gx, gy

    def batch():
        b = torch.rand(5, 300, device="cuda", generator=gen) + 0.1
        b[:, :7] = 0.0
        return (torch.randn(5, 400, 3, device="cuda", generator=gen) + torch.arange(5, device="cuda")[:, None, None],
                torch.randn(5, 300, 3, device="cuda", generator=gen) * 0.8 + 0.2, b / b.sum(1, keepdim=True))

    _replays_match_eager(run, [batch(), batch()], monkeypatch)
    assert any(k[0] == "samples_loss_packed" and s._graphs for k, s in cuda_graphs._sets.items()), \
        "the packed anneal did not go through the graphs"


def test_cg_blocks_replayed_equal_eager(monkeypatch):
    """The CG of an HVP (one problem, x and y) and of a batch, and the implicit VJP of f: the
    blocks after the first replay one graph captured for the loop; bitwise the eager results."""
    gen = torch.Generator(device="cuda").manual_seed(11)

    def single(x, y, v, w):
        outs = []
        for wrt, vv in (("x", v), ("y", w)):
            h, info = torch_api.hvp(x, y, vv, epsilon=0.1, wrt=wrt)
            assert int(info.cg_iterations) > 2 * 8, "too few CG blocks for a replay"
            outs += [h, info.cg_iterations]
        xg = x.clone().requires_grad_(True)
        out = torch_api.sinkhorn(xg, y, epsilon=0.1)
        outs.append(torch.autograd.grad((out.f * torch.arange(x.shape[0], device="cuda")).sum(), xg)[0])
        return outs

    def batch(x, y, v, w):
        h, info = torch_api.hvp(x, y, v, epsilon=0.1)
        assert int(info.cg_iterations.max()) > 2 * 8
        return h, info.cg_iterations, info.cg_residual

    pts = lambda *s: torch.randn(*s, device="cuda", generator=gen)  # noqa: E731
    _replays_match_eager(single, [(pts(700, 3), pts(500, 3) + 0.3, pts(700, 3), pts(500, 3)) for _ in range(2)],
                         monkeypatch)
    _replays_match_eager(batch, [(pts(6, 300, 3), pts(6, 200, 3) + 0.3, pts(6, 300, 3), None) for _ in range(2)],
                         monkeypatch)
