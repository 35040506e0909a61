"""bench/suite.py on the CPU: its floor model (real numbers), its plan, its plots, and the --dry-run CLI."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")
sys.path.insert(0, BENCH)  # as the bench scripts do, for `common`

PEERS = ("jax", "ott", "geomloss", "flash_sinkhorn")


def _load_suite():
    """A fresh copy of bench/suite.py, and the peers it imported that were not loaded before."""
    before = {p for p in PEERS if p in sys.modules}
    spec = importlib.util.spec_from_file_location("bench_suite_under_test", os.path.join(BENCH, "suite.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module, {p for p in PEERS if p in sys.modules} - before


suite, IMPORTED = _load_suite()
N = 65536
PAIRS = N * N


def test_import_loads_no_peer():
    assert IMPORTED == set()


def test_float32_d64_is_tensor_core_bound(monkeypatch):
    """d = 64 runs three FP16 products (launch_plans.fp16_operands) at the FP16 rate; with TF32
    parts (the floors follow the product's rule) three TF32 products."""
    from ot_triton_jax.core import launch_plans
    ms, unit = suite.floor_ms("sinkhorn_10it", N, N, 64, "float32", 1)
    assert unit == "tensor"
    assert ms == pytest.approx(3 * 2 * PAIRS * 64 / 686e12 * 1e3, rel=1e-12)
    assert ms == pytest.approx(2.40, abs=0.01)
    monkeypatch.setattr(launch_plans, "FP16_MIN_D", 10 ** 9)
    tensor64 = suite.half_step_seconds(N, N, 64, "float32")["tensor"]
    assert tensor64 == pytest.approx(3 * 2 * PAIRS * 64 / 369e12, rel=1e-12)


def test_d3_is_exp_bound():
    for precision in ("float32", "tf32"):
        ms, unit = suite.floor_ms("sinkhorn_10it", N, N, 3, precision, 1)
        assert unit == "exp2"
        assert ms == pytest.approx(PAIRS / 4.17e12 * 1e3, rel=1e-12)
        assert ms == pytest.approx(1.03, abs=0.005)


def test_tf32_is_max_of_exp_and_one_product():
    for d in (12, 16, 64, 256):
        ms, unit = suite.floor_ms("sinkhorn_10it", N, N, d, "tf32", 1)
        exp_ms, product_ms = PAIRS / 4.17e12 * 1e3, 2 * PAIRS * d / 686e12 * 1e3
        assert ms == pytest.approx(max(exp_ms, product_ms), rel=1e-12)
        assert unit == ("tensor" if product_ms > exp_ms else "exp2")
    # one FP16 product at d = 64 (0.80 ms) hides under the exponentials
    assert suite.floor_ms("sinkhorn_10it", N, N, 64, "tf32", 1) == (pytest.approx(1.03, abs=0.01), "exp2")


def test_half_steps_multiply():
    one, unit = suite.floor_ms("jax_sinkhorn_100it", 8192, 8192, 64, "float32", 1)
    many, unit_many = suite.floor_ms("jax_sinkhorn_100it", 8192, 8192, 64, "float32", 201)
    assert many == pytest.approx(201 * one, rel=1e-12) and unit == unit_many == "tensor"
    # the 10-iteration solve with OTT's final marginal check: 21 half-steps
    assert suite.floor_ms("sinkhorn_10it", N, N, 64, "float32", 21)[0] == pytest.approx(50.49, abs=0.01)


def test_fma_and_memory_never_bound_these_shapes():
    terms = suite.half_step_seconds(N, N, 3, "tf32")
    assert terms["fp32_fma"] == pytest.approx(PAIRS / 32.6e12)
    assert terms["hbm"] == pytest.approx(2 * N * 5 * 4 / 3.03e12)
    assert max(terms, key=terms.get) == "exp2"


def test_samples_loss_half_steps_follow_the_schedule():
    from ot_triton_jax.core.schedules import epsilon_schedule

    assert len(epsilon_schedule(2, 9.0, 0.05, 0.5)) == 10
    assert suite.samples_loss_half_steps(9.0, 0.05, 0.5) == 4 * (10 + 2) + 2
    assert suite.samples_loss_half_steps(0.5, 0.1, 0.5) < suite.samples_loss_half_steps(9.0, 0.1, 0.5)


def test_floor_rejects_unknown_workloads_and_unequal_samples_loss():
    with pytest.raises(ValueError):
        suite.floor_ms("nope", 8, 8, 3, "float32", 1)
    with pytest.raises(ValueError):
        suite.floor_ms("samples_loss_grad", 8, 16, 3, "float32", 1)


def test_plan_rows_fields_and_peers():
    required = {"workload", "n", "m", "d", "precision", "ours_ms", "peer", "peer_ms", "peer_error", "speedup",
                "floor_ms", "floor_unit", "fraction_of_floor", "error", "peer_error_vs_f64", "default_call"}
    rows = [r for it in suite.PLAN for r in suite.plan_rows(it)]
    assert all(required <= set(r) for r in rows)
    big = [r for r in rows if r["workload"] == "sinkhorn_10it" and r["n"] > 8192]
    assert len(big) == 6 and not any(r["peer"].startswith(("ott", "geomloss")) for r in big)
    geom = [r for r in rows if r["workload"] == "sinkhorn_10it" and r["peer"] == "geomloss_tensorized"]
    assert geom and all(r["peer_ms"] is None and "no fixed-iteration" in r["note"] for r in geom)
    assert {r["half_steps"] for r in rows if r["workload"] == "sinkhorn_10it"} == {21}
    default = [r["default_call"] for r in rows if r["workload"] == "sinkhorn_10it" and r["precision"] == "float32"]
    assert default and all("precision" not in c for c in default)  # the default path is what is measured


def test_plot_survives_missing_rows(tmp_path):
    rows = suite.plan_rows(suite.PLAN[0]) + suite.plan_rows(suite.PLAN[1])
    rows[0] = dict(rows[0], ours_ms=2.0, peer_ms=4.0)
    paths = suite.plot(rows, str(tmp_path / "s"))
    assert sorted(os.path.basename(p) for p in paths) == ["s_sinkhorn_d3.png", "s_sinkhorn_d64.png"]
    assert all(os.path.getsize(p) > 0 for p in paths)
    assert suite.plot([], str(tmp_path / "empty")) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA exit")
def test_without_cuda_exits_2(capsys):
    assert suite.main([]) == 2
    assert "no CUDA device" in capsys.readouterr().err


def test_dry_run_cli():
    # -X importtime lists every module the run imports: none of the peers may be among them
    out = subprocess.run([sys.executable, "-X", "importtime", os.path.join(BENCH, "suite.py"), "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split() for line in out.stdout.splitlines() if line.split()[:1] and line.split()[0] in suite.WORKLOADS]
    assert len(rows) == sum(len(suite.plan_rows(it)) for it in suite.PLAN) >= 20
    big = [r for r in rows if r[:5] == ["sinkhorn_10it", "65536", "64", "float32", "flash_sinkhorn_fp32"]]
    assert big and float(big[0][6]) == pytest.approx(50.49, abs=0.01) and big[0][7] == "tensor"
    imported = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert "torch" in imported and not imported & set(PEERS)
    assert not os.path.exists(os.path.join(BENCH, "results", "suite_cpu.json"))


def test_autotune_cache_restores_and_keeps_peer_results(tmp_path, monkeypatch):
    """The peers' Triton autotuning results travel with the repository (bench/results/flash_autotune):
    restored into Triton's cache before a run (existing files kept), new ones copied back after it."""
    import triton

    kept, cache = tmp_path / "kept", tmp_path / "cache"
    (kept / "KEYA").mkdir(parents=True)
    (kept / "KEYA" / "k.autotune.json").write_text('{"configs_timings": []}')
    (cache / "KEYB").mkdir(parents=True)
    (cache / "KEYB" / "k.autotune.json").write_text('{"configs_timings": [1]}')
    (cache / "KEYB" / "k.cubin").write_bytes(b"\0")  # compiled kernels are not kept
    monkeypatch.setattr(suite, "AUTOTUNE_DIR", str(kept))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(cache))
    assert suite.autotune_cache(restore=True) == 1
    assert (cache / "KEYA" / "k.autotune.json").read_text() == '{"configs_timings": []}'
    assert suite.autotune_cache(restore=True) == 0  # nothing new to restore
    assert suite.autotune_cache(restore=False) == 1
    assert (kept / "KEYB" / "k.autotune.json").exists() and not (kept / "KEYB" / "k.cubin").exists()
    assert os.environ.get("TRITON_CACHE_AUTOTUNING") == "1"
