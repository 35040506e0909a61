"""``torch.compile`` of ``torch_api.SamplesLoss``: one graph (fullgraph=True), forward and
backward, equal to eager, and no recompilation when new data brings a new diameter and
hence a new eps-schedule (the schedule lives inside the ``ot_triton::samples_loss_solve``
custom op, computed at run time).

CPU tests use ``backend="aot_eager"`` (AOTAutograd traces forward and backward through the
ops' fake implementations, then runs the same aten ops and the Triton kernels under the
interpreter), so compiled and eager numbers agree to the last bits. The GPU test compiles a
training step with the default inductor backend.
"""

import pytest
import torch
import torch._dynamo
import torch._dynamo.testing

import torch_api
from ot_triton_jax.core.schedules import epsilon_schedule
from torch_api import samples_loss_ops

BLUR, SCALING = 0.3, 0.6


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield
    torch._dynamo.reset()


def close(u, v):
    torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-7)


def problem(n, m, d, seed, scale=1.0, batch=None):
    g = torch.Generator().manual_seed(seed)
    lead = () if batch is None else (batch,)
    x = scale * torch.randn(lead + (n, d), generator=g)
    y = scale * torch.randn(lead + (m, d), generator=g) + 0.3
    a = torch.rand(lead + (n,), generator=g) + 0.2
    b = torch.rand(lead + (m,), generator=g) + 0.2
    return a / a.sum(-1, keepdim=True), x, b / b.sum(-1, keepdim=True), y


def schedule_length(x, y):
    return len(epsilon_schedule(2, samples_loss_ops.diameter(x, y), BLUR, SCALING))


def value_and_grads(fn, args, need):
    """fn(*args) -> scalar; returns its value and the gradients of the args flagged in ``need``."""
    ts = [t.detach().clone().requires_grad_(w) for t, w in zip(args, need)]
    v = fn(*ts)
    v.backward()
    return v.detach(), [t.grad for t, w in zip(ts, need) if w]


def check_compiled_matches_eager(fn, problems, need):
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, fullgraph=True, backend=counter)
    for args in problems:
        v, grads = value_and_grads(compiled, args, need)
        v_ref, grads_ref = value_and_grads(fn, args, need)
        close(v, v_ref)
        assert len(grads) == len(grads_ref)
        for g, g_ref in zip(grads, grads_ref):
            close(g, g_ref)
    assert counter.frame_count == 1  # one graph, never recompiled
    return counter


def test_value_and_gradient_in_x_match_eager_and_a_new_schedule_does_not_recompile():
    loss = torch_api.SamplesLoss(blur=BLUR, scaling=SCALING)
    _, x1, _, y1 = problem(11, 8, 3, seed=0)
    _, x2, _, y2 = problem(11, 8, 3, seed=1, scale=3.0)
    assert schedule_length(x1, y1) != schedule_length(x2, y2)  # a different eps-schedule
    counter = check_compiled_matches_eager(lambda x, y: loss(x, y), [(x1, y1), (x2, y2)], (True, False))
    assert counter.op_count > 0


def test_weights_and_gradients_in_all_four_inputs():
    loss = torch_api.SamplesLoss(blur=BLUR, scaling=SCALING)
    p1 = problem(9, 7, 2, seed=2)
    p2 = problem(9, 7, 2, seed=3, scale=4.0)
    assert schedule_length(p1[1], p1[3]) != schedule_length(p2[1], p2[3])
    check_compiled_matches_eager(lambda a, x, b, y: loss(a, x, b, y), [p1, p2], (True,) * 4)


def test_potentials_and_their_vjp():
    loss = torch_api.SamplesLoss(blur=BLUR, scaling=SCALING, potentials=True)
    g = torch.Generator().manual_seed(4)
    uF, uG = torch.randn(10, generator=g), torch.randn(6, generator=g)

    def fn(a, x, b, y):
        F, G = loss(a, x, b, y)
        return (F * uF).sum() + (G * uG).sum()

    p1 = problem(10, 6, 3, seed=5)
    p2 = problem(10, 6, 3, seed=6, scale=0.2)
    assert schedule_length(p1[1], p1[3]) != schedule_length(p2[1], p2[3])
    check_compiled_matches_eager(fn, [p1, p2], (False, True, False, True))


def test_batch_without_debias():
    loss = torch_api.SamplesLoss(blur=BLUR, scaling=SCALING, debias=False)
    p1 = problem(7, 5, 2, seed=7, batch=2)
    p2 = problem(7, 5, 2, seed=8, batch=2, scale=3.0)
    check_compiled_matches_eager(lambda a, x, b, y: loss(a, x, b, y).sum(), [p1, p2], (True,) * 4)


def test_invalid_values_raise_at_run_time_under_compile():
    """The value checks cannot run while tracing: the custom op runs them on the data."""
    loss = torch_api.SamplesLoss(blur=0.5)
    compiled = torch.compile(lambda a, x, b, y: loss(a, x, b, y), fullgraph=True, backend="aot_eager")
    a, x, b, y = problem(6, 5, 2, seed=9)
    compiled(a, x, b, y)
    x_nan = x.clone()
    x_nan[2, 1] = float("nan")
    with pytest.raises(ValueError, match="x contains NaN or Inf"):
        compiled(a, x_nan, b, y)
    with pytest.raises(ValueError, match="a and b must have the same total mass"):
        compiled(a, x, 2 * b, y)
    a_neg = a.clone()
    a_neg[0] = -0.1
    with pytest.raises(ValueError, match="a has negative entries"):
        compiled(a_neg, x, b, y)


@pytest.mark.gpu
def test_inductor_training_step_matches_eager():
    """A linear layer maps fixed inputs to a point cloud x; SamplesLoss(x, y); backward; SGD.
    Three steps compiled (default inductor backend, fullgraph) against three eager steps: every
    step moves x, hence the diameter and the eps-schedule, without a recompile."""
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(10)
    z = torch.randn(256, 8, generator=g).to(dev)
    y = (torch.randn(200, 3, generator=g) + 0.5).to(dev)
    loss = torch_api.SamplesLoss(blur=0.1, scaling=0.7)
    torch.manual_seed(11)
    layer_ref = torch.nn.Linear(8, 3).to(dev)
    layer = torch.nn.Linear(8, 3).to(dev)
    layer.load_state_dict(layer_ref.state_dict())

    def model_loss(lin, z, y):
        return loss(lin(z), y)

    compiled = torch.compile(model_loss, fullgraph=True)
    runs = []
    for lin, fn in ((layer_ref, model_loss), (layer, compiled)):
        opt = torch.optim.SGD(lin.parameters(), lr=0.5)
        values = []
        for _ in range(3):
            opt.zero_grad()
            v = fn(lin, z, y)
            v.backward()
            opt.step()
            values.append(v.detach())
        runs.append((torch.stack(values), [p.detach().clone() for p in lin.parameters()]))
    (v_ref, p_ref), (v, p) = runs
    assert torch.isfinite(v).all() and bool(v[2] < v[0])  # the steps descend
    torch.testing.assert_close(v, v_ref, rtol=1e-5, atol=1e-6)
    for u, u_ref in zip(p, p_ref):
        torch.testing.assert_close(u, u_ref, rtol=1e-5, atol=1e-6)
