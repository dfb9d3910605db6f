"""The model families over a shared decoder and its layers. This package import stays light (no torch)."""

from kvd.model.config import ModelConfig, UnsupportedModelError
from kvd.model.registry import SUPPORTED_ARCHITECTURES
from kvd.private_cache import pin_compiler_caches

# Before any module of this package imports torch (private_cache.py says why).
pin_compiler_caches()

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "UnsupportedModelError"]
