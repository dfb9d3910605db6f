"""dtype "auto" on a CPU: bfloat16 only where the cores multiply it natively."""

from __future__ import annotations

import pytest
import torch

from kvd.model.cpu_dtype import cpu_flags, pick_cpu_dtype
from kvd.model.loader import choose_dtype

AVX2_EPYC = "fpu sse2 avx avx2 fma f16c bmi2 avx_vnni"
SAPPHIRE_RAPIDS = "avx2 fma avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8"
ZEN4 = "avx2 fma avx512f avx512bw avx512_bf16"


@pytest.mark.parametrize(
    "flags,dtype,named",
    [
        (AVX2_EPYC, torch.float32, "neither"),
        ("avx2 fma avx512f avx512bw avx512_vnni", torch.float32, "neither"),  # Skylake/Cascade Lake server
        (SAPPHIRE_RAPIDS, torch.bfloat16, "amx_bf16 and avx512_bf16"),
        (ZEN4, torch.bfloat16, "avx512_bf16"),
        ("", torch.float32, "unreadable"),
    ],
)
def test_pick_cpu_dtype(flags, dtype, named):
    choice = pick_cpu_dtype(flags.split())
    assert choice.dtype == dtype
    assert named in choice.reason


def test_cpu_flags_reads_the_flags_line(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: x\nflags\t\t: {SAPPHIRE_RAPIDS}\n\nprocessor\t: 1\n")
    assert cpu_flags(cpuinfo) == frozenset(SAPPHIRE_RAPIDS.split())
    assert cpu_flags(tmp_path / "missing") == frozenset()


def test_choose_dtype_auto_follows_the_cpu_there_and_the_checkpoint_elsewhere():
    here = pick_cpu_dtype(cpu_flags())
    assert choose_dtype("auto", {"torch_dtype": "bfloat16"}, "cpu") == here
    assert choose_dtype("auto", {"torch_dtype": "float32"}, "cpu") == here
    assert choose_dtype("auto", {"torch_dtype": "bfloat16"}, "cuda").dtype == torch.bfloat16
    assert choose_dtype("auto", {}, "cuda").dtype == torch.float32
    asked = choose_dtype("bfloat16", {}, "cpu")
    assert asked.dtype == torch.bfloat16 and asked.reason == "as asked"


def test_engine_info_says_which_dtype_and_why(tmp_path):
    from tiny_models import save_tiny_llama

    from kvd.engine.llm_engine import LLMEngine

    engine = LLMEngine(model=str(save_tiny_llama(tmp_path)), kv_cache_memory=1 << 20)
    info = engine.info()
    here = pick_cpu_dtype(cpu_flags())
    assert (info["dtype"], info["dtype_reason"]) == (str(here.dtype).removeprefix("torch."), here.reason)
    assert info["quantization"] == "none"  # auto: a safetensors folder holds float weights
