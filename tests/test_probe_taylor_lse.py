"""bench/probe_taylor_lse.py's kernels (the Taylor-expanded block-sparse LSE pass, bench/NOTES.md 93)
against float64 on small problems: the probe's speed figures stand on these being right."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
import probe_taylor_lse as probe  # noqa: E402


@pytest.mark.parametrize("side, p", [(0.06, None), (0.04, None), (0.06, 3)])
def test_taylor_lse_matches_float64_within_its_truncation_bound(side, p):
    row = probe.small_problem_error(side=side, p=p)
    assert row["finite"]
    assert row["pairs"] > 100
    # the expansion's relative error per pair is at most trunc_bound, so the potential's (in eps units)
    # is at most log(1 + trunc_bound); float32 rounding adds ~1e-6
    assert row["max_err_over_eps"] <= row["trunc_bound"] * 1.01 + 4e-6, row
    if p == 3:  # a low order must show its truncation, or the test could not see a wrong expansion
        assert row["max_err_over_eps"] > 1e-5, row


def test_order_for_meets_the_target():
    for t in (0.1, 0.55, 0.93, 2.0):
        p = probe.order_for(t)
        bound = lambda q: t ** (q + 1) / probe.math.factorial(q + 1) * probe.math.exp(t)  # noqa: E731
        assert bound(p) <= 2.0 ** -24 and (p == 0 or bound(p - 1) > 2.0 ** -24)
