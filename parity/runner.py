"""Run cases: our frontends, the references (in a background thread), and the rows.

The reference of case k+1 (OTT-JAX's subprocess, or the GeomLoss / dense fallback) is computed
while our frontends run case k, so the second CPU core is used. A frontend's exception fails
its rows (the exception is in the note) instead of stopping the suite.
"""

from __future__ import annotations

import concurrent.futures as futures
import fnmatch
import importlib
import math
import re
import traceback
from typing import Callable, Iterable

import numpy as np
import torch

from . import references
from .cases import Case, Inputs, inputs
from .compare import Row, cancellation, make_row, normalise, rel_error, row_id, stop_gap
from .quantities import GROUPS, OTT_KEYS, OTT_NAME, QUANTITIES
from .solve_settings import SolveRecord
from .thresholds import OTT_THRESHOLD, reference_threshold

FRONTENDS: dict[str, str] = {"torch": "parity.frontend_torch", "jax": "parity.frontend_jax"}
SHARED_SOLVE = ("grad", "hvp", "pot_vjp", "hvp_default")  # groups whose values come from the "solve" group's solve
DENSE_MAX_POINTS = 512  # the dense fallback builds (n + m)^2 matrices and their pseudo-inverse


def matches(name: str, pattern: str | None) -> bool:
    """``--only`` semantics: substring, or fnmatch pattern (``*``, ``?``, ``[...]``)."""
    return pattern is None or pattern in name or fnmatch.fnmatchcase(name, pattern)


Plan = list[tuple[Case, tuple[str, ...], tuple[str, ...]]]


def plan(cases: Iterable[Case], frontends: tuple[str, ...], only: str | None) -> Plan:
    """(case, groups, frontends) to run: all of a matching case, else the groups / frontends
    with at least one matching row id ``case:frontend:quantity``."""
    out = []
    for case in cases:
        offered = tuple(fe for fe in frontends if fe in case.frontends)
        if not offered:
            continue
        if matches(case.name, only):
            out.append((case, case.groups, offered))
            continue
        groups = tuple(g for g in case.groups if any(matches(row_id(case.name, fe, q), only)
                                                      for fe in offered for q in GROUPS[g]))
        fes = tuple(fe for fe in offered if any(matches(row_id(case.name, fe, q), only)
                                                for g in groups for q in GROUPS[g]))
        if groups and fes:
            out.append((case, groups, fes))
    return out


class Reference:
    """The reference values of one case and, per quantity, the label of where they came from."""

    def __init__(self) -> None:
        self.values: dict[str, np.ndarray] = {}
        self.label: dict[str, str] = {}
        self.note = ""
        self.ott_iters: int | None = None


def _ott_failure(exc: Exception) -> tuple[str, str | None]:
    """A short reason, and the group of the quantity OTT-JAX returned as non-finite (if any)."""
    text = str(exc)
    key = re.search(r"non-finite OTT reference value for '(\w+)'", text)
    conv = re.search(r"(OTT[^\n]*did not converge[^\n]*|OTT sinkhorn_divergence: [^\n]*)", text)
    if key:
        name = OTT_NAME.get(key.group(1), key.group(1))
        group = next((g for g, keys in OTT_KEYS.items() if key.group(1) in keys or name in GROUPS[g]
                      or key.group(1).rsplit("_", 1)[0] in keys), None)
        return f"OTT-JAX returned NaN for {key.group(1)}", group
    if conv:
        return conv.group(1)[:160], None
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return (lines[-1][:160] if lines else type(exc).__name__), None


_REFERENCES: dict[tuple[Case, int, tuple[str, ...]], Reference] = {}


def reference(case: Case, seed: int, groups: tuple[str, ...]) -> Reference:
    """OTT-JAX float64 (else dense float64, with the reason in the note) and GeomLoss.

    When OTT-JAX returns NaN for one group's quantity, OTT is asked once more without that
    group, and only that group falls back to the dense reference. Cached in this process: the
    inputs are a function of (case, seed)."""
    key = (case, seed, groups)
    if key not in _REFERENCES:
        _REFERENCES[key] = _reference(case, inputs(case, seed), groups)
    return _REFERENCES[key]


def _reference(case: Case, inp: Inputs, groups: tuple[str, ...]) -> Reference:
    ref = Reference()
    todo = tuple(g for g in groups if g in OTT_KEYS)
    dense_groups: tuple[str, ...] = ()
    for attempt in range(2):
        if not todo:
            break
        try:
            vals = references.ott(case, inp, todo, on_gpu=torch.cuda.is_available(),
                                  threshold=reference_threshold(inp.max_cost, inp.eps, case.precision))
        except Exception as exc:  # noqa: BLE001  (any failure of OTT: fall back, say so)
            reason, group = _ott_failure(exc)
            ref.note += f"OTT-JAX failed: {reason}; "
            if group is None or attempt == 1:
                dense_groups += todo
                todo = ()
            else:
                dense_groups += (group,)
                todo = tuple(g for g in todo if g != group)
            continue
        ref.values.update(vals)
        ref.ott_iters = int(vals["n_iters"]) if "n_iters" in vals else None
        for g in todo:
            ref.label.update(dict.fromkeys(GROUPS[g], references.OTT_LABEL))
        break
    if dense_groups:
        if not case.balanced:
            ref.note += "no dense fallback for a relaxed problem; "
        elif case.n + case.m <= DENSE_MAX_POINTS:
            ref.values.update(references.dense(inp, dense_groups))
            for g in dense_groups:
                ref.label.update(dict.fromkeys(GROUPS[g], references.DENSE_LABEL))
        else:
            ref.note += "too large for the dense fallback; "
    if "hvp_default" in groups:  # the dense float64 implicit reference (OTT-JAX has no default-CG twin)
        ref.values.update(references.dense(inp, ("hvp_default",)))
        ref.label.update(dict.fromkeys(GROUPS["hvp_default"], references.DENSE_LABEL))
    if "samples_loss" in groups:
        ref.values.update(references.geomloss(case, inp))
        ref.label.update(dict.fromkeys(GROUPS["samples_loss"], references.GEOMLOSS_LABEL))
    return ref


