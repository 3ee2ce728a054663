"""Helpers shared by the test suite and the benchmarks: exported reference models, cached on disk.

The zoo needs the ``export`` extra (torch, transformers, optimum); ``checks`` needs only onnx-ir.
Nothing here is imported by the library.
"""
