"""The hook CUDA-graph capture needs from an attention backend: decode metadata over caller-owned tensors."""

from __future__ import annotations

from abc import abstractmethod

import torch

from kvd.model.layers.attention.attention_base import AttentionBackend, AttentionMetadata


class GraphDecodeBackend(AttentionBackend):
    """A backend whose pure-decode step reads only fixed-shape tensors, so a CUDA graph can replay it.

    (The torch backend is not one: its gather indices and masks change shape with the context lengths.)
    """

    @abstractmethod
    def decode_metadata(
        self,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        context_lens: torch.Tensor,
        block_size: int,
        max_context_len: int,
    ) -> AttentionMetadata:
        """Metadata for one new token per sequence that wraps these tensors without copying them.

        A graph captured with it reads whatever the tensors hold at replay. slot_mapping long [S] (-1 = do not
        write), block_tables int32 [S, max_blocks], context_lens int32 [S] (>= 1); max_context_len bounds them.
        """
