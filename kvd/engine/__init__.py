"""The engine: sequences, the paged-KV block manager, the scheduler, the model runner and the request loop."""

from kvd.private_cache import pin_compiler_caches

# Before any module of this package imports torch (private_cache.py says why).
pin_compiler_caches()
