"""Where the native kernels' library may be loaded from (never a place another user can write), and the
portable C build that runs on CPUs without AVX2."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvd.kernels import native_build
from kvd.private_cache import private

ROOT = Path(__file__).resolve().parent.parent
# The portable C paths: no AVX-512, AVX2, AVX, F16C or FMA, whatever this CPU has.
PORTABLE = "-mno-avx512f -mno-avx2 -mno-avx -mno-f16c -mno-fma"
AVX2 = "-mno-avx512f -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 -mno-avxvnni"  # an AVX2 EPYC's build, here
PLANTED_C = """
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE* f = fopen(getenv("KVD_PLANTED_MARKER"), "w");
    if (f) fclose(f);
}
"""
PROBE = (
    "from kvd.kernels import cpu_native as c, native_build as b\n"
    "print(c.available()); print(b.library_path()); print(b.isa(b.library()) if c.available() else '')"
)


def _probe(env: dict[str, str]) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in ("XDG_CACHE_HOME", "CACHE_DIRECTORY")}
    return subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=ROOT,
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def library_name(tmp_path_factory) -> str:
    """The file name this host's build gets (the key of its source, compiler, flags and CPU)."""
    folder = tmp_path_factory.mktemp("clean")
    proc = _probe({"KVD_CACHE_DIR": str(folder)})
    assert proc.stdout.splitlines()[0] == "True", proc.stderr
    return Path(proc.stdout.splitlines()[1]).name


def _plant(path: Path) -> None:
    """A shared object that, if anyone loads it, leaves a marker file."""
    source = path.with_suffix(".c")
    source.write_text(PLANTED_C)
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(path)], check=True)
    source.unlink()


def _run_with_planted(tmp_path: Path, cache_root: Path, planted: Path) -> subprocess.CompletedProcess:
    _plant(planted)
    marker = tmp_path / "loaded-the-planted-library"
    home = tmp_path / "home"
    home.mkdir(mode=0o700, exist_ok=True)
    proc = _probe({"KVD_CACHE_DIR": str(cache_root), "HOME": str(home), "KVD_PLANTED_MARKER": str(marker)})
    assert not marker.exists(), "the planted library was loaded"
    assert proc.stdout.splitlines()[0] == "True", proc.stderr  # a clean build runs instead
    assert Path(proc.stdout.splitlines()[1]) != planted
    assert "refusing" in proc.stderr
    return proc


def test_a_world_writable_cache_folder_is_refused(tmp_path, library_name):
    folder = tmp_path / "cache" / "native"
    folder.mkdir(parents=True)
    folder.chmod(0o777)
    proc = _run_with_planted(tmp_path, tmp_path / "cache", folder / library_name)
    assert "the cache folder" in proc.stderr and "drwxrwxrwx" in proc.stderr
    # The next candidate, ~/.cache/kvd, is private: the clean build lives there.
    assert Path(proc.stdout.splitlines()[1]).parent == tmp_path / "home" / ".cache" / "kvd" / "native"


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a folder to another user needs root")
def test_a_cache_folder_of_another_user_is_refused(tmp_path, library_name):
    folder = tmp_path / "cache" / "native"
    folder.mkdir(parents=True, mode=0o755)
    planted = folder / library_name
    _plant(planted)
    os.chown(folder, 65534, 65534)
    os.chown(planted, 65534, 65534)
    proc = _run_with_planted(tmp_path, tmp_path / "cache", planted)
    assert "owner uid 65534" in proc.stderr


def test_a_symlinked_cache_folder_is_refused(tmp_path, library_name):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "native").symlink_to(elsewhere)
    _run_with_planted(tmp_path, tmp_path / "cache", elsewhere / library_name)


def test_a_library_writable_by_others_in_a_private_folder_is_rebuilt(tmp_path, library_name):
    folder = tmp_path / "cache" / "native"
    folder.mkdir(parents=True, mode=0o700)
    planted = folder / library_name
    _plant(planted)
    planted.chmod(0o666)
    marker = tmp_path / "loaded-the-planted-library"
    proc = _probe({"KVD_CACHE_DIR": str(tmp_path / "cache"), "KVD_PLANTED_MARKER": str(marker)})
    assert "refusing the cached library" in proc.stderr
    assert not marker.exists() and proc.stdout.splitlines()[0] == "True"
    # Rebuilt in place: the file is now this user's alone.
    assert Path(proc.stdout.splitlines()[1]) == planted and private(planted)


