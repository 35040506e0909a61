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


def _cheaper_interpreter_bookkeeping() -> None:
    """Under the Triton interpreter, skip two pieces of per-operation bookkeeping that the
    interpreted kernels never use.

    * ``triton.language.tuple`` computes its ``tuple_type`` (one ``constexpr_type`` per entry)
      at construction; the interpreter builds millions of such tuples (every block shape) and
      reads almost none of their types. Here the type is computed when first read.
    * ``interpreter._get_np_dtype`` builds its Triton-to-NumPy dtype table on every call (one
      dict of 18 hashed dtypes per cast, splat and masked load); here the answer is looked up
      by the dtype's name in a table filled from the original function.

    Both return exactly what the originals return; together they are ~20% of the suite's
    kernel time.
    """
    if torch.cuda.is_available():
        return
    import triton.language as tl
    from triton.runtime import interpreter

    core = tl.core

    def init(self, args, type=None):
        self.values = [i for i in args]
        self._lazy_type = type if type is None or isinstance(type, core.tuple_type) else core.tuple_type(type)

    def get_type(self):
        lazy = self.__dict__.get("_lazy_type")  # not getattr: tuple.__getattr__ reads .type
        if lazy is None:
            lazy = self._lazy_type = core._type_for_tuple_values(self.values)
        return lazy

    def set_type(self, value):
        self._lazy_type = value

    core.tuple.__init__ = init
    core.tuple.type = property(get_type, set_type)

    original, table = interpreter._get_np_dtype, {}

    def get_np_dtype(tt_dtype):
        if isinstance(tt_dtype, tl.block_type):
            tt_dtype = tt_dtype.element_ty
        key = "pointer" if isinstance(tt_dtype, tl.pointer_type) else tt_dtype.name
        if key not in table:
            table[key] = original(tt_dtype)
        return table[key]

    interpreter._get_np_dtype = get_np_dtype


_cheaper_interpreter_bookkeeping()


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run bench/run_gpu.sh on the GPU machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
