"""ASE 3.29's own md/optimize/filter tests, run on this package's classes."""