def _ours(module: str, case: Case, inp: Inputs, groups: tuple[str, ...]):
    """Values and solve records of one frontend; a failing call is retried group by group so
    that one exception fails only its own group's rows. Returns (vals, recs, {group: error})."""
    compute = importlib.import_module(module).compute
    try:
        vals, recs = compute(case, inp, groups)
        return vals, recs, {}
    except Exception:  # noqa: BLE001
        if len(groups) == 1:
            return {}, {}, {groups[0]: traceback.format_exc(limit=1).strip().splitlines()[-1][:300]}
    vals, recs, errs = {}, {}, {}
    for g in groups:
        v, r, e = _ours(module, case, inp, (g,))
        vals.update(v), recs.update(r), errs.update(e)
    return vals, recs, errs


def _iters(rec: SolveRecord) -> str:
    return f"n_iters {rec.n_iters}, last error {rec.last_error:.2e}"


def case_rows(case: Case, inp: Inputs, frontend: str, groups: tuple[str, ...], vals: dict[str, np.ndarray],
              recs: dict[str, SolveRecord], errors: dict[str, str], ref: Reference) -> list[Row]:
    """The rows of one frontend on one case (see :mod:`parity.quantities`)."""
    rows = []
    for q in QUANTITIES:
        if q.group not in groups:
            continue
        rec = recs.get(q.group, recs.get("solve") if q.group in SHARED_SOLVE else None)
        label = ref.label.get(q.name, references.MARGINAL_LABEL if q.group == "stop" else "")
        if q.group in errors:
            rows.append(make_row(case, inp, frontend, q, math.inf, label, f"raised: {errors[q.group]}", passed=False))
            continue
        if q.kind == "converged":
            ott = f"; OTT-JAX float64 n_iters {ref.ott_iters}" if ref.ott_iters is not None else ""
            rows.append(make_row(case, inp, frontend, q, rec.last_error, "solver's own flag",
                                 f"converged={rec.converged}, {_iters(rec)}{ott}", passed=rec.converged))
            continue
        if q.kind == "stop":
            true = references.marginal_error(inp, vals["stop_f"], vals["stop_g"])
            err = abs(rec.last_error - true) / true if true > 0 else math.inf
            note = (f"reported {rec.last_error:.3e} vs float64 {true:.3e}; converged={rec.converged}, "
                    f"n_iters {rec.n_iters}")
            rows.append(make_row(case, inp, frontend, q, err, label, note))
            continue
        refvals = {OTT_NAME.get(k, k): v for k, v in ref.values.items()}
        if q.name not in refvals:
            rows.append(make_row(case, inp, frontend, q, math.inf, label or "none", ref.note + "no reference value",
                                 passed=False))
            continue
        err = rel_error(normalise(q, vals, inp), normalise(q, refvals, inp))
        cancel = cancellation(q, vals, refvals, inp)
        note = ref.note if label == references.DENSE_LABEL else ""
        passed = None
        if rec is not None and not rec.converged:
            note += f"our solve did not converge ({_iters(rec)}); "
            passed = False
        if cancel > 1.0 + 1e-9:
            note += f"; cancellation factor {cancel:.3g}"
        stopped_early = reference_threshold(inp.max_cost, inp.eps, case.precision) > OTT_THRESHOLD
        gap = stop_gap(q, refvals, inp) if label == references.OTT_LABEL and stopped_early else 0.0
        if gap > 0.0:
            note += f"; stop gap {gap:.3g} (OTT's implicit gradient vs its own f, g at the raised threshold)"
        rows.append(make_row(case, inp, frontend, q, err, label, note.strip("; "), passed=passed, cancel=cancel,
                             stop_gap=gap))
    return rows


def run(cases: Iterable[Case], frontends: tuple[str, ...] = ("torch", "jax"), only: str | None = None,
        seed: int = 0, progress: Callable[[str, bool], None] | None = None,
        rows: list[Row] | None = None) -> list[Row]:
    """Run the planned cases; ``progress(label, done)`` is called before (done=False) and after
    (done=True) each (case, frontend) step. Rows are appended to ``rows`` (a new list when None)
    case by case, so an interrupted run still has the finished cases' rows."""
    todo = plan(cases, frontends, only)
    rows = [] if rows is None else rows
    with futures.ThreadPoolExecutor(max_workers=1) as pool:
        drawn = [(case, groups, fes, inputs(case, seed)) for case, groups, fes in todo]
        pending = [pool.submit(reference, case, seed, groups) for case, groups, _, _ in drawn]
        for (case, groups, fes, inp), fut in zip(drawn, pending):
            ours = {}
            for fe in fes:
                if progress:
                    progress(f"{case.name}:{fe}", False)
                ours[fe] = _ours(FRONTENDS[fe], case, inp, groups)
                if progress:
                    progress(f"{case.name}:{fe}", True)
            ref = fut.result()
            for fe in fes:
                new = case_rows(case, inp, fe, groups, *ours[fe], ref)
                rows.extend(r for r in new if matches(case.name, only) or matches(r.id, only))
    return rows

