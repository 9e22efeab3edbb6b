"""A real CPU run: the loss and the validation loss fall on the learnable synthetic data, every output is
written (the registered model in a layout the safetensors package reads alone, the end-of-run sample), MLflow
gets the run and its id lands in the checkpoint; the Prometheus endpoint serves exactly the agreed metric names.

Run: .venv/bin/pytest tests/trainer/test_train.py -q
"""

from __future__ import annotations

import json
import math
import urllib.request

import pytest

from tests.trainer.launch import FAULTS, SMALL, free_port, run_trainer, step_records, summary
from trainer.checkpoint import verify
from trainer.metrics import TrainerMetrics

# Trains under torchrun.
pytestmark = pytest.mark.integration

INTERFACE_METRICS = [
    "trainer_step", "trainer_loss", "trainer_tokens_per_second", "trainer_mfu", "trainer_tokens_total",
    "trainer_step_seconds", "trainer_data_wait_seconds", "trainer_forward_backward_seconds",
    "trainer_optimizer_seconds", "trainer_checkpoint_blocking_seconds", "trainer_checkpoint_duration_seconds",
    "trainer_checkpoint_last_success_timestamp_seconds", "trainer_restarts_total",
    "trainer_last_step_timestamp_seconds", "trainer_val_loss",
]
# Per-rank straggler gauges: the names the monitoring rules use, each with exactly one label, the global rank.
RANK_METRICS = [
    "trainer_rank_step_seconds", "trainer_rank_compute_seconds", "trainer_rank_data_wait_seconds",
    "trainer_rank_collective_wait_seconds",
]


