"""Two training processes that take turns, one step each: our loop (the launcher, torchrun and a worker, as
`gpu-train run --local` starts them) and the bare loop (bench/bare.py), each timing its own turns.

Usage: bench/overhead.py's process rows. `python -m bench.turns --preset tiny ... overrides` runs where
`python -m trainer` would, with BENCH_TURNS_TO, BENCH_TURNS_FROM (two named pipes) and BENCH_TURNS_LOG (a file of
one turn's seconds per line) set; `python -m bench.turns --bare --preset tiny --to F --from F --log L overrides` is
the bare loop's side, stepping until our side ends. `pair(...)` starts both and returns each side's turns.

Why. On a shared machine separate runs of the same loop land up to 15% apart, and two loops running at once, each
on a core of its own, still drift apart by as much, since each core is slowed at other times. Taking turns, the two
processes meet the machine's drift alike, as bench/interleaved.py's two loops in one process do, while each keeps
all its process costs (torchrun's agent, its threads, its memory). Our side's turn runs from one step's
`before_sync` callback to the next (trainer/train.py): exactly one step's work, flags, optimizer, step record and the
next batch's read included. One byte through a pipe passes the turn; only the side holding it runs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import ONE_THREAD_ENV, ROOT, launch_local
from trainer.distributed import free_port

TURNS = "bench.turns"


class Turns:
    """One side of the exchange: `take()` waits for the other side's byte and starts this side's turn; `give()`
    ends it, logs its seconds and hands the turn over. EOF from the other side (it ended) stops the taking."""

    def __init__(self, to_other: str, from_other: str, log: str, *, read_first: bool) -> None:
        # Opening a named pipe waits for its other end: our side opens the pipe to the bare loop first and the bare
        # loop opens that one first too (read_first), so neither waits on the other's second pipe.
        if read_first:
            self._in = open(from_other, "rb", buffering=0)  # noqa: SIM115 - held for the process's life
        self._out = open(to_other, "wb", buffering=0)  # noqa: SIM115
        if not read_first:
            self._in = open(from_other, "rb", buffering=0)  # noqa: SIM115
        self._log = open(log, "a", buffering=1)  # noqa: SIM115
        self._start: float | None = None
        self.open = True

    def take(self) -> None:
        if self.open and not self._in.read(1):
            self.open = False
        self._start = time.perf_counter()

    def give(self) -> None:
        if self._start is not None:
            self._log.write(f"{time.perf_counter() - self._start}\n")
        if self.open:
            try:
                self._out.write(b"t")
            except BrokenPipeError:
                self.open = False


def _trainer_side() -> Callable[[Any, str, int], None]:
    """The step callback of our side: at each step's `before_sync` its turn ends and it waits for the next."""
    turns = Turns(os.environ["BENCH_TURNS_TO"], os.environ["BENCH_TURNS_FROM"], os.environ["BENCH_TURNS_LOG"],
                  read_first=False)

    def turn(trainer: Any, point: str, step: int) -> None:
        if point == "before_sync" and trainer.env.rank == 0:
            turns.give()
            turns.take()

    return turn


def _bare_side(argv: list[str]) -> int:
    from bench.bare import BareLoop
    from gpu_train.spec import trainer_config as tcfg

    ap = argparse.ArgumentParser(prog="python -m bench.turns --bare")
    ap.add_argument("--bare", action="store_true")
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--to", required=True)
    ap.add_argument("--from", dest="from_", required=True)
    ap.add_argument("--log", required=True)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    loop = BareLoop(tcfg.build_config(args.preset, None, args.overrides))
    turns = Turns(args.to, args.from_, args.log, read_first=True)
    step = 0
    while True:  # our side gives the first turn once its first step is done, and its end ends this loop
        turns.take()
        if not turns.open:
            return 0
        step += 1
        loop.step(step)
        loop.sync()
        turns.give()


def pair(preset: str, overrides: list[str], steps: int, *, core: int | None = None,
         timeout: float = 1200) -> tuple[list[float], list[float]]:
    """Run our loop for `steps` steps and the bare loop beside it, taking turns (both on `core`, if given); the
    seconds of each turn of ours and of the bare loop's, in order (the first is each side's first step)."""
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        for name in ("to_bare", "to_ours"):
            os.mkfifo(d / name)
        pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
        cmd, env = launch_local(d / "run", preset, [*overrides, f"train.steps={steps}"], port=free_port(),
                                module=TURNS, env={"BENCH_TURNS_TO": str(d / "to_bare"),
                                                   "BENCH_TURNS_FROM": str(d / "to_ours"),
                                                   "BENCH_TURNS_LOG": str(d / "ours.txt")})
        bare_cmd = [sys.executable, "-m", TURNS, "--bare", "--preset", preset, "--to", str(d / "to_ours"), "--from",
                    str(d / "to_bare"), "--log", str(d / "bare.txt"), *overrides, f"train.steps={steps}"]
        with (d / "ours.log").open("wb") as out, (d / "bare.log").open("wb") as err:
            procs = [subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, preexec_fn=pin,
                                      start_new_session=True),
                     subprocess.Popen(bare_cmd, cwd=ROOT, env=ONE_THREAD_ENV, stdout=err, stderr=subprocess.STDOUT,
                                      preexec_fn=pin, start_new_session=True)]
        # Each side waits on the other through the pipes. Our side's end closes them and ends the bare loop; a side
        # that fails, or a pair still running at the timeout, is not waited for: both process groups are ended.
        with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
            ended, _ = concurrent.futures.wait([pool.submit(p.wait) for p in procs], timeout=timeout,
                                               return_when=concurrent.futures.FIRST_COMPLETED)
            if not ended or any(p.returncode not in (None, 0) for p in procs):
                for p in procs:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(p.pid, signal.SIGKILL)
            codes = [p.wait() for p in procs]
        if codes != [0, 0]:
            raise RuntimeError(f"turns failed (ours {codes[0]}, bare {codes[1]}"
                               f"{'' if ended else f', both ended after {timeout:.0f} s'}):\n"
                               f"{(d / 'ours.log').read_text()[-3000:]}\n{(d / 'bare.log').read_text()[-2000:]}")
        ours, bare = ([float(x) for x in (d / f).read_text().split()] for f in ("ours.txt", "bare.txt"))
        return ours, bare


if __name__ == "__main__":
    if "--bare" in sys.argv[1:]:
        raise SystemExit(_bare_side(sys.argv[1:]))
    from trainer.__main__ import exit_now, main

    exit_now(main(sys.argv[1:], step_callbacks=[_trainer_side()]))