def test_the_temporary_fallback_is_used_only_when_private(tmp_path, library_name):
    """No cache folder can be made (a read-only home, say): `<tmp>/kvd-native-<uid>` is taken only when it is
    this user's; one planted there by someone else makes kvd build into a fresh private folder."""
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    shared = tmp / f"kvd-native-{os.getuid()}"
    shared.mkdir()
    shared.chmod(0o777)
    _plant(shared / library_name)
    marker = tmp_path / "loaded-the-planted-library"
    env = {"KVD_CACHE_DIR": str(blocker), "HOME": str(blocker), "TMPDIR": str(tmp)}
    proc = _probe(env | {"KVD_PLANTED_MARKER": str(marker)})
    assert not marker.exists() and proc.stdout.splitlines()[0] == "True", proc.stderr
    built = Path(proc.stdout.splitlines()[1])
    assert built.parent.parent == tmp and built.parent != shared and private(built.parent)
    assert "for this process only" in proc.stderr
    (shared / library_name).unlink()
    shared.chmod(0o700)  # now private: used as the cache
    proc = _probe(env)
    assert Path(proc.stdout.splitlines()[1]).parent == shared


# CPUs whose paths this machine may lack, for the compiler's -march (after kvd's -march=native): AVX-512 without
# VNNI, with VNNI, with BF16 but no AMX, with AMX; AVX-VNNI without AVX-512. Each combination's guards must leave
# no function unused and no call undeclared.
OTHER_CPUS = [
    f"-march={cpu}"
    for cpu in ("skylake-avx512", "icelake-server", "cooperlake", "sapphirerapids", "alderlake")
]


@pytest.mark.parametrize("extra", ["", PORTABLE, *OTHER_CPUS])
def test_the_kernels_compile_without_warnings_or_variable_length_arrays(tmp_path, extra):
    flags = [*extra.split(), "-Wall", "-Wextra", "-Wvla", "-Werror"]
    native_build.compile_sources(os.environ.get("CC", "cc"), native_build.SOURCES, tmp_path / "k.so", flags)


def test_the_library_exports_the_abi_alone():
    """The kernels' files call one another through hidden functions: the library exports the functions that
    cpu_kernels.h declares and no others (an internal name exported could bind to another library's)."""
    nm, path = shutil.which("nm"), native_build.library_path()
    if nm is None or path is None:
        pytest.skip("needs nm and a build of the kernels")
    out = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in out.stdout.splitlines() if line.split()[-2] in ("T", "t")}
    assert exported == set(re.findall(r"\b(kvd_\w+)\(", native_build.declarations()))


def _host_past_avx2() -> bool:
    """Whether this CPU's own build goes past AVX2 (AVX-512, AMX or AVX-VNNI paths); where it does not, the AVX2
    build is the host's, which the rest of the suite runs."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return bool(flags & {"avx512f", "amx_tile", "avx_vnni"})


NARROWER = ["portable", *(["avx2"] if _host_past_avx2() else [])]
# What the narrower builds run of the kernels' tests: the kernels, not the real model's file (slow in plain C) nor
# how a library is built and cached (this module's own concern).
NOT_KERNELS = "not smollm2 and not built_once and not without_a_compiler"


@pytest.fixture(scope="module")
def narrower_caches(tmp_path_factory) -> Path:
    """A cache folder for each narrower build, shared by the tests that run it (each build once)."""
    return tmp_path_factory.mktemp("narrower")


@pytest.mark.parametrize("build", NARROWER)
def test_the_narrower_builds_pass_the_kernel_tests(narrower_caches, build):
    """The plain-C paths (CPUs without AVX2/FMA) and the AVX2 ones (a host past AVX2 runs its own build
    otherwise) against the same torch references as the host's."""
    flags = PORTABLE if build == "portable" else AVX2
    cache = {"KVD_NATIVE_CFLAGS": flags, "KVD_CACHE_DIR": str(narrower_caches / build)}
    env = os.environ | cache
    isa = _probe(cache).stdout.splitlines()[2]
    if build == "portable":
        assert isa == "portable"
    else:
        assert "avx512" not in isa and "amx" not in isa
    tests = [
        "tests/test_cpu_native.py",
        "tests/test_quantized_linear.py",
        "tests/test_super_linear.py",
        "tests/test_native_decode.py",
    ]
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests, "-k", NOT_KERNELS],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert " passed" in proc.stdout.splitlines()[-1]


