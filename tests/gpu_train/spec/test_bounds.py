"""Every bound a spec model declares on a number holds, and is reported by the loader users meet, naming the key.

Run: .venv/bin/pytest tests/gpu_train/spec/test_bounds.py -q

The walk starts at the four inputs users write (a stack's `gpu-train:` settings, a job spec, a service spec, a sweep
spec), reads each numeric field's bounds from the model itself (the field's own `ge`/`gt`/`le`/`lt`, the bounds of
an item or value type, and the int32 cap of gpu_train.spec.errors.Int), and for each bound feeds a value just
outside it into a real file's settings. The loader must refuse it with exactly one line naming the full key.
"""

from __future__ import annotations

import copy
import importlib
import pkgutil
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import annotated_types
import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo

import gpu_train.spec
from gpu_train.spec import errors
from gpu_train.spec import sweep as sweep_spec
from gpu_train.spec.errors import INT_MAX, SettingsError
from gpu_train.spec.job import JobSpec, read_job, read_job_file
from gpu_train.spec.serving import ServiceSpec, read_service
from gpu_train.spec.settings import StackSettings, read
from gpu_train.spec.sweep import SweepSpec, parse_sweep

ROOT = Path(__file__).resolve().parents[3]
# Models of gpu_train/spec that no user writes: the platform contract is the program's own output.
NOT_INPUT = {"gpu_train.spec.contract"}
# Integer fields that may go without a lower bound of their own, each with its reason: a field added without one
# fails test_every_integer_field_has_a_lower_bound_of_its_own until it gets one or a reason here.
UNBOUNDED_INTEGERS: dict[tuple[str, str], str] = {
    ("Parameter", "values"): "a choice's values are values of the searched trainer setting, whatever it takes; "
                             "the trainer's own schema checks each one at submit time (bound_trials)",
}
BOUND_TYPES = (annotated_types.Ge, annotated_types.Gt, annotated_types.Le, annotated_types.Lt)


@dataclass(frozen=True)
class Number:
    """A numeric setting: where it is (model field names and list indexes, `{}` for a mapping's key), its type,
    its bounds and whether it carries the int32 cap."""

    model: type[BaseModel]
    field: str
    path: tuple[str | int, ...]
    kind: type
    bounds: tuple[Any, ...]
    capped: bool


def _value(bound: Any) -> Any:
    return next(getattr(bound, name) for name in ("ge", "gt", "le", "lt") if hasattr(bound, name))


def _unwrap(tp: Any, metadata: list[Any]) -> Any:
    while typing.get_origin(tp) is typing.Annotated:
        tp, *more = typing.get_args(tp)
        for m in more:  # a `Field(ge=1)` inside a type keeps its constraints in its own metadata
            metadata.extend(m.metadata if isinstance(m, FieldInfo) else [m])
    return tp


def _numbers(model: type[BaseModel], path: tuple, seen: set[type[BaseModel]]) -> Iterator[Number]:
    seen.add(model)
    for name, info in model.model_fields.items():
        if info.exclude:
            continue
        yield from _of_type(info.annotation, list(info.metadata), model, name, (*path, info.alias or name), seen)


def _of_type(tp: Any, metadata: list[Any], model: type[BaseModel], field: str, path: tuple,
             seen: set[type[BaseModel]]) -> Iterator[Number]:
    tp = _unwrap(tp, metadata)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        for arg in args:
            if arg is not type(None):
                # The field's own bounds belong to its number branch, never to a container's items.
                yield from _of_type(arg, list(metadata), model, field, path, seen)
    elif origin in (tuple, list):
        yield from _of_type(args[0], [], model, field, (*path, 0), seen)
    elif origin is dict:
        yield from _of_type(args[1], [], model, field, (*path, "{}"), seen)
    elif isinstance(tp, type) and issubclass(tp, BaseModel):
        yield from _numbers(tp, path, seen)
    elif tp in (int, float):
        # The int32 cap is the type's, not the field's own bound, whether a validator or a bound of +-INT_MAX.
        cap = [m for m in metadata if getattr(m, "func", None) is getattr(errors, "int32", object())
               or isinstance(m, BOUND_TYPES) and abs(_value(m)) == INT_MAX]
        bounds = tuple(m for m in metadata if isinstance(m, BOUND_TYPES) and m not in cap)
        yield Number(model, field, path, tp, bounds, bool(cap))


def _raw_stack(name: str) -> dict:
    return yaml.safe_load((ROOT / "stacks" / f"Pulumi.{name}.yaml").read_text())["config"]


def _stack_base() -> dict:
    """aws-dev with the serving example (a service, so that its settings are reachable)."""
    raw = copy.deepcopy(_raw_stack("aws-dev"))
    raw.update(yaml.safe_load((ROOT / "examples" / "serving.yaml").read_text()))
    raw["gpu-train:serving"]["services"][0]["canary"]["quality"] = {"prompts": [{"prompt": "2+2=", "expect": "4"}]}
    return raw


def _sweep_base() -> dict:
    raw = yaml.safe_load((ROOT / "examples" / "sweep-tiny.yaml").read_text())
    if isinstance(raw["trialTemplate"], str):
        raw["trialTemplate"] = read_job_file(ROOT / "examples" / raw["trialTemplate"])
    raw["searchSpace"]["train.warmup_steps"] = {"distribution": "uniform", "type": "int", "min": 1, "max": 8,
                                                "step": 1, "points": 2}
    return raw


