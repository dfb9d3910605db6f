"""Which family implements a checkpoint: its Hugging Face or GGUF architecture -> a module of kvd.model.families.

Adding a family is one module there and one line here (two where llama.cpp converts it too). This module imports
no torch, so that config.py (and with it `import kvd.model`) stays light: a family's module is imported when
its class is first asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvd.model.decoder import CausalLM

# config.json's architectures[0] -> its family: the module of kvd.model.families that defines a class named after
# the architecture. The family is also the ModelConfig's model_type (and names a config without architectures).
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GraniteForCausalLM": "granite",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma4ForCausalLM": "gemma4",
    "Gemma4ForConditionalGeneration": "gemma4",  # its text model (the released checkpoints' architecture)
    "Olmo2ForCausalLM": "olmo2",
    "Phi3ForCausalLM": "phi3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
    "GptOssForCausalLM": "gpt_oss",
    "Qwen3_5ForCausalLM": "qwen3_5",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # its text model (the released checkpoints' architecture)
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",  # as Qwen3.5's
    "Qwen3NextForCausalLM": "qwen3_next",
}
# A GGUF file's general.architecture -> the Hugging Face architecture. llama.cpp also writes Mistral as "llama", and
# Mixtral as "llama" with experts (kvd.model.gguf_loader reads it so).
GGUF_ARCHITECTURES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
    "gemma4": "Gemma4ForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "qwen3moe": "Qwen3MoeForCausalLM",
    "qwen2moe": "Qwen2MoeForCausalLM",
    "gpt-oss": "GptOssForCausalLM",
    "qwen35": "Qwen3_5ForCausalLM",
    "qwen35moe": "Qwen3_5MoeForCausalLM",
    "qwen3next": "Qwen3NextForCausalLM",
}


def family_class(family: str) -> type[CausalLM]:
    """The class of a family (a value of SUPPORTED_ARCHITECTURES), importing its module."""
    architecture = next(arch for arch, name in SUPPORTED_ARCHITECTURES.items() if name == family)
    module = importlib.import_module(f"kvd.model.families.{family}")
    return getattr(module, architecture)
