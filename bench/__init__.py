"""The benchmark suite: ``python bench/suite.py`` runs every area (see its docstring); one script per
area in ``bench/areas/``; shared helpers in this package; results in ``bench/results/<area>/``."""
