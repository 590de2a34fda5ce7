"""CLI flags that map one to one onto a config dataclass's fields."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, help: dict[str, str] | None = None) -> None:
    """--field-name for every field, typed and defaulted from the dataclass; bools get --x/--no-x."""
    help = help or {}
    for field in dataclasses.fields(cls):
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        text = f"{help.get(field.name, '')} (default: {default!r})".strip()
        if isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=text)
        else:
            parser.add_argument(flag, type=type(default), default=default, help=text, dest=field.name)


def dataclass_from_args(cls: type[T], args: argparse.Namespace) -> T:
    values: dict[str, Any] = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)}
    return cls(**values)
