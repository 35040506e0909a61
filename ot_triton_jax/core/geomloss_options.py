"""GeomLoss ``SamplesLoss`` options: the checks both frontends share. No framework imports.

Only ``loss="sinkhorn"`` with ``p=2`` (cost |x - y|^2 / 2) is implemented; every other
GeomLoss option raises ``NotImplementedError`` naming it. Marginals: strict (balanced, equal
masses required) or KL-relaxed by GeomLoss's ``reach`` (both marginals, rho = reach**p) or
flash-sinkhorn's ``reach_x`` / ``reach_y`` (only the marginal of x, resp. y); see
:func:`relaxation` and ``core.unbalanced``.
"""

from __future__ import annotations

from .checks import positive
from .unbalanced import check_reach, reach_to_rho

OTHER_LOSSES = ("hausdorff", "energy", "gaussian", "laplacian")


def reject_unsupported(loss, p, cost, kernel, cluster_scale, backend) -> None:
    """Raise for every GeomLoss option this library does not implement; ``cluster_scale`` only
    means something with ``backend="multiscale"``."""
    if loss != "sinkhorn":
        if loss in OTHER_LOSSES:
            raise NotImplementedError(f"loss={loss!r} is not implemented; only loss='sinkhorn' is supported")
        raise ValueError(f"loss must be 'sinkhorn' (GeomLoss's other losses {OTHER_LOSSES} are not "
                         f"implemented); got {loss!r}")
    if isinstance(p, bool) or p != 2:
        raise NotImplementedError(f"p={p!r} is not implemented; only p=2 (cost |x - y|^2 / 2) is supported")
    if cost is not None:
        raise NotImplementedError("cost: custom cost functions are not implemented; leave cost=None "
                                  "(cost |x - y|^2 / 2)")
    if kernel is not None:
        raise NotImplementedError("kernel: custom kernels are not implemented (they are only used by "
                                  "GeomLoss's kernel losses); leave kernel=None")
    if cluster_scale is not None and backend != "multiscale":
        raise ValueError(f"cluster_scale={cluster_scale!r} only has a meaning with backend='multiscale' "
                         f"(got backend={backend!r}); leave cluster_scale=None or pick that backend")


def schedule_numbers(blur, scaling, diameter) -> tuple[float, float, float | None]:
    """(blur, scaling, diameter) as floats: blur > 0, 0 < scaling < 1, diameter > 0 or None."""
    blur = positive("blur", blur)
    try:
        scaling_f = float(scaling)
    except (TypeError, ValueError):
        raise TypeError(f"scaling must be a number in (0, 1); got {scaling!r}") from None
    if not (0.0 < scaling_f < 1.0):
        raise ValueError(f"scaling must lie in (0, 1); got {scaling!r}")
    return blur, scaling_f, None if diameter is None else positive("diameter", diameter)


def relaxation(reach, reach_x, reach_y, p: int, backend) -> tuple[float | None, float | None]:
    """(rho_x, rho_y): the KL-relaxation strengths of the marginals of x (weights a) and of y
    (weights b), None for a strict marginal.

    GeomLoss's ``reach`` relaxes both marginals, rho_x = rho_y = reach**p; flash-sinkhorn's
    ``reach_x`` (resp. ``reach_y``) relaxes only the marginal of x (resp. y), rho = reach_x**p.
    Each is None or a positive finite float; ``reach`` together with ``reach_x`` / ``reach_y``
    is an error. ``backend="multiscale"`` takes ``reach`` only (rho_x = rho_y)."""
    if reach is not None and (reach_x is not None or reach_y is not None):
        raise ValueError(f"pass either reach (both marginals relaxed) or reach_x / reach_y (one marginal "
                         f"each), not both; got reach={reach!r}, reach_x={reach_x!r}, reach_y={reach_y!r}. "
                         f"reach=r is reach_x=r, reach_y=r")
    if reach is not None:
        r = check_reach("reach", reach)
        rho_x = rho_y = reach_to_rho(r, p)
    else:
        rho_x = reach_to_rho(check_reach("reach_x", reach_x), p)
        rho_y = reach_to_rho(check_reach("reach_y", reach_y), p)
    if backend == "multiscale" and rho_x != rho_y:
        raise NotImplementedError("backend='multiscale' relaxes both marginals equally (reach=...); with reach_x "
                                  "or reach_y use backend='online' (or 'tensorized', 'auto')")
    return rho_x, rho_y