LINEAR_PROBE = """
import sys, torch
from kvd.kernels import cpu_native, native_build
from kvd.model.layers.quantized_linear import NativeInt4Linear, NativeInt8Linear
torch.manual_seed(0)
out = {"isa": native_build.isa(native_build.library())}
for cls in (NativeInt4Linear, NativeInt8Linear):
    layer = cls(torch.randn(150, 96) * 0.05, torch.randn(150))
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(40, 96) * 2).to(dtype)
        out[cls.bits, str(dtype)] = cpu_native.linear(x, layer.native_weight())
# GGUF super-block weights: random bytes (every code, scale and high bit), finite fp16 multipliers.
for name, halves in (("Q4_K", (0, 2)), ("Q5_K", (0, 2)), ("Q6_K", (208,)), ("IQ4_XS", (0,))):
    size = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210, "IQ4_XS": 136}[name]
    raw = torch.randint(0, 256, (21, 2, size), dtype=torch.uint8)
    for at in halves:
        raw[:, :, at : at + 2] = (torch.rand(21, 2, 1) * 0.01 + 1e-4).half().view(torch.uint8)
    raw = raw.reshape(21, -1).contiguous()
    weight = cpu_native.super_weight(cpu_native.SUPER_TYPES[name], raw, 512)
    for dtype in (torch.float32, torch.bfloat16):  # one row (decoded in registers on AVX2), and 70
        x = (torch.randn(70, 512) * 2).to(dtype)
        out[name, str(dtype)] = torch.cat([cpu_native.linear(x[:1], weight), cpu_native.linear(x, weight)])
# Gated DeltaNet's convolution and recurrence (plain C on every build): two sequences, a snapshot, bf16 and float32.
from kvd.distributed.step import RecurrentRows
from kvd.model.layers.recurrent_state import RecurrentStep
step = RecurrentStep.build([5, 9], [RecurrentRows(0, -1), RecurrentRows(1, -1, ((4, 2),))])
for dtype in (torch.float32, torch.bfloat16):
    qkv, a, b = torch.randn(14, 64).to(dtype), torch.randn(14, 4).to(dtype), torch.randn(14, 4).to(dtype)
    conv, state = torch.zeros(3, 3, 64, dtype=dtype), torch.zeros(3, 4, 8, 8)
    core = cpu_native.gated_delta(
        qkv, a, b, torch.randn(64, 4), torch.randn(4), torch.randn(4), conv, state, step.starts_t, step.kernel_args, 2
    )
    out["gated delta", str(dtype)] = torch.cat([core.float().flatten(), state.flatten(), conv.float().flatten()])
# GGUF's 5-bit blocks (the 4-bit kernels with fifth bits): random bytes, finite fp16 multipliers; 2 rows take eight
# weight rows at a time, 70 VNNI outer products where the build has them.
from gguf import GGMLQuantizationType as Q
from kvd.model.layers.gguf_linear import GGUFLinear
for qtype, size, halves in ((Q.Q5_0, 22, (0,)), (Q.Q5_1, 24, (0, 2))):
    raw = torch.randint(0, 256, (37, 9, size), dtype=torch.uint8)
    for at in halves:
        raw[:, :, at : at + 2] = (torch.rand(37, 9, 1) * 0.01 + 1e-4).half().view(torch.uint8)
    layer = GGUFLinear(288, [("w", raw.reshape(37, -1).numpy(), qtype)], torch.randn(37), torch.float32)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(70, 288) * 2).to(dtype)
        out[qtype.name, str(dtype)] = torch.cat([layer(x[:2]), layer(x)])
weight, x = torch.randn(48, 96), torch.randn(9, 96)
panels = cpu_native.pack(weight)
out["panels"] = cpu_native.linear(x, cpu_native.linear_weight(32, panels, tiles=True))
for dtype in (torch.float32, torch.bfloat16):  # 100 values: twelve SIMD steps of eight, then four in order
    x, residual = (torch.randn(5, 100) * 3).to(dtype), torch.randn(5, 100).to(dtype)
    out["norm", str(dtype)] = cpu_native.add_rms_norm(x, residual, (torch.rand(100) + 0.5).to(dtype), 1e-5)[0]
# SIMD exponentials (plain C calls expf): SiLU past the last 16 and 8 lanes, and float32 attention (a softmax over
# 16s, 8s and a tail; 16-lane value sums on AVX-512, 8-lane on AVX2), twelve sequences streaming their blocks.
for dtype in (torch.float32, torch.bfloat16):
    gate, up = (torch.randn(3, 1560) * 4).to(dtype), torch.randn(3, 1560).to(dtype)
    out["simd", "silu", str(dtype)] = cpu_native.silu_mul(gate, up)
pool, lens = torch.randn(2, 80, 16, 3, 64), torch.randint(1, 100, (12,), dtype=torch.int32)
tables = torch.randint(0, 80, (12, 7), dtype=torch.int32)
out["simd", "attention"] = cpu_native.paged_attention(torch.randn(12, 9, 64), pool, tables, lens, 0.125)
# The 8-bit pool: VNNI scores sixteen keys at a time where the build has it, plain C elsewhere and in block tails.
pool8 = torch.zeros(2, 80, 16, 3, 68, dtype=torch.int8)
cpu_native.store_kv(pool[0].view(-1, 3, 64), pool[1].view(-1, 3, 64), pool8, torch.arange(80 * 16))
out["simd", "int8 pool"] = cpu_native.paged_attention(torch.randn(12, 9, 64), pool8, tables, lens, 0.125)
# The 8-bit rows themselves (16 codes at a time on AVX-512), rows of zeros, tiny values, a NaN and an inf among them.
for dtype in (torch.float32, torch.bfloat16):
    k, v = (torch.randn(2, 40, 2, 64) * torch.rand(2, 40, 2, 1) * 30).to(dtype)
    k[3, 0], k[4, 1], k[5, 0, 7], k[6, 1, 9], v[7, 0, 1] = 0, 1e-30, float("nan"), float("inf"), float("-inf")
    rows = torch.zeros(2, 3, 16, 2, 68, dtype=torch.int8)
    cpu_native.store_kv(k, v, rows, torch.arange(40))
    out["int8 rows", str(dtype)] = rows
torch.save(out, sys.argv[1])
"""


