"""Qwen2: the shared decoder with a bias on q/k/v, always (its config never says so), and none on o or the MLP."""

from __future__ import annotations

from typing import Any

from kvd.model.config import Layout
from kvd.model.decoder import CausalLM


def sliding_window(hf_config: dict[str, Any]) -> int | None:
    """Qwen2 and Qwen3 keep a sliding_window value but use it only on the layers marked "sliding_attention"."""
    window = hf_config.get("sliding_window")
    layer_types = hf_config.get("layer_types") or []
    uses_window = "sliding_attention" in layer_types or bool(hf_config.get("use_sliding_window"))
    return int(window) if window is not None and uses_window else None


class Qwen2ForCausalLM(CausalLM):
    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        return Layout(attention_bias=True, sliding_window=sliding_window(hf_config))
