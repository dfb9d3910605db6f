"""The GPU path of a mixture of experts (kvd.kernels.grouped_experts), checked on CPU in Triton's interpreter
(TRITON_INTERPRET=1, set before triton is first used): the row plan, the grouped matmuls against a per-row float
reference, a row's bits independent of the rows beside it, and SparseMoE's grouped path against its per-expert one."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # read when the kernels are first built, on first launch
DEVICE = "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else "cuda"

from kvd.kernels.grouped_experts import BLOCK_M, grouped_linear, grouped_linear_reference, plan_rows  # noqa: E402
from kvd.kernels.store_kvcache import KernelInputError  # noqa: E402

EXPERTS = 6


def _skewed_ids(tokens: int, top_k: int, seed: int) -> torch.Tensor:
    """Each token's top_k distinct experts in ascending order, expert 2 in most tokens' (one busy expert)."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, EXPERTS, generator=g)
    scores[: tokens * 3 // 4, 2] += 1.0
    return scores.topk(top_k, dim=-1).indices.sort(dim=-1).values.to(DEVICE)


@pytest.mark.parametrize(("tokens", "top_k"), [(1, 2), (7, 2), (40, 3)])
def test_the_plan_holds_every_row_once_in_blocks_of_one_expert(tokens, top_k):
    ids = _skewed_ids(tokens, top_k, seed=tokens)
    rows, block_expert = plan_rows(ids, EXPERTS)
    assert rows.numel() == block_expert.numel() * BLOCK_M
    assert sorted(r for r in rows.tolist() if r >= 0) == list(range(ids.numel()))
    flat = ids.flatten().tolist()
    for block, expert in enumerate(block_expert.tolist()):
        members = [r for r in rows[block * BLOCK_M : (block + 1) * BLOCK_M].tolist() if r >= 0]
        assert all(flat[r] == expert for r in members)
        assert expert < EXPERTS or not members  # the blocks past the last expert's hold nothing


@pytest.mark.parametrize("per_token", [True, False])
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_rows_match_the_reference_and_ignore_their_batch(per_token, bias):
    tokens, top_k, n, k = 24, 2, 80, 48  # n and k not whole tiles: the masks matter
    g = torch.Generator().manual_seed(1)
    ids = _skewed_ids(tokens, top_k, seed=5)
    x = torch.randn(tokens if per_token else tokens * top_k, k, generator=g).to(DEVICE)
    weight = torch.randn(EXPERTS, n, k, generator=g).to(DEVICE)
    biases = torch.randn(EXPERTS, n, generator=g).to(DEVICE) if bias else None
    out = grouped_linear(x, weight, biases, ids, plan_rows(ids, EXPERTS), per_token)
    torch.testing.assert_close(
        out, grouped_linear_reference(x, weight, biases, ids, per_token), rtol=1e-4, atol=1e-4
    )
    # Token 5 alone: its rows are the same bits as in the batch of 24.
    alone_ids = ids[5:6]
    alone_x = x[5:6] if per_token else x[5 * top_k : 6 * top_k]
    alone = grouped_linear(alone_x, weight, biases, alone_ids, plan_rows(alone_ids, EXPERTS), per_token)
    assert torch.equal(alone, out[5 * top_k : 6 * top_k])


def test_bad_shapes_are_refused_by_name():
    ids = torch.zeros(3, 2, dtype=torch.int64)
    weight = torch.zeros(EXPERTS, 8, 16)
    with pytest.raises(KernelInputError, match="x has 4 rows"):
        grouped_linear(torch.zeros(4, 16), weight, None, ids, plan_rows(ids, EXPERTS), per_token=True)
    with pytest.raises(KernelInputError, match=r"biases \(6, 4\)"):
        grouped_linear(
            torch.zeros(3, 16), weight, torch.zeros(6, 4), ids, plan_rows(ids, EXPERTS), per_token=True
        )


@pytest.mark.parametrize("family", ["qwen3_moe", "gpt_oss"])
def test_the_grouped_path_gives_the_per_expert_paths_outputs(tiny_checkpoint, family):
    """A tiny model's mixture (gpt-oss: biases, clamped SwiGLU): the two grouped launches against the torch loop
    over experts, and the stacked weights are views of the experts' own (no second copy)."""
    from kvd.model.layers.moe import SparseMoE
    from kvd.model.loader import load_model

    model = load_model(tiny_checkpoint(family), dtype="float32", attention_backend="torch").model.to(DEVICE)
    layer = next(m for m in model.modules() if isinstance(m, SparseMoE))
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    with torch.inference_mode():
        _, ids = layer.route(x)
        want = layer._per_expert(x, ids)
        got = layer._grouped(x, ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    gate_up = layer.stacked_weights()[0]
    assert layer.experts[3].gate_up_proj.weight.data_ptr() == gate_up[3].data_ptr()
