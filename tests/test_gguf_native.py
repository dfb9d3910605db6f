"""Quantization "gguf": a GGUF file's matrices run in their own types (Q4_K, Q5_K, Q6_K, IQ4_XS in place; Q4_0,
Q4_1, Q5_0, Q5_1, Q8_0, IQ4_NL in kvd's blocks, exactly), the embedding and output projection too, without a float
copy."""

from __future__ import annotations

import logging
import re
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from test_loader import tiny_hf_model, write_tiny_gguf

from kvd import LLM
from kvd.kernels import cpu_native
from kvd.model.gguf_loader import GGUFFile
from kvd.model.layers.attention import build_attention_metadata
from kvd.model.layers.gguf_linear import GGUFLinear, to_kvd_blocks
from kvd.model.layers.kv_cache import allocate_kv_cache
from kvd.model.loader import load_model
from kvd.model.native_decode import NativeDecoder

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="needs the native kernels built")

# Rows of 256 values or more, so that every super-block type fits.
SHAPE = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
}
# A Q4_K_M-like mix, with the other native types and one without a kernel (TQ2_0: dequantized) in layer 1.
TYPES = {
    "token_embd.weight": Q.Q6_K,
    "output.weight": Q.Q8_0,
    "blk.0.attn_q.weight": Q.Q4_K,
    "blk.0.attn_k.weight": Q.Q4_K,
    "blk.0.attn_v.weight": Q.Q6_K,
    "blk.0.attn_output.weight": Q.Q5_K,
    "blk.0.ffn_gate.weight": Q.Q4_K,
    "blk.0.ffn_up.weight": Q.IQ4_NL,
    "blk.0.ffn_down.weight": Q.Q4_K,
    "blk.1.attn_q.weight": Q.Q5_1,
    "blk.1.attn_k.weight": Q.Q8_0,
    "blk.1.attn_v.weight": Q.TQ2_0,
    "blk.1.attn_output.weight": Q.Q5_0,
    "blk.1.ffn_gate.weight": Q.IQ4_XS,
    "blk.1.ffn_up.weight": Q.Q4_1,
    "blk.1.ffn_down.weight": Q.Q4_0,
}


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def files(request, tmp_path_factory):
    model = tiny_hf_model(request.param, **SHAPE)
    with torch.no_grad():  # a trained model's scales (unit-variance layers), not one that amplifies rounding
        for name, param in model.named_parameters():
            param.mul_(param.shape[-1] ** -0.5 if param.dim() > 1 else 0.1).add_(
                1.0 if "norm" in name else 0.0
            )
    path = tmp_path_factory.mktemp("gguf") / f"tiny-{request.param}.gguf"
    write_tiny_gguf(model, path, tensor_types=TYPES)
    return path


@pytest.mark.parametrize(
    "qtype", [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.IQ4_NL, Q.MXFP4], ids=lambda q: q.name
)
def test_block_types_convert_to_kvd_blocks_exactly(qtype):
    import gguf_quants

    values = np.random.default_rng(0).standard_normal((24, 256)).astype(np.float32)
    raw = gguf_quants.quantize(values, qtype)
    layer = GGUFLinear(256, [("t", raw, qtype)], None, torch.float32)
    out = cpu_native.dequantize(layer.part_weight(0), 0, torch.empty(24, 256))
    np.testing.assert_array_equal(out.numpy(), gguf.quants.dequantize(raw, qtype))
    assert to_kvd_blocks(raw, qtype)[0] == {"Q4": 4, "Q5": 5}.get(qtype.name[:2], 8)


