"""Command-line flags that fall back on an environment variable (and, for the node agent, a configuration file):
one declaration per flag (name, environment variable, type, default, help) instead of an ``add_argument`` call that
reads ``os.environ`` by hand.

The services' ``main.py`` files describe their flags as tables of :class:`Flag` and add them with :func:`add_flags`.
Precedence: a value on the command line, then the environment variable, then the configuration file, then the
default.

A value from the environment is checked by the flag's ``type`` when the command line is parsed (so a value given on
the command line replaces it unchecked), and a bad one is a usage error that names the variable::

    phalanx-scheduler: error: argument --max-watches: environment variable PHALANX_SCHEDULER_MAX_WATCHES='x':
    'x' is not a whole number
"""

from __future__ import annotations

import argparse
import builtins
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Flag", "FlagError", "add_flags"]


class FlagError(ValueError):
    """An environment variable whose value a flag cannot take (raised while the parser is built, for the flags
    whose default is coerced then)."""


class _FromEnvironment(str):
    """A default read from an environment variable: argparse passes a string default through the flag's type when
    the flag is not on the command line, and this one remembers the variable for the error message."""

    variable: str

    def __new__(cls, value: str, variable: str) -> _FromEnvironment:
        text = super().__new__(cls, value)
        text.variable = variable
        return text


@dataclass(frozen=True)
class Flag:
    """One command-line flag.

    ``env``: the environment variable it falls back on (None: none). ``ignore_empty``: an empty variable counts
    as unset (otherwise its value is the empty string). ``type``, ``default``, ``help``, ``metavar``, ``dest``,
    ``action`` and ``choices`` are argparse's. ``coerce``: applied, when the parser is built, to the default it
    ends up with (the variable's value, the file's or ``default``), for flags such as booleans that argparse does
    not convert.
    """

    name: str
    env: str | None = None
    type: Callable[[str], Any] | None = None
    default: Any = None
    help: str | None = None
    metavar: str | None = None
    dest: str | None = None
    action: str | builtins.type[argparse.Action] | None = None
    choices: Sequence[str] | None = None
    ignore_empty: bool = False
    coerce: Callable[[Any], Any] | None = None

    @property
    def key(self) -> str:
        """The flag's name without its dashes (``--node-name`` -> ``node-name``): its key in a configuration file."""
        return self.name.lstrip("-")

    @property
    def dest_name(self) -> str:
        """The attribute of the parsed namespace that holds its value."""
        return self.dest or self.key.replace("-", "_")

    def from_environment(self, environ: Mapping[str, str]) -> str | None:
        """The variable's value, None where it is unset (or empty, with ``ignore_empty``)."""
        if self.env is None:
            return None
        value = environ.get(self.env)
        if value is None or (self.ignore_empty and value == ""):
            return None
        return value

    def resolved_default(self, file: Mapping[str, Any], environ: Mapping[str, str]) -> Any:
        """The default argparse gets: the environment's value, else the file's (keyed by ``dest_name``), else
        ``default``; coerced by ``coerce``."""
        value: Any
        env_value = self.from_environment(environ)
        if env_value is not None:
            value = _FromEnvironment(env_value, str(self.env))
        else:
            value = file.get(self.dest_name, self.default)
        if self.coerce is None:
            return value
        try:
            return self.coerce(str(value) if isinstance(value, _FromEnvironment) else value)
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            if isinstance(value, _FromEnvironment):
                raise FlagError(f"{self.name}: {_from_environment(value, exc, _name(self.coerce))}") from None
            raise

    def argparse_kwargs(self, file: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
        """The keyword arguments of ``add_argument`` (only those given, as argparse's actions differ in which they
        take)."""
        kwargs: dict[str, Any] = {}
        default = self.resolved_default(file, environ)
        if default is not None:  # None: argparse's own (False for store_true, True for store_false, else None)
            kwargs["default"] = default
        for name in ("help", "metavar", "dest", "action", "choices"):
            if getattr(self, name) is not None:
                kwargs[name] = getattr(self, name)
        if self.env is not None and self.coerce is None:  # a value-taking flag: the environment's is converted too
            kwargs["type"] = _checked(self.type or str)
        elif self.type is not None:
            kwargs["type"] = self.type
        return kwargs


def add_flags(
    parser: argparse._ActionsContainer,
    flags: Iterable[Flag],
    *,
    file: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> None:
    """Add `flags` to `parser` (or an argument group), in order; their defaults come from `environ` (default:
    ``os.environ``), then `file` ({dest: value}), then each flag's own."""
    environ = os.environ if environ is None else environ
    for flag in flags:
        parser.add_argument(flag.name, **flag.argparse_kwargs(file or {}, environ))


def _from_environment(value: _FromEnvironment, exc: Exception, kind: str) -> str:
    """What is wrong with a variable's value, worded as argparse words a bad command-line value: the type's own
    message (ArgumentTypeError), else "invalid <type> value"."""
    where = f"environment variable {value.variable}={str(value)!r}"
    if isinstance(exc, argparse.ArgumentTypeError):
        return f"{where}: {exc}"
    return f"{where}: invalid {kind} value"


def _checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """`parse` as an argparse type that, for a value from the environment, names the variable when it fails (a
    value from the command line fails as argparse reports it: "invalid int value: 'x'", or the type's message)."""

    def convert(text: str) -> Any:
        if not isinstance(text, _FromEnvironment):
            return parse(text)
        try:
            return parse(str(text))
        except (ValueError, TypeError, argparse.ArgumentTypeError) as exc:
            raise argparse.ArgumentTypeError(_from_environment(text, exc, _name(parse))) from None

    convert.__name__ = _name(parse)
    return convert


def _name(function: Callable[..., Any]) -> str:
    return str(getattr(function, "__name__", "value"))
