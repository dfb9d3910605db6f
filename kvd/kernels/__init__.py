"""kvd's kernels.

It holds the Triton GPU kernels (``store_kvcache``, ``paged_decode_attention``; triton is imported at first
launch, so an install without triton still runs on a CPU) and the native C CPU kernels (``cpu_kernels.c``,
compiled on the host at first use) with their loader, ``cpu_native``.
"""
