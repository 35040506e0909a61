"""Test set-up: GPU tests carry the ``gpu`` marker and are skipped without CUDA.

The CPU suite (``-m "not gpu"``) runs every kernel under the Triton interpreter;
``torch_api`` switches the interpreter on by itself when CUDA is absent.
"""

import pytest
import torch

import torch_api  # noqa: F401  (configures GPU vs interpreter before any kernel import)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run bench/run_gpu.sh on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
