"""The sweeps on the clusters of the multiscale solve (torch; d <= 3): GeomLoss's annealing on the
cluster centroids and weights, and the checked sweeps of the coarse finishing loop at blur^2,
replayed from CUDA graphs where a shape repeats (:class:`CoarsePhase`)."""

from __future__ import annotations

import torch
from torch import Tensor

from .. import cuda_graphs
from ..kernel_ops import Cloud, lse_update


def coarse_sweep(Xc: Cloud, Yc: Cloud, lac: Tensor, lbc: Tensor, wx: Tensor, wy: Tensor, pots: tuple, prm: Tensor,
                  precision: str, debias: bool, check: bool = False, relax: tuple = (0, 0)) -> tuple:
    """One sweep of the four LSE updates on the clusters (weights wx, wy; log-weights lac, lbc):
    the new (f_ba, g_ab, f_aa, g_bb) (None without debias), and with ``check`` also the largest
    marginal error of the four plans at ``pots`` as a 0-d device tensor (no host read).
    ``relax``: the RELAX_AT of x's and y's updates (multiscale_rules.relax_indices; 0: strict)."""
    f_ba, g_ab, f_aa, g_bb = pots
    kw = lambda pold: dict(pold=pold) if check else {}  # noqa: E731
    rx, ry = relax
    out = [lse_update(Xc, Yc, g_ab, prm, precision, logw_in=lbc, relax_at=rx, **kw(f_ba)),
           lse_update(Yc, Xc, f_ba, prm, precision, logw_in=lac, relax_at=ry, **kw(g_ab)), None, None]
    if debias:
        out[2] = lse_update(Xc, Xc, f_aa, prm, precision, logw_in=lac, relax_at=rx, **kw(f_aa))
        out[3] = lse_update(Yc, Yc, g_bb, prm, precision, logw_in=lbc, relax_at=ry, **kw(g_bb))
    new = tuple(None if o is None else o[0] for o in out)
    if not check:
        return new
    return new, torch.stack([(w * o[1]).sum() for w, o in zip((wx, wy, wx, wy), out) if o is not None]).max()


_CLOUD_FIELDS = ("x", "hi", "lo", "sqnorm", "scale")


class CoarsePhase:
    """The coarse sweeps of the solve (solve.anneal): the annealing (from zero potentials, ``jump`` + 1
    averaged sweeps after the first) and the finishing loop's checked sweeps at the last eps. Both
    launch fixed sequences of ~100 us kernels between host reads, so the eager loop is host-bound
    (~1 ms of host per sweep at 2^20 on the H100; docs/performance.md); where a shape repeats they are replayed
    from CUDA graphs (torch_api.cuda_graphs: one per segment, over static copies of the clusters,
    weights and PARAMS rows; bitwise the eager launches). Potentials they return are the caller's
    (copied out of the graphs' outputs)."""

    def __init__(self, Xc: Cloud, Yc: Cloud, lac: Tensor, lbc: Tensor, wx: Tensor, wy: Tensor, prm_rows: Tensor,
                 precision: str, debias: bool, schedule: tuple, relax: tuple = (0, 0)):
        self.precision, self.debias, self.relax = precision, debias, relax
        values = {"lac": lac, "lbc": lbc, "wx": wx, "wy": wy, "prms": prm_rows}
        for tag, c in (("xc", Xc), ("yc", Yc)):
            values.update({f"{tag}.{f}": getattr(c, f) for f in _CLOUD_FIELDS if getattr(c, f) is not None})
        kx, ky = Xc.n, Yc.n
        values.update(f_ba=lac, g_ab=lbc, f_aa=lac if debias else None, g_bb=lbc if debias else None)
        self.graphs = cuda_graphs.graph_set(
            ("multiscale_coarse", kx, ky, Xc.d, precision, debias, tuple(prm_rows.shape), schedule, relax,
             tuple(values)),
            lac.device, kx * ky, {k: v for k, v in values.items() if v is not None})
        self.eager = (Xc, Yc, lac, lbc, wx, wy, prm_rows)
        if self.graphs is not None:
            self.graphs.load({k: v for k, v in values.items() if v is not None and k not in ("f_ba", "g_ab", "f_aa", "g_bb")})

    def _args(self, s: dict | None) -> tuple:
        if s is None:
            return self.eager
        clouds_ = [Cloud(*(s.get(f"{tag}.{f}") for f in _CLOUD_FIELDS)) for tag in ("xc", "yc")]
        return (*clouds_, s["lac"], s["lbc"], s["wx"], s["wy"], s["prms"])

    def _annealed(self, s, jump: int) -> tuple:
        Xc, Yc, lac, lbc, wx, wy, prms = self._args(s)
        zx, zy = torch.zeros(Xc.n, device=lac.device), torch.zeros(Yc.n, device=lac.device)
        pots = coarse_sweep(Xc, Yc, lac, lbc, wx, wy, (zx, zy, zx, zy), prms[0], self.precision, self.debias,
                            relax=self.relax)
        for k in range(jump + 1):
            new = coarse_sweep(Xc, Yc, lac, lbc, wx, wy, pots, prms[k], self.precision, self.debias, relax=self.relax)
            pots = tuple(None if p is None else 0.5 * (p + q) for p, q in zip(pots, new))
        return pots

    def anneal(self, jump: int) -> tuple:
        """The potentials after the annealing sweeps (GeomLoss's averaged updates) up to eps_jump."""
        if self.graphs is None:
            return self._annealed(None, jump)
        return _copied(self.graphs.run("anneal", lambda s: self._annealed(s, jump)))

    def check(self, pots: tuple) -> tuple:
        """(the sweep at the last eps from ``pots``, the largest marginal error at ``pots`` as a float)."""
        if self.graphs is None:
            new, err = coarse_sweep(*self.eager[:6], pots, self.eager[6][-1], self.precision, self.debias, True,
                                    self.relax)
            return new, float(err)
        self.graphs.load({k: p for k, p in zip(("f_ba", "g_ab", "f_aa", "g_bb"), pots) if p is not None})

        def body(s):
            Xc, Yc, lac, lbc, wx, wy, prms = self._args(s)
            start = (s["f_ba"], s["g_ab"], s.get("f_aa"), s.get("g_bb"))
            new, err = coarse_sweep(Xc, Yc, lac, lbc, wx, wy, start, prms[-1], self.precision, self.debias, True,
                                    self.relax)
            return new + (err,)
        out = self.graphs.run("check", body, read=True)
        return _copied(out[:-1]), float(out[-1])


def _copied(pots: tuple) -> tuple:
    return tuple(None if p is None else p.clone() for p in pots)
