"""`kvd serve --config FILE`: a TOML file whose keys are the serve flags without dashes; flags given win."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

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
    for key, value in settings.items():
        action = flags.get(key)
        if action is None:
            raise ConfigFileError(
                f"{path}: unknown setting {key!r}; the settings are the `kvd serve` flags without dashes: "
                + ", ".join(sorted(flags))
            )
        defaults[action.dest] = _convert(action, value, f"{path}: {key}")
    parser.set_defaults(**defaults)


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
