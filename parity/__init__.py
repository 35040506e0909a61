"""Parity harness (``python -m parity``): both frontends against OTT-JAX 0.6.0 and GeomLoss 0.3.1.

Modules: ``cases`` (seeded problems), ``suites`` (the small and full case lists), ``quantities``
(what is compared, its gauge normalisation), ``thresholds`` (the bounds, stated once),
``solve_settings`` (solver options shared by both frontends), ``frontend_torch`` /
``frontend_jax`` (our numbers), ``references`` (OTT-JAX float64 in a subprocess, dense float64
fallback, GeomLoss), ``compare`` (rows and the error metric), ``runner`` (runs a suite),
``report`` (JSON / markdown / plot), ``cli`` (the command line), ``ott_worker`` (OTT on a GPU).

Python API: ``parity.runner.run(cases, frontends, only, seed) -> list[Row]`` and
``parity.cli.main(argv) -> exit status``.
"""
