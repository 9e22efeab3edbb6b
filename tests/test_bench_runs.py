"""The benchmarks' own arithmetic: the timing window of a trainer run and the error line a failed GPU row shows.

Run: .venv/bin/pytest tests/test_bench_runs.py -q
"""

from __future__ import annotations

from bench.gpu import _last_line
from bench.runs import seconds_per_step


def _steps(times: list[float], blocked: dict[int, float]) -> list[dict]:
    return [{"event": "start", "step": 0, "time": 0.0}] + [
        {"event": "step", "step": i, "time": t, "checkpoint_block_s": blocked.get(i, 0.0)}
        for i, t in enumerate(times, start=1)]


def test_the_window_leaves_out_time_blocked_on_checkpoints():
    # Steps of 0.5 s; step 6 saved for 0.25 s (a periodic save) and step 10, the last, for 4 s (the final save).
    times, t = [], 0.0
    for i in range(1, 11):
        t += 0.5 + {6: 0.25, 10: 4.0}.get(i, 0.0)
        times.append(t)
    events = _steps(times, {6: 0.25, 10: 4.0})
    assert seconds_per_step(events, 2) == 0.5
    # Without the record of the saves the same events would read 4.25 s slower over 8 steps.
    plain = [{k: v for k, v in e.items() if k != "checkpoint_block_s"} for e in events]
    assert seconds_per_step(plain, 2) == 0.5 + 4.25 / 8


def test_a_failed_gpu_row_names_the_workers_error_not_torchruns_summary():
    stderr = "\n".join([
        "python -m trainer: error: train.parallel: must be one of ddp, fsdp (got 'nope')",
        "Traceback (most recent call last):",
        '  File "torch/distributed/elastic/multiprocessing/errors/__init__.py", line 367, in wrapper',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
        "  error_file: <N/A>",
        "  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html",
        "============================================================",
    ])
    assert _last_line(stderr) == "python -m trainer: error: train.parallel: must be one of ddp, fsdp (got 'nope')"
    assert _last_line("=====\nKilled\n-----") == "Killed"
    assert _last_line("") == "(no output)"
