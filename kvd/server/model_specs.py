"""Which models a daemon serves, from `--model` (repeatable) and `--models-dir`: names and sources, read before
anything heavy is imported, so that a mistake fails at once."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvd.engine.engine_args import EngineArgs

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
# The engine settings a model of a config file's [[models]] tables may set for itself (the others are the
# daemon's, for every model).
MODEL_SETTINGS = ("dtype", "quantization", "max_model_len", "pooling", "kv_cache_memory", "kv_cache_dtype")


@dataclass(frozen=True)
class ModelSpec:
    """A model to serve: its name (None: the loader's, from what was asked), where it comes from (None: the
    bundled default), its own engine settings (MODEL_SETTINGS, over the daemon's) and whether it is pinned."""

    name: str | None
    source: str | None
    settings: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    pinned: bool = False

    def engine_args(self, base: EngineArgs, **changes: Any) -> EngineArgs:
        """The daemon's engine settings for this model: its source and its own settings over `base`."""
        return replace(base, model=self.source, **self.settings, **changes)

    def default_name(self) -> str:
        """The name of a model given without one, before it loads: its file's stem, its folder's name, or the
        hub id as given."""
        if self.source is None:
            return "default"
        path = Path(self.source)
        if path.is_file():
            return path.stem
        return path.name if path.is_dir() else self.source


def model_specs(
    values: Sequence[str], models_dir: str | None, tables: Mapping[str, Mapping[str, Any]] | None = None
) -> list[ModelSpec]:
    """The models of `--model` (PATH, hub id, or NAME=PATH; repeatable) and `--models-dir` (each GGUF file and
    model folder in it, named by its file stem or folder name); the bundled default when there are none.
    `tables`: a config file's per-model settings (kvd.server.config_file), by the --model value they came as."""
    specs = []
    for value in values:
        own = dict((tables or {}).get(value, {}))
        pinned = bool(own.pop("pinned", False))
        name, sep, source = value.partition("=")
        if sep and _NAME.fullmatch(name) and source:
            specs.append(ModelSpec(name, source, own, pinned))
        else:
            specs.append(ModelSpec(None, value, own, pinned))
    if models_dir is not None:
        folder = Path(models_dir)
        if not folder.is_dir():
            raise FileNotFoundError(f"--models-dir {models_dir}: no such folder")
        found = [
            ModelSpec(entry.stem if entry.is_file() else entry.name, str(entry))
            for entry in sorted(folder.iterdir())
            if (entry.is_file() and entry.suffix == ".gguf")
            or (entry.is_dir() and (entry / "config.json").is_file())
        ]
        if not found:
            raise FileNotFoundError(
                f"--models-dir {models_dir}: no .gguf file or model folder (with config.json)"
            )
        specs += found
    return specs or [ModelSpec(None, None)]
