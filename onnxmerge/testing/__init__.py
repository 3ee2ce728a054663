"""Helpers shared by the test suite and the benchmarks: exported reference models, cached on disk.

Needs the ``export`` extra (torch, transformers, optimum); nothing here is imported by the library.
"""
