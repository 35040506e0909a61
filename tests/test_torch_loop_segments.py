"""The alternating loop's segments (torch_api.sinkhorn_loops.segments) against the loop
they replace: iteration by iteration, the same updates (unfolded first, plain, measuring)
and the same host reads, for every kind of loop options."""

import itertools

import pytest

from ot_triton_jax.core.options import LoopOptions
from torch_api.sinkhorn_loops import segments, symmetric_segments


def per_iteration(opts):
    """The loop as written before segments: iteration it's g-update measures the state after
    it - 1 when opts.measured(it - 1); a last measurement follows max_iterations when the last
    iteration was measured (it always is)."""
    kinds, pending = [], False
    for it in range(opts.max_iterations):
        kinds.append("meas" if pending else "first" if it == 0 else "plain")
        pending = opts.measured(it)
    return kinds, pending


def from_segments(opts):
    kinds, stops, reads = [], [], 0
    for start, stop, end in segments(opts):
        assert start == len(kinds), "segments must be contiguous"
        for it in range(start, stop):
            meas = end == "meas" and it == stop - 1
            kinds.append("meas" if meas else "first" if it == 0 else "plain")
        stops.append(end)
        reads += 1
    assert stops[-1] == "final" and "final" not in stops[:-1]
    return kinds, stops[-1] == "final", reads


@pytest.mark.parametrize("inner,lo,hi", [c for c in itertools.product((1, 2, 3, 10), (0, 1, 7, 25), (1, 2, 9, 10, 11, 30, 57))
                                          if c[1] <= c[2]])
def test_segments_replay_the_per_iteration_loop(inner, lo, hi):
    opts = LoopOptions("float32", inner, lo, hi)
    old, final = per_iteration(opts)
    new, new_final, reads = from_segments(opts)
    assert new == old and new_final == final
    assert reads == sum(k == "meas" for k in old) + 1  # one host read per measurement


def test_default_options_use_three_segment_kinds():
    """Default blocks: a first segment (iterations 0-10), the repeated block, and the last nine
    iterations with the final measurement."""
    opts = LoopOptions("float32", 10, 0, 2000)
    kinds = {(s == 0, t - s, e) for s, t, e in segments(opts)}
    assert kinds == {(True, 11, "meas"), (False, 10, "meas"), (False, 9, "final")}


@pytest.mark.parametrize("inner,lo,hi", [(1, 0, 5), (10, 0, 2000), (10, 25, 57), (3, 7, 11), (10, 10, 10)])
def test_symmetric_segments_end_at_each_measured_iteration(inner, lo, hi):
    opts = LoopOptions("float32", inner, lo, hi)
    segs = list(symmetric_segments(opts))
    assert segs[0][0] == 0 and segs[-1][1] == hi
    assert all(s1[1] == s2[0] for s1, s2 in zip(segs, segs[1:]))
    assert [stop - 1 for _, stop in segs] == [it for it in range(hi) if opts.measured(it)]


@pytest.mark.parametrize("last", [None, 2.5e-3, 7e-2, float("nan")])
def test_loop_record_follows_otts_rule(last):
    """loop_record: from the host's record, or with the last block's error still a device tensor
    (a loop that ran to max_iterations without reading it): errors float32 with that error in
    place, n_iters int32, converged = no NaN and errors[-1] < threshold, as the host computes it."""
    import math

    import torch

    from torch_api.sinkhorn_loops import converged, f32, loop_record

    thr = f32(1e-2)
    host = [math.inf, 3.0e-2, math.inf, -1.0 if last is not None else 4e-3]
    dev = None if last is None else torch.tensor(last, dtype=torch.float64)
    errors, n_iters, conv = loop_record(host, 37, thr, torch.device("cpu"), last=dev)
    want = list(host)
    if last is not None:
        want[-1] = f32(last)
    assert errors.dtype == torch.float32 and n_iters.dtype == torch.int32 and conv.dtype == torch.bool
    assert errors.shape == (4,) and n_iters.shape == () and conv.shape == ()
    torch.testing.assert_close(errors, torch.tensor(want, dtype=torch.float32), rtol=0, atol=0, equal_nan=True)
    assert int(n_iters) == 37
    assert bool(conv) == converged(want, thr)
