"""`kvd serve --config FILE`: a TOML file whose keys are the serve flags without dashes; flags given win."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from kvd.server.model_specs import MODEL_SETTINGS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - the 3.10 fallback, a declared dependency there
    import tomli as tomllib


class ConfigFileError(ValueError):
    """The config file is unreadable or holds a key or value `kvd serve` does not accept."""


def apply_config_file(parser: argparse.ArgumentParser, path: Path) -> None:
    """Make the file's settings the parser's defaults, so that flags on the command line override them."""
    try:
        settings = tomllib.loads(path.read_text())
    except OSError as e:
        raise ConfigFileError(f"cannot read the config file {path}: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"{path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigFileError(f"{path} is not valid TOML: {e}") from None
    flags = _flags(parser)
    defaults = {}
    if "models" in settings:  # [[models]] tables: more --model values, each with its own settings
        values, tables = _model_tables(settings.pop("models"), f"{path}: models", flags)
        models = settings.get("model", [])
        if not isinstance(models, str | list):
            raise ConfigFileError(f"{path}: model takes a string or a list of strings, got {models!r}")
        settings["model"] = [*([models] if isinstance(models, str) else models), *values]
        defaults["model_tables"] = tables
    for key, value in settings.items():
        action = flags.get(key)
        if action is None:
            raise ConfigFileError(
                f"{path}: unknown setting {key!r}; the settings are the `kvd serve` flags without dashes: "
                + ", ".join(sorted(flags))
            )
        defaults[action.dest] = _convert(action, value, f"{path}: {key}")
    parser.set_defaults(**defaults)


def _model_tables(
    tables: Any, where: str, flags: dict[str, argparse.Action]
) -> tuple[list[str], dict[str, dict[str, Any]]]:
    """([[models]] as --model values (NAME=PATH, or PATH), each value's own settings: MODEL_SETTINGS, checked and
    converted as their flags' values are, and pinned)."""
    if not isinstance(tables, list) or not all(isinstance(t, dict) for t in tables):
        raise ConfigFileError(f"{where} must be [[models]] tables, each with a path")
    values, settings = [], {}
    for i, table in enumerate(tables):
        table = dict(table)
        path, name = table.pop("path", None), table.pop("name", None)
        if not isinstance(path, str) or (name is not None and not isinstance(name, str)):
            raise ConfigFileError(
                f"{where}[{i}] needs a path (a folder, a .gguf file or a hub id) and may give a name"
            )
        unknown = sorted(set(table) - {*MODEL_SETTINGS, "pinned"})
        if unknown:
            raise ConfigFileError(
                f"{where}[{i}]: {', '.join(unknown)} cannot be set per model; a model's own settings are "
                + ", ".join((*MODEL_SETTINGS, "pinned"))
            )
        if not isinstance(table.get("pinned", False), bool):
            raise ConfigFileError(f"{where}[{i}].pinned must be true or false")
        value = path if name is None else f"{name}={path}"
        values.append(value)
        settings[value] = {
            key: v if key == "pinned" else _convert(flags[key.replace("_", "-")], v, f"{where}[{i}].{key}")
            for key, v in table.items()
        }
    return values, settings


def _flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    flags = {}
    for action in parser._actions:
        for option in action.option_strings:
            if option.startswith("--") and option not in ("--help", "--config"):
                flags[option[2:]] = action
    return flags


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        if not isinstance(value, bool):
            raise ConfigFileError(f"{where} must be true or false, got {value!r}")
        return value if isinstance(action, argparse._StoreTrueAction) else not value
    if isinstance(action, argparse._AppendAction):  # a repeatable flag: a list of strings, or one
        if isinstance(value, str):
            return [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigFileError(f"{where} takes a string or a list of strings, got {value!r}")
        return value
    if isinstance(value, (bool, dict, list)):
        raise ConfigFileError(f"{where} takes a single number or string, got {value!r}")
    try:
        converted = action.type(str(value)) if action.type else str(value)
    except (argparse.ArgumentTypeError, ValueError) as e:
        raise ConfigFileError(f"{where}: {e}") from None
    if action.choices is not None and converted not in action.choices:
        raise ConfigFileError(f"{where} must be one of {', '.join(map(str, action.choices))}")
    return converted
