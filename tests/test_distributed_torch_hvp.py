"""torch_api.distributed.hvp on CPU processes (Gloo, Triton interpreter) against torch_api.hvp.

Each world size spawns its processes once; every worker computes the HVPs below on its shards
(in x and in y, of reg_ot_cost and of the Sinkhorn divergence), runs the bad-input checks that need
several ranks, and saves what it saw. The parent computes the same HVPs on the gathered problems
on one device and compares the gathered rows to float32 rounding.
"""

from __future__ import annotations


import pytest
import torch
import torch.distributed as dist

import torch_api
from gloo_world import Worlds, shard, sizes
from ot_triton_jax.core.sharding import split_sizes
from ot_triton_jax.core.implicit_solve import ImplicitOptions
from torch_api.distributed.hvp import hvp as sharded_hvp

JACOBI = ImplicitOptions(preconditioner="jacobi")  # its one extra pass (P^2 at eps / 2) is sharded too


def _problem(seed: int, n: int, m: int, d: int, zeros: bool) -> dict:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=gen, dtype=torch.float64).float()
    y = (0.8 * torch.randn(m, d, generator=gen, dtype=torch.float64) + 0.4).float()
    vx = torch.randn(n, d, generator=gen, dtype=torch.float64).float()
    vy = torch.randn(m, d, generator=gen, dtype=torch.float64).float()
    p = dict(x=x, y=y, vx=vx, vy=vy, a=None, b=None)
    if zeros:
        a = torch.rand(n, generator=gen, dtype=torch.float64) + 0.2
        b = torch.rand(m, generator=gen, dtype=torch.float64) + 0.2
        a[[0, n // 2]] = 0.0
        b[[1, m - 1]] = 0.0
        p.update(a=(a / a.sum()).float(), b=(b / b.sum()).float())
    return p


# (name, problem, options, x shard sizes per world size, y shard sizes per world size, (loss, wrt, implicit));
# None: array_split. "uniform": n > m; "weighted": n < m (CG on x's side), weights with zeros, rank 0's
# x shard one point of weight zero, a 1-row y shard with 4 ranks
REG, DIV = "reg_ot_cost", "sinkhorn_divergence"
CASES = [
    ("uniform", _problem(0, 23, 17, 2, False), dict(epsilon=2.0, threshold=1e-4, inner_iterations=2), None, None,
     ((REG, "y", None),)),
    ("weighted", _problem(1, 19, 26, 3, True), dict(epsilon=1.0, scale_cost=2.0, threshold=1e-4, inner_iterations=2),
     {2: (1, 18), 4: (1, 7, 5, 6)}, {2: (20, 6), 4: (9, 1, 8, 8)}, ((REG, "x", JACOBI), (DIV, "y", None))),
]


def _error(fn) -> str:
    try:
        fn()
    except Exception as err:  # noqa: BLE001 (the message is what is checked)
        return f"{type(err).__name__}: {err}"
    return "no error"


def _bad_inputs(rank: int, world: int) -> dict:
    p = _problem(3, 10, 8, 2, False)
    sx, sy = split_sizes(10, world), split_sizes(8, world)
    x, y, v = shard(p["x"], sx, rank), shard(p["y"], sy, rank), shard(p["vx"], sx, rank)
    last = rank == world - 1
    out = {"v_shape": _error(lambda: sharded_hvp(x, y, v[:, :1] if last else v, epsilon=0.5, max_iterations=3))}
    loss = "sinkhorn_divergence" if last else "reg_ot_cost"
    out["loss"] = _error(lambda: sharded_hvp(x, y, v, loss=loss, epsilon=0.5, max_iterations=3))
    out["tau"] = _error(lambda: sharded_hvp(x, y, v, epsilon=0.5, tau_a=0.5))
    return out


def _body(rank: int, world: int) -> dict:
    results = {}
    for name, p, opts, xsz, ysz, pairs in CASES:
        sx, sy = sizes(xsz, p["x"].shape[0], world), sizes(ysz, p["y"].shape[0], world)
        x, y = shard(p["x"], sx, rank), shard(p["y"], sy, rank)
        a, b = shard(p["a"], sx, rank), shard(p["b"], sy, rank)
        for loss, wrt, implicit in pairs:
            v = shard(p["vx"], sx, rank) if wrt == "x" else shard(p["vy"], sy, rank)
            h, info = sharded_hvp(x, y, v, wrt=wrt, a=a, b=b, loss=loss, implicit=implicit, **opts)
            results[(name, loss, wrt)] = dict(h=h, info=info)
    if world == 2:
        results["bad"] = _bad_inputs(rank, world)
    return results


_run = Worlds(_body)


_REFS: dict = {}


def _reference(name: str, loss: str, wrt: str):
    key = (name, loss, wrt)
    if key not in _REFS:
        _, p, opts, _, _, pairs = next(c for c in CASES if c[0] == name)
        implicit = next(c[2] for c in pairs if c[:2] == (loss, wrt))
        _REFS[key] = torch_api.hvp(p["x"], p["y"], p["v" + wrt], wrt=wrt, a=p["a"], b=p["b"], loss=loss,
                                   implicit=implicit, **opts)
    return _REFS[key]


def _close(got: torch.Tensor, want: torch.Tensor, what: str, rtol: float = 1e-5) -> None:
    got, want = got.double(), want.double()
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    scale = float(want.abs().max())
    err = float((got - want).abs().max())
    assert err <= rtol * scale, f"{what}: max error {err:.3g} at scale {scale:.3g}"


_KEYS = [(c[0], loss, wrt) for c in CASES for loss, wrt, _ in c[5]]


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name, loss, wrt", _KEYS)
def test_sharded_hvp_matches_single_device(world, name, loss, wrt, tmp_path_factory):
    ranks = [r[(name, loss, wrt)] for r in _run(world, tmp_path_factory)]
    want, ref_info = _reference(name, loss, wrt)
    _, p, _, xsz, ysz, _ = next(c for c in CASES if c[0] == name)
    rows = sizes(xsz, p["x"].shape[0], world) if wrt == "x" else sizes(ysz, p["y"].shape[0], world)
    assert [tuple(r["h"].shape) for r in ranks] == [(s, p["x"].shape[1]) for s in rows]
    assert all(r["h"].dtype == torch.float32 for r in ranks)
    _close(torch.cat([r["h"] for r in ranks]), want, f"hvp {name} {loss} in {wrt}")
    for r in ranks:  # the record is global: equal on every rank
        info = r["info"]
        assert bool(info.cg_converged) and bool(info.solve_converged)
        assert int(info.cg_iterations) == int(ranks[0]["info"].cg_iterations)
        assert abs(int(info.cg_iterations) - int(ref_info.cg_iterations)) <= 1
    assert float(want.abs().max()) > 0


def test_bad_inputs_raise_on_every_rank(tmp_path_factory):
    bad = [r["bad"] for r in _run(2, tmp_path_factory)]
    assert bad[1]["v_shape"].startswith("ValueError") and "v must have the shape of x" in bad[1]["v_shape"]
    assert bad[0]["v_shape"].startswith("ValueError") and "rank(s) [1]" in bad[0]["v_shape"]
    for r in bad:
        assert r["loss"].startswith("ValueError") and "same loss" in r["loss"]
        assert r["tau"].startswith("NotImplementedError") and "tau_a=0.5" in r["tau"]


def test_uninitialized_group_names_the_fix():
    assert not dist.is_initialized()
    with pytest.raises(RuntimeError, match="init_process_group.*torchrun"):
        sharded_hvp(torch.zeros(3, 2), torch.zeros(4, 2), torch.zeros(3, 2), epsilon=0.1)
