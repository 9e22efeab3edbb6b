"""A clock the test moves by hand, installed in place of a module's `time`: what a watchdog or a step clock
decides then depends only on the moves, never on how loaded the machine is."""

from __future__ import annotations

import time
import types

import pytest


class FakeClock:
    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds

    def install(self, monkeypatch: pytest.MonkeyPatch, module: types.ModuleType) -> FakeClock:
        """`module.time` becomes the real module with monotonic and perf_counter read from this clock."""
        fake = types.SimpleNamespace(**{name: getattr(time, name) for name in dir(time) if not name.startswith("_")})
        fake.monotonic = fake.perf_counter = self
        monkeypatch.setattr(module, "time", fake)
        return self
