"""GeomLoss's eps-schedule for the JAX frontend, on the host or on the device.

The schedule itself is ``ot_triton_jax.core.schedules.epsilon_schedule`` (float64,
on the host), used whenever the points are concrete or the diameter is given. Inside
``jax.jit`` with traced points and ``diameter=None``, the same formula runs on the
device in float32 and is represented by the tuple (eps_0, start, step, count,
eps_last): its length is then a run-time loop bound, so new data never retraces.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from ..core.schedules import epsilon_schedule

F32 = jnp.float32


def host_schedule(x, y, blur: float, diameter: float | None, scaling: float) -> np.ndarray:
    """The schedule in float64 on the host (as torch_api), returned as float32."""
    if diameter is None:
        d = x.shape[-1]
        pts = np.concatenate([np.asarray(x, np.float64).reshape(-1, d), np.asarray(y, np.float64).reshape(-1, d)])
        diameter = float(np.linalg.norm(pts.max(0) - pts.min(0)))
        if diameter == 0.0:  # every point coincides: anneal nothing
            diameter = blur
    return np.asarray(epsilon_schedule(2, diameter, blur, scaling), np.float32)


def device_schedule(x, y, blur: float, scaling: float):
    """(eps_0, start, step, count, eps_last) of the same schedule, computed on the device."""
    d = x.shape[-1]
    pts = jnp.concatenate([x.reshape(-1, d), y.reshape(-1, d)]).astype(F32)
    diam = jnp.linalg.norm(jnp.max(pts, 0) - jnp.min(pts, 0))
    diam = jnp.where(diam > 0, diam, blur)
    start, stop, step = 2 * jnp.log(diam), 2 * math.log(blur), 2 * math.log(scaling)
    count = jnp.maximum(jnp.ceil((stop - start) / step), 0).astype(jnp.int32)
    return diam * diam, start, jnp.float32(step), count, jnp.float32(blur * blur)


def eps_at(sched, k):
    """The k-th eps of a host (array) or device (tuple) schedule."""
    if isinstance(sched, tuple):
        e0, start, step, count, elast = sched
        k = jnp.asarray(k, jnp.int32)
        mid = jnp.exp(start + (k - 1).astype(F32) * step)
        return jnp.where(k == 0, e0, jnp.where(k <= count, mid, elast)).astype(F32)
    return sched[k]


def n_eps(sched):
    return sched[3] + 2 if isinstance(sched, tuple) else sched.shape[0]


def last_eps(sched):
    return sched[4] if isinstance(sched, tuple) else sched[-1]