def test_cpu_run_lowers_loss_and_writes_outputs(tmp_path):
    run_dir = tmp_path / "runs" / "learn"
    overrides = [o for o in SMALL if not o.startswith("tracking.")] + [
        "train.steps=40", "train.lr=1e-2", "train.min_lr=1e-3", "checkpoint.every_steps=20",
        "tracking.enabled=true", "tracking.log_every=5", "tracking.register_name=tiny-test",
        "eval.every_steps=15", "eval.batches=4", "eval.sample_tokens=40",
    ]
    res = run_trainer(run_dir, None, overrides)
    assert res.returncode == 0, res.output[-4000:]

    records = step_records(run_dir)
    first, last = records[1]["loss"], summary(run_dir)["final_loss"]
    assert first > 5.0  # about ln(264) at initialisation
    assert last < first - 2.0, f"loss {first:.3f} -> {last:.3f}"
    result = summary(run_dir)
    assert set(result) >= {"step", "tokens", "final_loss", "params_sha256", "restarts", "tokens_per_s", "mfu"}
    assert result["step"] == 40 and result["tokens"] == 40 * 384
    assert result["mfu"] is None and result["tokens_per_s"] > 0
    assert len(result["params_sha256"]) == 64
    assert "MFU n/a" in res.output and "final loss" in res.output
    assert (run_dir / "loss.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    resolved = json.loads((run_dir / "config.json").read_text())
    assert resolved["train"]["lr"] == 1e-2 and resolved["model"]["d_model"] == 32
    for rec in records.values():
        assert rec["step_s"] >= rec["data_wait_s"] >= 0 and rec["forward_backward_s"] > 0
        assert math.isfinite(rec["loss"])

    # Validation loss at steps 15, 30 and the end (40), falling, and in the summary, the checkpoint and the
    # printed summary; an untrained model is near ln(257) = 5.55 on the held-out split.
    evals = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if json.loads(line).get("event") == "eval"]
    assert [e["step"] for e in evals] == [15, 30, 40]
    losses = [e["val_loss"] for e in evals]
    assert losses[0] > losses[-1] and losses[-1] < 4.0, losses
    assert result["val_loss"] == losses[-1] and result["best_val_loss"] == min(losses)
    assert result["best_val_step"] == evals[losses.index(min(losses))]["step"]
    assert all(e["windows"] == 4 * 2 for e in evals)
    assert f"validation loss {losses[-1]:.4f} at step 40" in res.output
    # The end-of-run sample: 40 byte-level tokens of the synthetic language, after its header line.
    header = next(i for i, line in enumerate(res.output.splitlines()) if line.startswith("sample (40 tokens"))
    assert res.output.splitlines()[header + 1].strip()

    manifest = verify(run_dir / "checkpoints" / "step_000000040")
    assert manifest["config"] == resolved
    # A checkpoint names its MLflow run by the job's run key from the first step, and by the run's id once MLflow
    # has answered (on a busy machine that can be after step 40): the key finds the run, the id is that run's.
    import mlflow

    from trainer.tracking import TAG_RUN_KEY

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{tmp_path / 'runs' / 'mlflow.db'}")
    key = manifest["trainer"]["mlflow_run_key"]
    (found,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                  filter_string=f"tags.`{TAG_RUN_KEY}` = '{key}'")
    run_id = found.info.run_id
    assert manifest["trainer"]["mlflow_run_id"] in (None, run_id)
    assert manifest["trainer"]["eval"]["last"] == losses[-1] and manifest["trainer"]["eval"]["last_step"] == 40

    # The registered model: Hugging Face's GPT-2 layout (tiny is GPT-2's architecture), read here with the
    # safetensors package and mapped back by hand, holds exactly the trained parameters.
    from safetensors.torch import load_file

    from trainer.model import fuse_qkv
    from trainer.outputs import state_sha256

    hf_config = json.loads((run_dir / "model" / "config.json").read_text())
    assert hf_config["model_type"] == "gpt2" and hf_config["n_embd"] == 32 and hf_config["vocab_size"] == 264
    hf = load_file(str(run_dir / "model" / "model.safetensors"))
    assert hf["transformer.h.0.attn.c_attn.weight"].shape == (32, 96)  # Conv1D: (in, out)
    ours = {"tok_emb.weight": hf["transformer.wte.weight"], "lm_head.weight": hf["transformer.wte.weight"],
            "pos_emb.weight": hf["transformer.wpe.weight"], "norm_f.weight": hf["transformer.ln_f.weight"],
            "norm_f.bias": hf["transformer.ln_f.bias"]}
    for i in range(2):
        h = f"transformer.h.{i}."
        ours.update({
            f"blocks.{i}.norm1.weight": hf[h + "ln_1.weight"], f"blocks.{i}.norm1.bias": hf[h + "ln_1.bias"],
            # GPT-2's c_attn holds the query, key and value side by side; ours, one matrix head by head.
            f"blocks.{i}.attn.wqkv.weight": fuse_qkv(*hf[h + "attn.c_attn.weight"].t().chunk(3), n_head=2),
            f"blocks.{i}.attn.proj.weight": hf[h + "attn.c_proj.weight"].t(),
            f"blocks.{i}.norm2.weight": hf[h + "ln_2.weight"], f"blocks.{i}.norm2.bias": hf[h + "ln_2.bias"],
            f"blocks.{i}.mlp.fc.weight": hf[h + "mlp.c_fc.weight"].t(),
            f"blocks.{i}.mlp.proj.weight": hf[h + "mlp.c_proj.weight"].t(),
        })
    assert state_sha256(ours) == result["params_sha256"]

    # MLflow: the run holds the loss history, the artifacts, and the registered model.
    run = client.get_run(run_id)
    assert run.data.params["train.steps"] == "40"
    assert run.data.tags["dataset.uri"] == "synthetic"
    history = client.get_metric_history(run_id, "loss")
    assert [m.step for m in history] == [5, 10, 15, 20, 25, 30, 35, 40]
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "val_loss")] == [
        (e["step"], e["val_loss"]) for e in evals]
    artifacts = {a.path for a in client.list_artifacts(run_id)}
    assert {"loss.png", "summary.json"} <= artifacts
    assert {a.path for a in client.list_artifacts(run_id, "model")} >= {"model/model.safetensors",
                                                                        "model/config.json"}
    version = client.search_model_versions("name='tiny-test'")[0]
    assert version.tags["model.format"] == "hf-gpt2" and version.tags["params_sha256"] == result["params_sha256"]


