"""Settings classes that describe their own flags: `kvd serve` is generated from EngineArgs and ServerConfig.

Each field is made by `setting`, which keeps its help (and, where the defaults do not fit, its flag) in the
field's metadata; `add_flags` turns a class into flags and `from_flags` builds the class from parsed ones.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class Flag:
    """How a setting appears on the `kvd serve` command line (and so in its config file)."""

    help: str
    name: str | None = None  # None: --FIELD-NAME
    aliases: tuple[str, ...] = ()
    # Parses the flag's text; None: the annotation's int or float (or the text itself). A ValueError's
    # message is shown as argparse's error.
    type: Callable[[str], Any] | None = None
    choices: tuple[str, ...] | None = None
    metavar: str | None = None


def setting(default: Any, help: str, **flag: Any) -> Any:
    """A dataclass field and its flag (see Flag). A bool that defaults to True names the flag that turns it off."""
    if default is True and "name" not in flag:
        raise TypeError("a setting that is on by default needs the name of the flag that turns it off")
    return dataclasses.field(default=default, metadata={"flag": Flag(help, **flag)})


def positive_float(text: str) -> float:
    """A number > 0, as an argparse type."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def positive_int(text: str) -> int:
    """A whole number >= 1, as an argparse type."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_flags(group: argparse._ActionsContainer, cls: type) -> None:
    """One flag per field of the settings class `cls`, defaulting to the field's default."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flag: Flag = field.metadata["flag"]
        names = (_flag_name(field), *flag.aliases)
        if hints[field.name] is bool:
            group.add_argument(*names, action="store_true", help=flag.help)
            continue
        group.add_argument(
            *names,
            type=_reporting(flag.type) if flag.type else _value_type(hints[field.name]),
            default=field.default,
            choices=flag.choices,
            metavar=flag.metavar,
            help=flag.help,
        )


def from_flags(cls: type[T], args: argparse.Namespace) -> T:
    """`cls` from the flags add_flags made; a flag that turns a setting off is read back as the setting."""
    values = {}
    for field in dataclasses.fields(cls):
        value = getattr(args, _flag_name(field)[2:].replace("-", "_"))
        values[field.name] = not value if field.default is True else value
    return cls(**values)


def _flag_name(field: dataclasses.Field) -> str:
    return field.metadata["flag"].name or "--" + field.name.replace("_", "-")


def _value_type(hint: Any) -> type | None:
    """int or float for `int`, `float | None` and the like; None (the text itself) for strings."""
    (kind,) = [k for k in typing.get_args(hint) or (hint,) if k is not types.NoneType]
    return None if kind is str else kind


def _reporting(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` whose ValueError's message argparse shows (it would print only "invalid <name> value")."""

    @functools.wraps(parse)
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return convert
