"""The planning wing: ``remat.plan`` (``plan``; ``_solve``: the DP), ``remat.apply``/``auto``/``remove``
(``apply``) and synthetic chains for tests and benchmarks (``_synthetic``)."""