def test_prometheus_endpoint_serves_the_interface_names():
    port = free_port()
    m = TrainerMetrics(port=port, rank=5)
    try:
        before = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        m.observe_step(step=3, loss=2.5, tokens=4096, step_s=0.2, data_wait_s=0.01, fwd_bwd_s=0.15, optim_s=0.03,
                       ckpt_block_s=0.0, tokens_per_s=20480.0, mfu=None, now=1.7e9)
        m.observe_rank(step_s=0.2, compute_s=0.12, data_wait_s=0.01, collective_wait_s=0.05)
        m.observe_eval(2.25)
        m.observe_checkpoint(1.5, 1.7e9)
        m.restarts.set(2)
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    finally:
        m.close()
    samples = {}
    for line in body.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = value
    for name in INTERFACE_METRICS:
        assert any(s == name or s.startswith(name + "_bucket") or s == name + "_count" for s in samples), name
    assert samples["trainer_step"] == "3.0"
    assert samples["trainer_tokens_total"] == "4096.0"
    assert samples["trainer_mfu"] == "NaN"
    assert samples["trainer_restarts_total"] == "2.0"
    assert samples["trainer_step_seconds_count"] == "1.0"
    assert samples["trainer_val_loss"] == "2.25"
    assert "trainer_val_loss NaN" in before  # no evaluation yet
    assert samples['trainer_rank_step_seconds{rank="5"}'] == "0.2"
    assert samples['trainer_rank_compute_seconds{rank="5"}'] == "0.12"
    assert samples['trainer_rank_data_wait_seconds{rank="5"}'] == "0.01"
    assert samples['trainer_rank_collective_wait_seconds{rank="5"}'] == "0.05"
    # No labels beyond what Prometheus adds at scrape time, except `rank` on the per-rank gauges.
    labelled = {s.split("{")[0] for s in samples if "{" in s and not s.split("{")[0].endswith("_bucket")}
    assert labelled == set(RANK_METRICS)


def _evals(run_dir) -> list[dict]:
    return [r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if r.get("event") == "eval"]


def test_early_stopping_survives_a_restart_and_a_stopped_run_stays_stopped(tmp_path):
    """With train.lr=1e-30 every AdamW update is far below float32's resolution of weights of order 0.02 to 1
    (and RMSNorm leaves no bias at 0), so the weights never change and no evaluation after the first is a new
    best: with patience 2 the run stops after the evaluation of step 3. Killed in the middle of step 3, the
    resumed run stops at the same step on the same weights; launched again it trains nothing; with a larger
    patience it goes on until that patience is used up."""
    base = [*SMALL, "model.norm=rmsnorm", "train.steps=20", "train.lr=1e-30", "train.min_lr=0",
            "train.warmup_steps=1", "checkpoint.every_steps=1", "eval.every_steps=1", "eval.batches=2",
            "eval.early_stopping_patience=2", "eval.sample_tokens=0"]
    ref = run_trainer(tmp_path / "ref", None, base)
    assert ref.returncode == 0, ref.output[-4000:]
    want = summary(tmp_path / "ref")
    assert want["status"] == "stopped_early" and want["step"] == 3
    assert [e["step"] for e in _evals(tmp_path / "ref")] == [1, 2, 3]
    assert len({e["val_loss"] for e in _evals(tmp_path / "ref")}) == 1  # the weights never changed
    assert want["best_val_step"] == 1 and "early stopping at step 3" in ref.output
    assert "training stopped early: 3/20 steps" in ref.output

    run_dir = tmp_path / "run"
    killed = run_trainer(run_dir, None, base, module=FAULTS, env={"TRAINER_TEST_KILL_AT_STEP": "2"})
    assert killed.returncode != 0  # SIGKILLed in step 3, after the checkpoint of step 2
    again = run_trainer(run_dir, None, base)
    assert again.returncode == 0, again.output[-4000:]
    assert "resumed from" in again.output
    got = summary(run_dir)
    assert (got["status"], got["step"], got["params_sha256"]) == ("stopped_early", 3, want["params_sha256"])
    assert got["best_val_step"] == 1

    steps_before = len(step_records(run_dir))
    stopped = run_trainer(run_dir, None, base)
    assert stopped.returncode == 0, stopped.output[-4000:]
    assert "nothing to train" in stopped.output and summary(run_dir)["status"] == "stopped_early"
    assert len(step_records(run_dir)) == steps_before

    more = run_trainer(run_dir, None, [*base, "eval.early_stopping_patience=4"])
    assert more.returncode == 0, more.output[-4000:]
    assert (summary(run_dir)["status"], summary(run_dir)["step"]) == ("stopped_early", 5)


def test_auto_micro_batch_is_the_largest_that_fits_each_worker(tmp_path):
    """SMALL's 12 sequences per step over 2 workers are 6 each, and the tiny model at 6 sequences fits any host's
    memory, so auto is 6: the run's resolved configuration records it and the log line says why."""
    run_dir = tmp_path / "auto"
    res = run_trainer(run_dir, 2, [o for o in SMALL if not o.startswith("train.micro_batch_size")] + [
        "train.micro_batch_size=auto", "train.steps=2"])
    assert res.returncode == 0, res.output[-4000:]
    assert json.loads((run_dir / "config.json").read_text())["train"]["micro_batch_size"] == 6
    assert "train.micro_batch_size=auto: 6 at world size 2, estimated" in res.output
    assert "of this host's memory" in res.output
