"""Attention sinks through the model: a learned logit per query head in each softmax (gpt-oss's, for the
mixture-of-experts families to reuse), on a tiny Llama given sinks, over the torch and the native backends."""

from __future__ import annotations

import dataclasses
import json

import torch
from safetensors.torch import load_file

from kvd.distributed.shard import Shard, ShardPlan
from kvd.model.config import ModelConfig
from kvd.model.decoder import CausalLM
from kvd.model.layers.attention.native_attention import NativeAttentionBackend
from kvd.model.layers.attention.torch_attention import TorchAttentionBackend

PROMPT = [(11 * i + 5) % 250 for i in range(21)]


def _model(folder, backend, sinks: torch.Tensor) -> CausalLM:
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    model = CausalLM(dataclasses.replace(config, attention_sinks=True), backend)
    layers = range(config.num_hidden_layers)
    model.load_weights(
        [
            *load_file(folder / "model.safetensors").items(),
            *((f"model.layers.{i}.self_attn.sinks", sinks) for i in layers),
        ]
    )
    return model.eval()


def _run(model, paged_runner) -> torch.Tensor:
    """Prompt logits, then three decode steps' (the native backend's decode rows, the torch one's gathers)."""
    runner = paged_runner(model, shuffle_seed=4)
    rows = [runner.step([("a", PROMPT)], all_logits=True)]
    rows += [runner.step([("a", [t])]) for t in (3, 9, 27)]
    return torch.cat(rows)


def test_sinks_take_weight_from_the_keys_alike_in_every_backend(tiny_checkpoint, paged_runner):
    folder = tiny_checkpoint("llama")
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    native = _run(_model(folder, NativeAttentionBackend(), sinks), paged_runner)
    reference = _run(_model(folder, TorchAttentionBackend(), sinks), paged_runner)
    torch.testing.assert_close(native, reference, rtol=1e-4, atol=1e-4)
    # Sinks so low that they weigh nothing: the same bits as a model without them; real ones change the output.
    absent = _run(_model(folder, NativeAttentionBackend(), torch.full((4,), -1e30)), paged_runner)
    config = ModelConfig.from_hf_dict(json.loads((folder / "config.json").read_text()))
    plain = CausalLM(config, NativeAttentionBackend())
    plain.load_weights(load_file(folder / "model.safetensors").items())
    assert torch.equal(absent, _run(plain.eval(), paged_runner))
    assert (native - absent).abs().max() > 1e-2


def test_each_rank_holds_its_heads_sinks(tiny_checkpoint):
    config = ModelConfig.from_hf_dict(json.loads((tiny_checkpoint("llama") / "config.json").read_text()))
    sinks = torch.arange(4.0)  # 4 query heads over 2 KV heads: 2 each
    parts = [ShardPlan(config, Shard(r, 2)).tensor("model.layers.0.self_attn.sinks", sinks) for r in range(2)]
    assert [p.tolist() for p in parts] == [[0.0, 1.0], [2.0, 3.0]]
