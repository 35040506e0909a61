"""GeomLoss ``SamplesLoss`` options: the checks both frontends share. No framework imports.

Only ``loss="sinkhorn"`` with ``p=2`` (cost |x - y|^2 / 2) and balanced masses is
implemented; every other GeomLoss option raises ``NotImplementedError`` naming it.
"""

from __future__ import annotations

from .checks import positive

OTHER_LOSSES = ("hausdorff", "energy", "gaussian", "laplacian")


def reject_unsupported(loss, p, reach, cost, kernel, cluster_scale, backend) -> None:
    """Raise for every GeomLoss option this library does not implement; ``cluster_scale`` only
    means something with ``backend="multiscale"``."""
    if loss != "sinkhorn":
        if loss in OTHER_LOSSES:
            raise NotImplementedError(f"loss={loss!r} is not implemented; only loss='sinkhorn' is supported")
        raise ValueError(f"loss must be 'sinkhorn' (GeomLoss's other losses {OTHER_LOSSES} are not "
                         f"implemented); got {loss!r}")
    if isinstance(p, bool) or p != 2:
        raise NotImplementedError(f"p={p!r} is not implemented; only p=2 (cost |x - y|^2 / 2) is supported")
    if reach is not None:
        raise NotImplementedError(f"reach={reach!r} (unbalanced OT) is not implemented; use reach=None")
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
