"""kvd's kernels: this top-level ``kernels/`` folder is installed as ``kvd.kernels`` (pyproject's package-dir).

It holds the Triton GPU kernels (``store_kvcache``, ``paged_decode_attention``; triton is imported at first
launch, so an install without triton still runs on a CPU) and the native C CPU kernels (``cpu_kernels.c``,
compiled on the host at first use) with their loader, ``cpu_native``. This package deliberately defines no
``__version__``: a top-level ``kernels`` found on ``sys.path`` must not look like the hub's kernels package that
transformers probes for.
"""
