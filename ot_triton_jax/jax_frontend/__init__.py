"""The JAX frontend: one module per public operation (``sinkhorn_solver``,
``divergence``, ``samples_loss``, ``mhc``, ``interop``), the kernel launch
(``launch``: jax-triton or a DLPack callback), the kernel calls on JAX arrays
(``kernel_ops``), the solver loops (``loops``) and the derivative rules
(``derivatives``). The public names are re-exported lazily by ``ot_triton_jax``.
"""
