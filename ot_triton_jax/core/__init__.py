"""The framework-free core of ot_triton_jax: triton and numpy only.

Everything both frontends share lives here, written once:

* :mod:`.kernels`: the ``@triton.jit`` kernels (streaming LSE update, plan
  application, operand splits, the mHC Sinkhorn-Knopp kernels);
* :mod:`.launch_plans`, :mod:`.mhc_plans`: sizes, precision and device -> grid,
  tiles, warps and compile-time constants;
* :mod:`.kernel_calls`: one description per kernel call (argument order, scratch
  buffers, outputs, the split/combine step), which ``torch_api`` and the JAX
  frontend both execute;
* :mod:`.checks`, :mod:`.mhc_checks`: the validation rules and their error messages;
* :mod:`.options`: the solvers' static options (frozen dataclasses);
* :mod:`.geomloss_options`, :mod:`.schedules`: GeomLoss's options and eps-schedule;
* :mod:`.runtime`: GPU or Triton interpreter.

Importing this package or any of its submodules loads neither torch nor jax
(tests/test_core_imports.py checks it in a fresh interpreter).
"""
