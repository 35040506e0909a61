"""The parity harness (parity/): its rows pass on a tiny case, a perturbed result fails its row
and makes ``python -m parity`` exit 1 with the failure in the JSON, and bad arguments exit 2.

CPU (Triton interpreter) and OTT-JAX's float64 subprocess: ~30 s.
"""

import json
import math

import numpy as np
import pytest

import torch_api  # noqa: F401  (configures the interpreter before jax is imported)

from parity import cli, compare, frontend_torch, quantities, runner, suites, thresholds

TINY = next(c for c in suites.SMALL if c.name == "tiny-d1")


def test_rows_pass_on_a_tiny_case():
    rows = runner.run([TINY], ("torch", "jax"))
    by_id = {r.id: r for r in rows}
    for fe in ("torch", "jax"):
        for q in quantities.GROUPS["solve"] + quantities.GROUPS["grad"]:
            assert f"tiny-d1:{fe}:{q}" in by_id
    for r in rows:
        assert r.passed, (r.id, r.error, r.threshold, r.note)
        assert math.isfinite(r.error) and 0 <= r.error <= r.threshold
        assert r.reference  # where the number came from is always said
    # well-conditioned first-order rows are held to the conditioning-derived float32 bound (a few
    # hundred ulps at most here: an error of 1e-3 still fails), against OTT-JAX float64
    f = by_id["tiny-d1:torch:f"]
    u = thresholds.UNIT_ROUNDOFF_F32
    assert thresholds.FLOOR_ULPS * u <= f.threshold < 1e-4
    assert f.reference.startswith("OTT-JAX")
    assert by_id["tiny-d1:jax:converged"].note.startswith("converged=True")


def test_a_perturbed_potential_fails_its_row_and_the_exit_status(monkeypatch, tmp_path):
    compute = frontend_torch.compute

    def perturbed(case, inp, groups):
        vals, recs = compute(case, inp, groups)
        f = vals["f"]
        vals["f"] = f + 1e-3 * np.linalg.norm(f) / np.sqrt(f.size) * np.linspace(-1.0, 1.0, f.size)
        return vals, recs

    monkeypatch.setattr(frontend_torch, "compute", perturbed)
    status = cli.main(["--only", "tiny-d1:torch:*", "--frontend", "torch", "--out", str(tmp_path)])
    assert status == 1
    (report,) = tmp_path.glob("*.json")
    data = json.loads(report.read_text())
    rows = {r["quantity"]: r for r in data["rows"]}
    assert rows["f"]["passed"] is False and 1e-4 < rows["f"]["error"] < 1e-2
    assert rows["g"]["passed"] is True and rows["g"]["error"] < 1e-5  # only the perturbed row fails
    assert data["device"] == "cpu" and data["suite"] == "small" and "ott-jax" in data["versions"]
    assert data["thresholds"]["base"]["float32"]["second"] == 1e-4
    assert (tmp_path / report.name.replace(".json", ".md")).read_text().count("**NO**") == 1
    assert (tmp_path / report.name.replace(".json", ".png")).stat().st_size > 1000


@pytest.mark.parametrize("argv", [
    ["--max-n", "0"], ["--seed", "-1"], ["--seed", "1.5"], ["--suite", "huge"], ["--only", ""],
    ["--only", "no-such-case"], ["--frontend", "numpy"],
])
def test_bad_arguments_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(argv)
    assert exc.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_out_must_be_a_folder(tmp_path):
    path = tmp_path / "file"
    path.write_text("")
    with pytest.raises(SystemExit) as exc:
        cli.main(["--out", str(path), "--only", "tiny-d1"])
    assert exc.value.code == 2


def test_list_runs_nothing(capsys):
    assert cli.main(["--list", "--only", "*:jax:hvp_y"]) == 0
    out = capsys.readouterr().out
    assert "uniform-d2" in out and "tiny-d1:" not in out


def test_gauge_normalisation_and_metric():
    inp = runner.inputs(TINY)
    f, g = np.array([1.0, 2.0, 4.0, 3.0, 0.5]), np.array([0.3, -1.0, 2.0, 1.0])
    ref = {"f": f, "g": g}
    shifted = {"f": f + 7.0, "g": g - 7.0}  # the same potentials in another gauge
    for name in ("f", "g"):
        q = quantities.BY_NAME[name]
        assert compare.rel_error(compare.normalise(q, shifted, inp), compare.normalise(q, ref, inp)) < 1e-15
    assert compare.rel_error(np.array([1.0, np.nan]), np.array([1.0, 2.0])) == math.inf
    assert compare.rel_error(np.array([-np.inf, 1.0]), np.array([0.0, 1.0])) == math.inf
    assert compare.rel_error(np.array(1.1), np.array(1.0)) == pytest.approx(0.1)


def test_stop_gap_is_the_reference_envelope_to_implicit_distance():
    inp = runner.inputs(TINY)
    n, m = len(inp.a), len(inp.b)
    f, g = np.linspace(-1.0, 1.0, n), np.linspace(2.0, -2.0, m)
    implicit_a = f + 0.1 * np.cos(np.arange(n))  # an implicit gradient that corrects the stopped f
    ref = {"f": f, "g": g, "grad_a": implicit_a, "grad_b": g + 5.0}  # grad_b: g up to a constant
    qa, qb = quantities.BY_NAME["grad_a"], quantities.BY_NAME["grad_b"]
    expected = compare.rel_error(compare.normalise(qa, {"grad_a": f}, inp), compare.normalise(qa, ref, inp))
    assert expected > 1e-2
    assert compare.stop_gap(qa, ref, inp) == pytest.approx(expected)
    assert compare.stop_gap(qb, ref, inp) < 1e-15  # a constant is not a gap (centred)
    assert compare.stop_gap(quantities.BY_NAME["grad_x"], ref, inp) == 0.0
    row = compare.make_row(TINY, inp, "torch", qa, error=0.9 * expected, reference="r", stop_gap=expected)
    assert row.passed and row.threshold == pytest.approx(expected + thresholds.bound(
        "gradient", TINY.precision, inp.max_cost, inp.eps))
    assert not compare.make_row(TINY, inp, "torch", qa, error=1.5 * expected, reference="r", stop_gap=expected).passed
