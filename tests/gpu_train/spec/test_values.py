"""The core's one reading of values from text (gpu_train.spec.values), and the trainer's overrides through it.

Run: .venv/bin/pytest tests/gpu_train/spec/test_values.py -q
"""

from __future__ import annotations

import pytest

from gpu_train.spec.trainer_config import ConfigError, build_config, parse_override
from gpu_train.spec.values import (
    NonFiniteError,
    ValueTextError,
    parse_bool,
    parse_float,
    parse_int,
    parse_scalar,
)


@pytest.mark.parametrize(("text", "value"), [("true", True), ("false", False), ("True", True), ("FALSE", False)])
def test_booleans_are_true_or_false_in_any_case(text, value):
    assert parse_bool(text) is value


@pytest.mark.parametrize("text", ["yes", "no", "on", "off", "1", "0", "y", "t", " true", "true ", ""])
def test_nothing_else_is_a_boolean(text):
    with pytest.raises(ValueTextError, match="expected true or false"):
        parse_bool(text)


@pytest.mark.parametrize(("text", "value"), [("0", 0), ("7", 7), ("-3", -3), ("1_000", 1000), ("00", 0)])
def test_whole_numbers_are_python_integer_literals(text, value):
    assert parse_int(text) == value and type(parse_int(text)) is int


@pytest.mark.parametrize("text", ["+5", " 5", "5 ", "--5", "007", "5.0", "1e3", "0x10", "1__0", "_1", "١", "", "five"])
def test_what_python_int_would_take_but_a_literal_is_not(text):
    with pytest.raises(ValueTextError, match="expected a whole number"):
        parse_int(text)


@pytest.mark.parametrize(("text", "value"), [("3e-4", 3e-4), (".5", 0.5), ("5.", 5.0), ("-2.5E2", -250.0),
                                             ("1_000.5", 1000.5), ("3", 3.0), ("-0", 0.0)])
def test_numbers(text, value):
    assert parse_float(text) == value and type(parse_float(text)) is float


@pytest.mark.parametrize("text", ["nan", "NaN", "inf", "-inf", "Infinity", "1e999"])
def test_numbers_are_finite(text):
    with pytest.raises(NonFiniteError, match="finite"):
        parse_float(text)


@pytest.mark.parametrize("text", ["+1.5", " 1.5", "1.5 ", "1,5", "e5", ".", "1.5.2", "fast", "007"])
def test_not_numbers(text):
    with pytest.raises(ValueTextError):
        parse_float(text)


@pytest.mark.parametrize(("text", "value"), [
    ("true", True), ("False", False), ("12", 12), ("-1", -1), ("0.25", 0.25), ("1e-3", 1e-3),
    ("yes", "yes"), ("on", "on"), ("007", "007"), ("nan", "nan"), ("def ", "def "), (" x", " x"), ("", ""),
])
def test_a_scalar_is_what_the_text_spells_else_the_text_as_typed(text, value):
    got = parse_scalar(text)
    assert got == value and type(got) is type(value)


def test_trainer_overrides_use_the_same_rules():
    """A boolean override is refused unless true/false, naming the key; a string keeps its trailing spaces."""
    for text in ("yes", "on", "1", "Y"):
        with pytest.raises(ConfigError) as err:
            build_config("tiny", overrides=[f"train.compile={text}"])
        assert str(err.value) == f"train.compile: expected true or false, got {text!r}"
    assert build_config("tiny", overrides=["train.compile=TRUE"]).train.compile is True
    assert parse_override("eval.sample_prompt=def  ") == ("eval.sample_prompt", "def  ")
    assert build_config("tiny", overrides=["eval.sample_prompt=def  "]).eval.sample_prompt == "def  "
    for text in ("+5", " 5", "007"):
        with pytest.raises(ConfigError, match="train.steps: expected an integer"):
            build_config("tiny", overrides=[f"train.steps={text}"])
    assert build_config("tiny", overrides=["train.steps=1_000"]).train.steps == 1000
    with pytest.raises(ConfigError, match=r"train.lr must be a finite number \(got inf\)"):
        build_config("tiny", overrides=["train.lr=inf"])
