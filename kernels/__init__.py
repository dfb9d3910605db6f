"""Triton kernels of kvd, installed as ``kvd.kernels``.

Each kernel module imports triton lazily so that an install without triton still runs on a CPU. This package
deliberately defines no ``__version__``: a top-level ``kernels`` found on ``sys.path`` must not look like the
hub's kernels package that transformers probes for.
"""
