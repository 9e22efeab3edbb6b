"""The benchmark harness runs and writes its results file (no timings are asserted: figures are
reported by `make bench`, never checked in tests)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench import turns
from tests.conftest import ROOT

# Runs the benchmarks' sections for real.
pytestmark = pytest.mark.integration


def run_bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=600)


def test_plan_section_writes_results(tmp_path):
    out = tmp_path / "results.json"
    proc = run_bench("--only", "plan", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(out.read_text())
    names = {f["name"] for f in doc["figures"]}
    assert names == {"plan aws-dev"}  # --quick plans the first stack alone
    assert all(f["value"] > 0 and f["unit"] == "s" for f in doc["figures"])
    assert "gpu-train benchmarks" in proc.stdout


def test_unknown_section_is_rejected():
    proc = run_bench("--only", "speed")
    assert proc.returncode == 2 and "unknown section(s) ['speed']" in proc.stderr


def test_gpu_section_says_what_each_row_needs_without_cuda(tmp_path):
    """Without CUDA every GPU row is listed with no figure and what it needs: DDP and FSDP2 for both presets (and
    gpt2-124m's DDP at four times its micro batch and at train.micro_batch_size=auto), then the tensor- and
    pipeline-parallel rows, which need two GPUs."""
    out = tmp_path / "r.json"
    proc = run_bench("--only", "gpu", "--gpu", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    figures = json.loads(out.read_text())["figures"]
    assert [f["name"] for f in figures] == [
        "gpt2-124m DDP bf16+compile, micro batch 16 vs bare loop",
        "gpt2-124m FSDP bf16+compile, micro batch 16 vs bare loop",
        "gpt2-124m DDP bf16+compile, micro batch 64 vs bare loop",
        "gpt2-124m DDP bf16+compile, micro batch auto vs bare loop",
        "gpt2-350m DDP bf16+compile, micro batch 8 vs bare loop",
        "gpt2-350m FSDP bf16+compile, micro batch 8 vs bare loop",
        "gpt2-350m FSDP2+TP bf16 vs FSDP2", "gpt2-350m PP bf16 vs FSDP2"]
    assert all(f["value"] is None and "needs a CUDA device" in f["notes"] for f in figures)
    assert all("2 GPUs or more" in f["notes"] for f in figures[6:])


def test_bare_reference_loop_runs():
    proc = subprocess.run([sys.executable, "-m", "bench.bare", "--preset", "tiny", "--steps", "4", "--from-step", "2"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["from_step"] == 2 and result["to_step"] == 4 and result["seconds_per_step"] > 0


def test_the_two_processes_take_turns_a_step_each():
    """Our loop for 6 steps beside the bare loop: the bare loop steps once at each of our steps' callbacks (6), and
    our turns run from one callback to the next (5); the run ends when ours does."""
    ours, bare = turns.pair("tiny", ["metrics.port=0", "tracking.enabled=false", "checkpoint.every_steps=0"], 6)
    assert len(ours) == 5 and len(bare) == 6 and all(t > 0 for t in ours + bare)
    # A side that fails is not waited for: the other, waiting on the pipes, is ended and the failure said.
    with pytest.raises(RuntimeError, match="turns failed") as failed:
        turns.pair("tiny", ["train.no_such_setting=1"], 6)
    assert "no_such_setting" in str(failed.value)


def test_interleaved_runs_both_loops_in_turn():
    proc = subprocess.run([sys.executable, "-m", "bench.interleaved", "--preset", "tiny", "--blocks", "2",
                           "--block-steps", "2", "--warmup", "1"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    # 1 warm-up step, then 2 pairs of 2-step blocks: 5 steps of each loop, the trainer's through Trainer.advance().
    assert result["trainer_steps"] == result["bare_steps"] == 5
    assert len(result["ratios"]) == 2 and all(r > 0 for r in result["ratios"])
    assert result["ours_s"] > 0 and result["bare_s"] > 0


def test_serving_section_writes_results(tmp_path):
    out = tmp_path / "results.json"
    proc = run_bench("--only", "serving", "--quick", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    figures = {f["name"]: f for f in json.loads(out.read_text())["figures"]}
    assert len(figures) == 3 and all(f["section"] == "serving" for f in figures.values())
    latency = figures["p50 latency through the route vs the model server alone, concurrency 1"]
    assert latency["value"] > 0 and latency["reference"] > 0 and latency["unit"] == "ms"
    route = latency["extra"]["route"]
    assert route["ok"] == route["requests"] == 40 and route["p50_ms"] <= route["p95_ms"] <= route["p99_ms"]
