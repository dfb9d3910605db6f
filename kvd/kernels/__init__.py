"""kvd's kernels.

It holds the Triton GPU kernels (``store_kvcache``, ``paged_decode_attention``; triton is imported at first
launch, so an install without triton still runs on a CPU) and the native C CPU kernels (``cpu_*.c``, a file per
concern, compiled together on the host at first use) with their loader, ``cpu_native``.
"""

from kvd.private_cache import pin_compiler_caches

# Before any module of this package imports torch or triton (private_cache.py says why).
pin_compiler_caches()
