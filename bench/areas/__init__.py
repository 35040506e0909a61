"""One script per benchmark area; each runs as ``python -m bench.areas.<name>`` or through bench/suite.py."""

# area name -> module in this package, in the order the suite runs them
AREAS = {"sinkhorn": "sinkhorn", "samples_loss": "samples_loss", "jax": "jax_sinkhorn", "mhc": "mhc",
         "multiscale": "multiscale", "hvp": "hvp", "unbalanced": "unbalanced", "batched": "batched",
         "ott_geometry": "ott_geometry", "batched_samples_loss": "batched_samples_loss",
         "batched_hvp": "batched_hvp", "batched_divergence": "batched_divergence"}
