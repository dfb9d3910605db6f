"""Tensor parallelism's primitives: which slice each rank holds (shard), the collectives of a sharded forward
pass (comm, shm) and the step commands rank 0 broadcasts (step). The model and the engine import these; how
the ranks are started and meet is kvd.parallel, a worker rank's process kvd.worker (docs/architecture.md,
"Tensor parallel")."""

from kvd.private_cache import pin_compiler_caches

# Before any module of this package imports torch (private_cache.py says why).
pin_compiler_caches()
