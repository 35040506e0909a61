"""epsilon-scaling schedules (GeomLoss conventions). No framework imports.

GeomLoss anneals the temperature from diameter^p down to blur^p, dividing it by
scaling^p at every step:

    eps_list = [diameter^p] + [exp(t) for t in p log(diameter), p log(diameter) + p log(scaling), ...
                               while t > p log(blur)] + [blur^p]

so the first value is repeated once (an extra iteration at the largest scale)
and the last value is blur^p exactly.
"""

from __future__ import annotations

import math

import numpy as np


def epsilon_schedule(p: float, diameter: float, blur: float, scaling: float) -> list[float]:
    """The list of temperatures of GeomLoss's annealing loop (see module docstring)."""
    if not (0.0 < scaling < 1.0):
        raise ValueError(f"scaling must lie in (0, 1), got {scaling}")
    if blur <= 0 or diameter <= 0:
        raise ValueError(f"blur and diameter must be > 0, got blur={blur}, diameter={diameter}")
    start, stop, step = p * math.log(diameter), p * math.log(blur), p * math.log(scaling)
    logs = np.arange(start, stop, step)  # empty when diameter <= blur
    return [float(diameter**p)] + [float(math.exp(t)) for t in logs] + [float(blur**p)]


def diameter_from_bounds(mins, maxs) -> float:
    """Length of the diagonal of the bounding box [mins, maxs] (sequences of floats)."""
    return float(math.sqrt(sum((float(hi) - float(lo)) ** 2 for lo, hi in zip(mins, maxs))))
