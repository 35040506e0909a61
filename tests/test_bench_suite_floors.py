"""The benchmark suite's shared helpers on the CPU: the floor arithmetic (real numbers), the float64
gate of a row, the plots from a JSON alone, the peers' autotuning cache, and the --dry-run CLI."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
PEERS = ("jax", "ott", "geomloss", "flash_sinkhorn")
_before = {p for p in PEERS if p in sys.modules}
from bench import floors, harness  # noqa: E402
from bench.areas import AREAS  # noqa: E402
from bench.areas import sinkhorn as sinkhorn_area  # noqa: E402

IMPORTED = {p for p in PEERS if p in sys.modules} - _before
N = 65536
PAIRS = N * N


def test_import_loads_no_peer():
    assert IMPORTED == set()


def test_float32_d64_is_tensor_core_bound(monkeypatch):
    """d = 64 runs three FP16 products (launch_plans.fp16_operands) at the FP16 rate; with TF32
    parts (the floors follow the product's rule) three TF32 products."""
    from ot_triton_jax.core import launch_plans
    ms, unit = floors.floor_ms("sinkhorn_10it", N, N, 64, "float32", 1)
    assert unit == "tensor"
    assert ms == pytest.approx(3 * 2 * PAIRS * 64 / 686e12 * 1e3, rel=1e-12)
    assert ms == pytest.approx(2.40, abs=0.01)
    monkeypatch.setattr(launch_plans, "FP16_MIN_D", 10 ** 9)
    tensor64 = floors.half_step_seconds(N, N, 64, "float32")["tensor"]
    assert tensor64 == pytest.approx(3 * 2 * PAIRS * 64 / 369e12, rel=1e-12)


def test_d3_is_exp_bound():
    for precision in ("float32", "tf32"):
        ms, unit = floors.floor_ms("sinkhorn_10it", N, N, 3, precision, 1)
        assert unit == "exp2"
        assert ms == pytest.approx(PAIRS / 4.17e12 * 1e3, rel=1e-12)
        assert ms == pytest.approx(1.03, abs=0.005)


def test_tf32_is_max_of_exp_and_one_product():
    for d in (12, 16, 64, 256):
        ms, unit = floors.floor_ms("sinkhorn_10it", N, N, d, "tf32", 1)
        exp_ms, product_ms = PAIRS / 4.17e12 * 1e3, 2 * PAIRS * d / 686e12 * 1e3
        assert ms == pytest.approx(max(exp_ms, product_ms), rel=1e-12)
        assert unit == ("tensor" if product_ms > exp_ms else "exp2")
    # one FP16 product at d = 64 (0.80 ms) hides under the exponentials
    assert floors.floor_ms("sinkhorn_10it", N, N, 64, "tf32", 1) == (pytest.approx(1.03, abs=0.01), "exp2")


def test_half_steps_multiply():
    one, unit = floors.floor_ms("jax_sinkhorn_100it", 8192, 8192, 64, "float32", 1)
    many, unit_many = floors.floor_ms("jax_sinkhorn_100it", 8192, 8192, 64, "float32", floors.sinkhorn_half_steps(100))
    assert many == pytest.approx(201 * one, rel=1e-12) and unit == unit_many == "tensor"
    # the 10-iteration solve with OTT's final marginal check: 21 half-steps
    assert floors.floor_ms("sinkhorn_10it", N, N, 64, "float32", 21)[0] == pytest.approx(50.49, abs=0.01)


def test_fma_and_memory_never_bound_these_shapes():
    terms = floors.half_step_seconds(N, N, 3, "tf32")
    assert terms["fp32_fma"] == pytest.approx(PAIRS / 32.6e12)
    assert terms["hbm"] == pytest.approx(2 * N * 5 * 4 / 3.03e12)
    assert max(terms, key=terms.get) == "exp2"


def test_samples_loss_half_steps_follow_the_schedule():
    from ot_triton_jax.core.schedules import epsilon_schedule

    assert len(epsilon_schedule(2, 9.0, 0.05, 0.5)) == 10
    assert floors.samples_loss_half_steps(9.0, 0.05, 0.5) == 4 * (10 + 2) + 2
    assert floors.samples_loss_half_steps(0.5, 0.1, 0.5) < floors.samples_loss_half_steps(9.0, 0.1, 0.5)


def test_mhc_floor_is_memory():
    assert floors.mhc_floor_bytes(4, "fwd_bwd") == 320 and floors.mhc_floor_bytes(4, "fwd") == 128
    assert floors.mhc_floor_ms(1 << 20, 4, "fwd_bwd") == pytest.approx((1 << 20) * 320 / 3.03e12 * 1e3, rel=1e-12)


def test_floor_rejects_unknown_workloads_and_unequal_samples_loss():
    with pytest.raises(ValueError):
        floors.floor_ms("nope", 8, 8, 3, "float32", 1)
    with pytest.raises(ValueError):
        floors.floor_ms("samples_loss_grad", 8, 16, 3, "float32", 1)


def test_gate_never_passes_nan_or_missing_errors():
    assert harness.gate(1e-6, 1e-4) and not harness.gate(2e-4, 1e-4)
    assert not harness.gate(float("nan"), 1e-4) and not harness.gate(float("inf"), 1e-4)
    assert not harness.gate(None, 1e-4)
    ok = harness.row("w", "l", {}, "ours", "c", {"ms": 1.0, "error": 1e-6}, tolerance=1e-4, error_of="e", ours=True)
    nan = harness.row("w", "l", {}, "peer", "c", {"ms": 0.5, "error": float("nan")}, tolerance=1e-4, error_of="e",
                      compare_to="ours")
    slow = harness.row("w", "l", {}, "peer2", "c", {"ms": 4.0, "error": 2e-6}, tolerance=1e-4, error_of="e",
                       compare_to="ours")
    rows = harness.add_speedups([ok, nan, slow])
    assert ok["passed"] and not nan["passed"] and "float64 gate" in nan["failure"]
    assert nan["speedup"] is None and slow["speedup"] == pytest.approx(4.0)


def test_sinkhorn_rows_carry_floors_and_the_default_call():
    rows = sinkhorn_area.plan(quick=False)
    assert {r["workload"] for r in rows} == {"sinkhorn_10it"}
    big = [r for r in rows if r["sizes"]["n"] > 8192]
    assert len(big) == 12 and not any(r["method"].startswith("ott") for r in big)
    default = [r for r in rows if r["default"]]
    assert len(default) == 5 and all(r["method"] == "ours" and "precision" not in r["call"] for r in default)
    r = next(r for r in rows if r["label"] == "n=65536 d=64" and r["method"] == "ours")
    assert r["floor_ms"] == pytest.approx(50.49, abs=0.01) and r["floor_unit"] == "tensor"


def test_plot_from_a_json_alone(tmp_path):
    from bench.plot import plot_file
    rows = [harness.row("w", f"n={n}", {"n": n}, m, "c", {"ms": ms, "error": 1e-6}, tolerance=1e-4, error_of="e",
                        ours=m == "ours", compare_to=None if m == "ours" else "ours")
            for n in (8, 16) for m, ms in (("ours", 1.0), ("peer", 3.0))]
    rows.append(harness.row("w", "n=8", {"n": 8}, "broken", "c", {"ms": 1.0, "error": float("nan")}, tolerance=1e-4,
                            error_of="e", compare_to="ours"))
    path = tmp_path / "dev.json"
    path.write_text(json.dumps(harness.payload("w", "doc", rows, {"device": "cpu"})))
    out = plot_file(str(path))
    assert out == str(tmp_path / "dev.png") and os.path.getsize(out) > 0


def test_autotune_cache_restores_and_keeps_peer_results(tmp_path, monkeypatch):
    """The peers' Triton autotuning results travel with the repository (bench/peer_autotune_cache):
    restored into Triton's cache before a run (existing files kept), new ones copied back after it."""
    import triton

    kept, cache = tmp_path / "kept", tmp_path / "cache"
    (kept / "KEYA").mkdir(parents=True)
    (kept / "KEYA" / "k.autotune.json").write_text('{"configs_timings": []}')
    (cache / "KEYB").mkdir(parents=True)
    (cache / "KEYB" / "k.autotune.json").write_text('{"configs_timings": [1]}')
    (cache / "KEYB" / "k.cubin").write_bytes(b"\0")  # compiled kernels are not kept
    monkeypatch.setattr(harness, "AUTOTUNE_DIR", str(kept))
    monkeypatch.setattr(triton.knobs.cache, "dir", str(cache))
    assert harness.autotune_cache(restore=True) == 1
    assert (cache / "KEYA" / "k.autotune.json").read_text() == '{"configs_timings": []}'
    assert harness.autotune_cache(restore=True) == 0  # nothing new to restore
    assert harness.autotune_cache(restore=False) == 1
    assert (kept / "KEYB" / "k.autotune.json").exists() and not (kept / "KEYB" / "k.cubin").exists()
    assert os.environ.get("TRITON_CACHE_AUTOTUNING") == "1"
    assert os.path.isdir(os.path.join(ROOT, "bench", "peer_autotune_cache"))


def test_dry_run_cli_imports_no_peer():
    # -X importtime lists every module the run imports: none of the peers may be among them
    out = subprocess.run([sys.executable, "-X", "importtime", os.path.join(ROOT, "bench", "suite.py"), "--dry-run"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert all(f"== {area}:" in out.stdout for area in AREAS)
    big = [line.split() for line in out.stdout.splitlines() if line.startswith("sinkhorn_10it")
           and "n=65536 d=64" in line and " ours " in line]
    assert big and float(big[0][-1]) == pytest.approx(50.49, abs=0.01)
    imported = {line.split("|")[-1].strip().split(".")[0] for line in out.stderr.splitlines() if "|" in line}
    assert "torch" in imported and not imported & set(PEERS)


def test_only_selects_workloads_and_merge_keeps_the_others(tmp_path):
    """``--only`` runs the workloads whose label contains one of its strings (others are neither run
    nor listed as skipped); ``--merge`` keeps the previous JSON's rows and skip notes of the others."""
    path = tmp_path / "area.json"
    path.write_text(json.dumps({"rows": [{"workload": "w", "label": "B=1 d=3", "ms": 1.0},
                                         {"workload": "w", "label": "B=1 d=64", "ms": 2.0}],
                                "skipped": ["w B=2 d=64: time budget", "w B=2 d=3: time budget"]}))
    budget = harness.Budget(10.0, ["d=64"])
    assert budget.selected("w B=1 d=64") and not budget.selected("w B=1 d=3")
    assert not budget.fits("w B=1 d=3", 1.0) and budget.fits("w B=1 d=64", 1.0) and budget.skipped == []
    rows, skips = harness.previous_rows(str(path), budget)
    assert [r["label"] for r in rows] == ["B=1 d=3"] and skips == ["w B=2 d=3: time budget"]
    assert harness.previous_rows(str(tmp_path / "absent.json"), budget) == ([], [])
    assert harness.Budget(10.0).selected("anything")
