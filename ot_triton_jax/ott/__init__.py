"""OTT-JAX's solvers on the streaming kernels: :class:`PointCloud`.

``from ot_triton_jax.ott import PointCloud`` gives a drop-in for ``ott.geometry.pointcloud.PointCloud``
(squared Euclidean cost) whose Sinkhorn operations are this library's streaming passes, and
:func:`segment_sinkhorn`, OTT's ``segment_sinkhorn`` tool on that geometry. This
subpackage needs OTT-JAX (``pip install ott-jax``); the rest of ``ot_triton_jax`` does not.
"""

from __future__ import annotations

try:
    import ott  # noqa: F401
except ImportError as err:  # pragma: no cover - exercised in a subprocess by the tests
    raise ImportError("ot_triton_jax.ott needs OTT-JAX, which is not installed: pip install ott-jax") from err

from .pointcloud import PointCloud
from .segment import segment_sinkhorn

__all__ = ["PointCloud", "segment_sinkhorn"]
