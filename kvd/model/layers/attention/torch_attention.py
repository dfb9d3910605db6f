"""The torch attention backend (CPU and GPU): index_copy K/V into the pool, gather blocks, SDPA.

A step splits into a decode group (sequences with one new token) and a prefill group (several new tokens).
Every index, padding and mask that depends only on the step is built once in build_metadata, so a layer
does one K/V write, then per group block gathers into a reused workspace and batched SDPA calls: there is
no Python loop over sequences (decode works through the batch in cache-sized chunks of sequences).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from kvd.model.layers.attention.attention_base import (
    AttentionBackend,
    AttentionMetadata,
    StepLayout,
    host_to_device,
)


@dataclass
class BlockGather:
    """The pool blocks a group of sequences attends over, padded to the group's longest, and who sees what."""

    block_ids: torch.Tensor  # long [num_seqs, num_blocks], padded with block 0
    num_slots: int  # leading gathered slots that any query may see
    # bool [num_seqs, 1, q, num_slots], True = visible; None when every query sees all num_slots
    visible: torch.Tensor | None
    _bias: dict[torch.dtype, torch.Tensor] = field(default_factory=dict, repr=False)

    def attn_bias(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The mask as an additive bias (0 or -inf) in `dtype`: made by the first layer, reused by the rest.

        SDPA would otherwise turn a bool mask into this bias again in every layer.
        """
        if self.visible is None:
            return None
        if dtype not in self._bias:
            bias = torch.zeros(self.visible.shape, dtype=dtype, device=self.visible.device)
            self._bias[dtype] = bias.masked_fill_(~self.visible, float("-inf"))
        return self._bias[dtype]


@dataclass
class DecodePlan:
    rows: torch.Tensor | None  # long [n]: batch rows of the decode tokens; None = every row, in order
    gather: BlockGather


@dataclass
class PrefillPlan:
    """Prefill sequences padded to [num_seqs, max_query_len]; padded query slots repeat a real row."""

    num_seqs: int
    max_query_len: int
    # long [num_seqs * max_query_len]: the batch row of each padded slot; None = the batch is already so laid out
    pad_index: torch.Tensor | None
    out_rows: torch.Tensor | None  # long: batch rows of the real prefill tokens ...
    out_pos: torch.Tensor | None  # ... and their places in the padded layout
    gather: BlockGather | None  # None: no cached prefix, so attend the new K/V causally without the pool


@dataclass
class TorchAttentionMetadata(AttentionMetadata):
    write_rows: torch.Tensor | None = None  # rows whose K/V are stored; None = every row
    write_slots: torch.Tensor | None = None  # long: their pool slots
    decode: DecodePlan | None = None
    prefill: PrefillPlan | None = None


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    metadata_cls = TorchAttentionMetadata

    def __init__(self, gather_chunk_bytes: int = 4 << 20) -> None:
        self.gather_chunk_bytes = gather_chunk_bytes  # decode: gathered K+V per SDPA call, about L2/L3 size
        # Gathered K/V land in one buffer reused by every layer and step: on CPU, a fresh multi-MB allocation
        # per layer costs more in page faults than the copy itself.
        self._workspace: torch.Tensor | None = None

    def build_metadata(self, layout: StepLayout, device: torch.device | str) -> TorchAttentionMetadata:
        base = super().build_metadata(layout, device)
        starts = layout.query_starts
        decode = [s for s, n in enumerate(layout.query_lens) if n == 1]
        prefill = [s for s, n in enumerate(layout.query_lens) if n > 1]
        valid = [r for r, slot in enumerate(layout.slot_mapping) if slot >= 0]
        all_rows_written = len(valid) == len(layout.slot_mapping)
        return TorchAttentionMetadata(
            **vars(base),
            write_rows=None if all_rows_written else host_to_device(valid, torch.long, device),
            write_slots=base.slot_mapping if all_rows_written else base.slot_mapping[valid],
            decode=self.decode_plan(layout, decode, starts, device) if decode else None,
            prefill=_prefill_plan(layout, prefill, starts, device) if prefill else None,
        )

    def decode_plan(
        self, layout: StepLayout, seqs: list[int], starts: list[int], device: torch.device | str
    ) -> DecodePlan:
        """What _decode needs for the one-token sequences `seqs` (backends on this one plan their own way)."""
        return DecodePlan(decode_rows(layout, seqs, starts, device), _block_gather(layout, seqs, 1, device))

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        attn: AttentionMetadata,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        self.check_metadata(attn)
        self._write(k, v, kv_cache, attn)
        decode, prefill = attn.decode, attn.prefill
        if prefill is None and decode is not None and decode.rows is None:
            return self._decode(q, kv_cache, decode, scale, sinks)
        if decode is None and prefill is not None and prefill.pad_index is None:
            return self._prefill(q, k, v, kv_cache, prefill, scale, sinks)
        out = torch.empty_like(q)
        if decode is not None:
            out.index_copy_(
                0, decode.rows, self._decode(q.index_select(0, decode.rows), kv_cache, decode, scale, sinks)
            )
        if prefill is not None:
            padded = self._prefill(q, k, v, kv_cache, prefill, scale, sinks)
            out.index_copy_(0, prefill.out_rows, padded.index_select(0, prefill.out_pos))
        return out

    def _write(
        self, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, attn: TorchAttentionMetadata
    ) -> None:
        if attn.write_rows is not None:
            k, v = k.index_select(0, attn.write_rows), v.index_select(0, attn.write_rows)
        slots = kv_cache.view(2, -1, *kv_cache.shape[-2:])
        slots[0].index_copy_(0, attn.write_slots, k)
        slots[1].index_copy_(0, attn.write_slots, v)

    def _gather(
        self, kv_cache: torch.Tensor, block_ids: torch.Tensor, num_slots: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of block_ids' rows of blocks as [rows, kv_heads, num_slots, head_dim] views of the workspace."""
        block_shape = kv_cache.shape[2:]
        numel = 2 * block_ids.numel() * block_shape.numel()
        workspace = self._workspace
        if workspace is None or workspace.numel() < numel or workspace.dtype != kv_cache.dtype:
            workspace = self._workspace = torch.empty(numel, dtype=kv_cache.dtype, device=kv_cache.device)
        buf = workspace[:numel].view(2, block_ids.numel(), *block_shape)
        torch.index_select(kv_cache, 1, block_ids.view(-1), out=buf)
        kv = buf.view(2, block_ids.shape[0], -1, *block_shape[-2:])[:, :, :num_slots].transpose(2, 3)
        return kv[0], kv[1]

    def _decode(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: DecodePlan,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        n, num_heads, head_dim = q.shape
        gather = plan.gather
        # GQA by reshape: the query heads that share a kv head become its query rows; K/V are not repeated.
        q = q.view(n, kv_cache.shape[-2], -1, head_dim)
        sink_logits = None if sinks is None else sinks.view(1, *q.shape[1:3], 1)
        bias = gather.attn_bias(q.dtype)
        # Gather and attend a chunk of sequences at a time, so that SDPA reads the gathered K/V while they are
        # still in cache: on CPU this beats one gather of the whole batch (2-3x at long contexts) and it bounds
        # the workspace.
        # The chunking is tuned to CPU caches; other devices gather the whole batch at once.
        seq_bytes = 2 * gather.block_ids.shape[1] * kv_cache[0, 0].numel() * kv_cache.element_size()
        step = max(1, self.gather_chunk_bytes // seq_bytes) if kv_cache.device.type == "cpu" else n
        chunks = []
        for start in range(0, n, step):
            rows = slice(start, start + step)
            keys, values = self._gather(kv_cache, gather.block_ids[rows], gather.num_slots)
            mask = None if bias is None else bias[rows]
            chunks.append(_attention(q[rows], keys, values, scale, mask, sink_logits=sink_logits))
        out = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
        # reshape: CUDA's SDPA kernels may return the heads' rows strided, where a view cannot merge them.
        return out.reshape(n, num_heads, head_dim)

    def _prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        plan: PrefillPlan,
        scale: float,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Output [num_seqs * max_query_len, heads, head_dim] in the padded layout."""
        sink_logits = None if sinks is None else sinks.view(1, -1, 1, 1)
        n, width = plan.num_seqs, plan.max_query_len

        def padded(x: torch.Tensor) -> torch.Tensor:
            x = x if plan.pad_index is None else x.index_select(0, plan.pad_index)
            return x.view(n, width, *x.shape[1:]).transpose(1, 2)

        if plan.gather is None:
            # Nothing cached: queries and keys share positions, padding sits at the end: is_causal is exact.
            out = _attention(padded(q), padded(k), padded(v), scale, is_causal=True, sink_logits=sink_logits)
        else:
            keys, values = self._gather(kv_cache, plan.gather.block_ids, plan.gather.num_slots)
            out = _attention(
                padded(q), keys, values, scale, plan.gather.attn_bias(q.dtype), sink_logits=sink_logits
            )
        return out.transpose(1, 2).reshape(n * width, *q.shape[1:])


def _attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    bias: torch.Tensor | None = None,
    is_causal: bool = False,
    sink_logits: torch.Tensor | None = None,
) -> torch.Tensor:
    """SDPA over q [..., heads, L, D] and keys/values [..., kv_heads, S, D] (GQA when fewer); with `sink_logits`
    (broadcast to [..., heads, L, 1]) written out instead: each sink is one more column of its row's softmax,
    which attends to nothing (SDPA has no such column)."""
    if sink_logits is None:
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=bias, is_causal=is_causal, scale=scale, enable_gqa=True
        )
    group = q.shape[-3] // keys.shape[-3]
    keys, values = (x.repeat_interleave(group, dim=-3).float() for x in (keys, values))
    scores = q.float() @ keys.transpose(-1, -2) * scale
    if is_causal:  # queries and keys share positions (a prompt with nothing cached)
        scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
    if bias is not None:
        scores = scores + bias.float()
    scores = torch.cat((scores, sink_logits.float().expand(*scores.shape[:-1], 1)), dim=-1)
    return (scores.softmax(-1)[..., :-1] @ values).to(q.dtype)


def decode_rows(
    layout: StepLayout, seqs: list[int], starts: list[int], device: torch.device | str
) -> torch.Tensor | None:
    """Batch rows of the decode sequences `seqs`; None when the step is all decode (every row, in order)."""
    if len(seqs) == len(layout.query_lens):
        return None
    return host_to_device([starts[s] for s in seqs], torch.long, device)


def _block_gather(
    layout: StepLayout, seqs: list[int], query_width: int, device: torch.device | str
) -> BlockGather:
    """Blocks of `seqs` and the causal mask of their last query_width queries (padding rows see all), narrowed
    to each query's last layout.window tokens in a sliding layer's step."""
    num_blocks = max(len(layout.block_tables[s]) for s in seqs)
    ids = [b for s in seqs for b in layout.block_tables[s] + [0] * (num_blocks - len(layout.block_tables[s]))]
    ctx = [layout.context_lens[s] for s in seqs]
    num_slots = max(ctx)  # attend up to the longest context, not to the end of its last block
    visible = None
    window = layout.window
    if query_width > 1 or any(c != num_slots for c in ctx) or (window is not None and num_slots > window):
        ctx_t = host_to_device(ctx, torch.long, device)[:, None]
        first = ctx_t - host_to_device([layout.query_lens[s] for s in seqs], torch.long, device)[:, None]
        # Query i of a sequence sits at position first + i and sees slots 0..that position.
        last_visible = torch.minimum(first + torch.arange(query_width, device=device), ctx_t - 1)
        slots = torch.arange(num_slots, device=device)
        visible = slots <= last_visible[:, :, None]
        if window is not None:
            visible &= slots > last_visible[:, :, None] - window
        visible = visible.unsqueeze(1)
    block_ids = host_to_device(ids, torch.long, device).view(len(seqs), num_blocks)
    return BlockGather(block_ids, num_slots, visible)


def _prefill_plan(
    layout: StepLayout, seqs: list[int], starts: list[int], device: torch.device | str
) -> PrefillPlan:
    width = max(layout.query_lens[s] for s in seqs)
    gather = None
    # Attending the new K/V alone (is_causal) needs no cached prefix and no window narrower than the prompt.
    windowed = layout.window is not None and width > layout.window
    if windowed or any(layout.context_lens[s] > layout.query_lens[s] for s in seqs):
        gather = _block_gather(layout, seqs, width, device)
    if len(seqs) == len(layout.query_lens) and all(layout.query_lens[s] == width for s in seqs):
        return PrefillPlan(len(seqs), width, None, None, None, gather)
    pad_index, out_rows, out_pos = [], [], []
    for i, s in enumerate(seqs):
        n = layout.query_lens[s]
        pad_index.extend(starts[s] + min(j, n - 1) for j in range(width))
        out_rows.extend(range(starts[s], starts[s] + n))
        out_pos.extend(range(i * width, i * width + n))

    return PrefillPlan(
        len(seqs),
        width,
        host_to_device(pad_index, torch.long, device),
        host_to_device(out_rows, torch.long, device),
        host_to_device(out_pos, torch.long, device),
        gather,
    )
