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
from collections.abc import Callable, Collection
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


_DURATION_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_duration(value: object) -> float:
    """Seconds of a duration: a number of seconds, or text like "30s", "5m", "1h", "1.5h"; negative means
    forever (inf). ValueError when it is neither."""
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str) and value.strip():
        text = value.strip()
        unit = _DURATION_UNITS.get(text[-1])
        try:
            seconds = float(text[:-1] if unit else text) * (unit or 1.0)
        except ValueError:
            raise ValueError(f"{value!r} is not a duration (seconds, or like 30s, 5m, 1h)") from None
    else:
        raise ValueError(f"{value!r} is not a duration (seconds, or like 30s, 5m, 1h)")
    if seconds != seconds:
        raise ValueError(f"{value!r} is not a duration")
    return float("inf") if seconds < 0 else seconds


def add_flags(group: argparse._ActionsContainer, cls: type, repeated: Collection[str] = ()) -> None:
    """One flag per field of the settings class `cls`, defaulting to the field's default. A boolean has its
    opposite too (--x and --no-x), so a flag can undo what a config file turned on: the last given wins. The
    fields named in `repeated` take their flag several times, as a list (its reader makes one value of them)."""
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        flag: Flag = field.metadata["flag"]
        name = _flag_name(field)
        names = (name, *flag.aliases)
        if hints[field.name] is bool:
            group.add_argument(*names, action="store_true", help=flag.help)
            # The same destination, no default of its own: the first flag's (or the config file's) stands.
            group.add_argument(
                opposite_flag(name),
                dest=name[2:].replace("-", "_"),
                action="store_false",
                default=argparse.SUPPRESS,
                help=f"the opposite of {name} (the default unless a config file says otherwise)",
            )
            continue
        if _repeated(hints[field.name]) or field.name in repeated:  # the flag given once per value
            group.add_argument(
                *names, action=_AppendOverDefault, default=None, metavar=flag.metavar, help=flag.help
            )
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
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        value = getattr(args, _flag_name(field)[2:].replace("-", "_"))
        if _repeated(hints[field.name]):
            value = tuple(value or field.default)
        values[field.name] = not value if field.default is True else value
    return cls(**values)


def to_flags(settings: object) -> list[str]:
    """The command-line arguments that give `settings` (a settings class's instance) its values: a flag for each
    value that is not the default (for a process started with the same settings)."""
    args: list[str] = []
    for field in dataclasses.fields(settings):
        value, name = getattr(settings, field.name), _flag_name(field)
        if value == field.default:
            continue
        if isinstance(value, bool):  # away from its default: the field's own flag says so
            args.append(name)
        elif isinstance(value, tuple):
            args += [part for v in value for part in (name, str(v))]
        else:
            args += [name, str(value)]
    return args


class _AppendOverDefault(argparse._AppendAction):
    """A repeatable flag whose values on the command line replace its default (a config file's list) rather
    than add to it: flags win over the file, as for every other setting."""

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        if getattr(namespace, self.dest, None) is self.default:
            setattr(namespace, self.dest, None)
        super().__call__(parser, namespace, values, option_string)


def opposite_flag(name: str) -> str:
    """--no-x for --x, and --x for --no-x."""
    return "--" + name[5:] if name.startswith("--no-") else "--no-" + name[2:]


def _flag_name(field: dataclasses.Field) -> str:
    return field.metadata["flag"].name or "--" + field.name.replace("_", "-")


def _repeated(hint: Any) -> bool:
    return typing.get_origin(hint) is tuple


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
