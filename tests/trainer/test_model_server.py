"""The model server's answers count what they return: `usage.completion_tokens` ends at a stop string, and a
max_tokens the model's context cannot hold is capped with a warning in the answer and one log line.

Run: .venv/bin/pytest tests/trainer/test_model_server.py -q

A real server (python -m trainer.model_server) on a socket this test binds and hands it (--fd), serving a
tiny export (64-token context, byte-level tokenizer).
"""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gpu_train.serving.ports import bind
from tests.gpu_train.serving.servers import TINY, export_tiny, get_json, wait_for
from trainer.data.tokenizer import ByteTokenizer
from trainer.export import load_model_dir
from trainer.sample import generate

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """(url, export, log) of a model server that serves a tiny export as `tiny`."""
    tmp = tmp_path_factory.mktemp("server")
    export = export_tiny(tmp / "export", seed=3)
    sock = bind("127.0.0.1", 0, "port", any_port=True)
    log = tmp / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "trainer.model_server", "--model", str(export),
                                 "--name", "tiny", "--version", "1", "--fd", str(sock.fileno()), "--threads", "1"],
                                pass_fds=[sock.fileno()], stdout=out, stderr=subprocess.STDOUT,
                                env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()
    try:
        wait_for(lambda: get_json(f"{url}/health"), "the model server", timeout_s=120, proc=proc, log=log)
        yield url, export, log
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def complete(url: str, **body) -> dict:
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps({"prompt": "def ", "temperature": 0,
                                                                               **body}).encode(),
                                     headers={"content-type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as resp:
        return json.load(resp)


def test_completion_tokens_stop_at_the_stop_string(server):
    url, export, _ = server
    # The tokens the server generates greedily, from the trainer's own sampler on the same export.
    ids = generate(load_model_dir(export).model, ByteTokenizer().encode("def ").tolist(), max_tokens=24,
                   temperature=0, vocab_limit=257, stop_id=256)
    assert 256 not in ids and len(ids) == 24
    tokenizer = AutoTokenizer.from_pretrained(export)
    text = tokenizer.decode(ids)
    full = complete(url, max_tokens=24)
    assert full["choices"][0]["text"] == text and full["usage"]["completion_tokens"] == 24
    # Any whole character past the first (whitespace too; not a byte the tokenizer could only decode as U+FFFD).
    stop = next(c for i, c in enumerate(text) if i >= 1 and c != "\ufffd")
    # The generation ends with the token that completes the stop string: only the tokens up to it are counted.
    counted = next(k for k in range(1, 25) if stop in tokenizer.decode(ids[:k]))
    assert counted < 24
    cut = complete(url, max_tokens=24, stop=stop)
    assert cut["choices"][0] == {"index": 0, "text": text[:text.find(stop)], "finish_reason": "stop",
                                 "logprobs": None}
    assert cut["usage"] == {"prompt_tokens": 4, "completion_tokens": counted, "total_tokens": 4 + counted}
    assert "warnings" not in cut


def test_max_tokens_beyond_the_context_is_capped_and_said(server):
    url, _, log = server
    context = TINY["context"]
    answer = complete(url, max_tokens=500)
    assert answer["usage"]["completion_tokens"] <= context - 1
    assert answer["warnings"][0] == (f"max_tokens 500 is more than the model's context of {context} tokens allows: "
                                     f"at most {context - 1} tokens are generated")
    said = [line for line in log.read_text().splitlines() if "max_tokens 500" in line]
    assert len(said) == 1 and said[0].startswith("gpu-train: model tiny version 1: max_tokens 500 is more than")
