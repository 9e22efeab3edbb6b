"""Errors that name the setting, the base of the models whose errors they word (SpecModel), and the trainer's exit
codes that the JobSet maps to failure rules.

Usage:
    raise SettingsError(["gpu-train:gpuPools[0].maxNodes must be >= minNodes (got 2 < 4)"])
    problems = validation_problems(exc, prefix="gpu-train:", root=StackSettings, raw=raw)

`validation_problems` turns a pydantic ValidationError into one line per problem, each starting with the full
key the user wrote (`gpu-train:gpuPools[0].maxNodes`, `job.overrides.train.lr`), in the project's own words
("must be a whole number (got '3')", "is not a known setting (did you mean 'maxNodes'?)"). A model validator
reports several problems at once by raising a ValueError whose lines each start with a field name relative to
the model ("maxNodes must be >= minNodes ..."); the line is prefixed with the model's own key.

Hand-written on purpose: pydantic's messages name its own types ("Input should be a valid integer") and its
locations carry union branch tags; users read the stack file's keys.
"""

from __future__ import annotations

import difflib
import typing
from collections.abc import Mapping, Sequence
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

# Exit codes of `python -m trainer`, the launcher and any job the platform runs (docs/trainer.md). The JobSet's
# podFailurePolicy fails a job at once on EXIT_BAD_INPUT; every other failure is retried.
EXIT_OK = 0
EXIT_FAILED = 1  # worth retrying: a lost peer, a storage outage
EXIT_BAD_INPUT = 2  # settings, dataset, run directory or checkpoint unusable; retrying cannot help
EXIT_RESUMABLE = 75  # stopped after a final checkpoint (SIGTERM/SIGINT); EX_TEMPFAIL of sysexits.h
EXIT_HUNG = 124  # a hung worker ended by its watchdog; retried from the newest checkpoint
EXIT_INTERRUPTED = 130  # 128 + SIGINT: the user's Ctrl-C, after the graceful stop (the commands a user runs)

# Kubernetes object fields are int32: no whole-number setting may exceed one.
INT_MAX = 2**31 - 1


def int32(value: int) -> int:
    """The int32 cap of every whole-number setting, as a validator rather than a `Field(ge=..., le=...)` bound:
    pydantic applies a type's bound after the field's own, so a bound in the type would replace a field's
    `Field(ge=1)` instead of adding to it."""
    if abs(value) > INT_MAX:
        raise PydanticCustomError("int32", "must be at most {limit}, a Kubernetes int32 (got {got})",
                                  {"limit": INT_MAX, "got": value})
    return value


# A whole number that fits the int32 fields of Kubernetes objects; each field states its own range besides
# (`steps: Int = Field(1000, ge=1)`), which tests/gpu_train/spec/test_bounds.py requires.
Int = Annotated[int, AfterValidator(int32)]


