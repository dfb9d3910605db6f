#!/usr/bin/env bash
# The GPU check, for a CUDA host such as an H200, from the repository root. It fits one 10-minute device call:
# every step, the install included, has a hard time limit (60 + 150 + 100 + 60 + 150 s, 520 s in all; about 4
# minutes on an H200):
#   1. the kernel and backend tests on CUDA (tests/test_kernels.py, tests/test_backends.py): kernels against
#      their torch references, backends against the torch backend, padded graph steps against eager ones;
#   2. greedy parity against transformers on a small random Qwen3, every backend that runs there, float32
#      (identical tokens) and bfloat16 (gpu_bench.BF16_MIN_SHARED), with real CUDA graphs replayed between eager
#      prefill steps and torch.compile (Inductor), and with --enforce-eager;
#   3. batch invariance, measured and printed (not a failure): 8 prompts alone and in a batch of 32, whether
#      they keep their tokens and logprobs bit for bit;
#   4. nano-vllm's throughput workload (256 sequences, 100-1024 tokens in and out) on a random Qwen3-0.6B:
#      output tokens/s with graphs + compile, the --enforce-eager figure beside it, and the steps each replayed;
#   5. on a host with two GPUs or more, a TP=2 run over NCCL (benchmarks/tensor_parallel.py --check), whose
#      greedy tokens must be TP=1's (120 s more); skipped with a message on one GPU.
# It exits non-zero when any check fails.
#
#   benchmarks/gpu_check.sh                 run it (PYTHON=python3 by default; KVD_BACKEND=auto for steps 3, 4)
#   benchmarks/gpu_check.sh --cpu           steps 2-4 on the CPU with a tiny model (checks the script;
#                                           step 1 runs in the ordinary test suite, in Triton's interpreter)
#   benchmarks/gpu_check.sh --fetch-wheels  where pip can download: put the wheels the H200 image lacks
#                                           (the list below) into build/gpu-wheels/
#
# The host needs torch with CUDA, triton, transformers, tokenizers, safetensors, numpy, xxhash, msgpack, tqdm,
# pytest and hypothesis; flash-attn is optional (without it, auto picks triton). No network is used: wheels
# found in build/gpu-wheels/ (ignored by git; carry it to the host) are installed into a scratch folder first.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=build/gpu-wheels

if [[ "${1:-}" == "--fetch-wheels" ]]; then
  # The H200 image runs Python 3.12 and lacks what kvd's engine imports besides torch and transformers:
  # gguf, pyzmq, llguidance, jsonschema (and its own needs), cffi; its transformers is older than pyproject's
  # and its setuptools may be too old for pyproject's license string (the editable install below).
  "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$WHEELS" \
    gguf==0.19.0 pyzmq==27.3.0 transformers==5.24.0 llguidance==1.9.1 jsonschema==4.26.0 \
    jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1 cffi==2.1.1 pycparser==3.12 \
    setuptools==84.2.1 wheel==0.48.0
  exit 0
fi

export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
unset TRITON_INTERPRET  # kernels must compile for the GPU, not run in the interpreter
started=$SECONDS
step() { echo; echo "== $1 (at $((SECONDS - started)) s)"; }

DEVICE=cuda
BENCH_ARGS=()
if [[ "${1:-}" == "--cpu" ]]; then
  DEVICE=cpu
  BENCH_ARGS=(--tiny --backends torch)
fi

step "environment"
if [[ $DEVICE == cuda ]]; then
  "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: this script is for a GPU host (--cpu checks it on a CPU)')"
fi
if compgen -G "$WHEELS/*.whl" >/dev/null; then
  timeout 60 "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/kvd-wheels "$WHEELS"/*.whl
  export PYTHONPATH=/tmp/kvd-wheels${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/clients/python${PYTHONPATH:+:$PYTHONPATH}  # kvd_client, for the tests' conftest
# kvd's dependencies come from the wheels above or the host; kvd itself is installed in place.
"$PY" -c "import kvd.kernels" 2>/dev/null || timeout 60 "$PY" -m pip install -q --no-deps --no-build-isolation -e .
"$PY" - <<'EOF'
import importlib.util, sys
import torch
missing = [m for m in ("triton", "transformers", "gguf", "zmq", "xxhash", "msgpack", "pytest") if not importlib.util.find_spec(m)]
if missing:
    sys.exit(f"missing packages: {missing}; run benchmarks/gpu_check.sh --fetch-wheels where pip can download")
import triton
flash = importlib.util.find_spec("flash_attn") is not None
device = torch.cuda.get_device_name() if torch.cuda.is_available() else "CPU"
print(f"{device}, torch {torch.__version__}, triton {triton.__version__}, flash-attn {'yes' if flash else 'no'}")
EOF

# Each check runs under its own time limit and the next one runs even if it fails; the exit status tells.
failed=()
check() {  # check SECONDS NAME COMMAND...
  local limit=$1 name=$2
  shift 2
  step "$name"
  timeout "$limit" "$@" || failed+=("$name (exit $?)")
}
if [[ $DEVICE == cuda ]]; then
  # The CPU smoke run of gpu_bench is left out: the real runs follow.
  check 150 "kernel and backend tests on CUDA" \
    "$PY" -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_backends.py -k "not smoke_run"
fi
check 100 "greedy parity against transformers (float32 identical, bfloat16 by threshold)" \
  "$PY" -m benchmarks.gpu_bench parity --device "$DEVICE" "${BENCH_ARGS[@]}"
check 60 "batch invariance, measured: 8 prompts alone and in a batch of 32 (float32, bfloat16; graphs, eager)" \
  "$PY" -m benchmarks.gpu_bench invariance --device "$DEVICE" --attention-backend "${KVD_BACKEND:-auto}" "${BENCH_ARGS[@]}"
check 150 "throughput: nano-vllm workload (256 sequences, 100-1024 tokens in and out), random Qwen3-0.6B" \
  "$PY" -m benchmarks.gpu_bench throughput --device "$DEVICE" --attention-backend "${KVD_BACKEND:-auto}" "${BENCH_ARGS[@]}"
if [[ $DEVICE == cuda ]]; then
  # Tensor parallel over NCCL needs a GPU per rank: on a single GPU there is nothing to run.
  if [[ $("$PY" -c "import torch; print(torch.cuda.device_count())") -ge 2 ]]; then
    check 120 "tensor parallel: a TP=2 step over NCCL (SmolLM2, float32; greedy tokens equal to TP=1)" \
      "$PY" -m benchmarks.tensor_parallel --device cuda --batch 4 --steps 8 --check
  else
    step "tensor parallel: skipped, this host has one GPU (TP=2 over NCCL needs two)"
  fi
fi

step "done"
if ((${#failed[@]})); then
  printf 'FAILED: %s\n' "${failed[@]}"
  exit 1
fi
