"""The benchmark scripts (each run as a file: ``python benchmarks/<script>.py``) and what they share
with the tests (``accuracy.rel_err``, imported by tests/helpers.py: the tests import benchmarks,
never the other way round)."""
