"""Mistral: Llama's layout, but attention_bias puts a bias on q/k/v only (none on o, none on the MLP), and its
sliding window, when it has one, covers every layer."""

from __future__ import annotations

from typing import Any

from kvd.model.config import Layout
from kvd.model.decoder import CausalLM


class MistralForCausalLM(CausalLM):
    @staticmethod
    def read_layout(hf_config: dict[str, Any]) -> Layout:
        window = hf_config.get("sliding_window")
        return Layout(
            attention_bias=bool(hf_config.get("attention_bias", False)),
            sliding_window=None if window is None else int(window),
        )
