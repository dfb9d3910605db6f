"""Which models a daemon serves, from `--model` (repeatable) and `--models-dir`: names and sources, read before
anything heavy is imported, so that a mistake fails at once."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")


@dataclass(frozen=True)
class ModelSpec:
    """A model to serve: its name (None: the loader's, from what was asked) and where it comes from (None: the
    bundled default)."""

    name: str | None
    source: str | None

    def default_name(self) -> str:
        """The name of a model given without one, before it loads: its file's stem, its folder's name, or the
        hub id as given."""
        if self.source is None:
            return "default"
        path = Path(self.source)
        if path.is_file():
            return path.stem
        return path.name if path.is_dir() else self.source


def model_specs(values: Sequence[str], models_dir: str | None) -> list[ModelSpec]:
    """The models of `--model` (PATH, hub id, or NAME=PATH; repeatable) and `--models-dir` (each GGUF file and
    model folder in it, named by its file stem or folder name); the bundled default when there are none."""
    specs = []
    for value in values:
        name, sep, source = value.partition("=")
        if sep and _NAME.fullmatch(name) and source:
            specs.append(ModelSpec(name, source))
        else:
            specs.append(ModelSpec(None, value))
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
