"""Parity helpers: compare loaded weights with a Hugging Face state dict, and a minimal paged greedy loop."""

from __future__ import annotations

from pathlib import Path

import torch

from kvd.model.decoder import CausalLM
from kvd.model.layers.attention import build_attention_metadata
from kvd.model.layers.kv_cache import allocate_kv_cache
from kvd.model.loader import LoadedModel


@torch.inference_mode()
def greedy_generate(
    model: CausalLM,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_ids: tuple[int, ...] = (),
    block_size: int = 16,
) -> list[int]:
    """Prefill the prompt, then decode one token per step, argmax each time; stops after a stop id."""
    param = next(model.parameters())
    total = len(prompt_ids) + max_new_tokens
    num_blocks = -(-total // block_size)
    model.bind_kv_cache(allocate_kv_cache(model.config, num_blocks, block_size, param.dtype, param.device))
    block_table = list(range(num_blocks))  # one sequence owning contiguous blocks
    tokens = list(prompt_ids)
    computed = 0  # tokens whose K/V are in the cache
    output: list[int] = []
    while len(output) < max_new_tokens:
        new = tokens[computed:]
        attn = build_attention_metadata(
            [block_table],
            [len(tokens)],
            [len(new)],
            block_size,
            param.device,
            model.attention_backend,
            kv_groups=model.kv_groups,
        )
        input_ids = torch.tensor(new, device=param.device)
        positions = torch.arange(computed, len(tokens), device=param.device)
        hidden = model(input_ids, positions, attn)
        next_id = int(model.compute_logits(hidden[-1:]).argmax(-1))
        computed = len(tokens)
        tokens.append(next_id)
        output.append(next_id)
        if next_id in stop_ids:
            break
    return output


def load_with_private_cache(model: str | None, tmp_path_factory) -> LoadedModel:
    """load_model in float32 with the GGUF tokenizer cache in a fresh folder, not the user's."""
    import pytest

    from kvd.model.loader import load_model

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
        return load_model(model, dtype=torch.float32)


def transformers_gguf(path: Path) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) as transformers loads a GGUF file itself, the model in float32, for eval."""
    import gguf
    import pytest
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers parses the file's metadata three times (its config, its weights, its tokenizer): about 30 s
    # each for a 262k-token vocabulary, read one string at a time through numpy views of the file. The same
    # reader (gguf's own) serves the three.
    reader = gguf.GGUFReader(path)
    opened = gguf.GGUFReader
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", lambda p, *a, **k: reader if Path(p) == path else opened(p, *a, **k))
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        return model.eval(), AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def assert_params_equal_hf(
    loaded: LoadedModel, hf_state: dict[str, torch.Tensor], norms_within_an_ulp: bool = False
) -> None:
    """Each of our parameters equals, bit for bit, the HF tensors it is built from (fused ones stacked in
    order) cast to the loaded dtype; a weight that batch invariance laid out in its kernel's order, in that order.
    `norms_within_an_ulp`: norm weights with an offset may differ by their last bit (a reference that took the
    offset off and put it back)."""
    from kvd.kernels import cpu_native

    modules = dict(loaded.model.named_modules())
    ours = dict(loaded.model.named_parameters())
    fused = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
    offset = loaded.config.norm_weight_offset  # added to norm weights as they load (Gemma)
    for name, param in ours.items():
        part = name.split(".")[-2]
        checkpoint_name = loaded.model.rename_weight(name, back=True)
        sources = (  # a checkpoint that fuses them too (Phi-3), or the parts stacked (those it has: Gemma 4's
            # layers sharing K/V project q alone, its k_eq_v layers q and k)
            [checkpoint_name]
            if checkpoint_name in hf_state
            else [
                source
                for p in fused.get(part, (part,))
                if (source := checkpoint_name.replace(part, p)) in hf_state
            ]
        )
        expected = torch.cat([hf_state[s] for s in sources])
        if offset and name.endswith("norm.weight"):
            expected = expected.float() + offset
        expected = expected.to(loaded.dtype)
        if getattr(modules[name.rpartition(".")[0]], "tiles", False) and name.endswith(".weight"):
            expected = cpu_native.pack(expected)
        if offset and norms_within_an_ulp and name.endswith("norm.weight"):
            torch.testing.assert_close(param.data, expected, rtol=2**-23, atol=0)
        else:
            assert torch.equal(param.data, expected), name
    assert loaded.config.tie_word_embeddings == ("lm_head.weight" not in ours)
