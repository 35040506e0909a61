"""Test set-up: GPU tests carry the ``gpu`` marker and are skipped without CUDA.

The CPU suite (``-m "not gpu"``) runs every kernel under the Triton interpreter;
``torch_api`` switches the interpreter on by itself when CUDA is absent.
"""

import pytest
import torch

import torch_api  # noqa: F401  (configures GPU vs interpreter before any kernel import)


def _patch_the_language_once_per_launch() -> None:
    """Under the Triton interpreter, patch each language module once per kernel launch.

    The interpreter replaces the builtins of the language modules a function sees
    (``triton.language``, ``triton.language.core``) by interpreted ones when a kernel is
    launched, and repeats the replacement on every call of a nested ``@triton.jit`` function,
    in every program of the grid. Once a module is replaced in a launch the repeat changes
    nothing (the builtins it looks for are already replaced) but costs a scan of every member
    of the module, its ``tensor`` class and ``math``: ~35% of the suite's kernel time. This hook
    replaces each module at its first use in a launch (the kernel's own, then e.g. ``core`` at
    the first ``tl.sum``) and skips the repeats; the kernels run the same interpreted operations.
    """
    if torch.cuda.is_available():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    original, state = interpreter._patch_lang, {"depth": 0, "done": set()}

    class _InPlace:
        def restore(self):
            pass

    def langs(fn) -> set:
        return {id(v) for v in fn.__globals__.values() if v is tl or v is tl.core}

    def patch_lang(fn):
        if state["depth"]:  # a nested device function
            if langs(fn) <= state["done"]:
                return _InPlace()
            state["done"] |= langs(fn)
            return original(fn)  # as the interpreter does: kept until the launch's own restore
        scope = original(fn)  # a kernel launch
        undo = scope.restore
        state["depth"], state["done"] = 1, langs(fn)

        def restore():
            state["depth"], state["done"] = 0, set()
            undo()
        scope.restore = restore
        return scope

    interpreter._patch_lang = patch_lang


_patch_the_language_once_per_launch()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run bench/run_gpu.sh on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
