"""``python -m parity.ott_worker IN.npz OUT.npz``: tests/ott_reference.py's float64 OTT-JAX
computation on the default JAX device (the GPU where there is one).

``tests/ott_reference.py`` pins its subprocess to the CPU, where OTT's dense float64 solves at
n = 8192 would not fit the full suite's time. This worker configures JAX first (float64, default
platform, optimised compiles) and then runs that module's own ``_main`` unchanged; its later
requests to switch the platform to the CPU and to disable optimisations are ignored.
"""

from __future__ import annotations

import os
import sys

_IGNORED = {"jax_platforms", "jax_disable_most_optimizations"}


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m parity.ott_worker IN.npz OUT.npz", file=sys.stderr)
        return 2
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.devices()  # initialise the default backend now: later platform requests cannot move it
    update = jax.config.update
    jax.config.update = (  # type: ignore[method-assign]
        lambda name, value: None if name in _IGNORED else update(name, value))
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
    import ott_reference

    platforms = os.environ.get("JAX_PLATFORMS")
    try:
        ott_reference._main(argv[0], argv[1])
    finally:
        jax.config.update = update  # type: ignore[method-assign]
        if platforms is not None:
            os.environ["JAX_PLATFORMS"] = platforms
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
