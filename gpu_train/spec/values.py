"""One reading of a setting's value from text, shared by every place that takes settings as text: the trainer's
`section.key=value` overrides (gpu_train.spec.trainer_config), a job spec's trainer settings, and the stack
settings' values as the Pulumi engine hands them over.

Usage:
    from gpu_train.spec.values import parse_bool, parse_int, parse_float, parse_scalar, ValueTextError
    parse_bool("True")        # True; "yes", "on", "1" raise ValueTextError("expected true or false")
    parse_int("1_000")        # 1000; "+5", " 5", "5.0", "1e3" raise ValueTextError("expected a whole number")
    parse_float("3e-4")       # 0.0003; "nan" and "inf" raise NonFiniteError (a ValueTextError)
    parse_scalar("0.5")       # 0.5: a bool, int or finite float when the text is exactly one, else the text as typed
    as_uri("runs/data/x")     # "file:///abs/cwd/runs/data/x"; "s3://b/p" and "file:///abs" unchanged

The rules, the same everywhere:
- a boolean is `true` or `false` in any case, nothing else (not yes/no, on/off, 1/0, which YAML 1.1 and some
  parsers take and others do not);
- a whole number is a Python decimal integer literal with an optional leading `-`: digits, `_` between digits,
  no leading zeros (`007` is not one), no `+`, no surrounding spaces, ASCII digits only (Python's own `int()`
  also takes " 7 ", "+7" and "٧");
- a number is a whole number or a Python float literal (`3e-4`, `.5`, `5.`, `1_000.5`) with an optional leading
  `-`, and must be finite;
- anything else is a string, kept exactly as typed, spaces included.
"""

from __future__ import annotations

import os
import re

__all__ = ["NonFiniteError", "ValueTextError", "as_uri", "parse_bool", "parse_float", "parse_int", "parse_scalar"]

_DIGITS = r"[0-9](?:_?[0-9])*"
_INT = re.compile(r"-?(?:0(?:_?0)*|[1-9](?:_?[0-9])*)")
_EXP = rf"[eE][-+]?{_DIGITS}"
_POINT = rf"(?:(?:{_DIGITS})?\.{_DIGITS}|{_DIGITS}\.)"
_FLOAT = re.compile(rf"-?(?:{_POINT}(?:{_EXP})?|{_DIGITS}{_EXP})")
_NON_FINITE = re.compile(r"-?(?:nan|inf|infinity)", re.IGNORECASE)


class ValueTextError(ValueError):
    """Text that is not a value of the asked type; the message says what was expected ("expected ...")."""


class NonFiniteError(ValueTextError):
    """A number that is NaN or infinite."""


def parse_bool(text: str) -> bool:
    """`true` or `false`, in any case."""
    lowered = text.lower()
    if lowered == "true":
        return True
    if lowered == "false":
        return False
    raise ValueTextError("expected true or false")


def parse_int(text: str) -> int:
    """A Python decimal integer literal with an optional leading `-` (module docstring)."""
    if not _INT.fullmatch(text):
        raise ValueTextError("expected a whole number")
    return int(text)


def parse_float(text: str) -> float:
    """A whole number or a Python float literal with an optional leading `-`; finite."""
    if _NON_FINITE.fullmatch(text):
        raise NonFiniteError("expected a finite number")
    if _INT.fullmatch(text):
        return float(int(text))
    if not _FLOAT.fullmatch(text):
        raise ValueTextError("expected a number")
    value = float(text)
    if value in (float("inf"), float("-inf")):  # 1e999
        raise NonFiniteError("expected a finite number")
    return value


def parse_scalar(text: str) -> bool | int | float | str:
    """The value the text spells: a boolean, a whole number, a finite number, else the text itself, unchanged."""
    for parse in (parse_bool, parse_int, parse_float):
        try:
            return parse(text)
        except ValueTextError:
            continue
    return text


_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")


def as_uri(text: str) -> str:
    """A plain path (absolute, relative to the working directory, or ~/...) as the file:// URI of its absolute
    path; text that starts with a scheme (`file://`, `s3://`, ...) or is empty is returned unchanged. The path is
    not percent-encoded: the stores read a file:// URI's path as it is."""
    if not text or _SCHEME.match(text):
        return text
    return "file://" + os.path.abspath(os.path.expanduser(text))
