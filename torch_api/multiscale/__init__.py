"""The multiscale backend of the PyTorch frontend (d <= 3): GeomLoss's coarse-to-fine solve on
voxel clusters with truncation masks from rigorous bounds and block-sparse (or Taylor-expanded)
passes on the kept blocks. Rules shared with the JAX frontend: ``ot_triton_jax.core.multiscale_rules``.

Entry points: :mod:`.samples_loss` (``SamplesLoss(..., backend="multiscale")``) and
:mod:`.sinkhorn` (``sinkhorn(..., multiscale=MultiscaleOptions())``). The solve: :mod:`.solve`
(the loop) over :mod:`.problem`, :mod:`.coarse`, :mod:`.lift`, :mod:`.fine`, :mod:`.anderson`
and :mod:`.prewarm`; its building blocks :mod:`.clusters`, :mod:`.bounds`, :mod:`.taylor`;
derivatives :mod:`.gradient` and :mod:`.hvp`. Nothing is imported here: each module is loaded
where it is used.
"""
