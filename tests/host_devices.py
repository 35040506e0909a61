"""Checks of the sharded JAX operations (``ot_triton_jax.distributed``) on 4 forced host devices.

The devices need ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before jax is imported, so
:func:`run` executes a check script in a fresh interpreter (real kernels, Triton interpreter) after
:data:`HEADER`: the imports and ``problem``, the shared test problem (randn clouds of n != m points,
neither a multiple of the device counts 2 and 4, y shifted; non-uniform weights with a zero on
each side). The script prints "OK" at its end.
"""

import os
import subprocess
import sys
import textwrap

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

HEADER = textwrap.dedent('''
    import os
    os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
    import numpy as np, jax, jax.numpy as jnp, pytest
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    import ot_triton_jax as otj


    def problem(seed, spread=1.0, shift=0.3, zero_a=2, zero_b=-1, n=13, m=10, d=3):
        """(rng, n, m, d, x, y, a, b), float32; rng continues after the draws."""
        rng = np.random.default_rng(seed)
        x = jnp.asarray(spread * rng.standard_normal((n, d)), jnp.float32)
        y = jnp.asarray(spread * rng.standard_normal((m, d)) + shift, jnp.float32)
        a = rng.uniform(0.2, 1, n); a[zero_a] = 0; a /= a.sum()
        b = rng.uniform(0.2, 1, m); b[zero_b] = 0; b /= b.sum()
        return rng, n, m, d, x, y, jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
''')


def run(body: str) -> None:
    """``HEADER`` + ``body`` in a fresh interpreter; it must exit 0 and print "OK" last."""
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, "-c", HEADER + textwrap.dedent(body)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("OK"), proc.stdout[-3000:] + proc.stderr[-6000:]
