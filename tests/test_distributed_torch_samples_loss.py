"""torch_api.distributed.SamplesLoss on CPU processes (Gloo, Triton interpreter) against torch_api.SamplesLoss.

Each world size spawns its processes once; every worker computes the cases below on its shards
(the loss with its gradients in x, y, a, b, then the potentials), runs the bad-input checks that
need several ranks, and saves what it saw. The parent computes the gathered problems on one
device and compares the loss, the gathered potentials and the gathered gradients to float32
rounding.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import torch_api
from gloo_world import Worlds, shard, sizes
from ot_triton_jax.core.sharding import split_sizes
from torch_api.distributed.loss import SamplesLoss, samples_loss


def _problem(seed: int, n: int, m: int, d: int, zeros: bool, mass_b: float = 1.0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64).float()
    y = (0.8 * torch.randn(m, d, generator=gen, dtype=torch.float64) + 0.4).float()
    if not zeros:
        return dict(x=x, y=y, a=None, b=None)
    a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.2
    b = torch.rand(m, generator=gen, dtype=torch.float64) + 0.2
    a[[0, 5, n - 1]] = 0.0
    b[[2, m // 2]] = 0.0
    return dict(x=x, y=y, a=(a / a.sum()).float(), b=(mass_b * b / b.sum()).float())


# (name, problem, options, x shard sizes per world size, y shard sizes per world size); None: array_split.
# A rank whose x shard is one point of weight zero in "weighted"; "weighted" and "reach" keep their
# clouds sharded (the ring exchange), the others gather them.
CASES = [
    ("uniform", _problem(0, 23, 17, 2, False), dict(blur=0.3, scaling=0.3), None, None),
    ("weighted", _problem(1, 21, 26, 3, True), dict(blur=0.25, scaling=0.5, exchange="ring"),
     {2: (1, 20), 4: (1, 9, 6, 5)}, {2: (20, 6), 4: (9, 1, 12, 4)}),
    ("no_debias", _problem(2, 19, 13, 3, True), dict(blur=0.4, scaling=0.3, debias=False), None,
     {2: (12, 1), 4: (1, 5, 3, 4)}),
    ("reach", _problem(3, 17, 22, 2, True, mass_b=1.3), dict(blur=0.3, scaling=0.3, reach=1.0, exchange="ring"),
     None, None),
]


def _error(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 (the message is what is checked)
        return f"{type(err).__name__}: {err}"
    return "no error"


def _bad_inputs(rank: int, world: int) -> dict:
    """Checks that need several ranks; each returns this rank's error."""
    p = _problem(4, 10, 8, 2, False)
    x, y = shard(p["x"], split_sizes(10, world), rank), shard(p["y"], split_sizes(8, world), rank)
    opts = dict(blur=0.5, scaling=0.3)
    out = {"multiscale": _error(lambda: samples_loss(x, y, backend="multiscale", **opts))}
    out["blur"] = _error(lambda: samples_loss(x, y, blur=0.5 + 0.1 * (rank == world - 1), scaling=0.3))
    a = torch.full((x.shape[0] + (rank == world - 1),), 0.1)
    out["local_shape"] = _error(lambda: samples_loss(x, y, a, None, **opts))
    a, b = torch.full((x.shape[0],), 0.1), torch.full((y.shape[0],), 2.0 / 8)
    out["masses"] = _error(lambda: samples_loss(x, y, a, b, **opts))
    out["reach_x"] = _error(lambda: samples_loss(x, y, reach_x=1.0, **opts))
    out["batched"] = _error(lambda: samples_loss(x[None], y[None], **opts))
    xg = x.clone().requires_grad_()
    loss = samples_loss(xg, y, **opts)
    loss.backward(create_graph=True)
    out["second_order"] = _error(lambda: xg.grad.sum().backward())
    out["after_errors"] = float(SamplesLoss(**opts)(x, y))  # the group still works
    return out


