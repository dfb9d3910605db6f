"""The model family and its layers. This package import stays light (no torch)."""

from kvd.model.config import SUPPORTED_ARCHITECTURES, ModelConfig, UnsupportedModelError

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig", "UnsupportedModelError"]
