"""What `python -m trainer.data prepare` says while it works: phases, fallbacks and one progress line for the job
(trainer/data/prepare.py passes one to `prepare`)."""

from __future__ import annotations

import time
from typing import Any


class Progress:
    """What `prepare` says while it works, on `stream` (stderr by default): phases (the BPE training, the plan), one
    line per fallback (a skipped file, an undecodable one, a retried task, an empty split), and one progress line for
    the whole job: tasks done of all, tokens, tokens/s, MB of input/s and the time left at the pace so far. Tasks
    committed by an earlier run count as done but not towards the pace. On a terminal the line is redrawn in place
    (at most 5 times a second); otherwise a line is printed every `every_s` seconds, and once at the end."""

    def __init__(self, stream: Any = None, *, every_s: float = 10.0, tty: bool | None = None) -> None:
        import sys

        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = 0.2 if self.tty else every_s
        self.total_bytes = self.total_tasks = 0
        self.bytes = self.tasks = self.tokens = 0  # this run's
        self.done_before = self.bytes_before = 0  # committed by an earlier run
        self._t0 = self._last = 0.0
        self._drawn = False
        self._shown = -1  # the tasks done at the last line drawn

    def say(self, text: str) -> None:
        """One line of its own (ending an in-place progress line first)."""
        self._end_line()
        print(f"prepare: {text}", file=self.stream, flush=True)

    def warn(self, text: str) -> None:
        self.say(f"warning: {text}")

    def start(self, total_bytes: int, total_tasks: int, done_tasks: int = 0, done_bytes: int = 0) -> None:
        self.total_bytes, self.total_tasks = max(total_bytes, 1), total_tasks
        self.done_before, self.bytes_before = done_tasks, done_bytes
        self._t0 = self._last = time.monotonic()

    def advance(self, nbytes: int, tokens: int, tasks: int = 1) -> None:
        self.bytes, self.tokens, self.tasks = self.bytes + nbytes, self.tokens + tokens, self.tasks + tasks
        now = time.monotonic()
        if now - self._last >= self.every_s:
            self._last = now
            self._draw(now)

    def finish(self) -> None:
        if self.total_tasks and self._shown != self.tasks:
            self._draw(time.monotonic())
        self._end_line()

    def line(self, now: float) -> str:
        elapsed = max(now - self._t0, 1e-9)
        left_bytes = self.total_bytes - self.bytes_before - self.bytes
        rate = self.bytes / elapsed
        left = left_bytes / rate if rate > 0 else None
        if self.done_before + self.tasks >= self.total_tasks:
            left = 0.0
        eta = "?" if left is None else f"{int(left) // 3600}:{int(left) % 3600 // 60:02d}:{int(left) % 60:02d}"
        done = (self.bytes_before + self.bytes) / self.total_bytes
        return (f"{self.done_before + self.tasks}/{self.total_tasks} tasks, {self.tokens:,} tokens, "
                f"{self.tokens / elapsed:,.0f} tokens/s, {rate / 1e6:,.1f} MB/s, {100 * done:.0f}% of "
                f"{self.total_bytes / 1e6:,.1f} MB, ETA {eta}")

    def _draw(self, now: float) -> None:
        self._shown = self.tasks
        if self.tty:
            print(f"\rprepare: {self.line(now)}\x1b[K", end="", file=self.stream, flush=True)
            self._drawn = True
        else:
            print(f"prepare: {self.line(now)}", file=self.stream, flush=True)

    def _end_line(self) -> None:
        if self._drawn:
            print(file=self.stream, flush=True)
            self._drawn = False
