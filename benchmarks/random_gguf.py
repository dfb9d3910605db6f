"""What the random-weight GGUF writers (benchmarks.moe_model, benchmarks.hybrid_model) share: a writer with the
bundled SmolLM2's tokenizer and vocabulary, seeded unit-variance matrices, and the F32 file quantized by
llama.cpp's llama-quantize (from $LLAMA_CPP_BIN) into each asked type."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from benchmarks.host import bundled_gguf


def tokenizer_writer(path: Path, arch: str) -> tuple[gguf.GGUFWriter, int]:
    """A GGUF writer for `arch` holding the bundled model's tokenizer fields; and the vocabulary's size."""
    source = gguf.GGUFReader(bundled_gguf())
    tokenizer = [f for f in source.fields.values() if f.name.startswith("tokenizer.")]
    vocab = len(next(f for f in tokenizer if f.name == "tokenizer.ggml.tokens").contents())
    writer = gguf.GGUFWriter(path, arch)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    for field in tokenizer:  # each value in its own GGUF type
        sub_type = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), field.types[0], sub_type)
    return writer, vocab


def matrices(seed: int) -> Callable[..., np.ndarray]:
    """matrix(*shape, scale=1.0): seeded normal values scaled so that a layer keeps unit variance."""
    rng = np.random.default_rng(seed)

    def matrix(*shape: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal(shape, dtype=np.float32) * scale / np.sqrt(shape[-1])).astype(np.float32)

    return matrix


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file(progress=True)
    writer.close()


def write_and_quantize(out: Path, stem: str, types: str, write_f32: Callable[[Path], None]) -> None:
    """OUT/STEM-f32.gguf (written once), then a copy in each of the comma-separated llama-quantize `types`;
    prints each file's path."""
    out.mkdir(parents=True, exist_ok=True)
    f32 = out / f"{stem}-f32.gguf"
    if not f32.exists():
        write_f32(f32)
    print(f32)
    quantize = Path(os.environ.get("LLAMA_CPP_BIN", "")) / "llama-quantize"
    if not quantize.is_file():
        print("no $LLAMA_CPP_BIN/llama-quantize: only the F32 file was written")
        return
    for kind in types.split(","):
        target = out / f"{stem}-{kind.lower()}.gguf"
        if not target.exists():
            subprocess.run([str(quantize), str(f32), str(target), kind], check=True, capture_output=True)
        print(target)
