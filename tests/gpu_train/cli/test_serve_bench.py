"""`gpu-train serve bench` with a bad --requests, --concurrency, --max-tokens or --url: one line naming the flag and
its value, exit status 2, before any request is sent.

Run: .venv/bin/pytest tests/gpu_train/cli/test_serve_bench.py -q
"""

from __future__ import annotations

import pytest

from gpu_train.cli.main import main


def bench(capsys, *args: str) -> tuple[int, str]:
    code = main(["serve", "bench", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(("args", "line"), [
    (["--requests", "0"], "--requests 0 must be >= 1"),
    (["--requests", "-5"], "--requests -5 must be >= 1"),
    (["--requests", "many"], "--requests 'many' is not a whole number"),
    (["--concurrency", "0"], "--concurrency 0 must be >= 1"),
    (["--concurrency", "2.5"], "--concurrency '2.5' is not a whole number"),
    (["--max-tokens", "0"], "--max-tokens 0 must be >= 1"),
    (["--url", "127.0.0.1:8000"], "--url '127.0.0.1:8000' is not an http:// or https:// URL with a host"),
    (["--url", "localhost"], "--url 'localhost' is not an http:// or https:// URL with a host"),
    (["--url", "http://127.0.0.1:99999"], "--url 'http://127.0.0.1:99999' is not a usable URL: Port out of range"),
    (["--url", "http://127.0.0.1:port"], "--url 'http://127.0.0.1:port' is not a usable URL"),
    (["--url", "http://"], "--url 'http://' is not an http:// or https:// URL with a host"),
])
def test_a_bad_flag_is_one_line_naming_it(capsys, args, line):
    code, err = bench(capsys, "--model", "m", *args)
    assert code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith(f"gpu-train: error: {line}")