def _body(rank: int, world: int) -> dict:
    results = {}
    for name, p, opts, xsz, ysz in CASES:
        sx, sy = sizes(xsz, p["x"].shape[0], world), sizes(ysz, p["y"].shape[0], world)
        x = shard(p["x"], sx, rank).requires_grad_()
        y = shard(p["y"], sy, rank).requires_grad_()
        a, b = shard(p["a"], sx, rank), shard(p["b"], sy, rank)
        if a is None:
            loss = SamplesLoss(**opts)(x, y)
        else:
            a.requires_grad_()
            b.requires_grad_()
            loss = samples_loss(x, y, a, b, **opts)
        loss.backward()
        F, G = samples_loss(x, y, a, b, potentials=True, **opts)
        results[name] = dict(loss=loss.detach(), F=F.detach(), G=G.detach(), gx=x.grad, gy=y.grad,
                             ga=None if a is None else a.grad, gb=None if b is None else b.grad)
    if world == 2:
        results["bad"] = _bad_inputs(rank, world)
    return results


_run = Worlds(_body)


_REFS: dict = {}


def _reference(name: str) -> dict:
    if name not in _REFS:
        _, p, opts, _, _ = next(c for c in CASES if c[0] == name)
        opts = {k: v for k, v in opts.items() if k != "exchange"}  # the sharded call's option alone
        x, y = p["x"].clone().requires_grad_(), p["y"].clone().requires_grad_()
        if p["a"] is None:
            loss = torch_api.SamplesLoss(**opts)(x, y)
            F, G = torch_api.SamplesLoss(potentials=True, **opts)(x, y)
            a = b = None
        else:
            a, b = p["a"].clone().requires_grad_(), p["b"].clone().requires_grad_()
            loss = torch_api.SamplesLoss(**opts)(a, x, b, y)
            F, G = torch_api.SamplesLoss(potentials=True, **opts)(a, x, b, y)
        loss.backward()
        _REFS[name] = dict(loss=loss.detach(), F=F.detach(), G=G.detach(), gx=x.grad, gy=y.grad,
                           ga=None if a is None else a.grad, gb=None if b is None else b.grad)
    return _REFS[name]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert torch.isfinite(got).all() and torch.isfinite(want).all(), f"{what}: non-finite entries"
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= rtol * max(scale, 1e-30) + 1e-7, f"{what}: max error {err:.3g} at scale {scale:.3g}"


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", [c[0] for c in CASES])
def test_sharded_samples_loss_matches_single_device(world, name, tmp_path_factory):
    ranks = [r[name] for r in _run(world, tmp_path_factory)]
    ref = _reference(name)
    _, p, _, xsz, ysz = next(c for c in CASES if c[0] == name)
    rows = (sizes(xsz, p["x"].shape[0], world), sizes(ysz, p["y"].shape[0], world))
    for r, res in enumerate(ranks):
        assert res["loss"].shape == () and res["loss"].dtype == torch.float32
        _close(res["loss"], ref["loss"], f"loss (rank {r})")
        assert (res["F"].shape[0], res["G"].shape[0]) == (rows[0][r], rows[1][r])
    keys = ("F", "G", "gx", "gy") + (("ga", "gb") if ref["ga"] is not None else ())
    for key in keys:
        _close(torch.cat([r[key] for r in ranks]), ref[key], key)
    assert float(ref["gx"].abs().max()) > 1e-3 and float(ref["gy"].abs().max()) > 1e-3


def test_bad_inputs_raise_on_every_rank(tmp_path_factory):
    bad = [r["bad"] for r in _run(2, tmp_path_factory)]
    for r in bad:
        assert r["multiscale"].startswith("NotImplementedError") and "backend='multiscale'" in r["multiscale"]
        assert r["blur"].startswith("ValueError") and "same blur" in r["blur"]
        assert r["masses"].startswith("ValueError") and "same total mass" in r["masses"]
        assert r["reach_x"].startswith("NotImplementedError") and "reach_x" in r["reach_x"]
        assert r["batched"].startswith("NotImplementedError") and "unbatched" in r["batched"]
        assert r["second_order"].startswith("RuntimeError"), r["second_order"]
        assert torch.isfinite(torch.tensor(r["after_errors"]))
    assert bad[0]["after_errors"] == bad[1]["after_errors"]
    assert bad[1]["local_shape"].startswith("ValueError") and "a must have shape" in bad[1]["local_shape"]
    assert bad[0]["local_shape"].startswith("ValueError") and "rank(s) [1]" in bad[0]["local_shape"]


def test_uninitialized_group_names_the_fix():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group.*torchrun"):
        samples_loss(torch.zeros(3, 2), torch.zeros(4, 2))
    with pytest.raises(NotImplementedError, match="backend='multiscale'"):
        SamplesLoss(backend="multiscale")