def _stack(raw: dict) -> None:
    read(raw)


def _sweep(raw: dict) -> None:
    parse_sweep(raw, "sweep.yaml", base=ROOT / "examples")


@dataclass(frozen=True)
class Root:
    """One input users write: its model, a real instance's raw settings, its loader and how keys are spelt."""

    model: type[BaseModel]
    base: Callable[[], dict]
    load: Callable[[dict], None]
    key: Callable[[str], str]
    top: Callable[[str], str] = lambda alias: alias  # the raw mapping's key of a top-level field


ROOTS = {
    "stack": Root(StackSettings, _stack_base, _stack, lambda path: f"gpu-train:{path}", lambda a: f"gpu-train:{a}"),
    "job": Root(JobSpec, lambda: copy.deepcopy(_raw_stack("aws-dev")["gpu-train:job"]),
                lambda raw: read_job(raw, key="job"), lambda path: f"job.{path}"),
    "service": Root(ServiceSpec, lambda: copy.deepcopy(_stack_base()["gpu-train:serving"]["services"][0]),
                    lambda raw: read_service(raw, key="service"), lambda path: f"service.{path}"),
    "sweep": Root(SweepSpec, _sweep_base, _sweep, lambda path: f"sweep.yaml: {path}"),
}


def _outside(number: Number) -> Iterator[tuple[str, Any]]:
    """(bound, a value just outside it) for each bound of a number."""
    step = 1 if number.kind is int else 0.001
    for b in number.bounds:
        if isinstance(b, annotated_types.Ge):
            yield f"ge={b.ge}", b.ge - step
        elif isinstance(b, annotated_types.Gt):
            yield f"gt={b.gt}", b.gt
        elif isinstance(b, annotated_types.Le):
            yield f"le={b.le}", b.le + step
        elif isinstance(b, annotated_types.Lt):
            yield f"lt={b.lt}", b.lt
    if number.capped and not any(isinstance(b, annotated_types.Le | annotated_types.Lt) for b in number.bounds):
        yield "int32", INT_MAX + 1


def _set(raw: Any, root: Root, path: tuple, value: Any) -> str:
    """Put `value` at `path` in the raw settings (creating what is missing); return the key as users read it."""
    node, key = raw, ""
    for i, part in enumerate(path):
        last = i == len(path) - 1
        if part == "{}":  # a mapping's value: an entry it has, else a new one
            part = next(iter(node), "x") if isinstance(node, dict) and node else "x"
        name = root.top(part) if i == 0 else part
        key += f"[{part}]" if isinstance(part, int) else (f".{part}" if key else str(part))
        if isinstance(part, int):
            while len(node) <= part:
                node.append({})
        elif not isinstance(node.get(name), dict | list) and not last:
            node[name] = [] if isinstance(path[i + 1], int) else {}
        if last:
            node[name] = value
        else:
            node = node[name]
    return root.key(key)


def _cases() -> list[Any]:
    out = []
    for name, root in ROOTS.items():
        for number in _numbers(root.model, (), set()):
            for bound, value in _outside(number):
                path = ".".join(str(p) for p in number.path)
                out.append(pytest.param(name, number.path, value, id=f"{name}:{path}:{bound}"))
    return out


@pytest.mark.parametrize(("root_name", "path", "value"), _cases())
def test_a_value_just_outside_a_bound_is_refused_naming_its_key(root_name, path, value):
    root = ROOTS[root_name]
    raw = root.base()
    root.load(copy.deepcopy(raw))  # the base itself loads
    key = _set(raw, root, path, value)
    with pytest.raises(SettingsError) as err:
        root.load(raw)
    named = [p for p in err.value.problems if p.startswith(f"{key} ")]
    assert len(named) == 1, err.value.problems
    assert named[0].startswith(f"{key} must be ") and f"(got {value})" in named[0], named[0]
    assert "\n" not in named[0] and f"\n  {named[0]}" in str(err.value)


def _spec_models() -> set[type[BaseModel]]:
    """Every pydantic model defined in gpu_train/spec (its platform contract aside) and in the sweep spec."""
    modules = [sweep_spec]
    for info in pkgutil.walk_packages(gpu_train.spec.__path__, "gpu_train.spec."):
        if info.name not in NOT_INPUT:
            modules.append(importlib.import_module(info.name))
    return {obj for module in modules for obj in vars(module).values()
            if isinstance(obj, type) and issubclass(obj, BaseModel) and obj.__module__ == module.__name__
            and obj.model_fields}


def test_the_walk_reaches_every_model_of_the_spec():
    reached: set[type[BaseModel]] = set()
    for root in ROOTS.values():
        list(_numbers(root.model, (), reached))
    assert _spec_models() - reached == set()


def test_every_integer_field_has_a_lower_bound_of_its_own():
    """The int32 cap alone lets -5 replicas through: each integer states its own range, or its reason here."""
    missing = []
    for root in ROOTS.values():
        for number in _numbers(root.model, (), set()):
            where = (number.model.__name__, number.field)
            own = any(isinstance(b, annotated_types.Ge | annotated_types.Gt) for b in number.bounds)
            if number.kind is int and not own and where not in UNBOUNDED_INTEGERS:
                missing.append(".".join(where))
    assert missing == []
    assert all(reason.strip() for reason in UNBOUNDED_INTEGERS.values())
