"""Qwen2: the shared decoder with a bias on q/k/v, always (its config never says so), and none on o or the MLP."""

from __future__ import annotations

from typing import Any

from kvd.model.config import FULL, SLIDING, Layout
from kvd.model.decoder import CausalLM


def sliding_layers(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Layout's sliding_window and layer_types for Qwen2 and Qwen3: a window only where use_sliding_window says so,
    on the layers layer_types marks (transformers 5), or from max_window_layers on (older configs)."""
    window = hf_config.get("sliding_window")
    types = hf_config.get("layer_types")
    if window is None or not (hf_config.get("use_sliding_window") or SLIDING in (types or ())):
        return {}
    if types is None:
        first = int(hf_config.get("max_window_layers") or 0)
        types = [SLIDING if i >= first else FULL for i in range(int(hf_config["num_hidden_layers"]))]
    return {"sliding_window": int(window), "layer_types": tuple(types)}


class Qwen2ForCausalLM(CausalLM):
    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        return Layout(attention_bias=True, **sliding_layers(hf_config))