class SpecModel(BaseModel):
    """Base of the stack settings and the job and service specs: frozen, camelCase keys, unknown keys refused,
    strict types."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True,
                              strict=True)


class BadInput(Exception):
    """Input that no retry can fix; the message is one line and names the setting, file, URI or checkpoint."""


class ConfigError(BadInput, ValueError):
    """A trainer setting is unknown, of the wrong type, or inconsistent with another one (gpu_train.spec.
    trainer_config and the layout checks of gpu_train.sizing.layout raise it)."""


class SettingsError(ValueError):
    """One or more invalid settings; `problems` holds one line per problem, each naming its full key."""

    def __init__(self, problems: Sequence[str], title: str = "invalid stack settings"):
        self.problems = list(problems)
        super().__init__(f"{title}:\n  " + "\n  ".join(self.problems))


def key_of(prefix: str, loc: Sequence[str | int]) -> str:
    """`gpu-train:` + ("gpuPools", 0, "maxNodes") -> `gpu-train:gpuPools[0].maxNodes`; "job" -> `job.nodes`."""
    out = prefix
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif out and not out.endswith(":"):
            out += f".{part}"
        else:
            out += str(part)
    return out


def join_key(base: str, rest: str) -> str:
    """`gpu-train:gpuPools[0]` + `maxNodes must ...` -> `gpu-train:gpuPools[0].maxNodes must ...`."""
    if not base or base.endswith(":") or rest.startswith("["):
        return base + rest
    return f"{base}.{rest}"


_TYPE_WORDS = {
    "int": "a whole number", "float": "a finite number", "bool": "true or false", "string": "a string",
    "tuple": "a list", "list": "a list", "dict": "a mapping", "model": "a mapping", "mapping": "a mapping",
}


def _type_word(error_type: str) -> str | None:
    for prefix, word in _TYPE_WORDS.items():
        if error_type.startswith(prefix + "_") or error_type == prefix:
            return word
    if error_type in ("finite_number", "float_parsing"):
        return "a finite number"
    return None


def _got(value: Any) -> str:
    if isinstance(value, str | int | float | bool) or value is None:
        return repr(value)
    return f"{type(value).__name__} {value!r}"


def _strip_tags(loc: Sequence[str | int], raw: Any) -> tuple[tuple[str | int, ...], bool]:
    """The location in the user's input, without pydantic's union branch tags; and whether a tag was dropped.

    A tag is a location part that is not in the input: a name where the input holds no mapping (the `int` branch
    of `int | dict`), or a type expression such as `dict[str,constrained-int]`."""
    out: list[str | int] = []
    node, tagged = raw, False
    for part in loc:
        if isinstance(node, Mapping) and part in node or isinstance(node, list | tuple) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
            out.append(part)
        elif isinstance(part, str) and (not isinstance(node, Mapping) or "[" in part or part in _TYPE_WORDS
                                        or part in ("str", "int", "float", "bool", "constrained-int")):
            tagged = True
        else:
            out.append(part)
            node = None
    return tuple(out), tagged


def _model_at(root: type[BaseModel] | None, loc: Sequence[str | int]) -> type[BaseModel] | None:
    """The model class whose fields are named at `loc` (for "did you mean")."""
    model: Any = root
    for part in loc:
        if model is None or isinstance(part, int):
            continue
        field = next((f for name, f in model.model_fields.items() if (f.alias or name) == part), None)
        if field is None:
            return None
        model = model_in(field.annotation)
    return model


def model_in(tp: Any) -> type[BaseModel] | None:
    if isinstance(tp, type) and issubclass(tp, BaseModel):
        return tp
    for arg in typing.get_args(tp):
        found = model_in(arg)
        if found is not None:
            return found
    return None


def validation_problems(exc: ValidationError, *, prefix: str, root: type[BaseModel] | None = None,
                        raw: Any = None) -> list[str]:
    """One line per problem of a pydantic ValidationError, each starting with the full key."""
    stripped = [(*_strip_tags(err["loc"], raw), err) for err in exc.errors(include_url=False)]
    # A union whose value has one branch's shape (a mapping for `int | dict`) reports that branch's own problems,
    # deeper in the value; the other branches' "wrong type" at the union itself then says nothing useful.
    deeper = {loc[:i] for loc, tagged, _ in stripped if tagged for i in range(len(loc))}
    by_key: dict[tuple, list[dict]] = {}
    for loc, tagged, err in stripped:
        if not (tagged and loc in deeper):
            by_key.setdefault(loc, []).append(err)
    problems: list[str] = []
    for loc, errs in by_key.items():
        key = key_of(prefix, loc)
        # A union branch whose type the value has (the number of `int | dict`) says what is wrong with it; the
        # other branches' "wrong type" would only mislead.
        valued = [e for e in errs if not _type_word(e["type"])]
        errs = valued or errs
        words = [w for w in (_type_word(e["type"]) for e in errs) if w]
        if len(errs) > 1 and len(words) == len(errs):
            shapes = " or ".join(dict.fromkeys(words))
            problems.append(f"{key} must be {shapes} (got {_got(errs[0]['input'])})")
            continue
        for err in errs:
            problems.extend(_one(err, key, loc, prefix, root))
    return problems


def _one(err: Mapping[str, Any], key: str, loc: tuple, prefix: str, root: type[BaseModel] | None) -> list[str]:
    kind, value, ctx = err["type"], err.get("input"), err.get("ctx") or {}
    if kind == "extra_forbidden":
        model = _model_at(root, loc[:-1])
        known = sorted((f.alias or n) for n, f in model.model_fields.items() if not f.exclude) if model else []
        close = difflib.get_close_matches(str(loc[-1]), known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else (f" (known: {', '.join(known)})" if known else "")
        return [f"{key} is not a known setting{hint}"]
    if kind == "missing":
        return [f"{key} is required"]
    if kind == "value_error":
        # A model validator's problems: one per line, each starting with a field name relative to the model.
        text = str(ctx.get("error") or err["msg"]).removeprefix("Value error, ")
        return [join_key(key, line) for line in text.splitlines() if line.strip()]
    if kind == "literal_error":
        return [f"{key} must be one of {ctx.get('expected', '').replace(' or ', ' | ')} (got {_got(value)})"]
    if kind in ("greater_than_equal", "greater_than", "less_than_equal", "less_than"):
        op = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}[kind]
        bound = next(iter(ctx.values()), "?")
        return [f"{key} must be {op} {bound} (got {value})"]
    if kind == "string_pattern_mismatch":
        return [f"{key} {value!r} does not match {ctx.get('pattern')}"]
    word = _type_word(kind)
    if word:
        return [f"{key} must be {word} (got {_got(value)})"]
    if err["msg"].startswith(("must ", "is ")):  # the project's own field validators speak its words already
        return [f"{key} {err['msg']}"]
    return [f"{key}: {err['msg']} (got {_got(value)})"]