@pytest.mark.parametrize(
    "types",
    [(Q.Q8_0, Q.IQ4_NL), (Q.Q5_0, Q.Q5_1), (Q.Q4_0, Q.Q4_1)],
    ids=lambda t: "+".join(q.name for q in t),
)
def test_a_part_converted_in_chunks_equals_one_converted_whole(monkeypatch, types):
    """Matrices of one layout stack into one part, converted CHUNK_ROWS rows at a time: chunk edges inside a
    matrix and between two of different types, and rows that are no whole group, give the whole's buffers."""
    import gguf_quants

    from kvd.model.layers import gguf_linear

    rng = np.random.default_rng(1)
    parts = [
        (name, gguf_quants.quantize(rng.standard_normal((rows, 64)).astype(np.float32), qtype), qtype)
        for name, rows, qtype in (("q", 20, types[0]), ("k", 13, types[1]), ("v", 7, types[0]))
    ]
    whole = GGUFLinear(64, parts, None, torch.float32)
    monkeypatch.setattr(gguf_linear, "CHUNK_ROWS", 16)
    chunked = GGUFLinear(64, parts, None, torch.float32)
    assert [s.rows for s in chunked.specs] == [40] and chunked.out_sizes == [20, 13, 7]
    for (name, a), (_, b) in zip(whole.named_buffers(), chunked.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    expected = np.concatenate([gguf.quants.dequantize(raw, qtype) for _, raw, qtype in parts])
    out = cpu_native.dequantize(chunked.part_weight(0), 0, torch.empty(40, 64))
    np.testing.assert_array_equal(out.numpy(), expected)


def _logits(loaded, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Last-position logits of each sequence, all prefilled together in one varlen step."""
    model, block = loaded.model, 16
    per_seq = -(-max(len(s) for s in sequences) // block)
    dtype = next(model.parameters()).dtype
    model.bind_kv_cache(
        allocate_kv_cache(model.config, per_seq * len(sequences), block, dtype, torch.device("cpu"))
    )
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(sequences))]
    lens = [len(s) for s in sequences]
    attn = build_attention_metadata(tables, lens, lens, block, torch.device("cpu"), model.attention_backend)
    ids = torch.tensor([t for s in sequences for t in s])
    positions = torch.cat([torch.arange(n) for n in lens])
    with torch.inference_mode():
        hidden = model(ids, positions, attn)
        last = torch.tensor(lens).cumsum(0) - 1
        return list(model.compute_logits(hidden[last]))


def test_auto_runs_each_matrix_in_its_file_type_without_a_float_copy(files, caplog):
    with caplog.at_level(logging.WARNING):
        loaded = load_model(str(files), dtype="float32", quantization="auto")
    assert loaded.quantization == "gguf"
    # What `info` reports: tensors and bytes per type, as the file holds them.
    stored = GGUFFile(files).tensors  # a tied model has no output.weight
    for qtype in set(TYPES.values()):
        count = sum(1 for name, t in TYPES.items() if t == qtype and name in stored)
        assert loaded.file_types[qtype.name][0] == count
        assert (
            loaded.file_types[qtype.name][1]
            >= count * 256 * 256 * gguf.GGML_QUANT_SIZES[qtype][1] // 256 // 2
        )
    # The one type without a kernel is dequantized, and said so by name.
    assert any("blk.1.attn_v.weight" in r.getMessage() and "TQ2_0" in r.getMessage() for r in caplog.records)
    matrices = [n for n, p in loaded.model.named_parameters() if p.dim() > 1]
    assert matrices == []  # no float embedding table, lm_head or linear weight left
    qkv = loaded.model.model.layers[0].self_attn.qkv_proj
    # q and k (Q4_K) share a part, v (Q6_K) has its own; layer 1's q, k and v are three parts (5-bit blocks,
    # 8-bit blocks, v's float values); its IQ4_XS gate runs in the file's super-blocks beside a Q4_1 up.
    assert [(s.kind, s.ggml, s.rows) for s in qkv.specs] == [("super", 12, 256 + 128), ("super", 14, 128)]
    qkv1 = loaded.model.model.layers[1].self_attn.qkv_proj
    assert [(s.kind, s.bits, s.rows) for s in qkv1.specs] == [
        ("blocks", 5, 256),
        ("blocks", 8, 128),
        ("float", 32, 128),
    ]
    gate_up1 = loaded.model.model.layers[1].mlp.gate_up_proj
    assert [(s.kind, s.ggml, s.bits) for s in gate_up1.specs] == [("super", 23, 0), ("blocks", 0, 4)]
    file = GGUFFile(files)
    matrix_bytes = sum(i.nbytes for n, i in file.tensors.items() if n in TYPES)
    held = sum(b.numel() * b.element_size() for b in loaded.model.buffers() if b.dim() > 1)
    # The file's bytes (TQ2_0's [128, 256] dequantized in place of its own, 8-bit blocks at one byte a code) and
    # no more.
    dequantized = 128 * 256 * 4 - file.tensors["blk.1.attn_v.weight"].nbytes
    assert matrix_bytes < held < matrix_bytes + dequantized + 4 * 256 * 256


def test_logits_follow_the_dequantized_model(files):
    prompt = [5, 77, 120, 33, 9, 250, 14, 3]
    native = _logits(load_model(str(files), dtype="float32", quantization="gguf"), [prompt])[0]
    reference = _logits(load_model(str(files), dtype="float32", quantization="none"), [prompt])[0]
    # Only the activations' int8 rounding separates them.
    cosine = torch.nn.functional.cosine_similarity(native, reference, dim=0)
    assert cosine > 0.995, cosine
    assert (native - reference).abs().max() < 0.1 * reference.abs().max()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sequence_is_the_same_bits_alone_and_in_a_batch(files, dtype):
    loaded = load_model(str(files), dtype=dtype, quantization="gguf", attention_backend="native")
    a, b, c = [5, 77, 120, 33, 9], list(range(40, 90)), [1, 2, 3]
    alone = _logits(loaded, [a])[0]
    together = _logits(loaded, [b, a, c])
    assert torch.equal(alone, together[1])


def _dense(linear: GGUFLinear) -> torch.Tensor:
    """A GGUFLinear's weight [N, K] as float32 values, part by part."""
    parts = []
    for i, spec in enumerate(linear.specs):
        if spec.kind == "float":
            data = getattr(linear, f"data{i}")
            parts.append((cpu_native.unpack(data) if spec.tiles else data).float())
        else:
            out = torch.empty(spec.rows, linear.in_features)
            parts.append(cpu_native.dequantize(linear.part_weight(i), 0, out))
    return torch.cat(parts)


# Our fused linears -> the Hugging Face matrices stacked in them.
FUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def test_tensor_parallel_ranks_hold_their_slices_in_the_files_types(files, caplog):
    """Each rank of two holds its slice of every matrix, the values of the whole file's: rows (q/k/v, gate/up,
    the vocabulary, padded) in any type, columns (o, down) on their types' blocks, or dequantized with a warning
    where a rank's columns are no whole blocks (o's 128 of Q5_K's 256)."""
    from kvd.distributed.shard import Shard, ShardPlan

    whole = load_model(str(files), dtype="float32", quantization="gguf")
    for rank in (0, 1):
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            part = load_model(str(files), dtype="float32", quantization="gguf", shard=Shard(rank, 2))
        plan = ShardPlan(whole.config, Shard(rank, 2))
        warned = [r.getMessage() for r in caplog.records if "no whole" in r.getMessage()]
        columns = f"{128 * rank}..{128 * rank + 128}"
        assert warned == [
            f"blk.0.attn_output.weight: this rank's columns {columns} are no whole Q5_K blocks; dequantized"
        ]
        linears = [(n, m) for n, m in whole.model.named_modules() if isinstance(m, GGUFLinear)]
        assert len(linears) >= 4 * 2 + 1  # two layers' four, the table (and an untied output)
        for name, module in linears:
            mine = part.model.get_submodule(name)
            parent, _, attr = name.rpartition(".")
            if name == "output_proj":
                hf = ["lm_head.weight"]
            elif attr == "table":
                hf = ["model.embed_tokens.weight"]
            else:
                hf = [f"{parent}.{m}.weight" for m in FUSED.get(attr, (attr,))]
            matrices = _dense(module).split(module.out_sizes)
            expected = torch.cat([plan.tensor(h, m) for h, m in zip(hf, matrices, strict=True)])
            assert torch.equal(_dense(mine), expected), name


def _greedy(path, dtype: str, native_loop: bool, max_num_seqs: int) -> list:
    """Greedy tokens and logprobs of test_native_decode's prompts, with the native layer loop or Python's."""
    from test_native_decode import GREEDY, PROMPTS

    llm = LLM(str(path), dtype=dtype, quantization="gguf", kv_cache_memory=2**24, max_num_seqs=max_num_seqs)
    model = llm.engine.runner.model
    if not native_loop:
        model._native_decoder = False
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert isinstance(model._native_decoder, NativeDecoder) == native_loop
    return [(o.token_ids, [s.logprob for s in o.logprobs]) for o in outputs]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_decode_steps_run_natively_with_the_python_loops_bits_alone_and_batched(files, dtype):
    """The native layer loop takes projections of several parts in their own types (layer 0's Q4_K q, k beside
    a Q6_K v; layer 1's Q5_1 q, Q8_0 k and dequantized TQ2_0 v, an IQ4_XS gate beside a Q4_1 up): the Python
    loop's bits, one sequence at a time or all together."""
    native = _greedy(files, dtype, True, 4)
    assert native == _greedy(files, dtype, False, 4)
    assert native == _greedy(files, dtype, True, 1)


@pytest.mark.parametrize("qtype", [Q.F16, Q.BF16], ids=lambda q: q.name)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_16_bit_float_files_run_as_their_values_without_a_float32_copy(tmp_path, qtype, dtype):
    """An F16 or BF16 file's matrices stay 16-bit: as stored in a float32 model (widened as they are read), in
    bf16 tiles in a bf16 one (F16 cast as a float16 checkpoint is); logits follow the file's values in float32,
    a sequence is the same bits alone and in a batch, and decode steps run in the native layer loop with the
    Python loop's bits."""
    path = tmp_path / f"tiny-{qtype.name}.gguf"
    write_tiny_gguf(tiny_hf_model("llama", **SHAPE), path, tensor_types=dict.fromkeys(TYPES, qtype))
    loaded = load_model(str(path), dtype=dtype, quantization="auto", attention_backend="native")
    assert loaded.quantization == "gguf"
    stored = torch.bfloat16 if qtype == Q.BF16 or dtype == "bfloat16" else torch.float16
    linears = [m for m in loaded.model.modules() if isinstance(m, GGUFLinear)]
    held = [b for m in linears for b in m.buffers() if b.dim() > 1]
    assert {b.dtype for b in held} == {stored}
    file = GGUFFile(path)
    assert sum(b.numel() * 2 for b in held) == sum(i.nbytes for n, i in file.tensors.items() if n in TYPES)
    for m in linears:  # in the packed kernels' order where they take the model's dtype and the shape
        assert m.specs[0].tiles == (stored == loaded.dtype and cpu_native.packable(m.data0))
    # Some are packed wherever the kernels have a packed order for that dtype (bf16's: AMX or AVX-512 BF16).
    packs = stored == torch.float32 or cpu_native.bf16_kernel_order()
    assert any(m.specs[0].tiles for m in linears) == (stored == loaded.dtype and packs)

    prompt = [5, 77, 120, 33, 9, 250, 14, 3]
    native = _logits(loaded, [prompt])[0]
    reference = _logits(load_model(str(path), dtype=dtype, quantization="none"), [prompt])[0]
    if dtype == "float32":  # the same float32 values, summed in another order
        torch.testing.assert_close(native, reference, rtol=0, atol=1e-4 * reference.abs().max().item())
    else:
        assert torch.nn.functional.cosine_similarity(native.float(), reference.float(), dim=0) > 0.999
    assert torch.equal(native, _logits(loaded, [list(range(40, 90)), prompt, [1, 2, 3]])[1])
    assert _greedy(path, dtype, True, 4) == _greedy(path, dtype, False, 4)


@pytest.mark.parametrize("fault", ["truncated", "unknown type", "ragged rows"])
def test_serving_a_corrupt_file_is_one_line_and_status_2(files, tmp_path, fault):
    from daemon_fixtures import REPO, daemon_env
    from test_loader import _patched_tensor_entry

    bad = tmp_path / "bad.gguf"
    if fault == "truncated":
        bad.write_bytes(files.read_bytes()[: files.stat().st_size - 1000])
        expected = "past the end"
    elif fault == "unknown type":
        _patched_tensor_entry(files, bad, "blk.0.attn_v.weight", "type", 99)
        expected = "blk.0.attn_v.weight has unknown type id 99"
    else:
        _patched_tensor_entry(files, bad, "blk.0.attn_v.weight", "dim", 250)
        expected = "blk.0.attn_v.weight: rows of .* not whole Q6_K blocks"
    command = [
        sys.executable,
        "-m",
        "kvd.cli",
        "serve",
        "--model",
        str(bad),
        "--listen",
        f"ipc://{tmp_path}/s",
    ]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, env=daemon_env(), timeout=120)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert re.search(rf"kvd serve: .*bad.gguf.*{expected}", result.stderr), result.stderr


def test_mxfp4_blocks_whose_scale_fp16_cannot_hold_are_dequantized():
    """MXFP4's scale is a power of two, 2^(e - 128) for its exponent byte e: held in an fp16 from 2^-24 to 2^15."""
    from kvd.model.layers.gguf_linear import held_exactly

    values = np.random.default_rng(2).standard_normal((8, 64)).astype(np.float32)
    raw = gguf.quants.quantize(values, Q.MXFP4)
    assert held_exactly(raw, Q.MXFP4)
    for exponent, held in ((104, True), (103, False), (143, True), (144, False)):
        edited = raw.copy()
        edited[3, 17] = exponent  # row 3's second block's exponent byte
        assert held_exactly(edited, Q.MXFP4) == held
    # An all-zero block (+0 and -0 codes), as quantizers write it with exponent 0 (or any): zeros, held exactly.
    edited = raw.copy()
    edited[3, 17] = 0
    edited[3, 18:34] = np.array([0x00, 0x88] * 8, np.uint8)
    assert held_exactly(edited, Q.MXFP4)
    layer = GGUFLinear(64, [("w", edited, Q.MXFP4)], None, torch.float32)
    out = cpu_native.dequantize(layer.part_weight(0), 0, torch.empty(8, 64))
    np.testing.assert_array_equal(out.numpy(), gguf.quants.dequantize(edited, Q.MXFP4))