def test_every_instruction_set_computes_the_same_linears_and_norms(tmp_path, narrower_caches):
    """The host's build (AMX tiles, VNNI where the CPU has them), the AVX2 one (where the host's goes past it) and
    the portable C one give the same quantized, float32-panel and RMSNorm outputs bit for bit: those do not depend
    on the CPU's features.
    SiLU and float32 attention (over a float or an 8-bit pool), whose SIMD exponential differs from expf, are the
    same on AVX-512 and AVX2."""
    builds = {"host": "", **({"avx2": AVX2} if "avx2" in NARROWER else {}), "portable": PORTABLE}
    results = {}
    for name, flags in builds.items():
        out = tmp_path / f"{len(results)}.pt"
        # The host's build where the suite keeps it; the narrower ones where their kernel tests built them.
        cache = {} if name == "host" else {"KVD_CACHE_DIR": str(narrower_caches / name)}
        env = os.environ | {"KVD_NATIVE_CFLAGS": flags} | cache
        proc = subprocess.run(
            [sys.executable, "-c", LINEAR_PROBE, str(out)], cwd=ROOT, env=env, capture_output=True, text=True
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[name] = torch.load(out)
    assert results["portable"].pop("isa") == "portable"
    if "avx2" in results:
        assert results["avx2"].pop("isa") in ("avx2+fma", "portable")  # portable: a CPU without AVX2
    results["host"].pop("isa")
    narrower = [name for name in ("avx2", "portable") if name in results]
    for key, want in results["host"].items():
        for name in ["avx2"] if key[0] == "simd" else narrower:
            if name in results:
                assert torch.equal(results[name][key], want), (name, key)
