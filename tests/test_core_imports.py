"""The framework-free core and the frontends' import boundaries, each checked in a fresh interpreter."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CORE_MODULES = [
    "ot_triton_jax.core", "ot_triton_jax.core.checks", "ot_triton_jax.core.options",
    "ot_triton_jax.core.launch_plans", "ot_triton_jax.core.cloud_plans", "ot_triton_jax.core.multiscale_plans",
    "ot_triton_jax.core.pair_plans", "ot_triton_jax.core.mhc_plans", "ot_triton_jax.core.kernel_calls",
    "ot_triton_jax.core.multiscale_calls", "ot_triton_jax.core.multiscale_rules",
    "ot_triton_jax.core.kernels", "ot_triton_jax.core.kernels.mhc", "ot_triton_jax.core.geomloss_options",
    "ot_triton_jax.core.schedules", "ot_triton_jax.core.runtime",
]


def _loaded_after(code: str) -> set[str]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, env=env, cwd=ROOT, check=True)
    return set(out.stdout.split())


@pytest.mark.parametrize("module", CORE_MODULES)
def test_core_loads_neither_torch_nor_jax(module):
    loaded = _loaded_after(f"import {module}")
    assert module in loaded
    assert "torch" not in loaded and "jax" not in loaded, module


def test_top_level_package_is_lazy():
    loaded = _loaded_after("import ot_triton_jax")
    assert "jax" not in loaded and "torch" not in loaded


def test_torch_api_does_not_load_jax():
    loaded = _loaded_after(
        "import torch, torch_api\n"
        "torch_api.sinkhorn, torch_api.SamplesLoss, torch_api.FusedMHC, torch_api.sinkhorn_divergence\n"
        "x = torch.randn(6, 2); torch_api.sinkhorn(x, x + 1, epsilon=1.0).reg_ot_cost")
    assert "torch_api.sinkhorn_solver" in loaded
    assert "jax" not in loaded
