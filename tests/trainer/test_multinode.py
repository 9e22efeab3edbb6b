"""Several torchrun agents on localhost as nodes: each its own node-local checkpoint directory, one c10d
rendezvous, a local S3 server (moto) as the checkpoint store, all started through the launcher.

Run: .venv/bin/pytest tests/trainer/test_multinode.py -q

The reference is one process training the same settings. With 12 sequences per step in micro batches of 6,
one worker runs 2 micro batches and each of two workers runs 1: the summed gradient is g0/2 + g1/2 either way
(scaling by a power of two is exact and the two-rank all-reduce adds the same two numbers), so the final
parameters are bit-identical at world size 1 and 2 and every scenario below must end on the reference's
params_sha256, whatever the world size it went through.
"""

from __future__ import annotations

import json
import random
import signal
import time

import pytest

from tests.trainer.launch import FAULTS, Nodes, run_trainer, summary
from trainer.checkpoint import MANIFEST, list_step_dirs

pytestmark = pytest.mark.slow

STEPS = 24
BASE = [
    "model.n_layer=2", "model.d_model=32", "model.n_head=2", "model.context=32",
    "train.global_batch_tokens=384", "train.micro_batch_size=6", "train.warmup_steps=2",
    f"train.steps={STEPS}", "tracking.enabled=false", "metrics.log_every=1", "checkpoint.every_steps=2",
    "checkpoint.keep=2",
]
# A bound on each phase, not a pace: on a machine loaded well past its cores, starting two agents' workers (torch
# imports, rendezvous) has taken over 240 s, so the bound is far above an idle machine's 20-40 s.
TIMEOUT = 600


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> dict:
    """The same training in one process, never interrupted."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    res = run_trainer(run_dir, None, BASE)
    assert res.returncode == 0, res.output[-4000:]
    return summary(run_dir)


def _nodes(tmp_path, s3, *, env: dict[str, str] | None = None, **kw) -> Nodes:
    remote = [f"checkpoint.remote_uri=s3://{s3.bucket}/run", f"checkpoint.endpoint_url={s3.endpoint}"]
    return Nodes(tmp_path, overrides=[*BASE, *remote], env={**s3.env, **(env or {})}, **kw)


def _remote_complete(s3) -> list[int]:
    keys = s3.keys("run/")
    return sorted(int(k.split("/")[1].split("_")[1]) for k in keys if k.endswith("/" + MANIFEST))


def test_two_nodes_match_one_process_and_refuse_a_changed_model(tmp_path, s3, reference):
    nodes = _nodes(tmp_path, s3)
    try:
        nodes.start(0)
        nodes.start(1)
        assert nodes.wait_all(TIMEOUT) == [0, 0], nodes.logs()
        got = nodes.summary()
        assert got["status"] == "completed" and got["step"] == STEPS
        assert got["params_sha256"] == reference["params_sha256"]

        # Node-local directories: each node holds its own ranks' files and the whole checkpoint's manifest;
        # only the union (and the remote copy) is complete. Both nodes pruned to checkpoint.keep.
        kept = [[p.name for p in list_step_dirs(nodes.run_dir(n) / "checkpoints")] for n in (0, 1)]
        assert kept[0] == kept[1] == [f"step_{STEPS:09d}", f"step_{STEPS - 2:09d}"]
        newest = [nodes.run_dir(n) / "checkpoints" / kept[0][0] for n in (0, 1)]
        manifest = json.loads((newest[0] / MANIFEST).read_text())
        assert (newest[1] / MANIFEST).read_text() == (newest[0] / MANIFEST).read_text()
        on_disk = [{str(p.relative_to(d)) for d in [d] for p in d.rglob("*") if p.is_file() and p.name != MANIFEST}
                   for d in newest]
        assert on_disk[0] | on_disk[1] == set(manifest["files"])
        assert on_disk[0] and on_disk[1] and not on_disk[0] & on_disk[1]
        assert _remote_complete(s3) == [STEPS - 2, STEPS]

        # Relaunch both nodes with another model shape: refused by the workers (the checkpoint says so),
        # exit 2 on both nodes, torchrun never restarts a worker although restarts are allowed, and the run
        # directory is unchanged.
        config = {n: (nodes.run_dir(n) / "config.json").read_bytes() for n in (0, 1)
                  if (nodes.run_dir(n) / "config.json").exists()}
        t0 = time.monotonic()
        changed = Nodes(tmp_path, overrides=[*nodes.overrides, "model.n_layer=3"], env=s3.env, max_restarts=3,
                        name="changed")
        changed.start(0)
        changed.start(1)
        try:
            assert changed.wait_all(TIMEOUT) == [2, 2], changed.logs()
        finally:
            changed.close()
        logs = changed.logs()
        assert "bad input, not retried" in logs and "n_layer=2" in logs and "n_layer=3" in logs
        assert "will restart worker group" not in logs
        assert "Traceback" not in logs
        assert time.monotonic() - t0 < 120
        for n, data in config.items():
            assert (nodes.run_dir(n) / "config.json").read_bytes() == data
    finally:
        nodes.close()


def test_node_local_directories_without_a_remote_store_are_refused(tmp_path):
    """Each node's checkpoint directory is its own and there is no remote store: no node could ever resume, so
    both nodes refuse to start, with one line, without restarts."""
    nodes = Nodes(tmp_path, overrides=BASE, max_restarts=3)
    try:
        nodes.start(0)
        nodes.start(1)
        assert nodes.wait_all(TIMEOUT) == [2, 2], nodes.logs()
    finally:
        nodes.close()
    logs = nodes.logs()
    assert "checkpoint.local_dir" in logs and "separate directory on each of 2 nodes" in logs
    assert "checkpoint.remote_uri is empty" in logs
    assert "will restart worker group" not in logs and "Traceback" not in logs


def test_worker_killed_at_a_random_step(tmp_path, s3, reference):
    kill_at = random.Random().randrange(3, STEPS - 2)
    nodes = _nodes(tmp_path, s3, max_restarts=2, module=FAULTS, env={
        "TRAINER_TEST_KILL_AT_STEP": str(kill_at), "TRAINER_TEST_KILL_RANK": "1",
        "TRAINER_TEST_KILL_MARKER": str(tmp_path / "killed"),
    })
    try:
        nodes.start(0)
        nodes.start(1)
        codes = nodes.wait_all(TIMEOUT)
        assert codes == [0, 0], f"killed at step {kill_at}\n{nodes.logs()}"
        assert (tmp_path / "killed").exists()
        got = nodes.summary()
        # One agent restarts after its worker's failure, the other one for the membership change (not counted).
        starts = [e for e in nodes.events() if e.get("event") == "start"]
        assert len(starts) == 2 and starts[1]["step"] <= kill_at and starts[1]["resumed_from"]
        assert got["step"] == STEPS
        assert got["params_sha256"] == reference["params_sha256"], f"killed at step {kill_at}"
        logs = nodes.logs()
        assert "resumed from" in logs and f"downloaded checkpoint s3://{s3.bucket}/run/step_" in logs, logs
    finally:
        nodes.close()


def test_lost_node_is_replaced_by_one_with_an_empty_disk(tmp_path, s3, reference):
    """Node 1's launcher is SIGKILLed (its torchrun and worker die with it); a replacement with an empty
    disk joins the rendezvous and the group restarts from the newest checkpoint in the store."""
    nodes = _nodes(tmp_path, s3, max_restarts=2)
    try:
        nodes.start(0)
        lost = nodes.start(1)
        nodes.wait_for(lambda: nodes.last_step() >= 5, 120, "step 5")
        lost.kill()
        nodes.agents.remove(lost)
        nodes.start(2)  # a new node: its own, empty directory
        assert nodes.wait_all(TIMEOUT) == [0, 0], nodes.logs()
        got = nodes.summary()
        assert got["step"] == STEPS and got["params_sha256"] == reference["params_sha256"]
        starts = [e for e in nodes.events() if e.get("event") == "start"]
        assert len(starts) == 2 and starts[1]["resumed_from"] and starts[1]["step"] >= 2
        assert "downloaded checkpoint" in nodes.agents[-1].output()
    finally:
        nodes.close()


def test_sigterm_on_one_node_leaves_the_other_training_alone(tmp_path, s3, reference):
    """SIGTERM to node 1 (spot reclaim): every rank finishes the step and saves it; node 1 exits non-zero
    (not completed), node 0's agent restarts its worker, which continues alone (--nnodes=1:2) from that
    checkpoint to the end."""
    nodes = _nodes(tmp_path, s3, nnodes="1:2", max_restarts=2)
    try:
        nodes.start(0)
        preempted = nodes.start(1)
        nodes.wait_for(lambda: nodes.last_step() >= 4, 120, "step 4")
        preempted.signal(signal.SIGTERM)
        code = preempted.wait(TIMEOUT)
        assert code != 0, "a preempted node must not report success"
        assert nodes.agents[0].wait(TIMEOUT) == 0, nodes.logs()
        logs = "".join(a.output() for a in nodes.agents)
        saved = sorted({int(line.split("saved checkpoint at step ")[1].split(",")[0])
                        for line in logs.splitlines() if "SIGTERM: saved checkpoint at step" in line})
        assert len(saved) == 1, logs  # both ranks stopped after the same step
        stopped = saved[0]
        assert logs.count(f"SIGTERM: saved checkpoint at step {stopped}") == 2
        starts = [e for e in nodes.events() if e.get("event") == "start"]
        assert [s["world_size"] for s in starts] == [2, 1]
        assert starts[1]["step"] == stopped and starts[1]["resumed_from"].endswith(f"step_{stopped:09d}")
        got = nodes.summary()
        assert got["status"] == "completed" and got["step"] == STEPS
        assert got["params_sha256"] == reference["params_sha256"]
    finally:
        nodes.close()


def test_one_node_cannot_upload_and_training_goes_on(tmp_path, failing_s3, reference):
    """Node 1 reaches the store through a proxy that refuses its uploads of steps 4 and 6: every rank agrees
    those saves failed (no rank waits forever), their remote copies get no manifest, training continues and
    the later checkpoints are uploaded."""
    s3, proxy = failing_s3
    proxy.refuse = {"/step_000000004/", "/step_000000006/"}
    nodes = _nodes(tmp_path, s3)
    try:
        nodes.start(0)
        nodes.start(1, overrides=[f"checkpoint.endpoint_url={proxy.endpoint}"])
        assert nodes.wait_all(TIMEOUT) == [0, 0], nodes.logs()
        assert proxy.refused, "the proxy refused nothing"
        logs = "".join(a.output() for a in nodes.agents)
        for step in (4, 6):
            failed = [line for line in logs.splitlines() if f"checkpoint step {step} failed" in line]
            assert failed and "AccessDenied" in failed[0] and "rank " in failed[0], logs
        keys = s3.keys("run/")
        assert not any(k.startswith(("run/step_000000004/manifest", "run/step_000000006/manifest")) for k in keys)
        assert _remote_complete(s3) == [STEPS - 2, STEPS]
        got = nodes.summary()
        assert got["params_sha256"] == reference["params_sha256"]
    finally:
        nodes.close()


def _expected_batch_hashes(steps: int) -> dict[int, str]:
    """What the sampler must hand out, computed here without any worker: independent of world size."""
    from gpu_train.sizing.layout import batch_layout
    from gpu_train.spec.trainer_config import build_config
    from trainer.data import GlobalSampler, open_dataset
    from trainer.metrics import batch_hash

    cfg = build_config("tiny", overrides=BASE)
    global_batch, _ = batch_layout(cfg, 1)
    ds = open_dataset(cfg.data.uri, context=cfg.model.context)
    sampler = GlobalSampler(ds.num_windows, global_batch=global_batch, seed=cfg.train.seed,
                            shard_windows=ds.shard_windows, block_shards=cfg.data.block_shards)
    ds.close()
    return {s + 1: batch_hash(sampler.global_batch(s)) for s in range(steps)}


def test_two_then_one_then_two_nodes(tmp_path, s3, reference):
    """Launch 2 nodes and lose node 0, which hosts the rendezvous: node 1 cannot rendezvous any more and exits
    non-zero within seconds (a loud failure; the Job controller would recreate the pods). Then node 0 alone
    (its worker dies at step 13, no restarts), then node 0 and a fresh node: the same global batches in the
    same order, and the reference's parameters."""
    env = {"TRAINER_TEST_KILL_MARKER": str(tmp_path / "killed")}
    extra = ["metrics.batch_hash=true"]
    first = _nodes(tmp_path, s3, name="first", max_restarts=2)
    try:
        host = first.start(0, overrides=extra)
        other = first.start(1, overrides=extra)
        first.wait_for(lambda: first.last_step() >= 5, 120, "step 5")
        host.kill()
        t0 = time.monotonic()
        code = other.wait(60)
        assert code != 0 and time.monotonic() - t0 < 60, other.output()[-3000:]
        assert "RendezvousConnectionError" in other.output()
    finally:
        first.close()
    second = _nodes(tmp_path, s3, nnodes="1", name="second", module=FAULTS,
                    env={**env, "TRAINER_TEST_KILL_AT_STEP": "13"})
    try:
        second.start(0, overrides=extra)
        assert second.wait_all(TIMEOUT)[0] != 0, second.logs()
    finally:
        second.close()
    third = _nodes(tmp_path, s3, name="third")
    try:
        third.start(0, overrides=extra)
        third.start(2, overrides=extra)  # a new node: its own, empty directory
        assert third.wait_all(TIMEOUT) == [0, 0], third.logs()
    finally:
        third.close()
    starts = [e for e in third.events() if e.get("event") == "start"]
    assert [s["world_size"] for s in starts] == [2, 1, 2]
    # Each launch resumed from a checkpoint of the one before (the newest one, unless its asynchronous save
    # was still in flight when the node or the worker was killed).
    steps = [s["step"] for s in starts]
    assert steps[0] == 0 and steps[1] > 0 and steps[1] < steps[2] <= 13, steps
    got = {s: r["batch_sha256"] for s, r in third.step_records().items()}
    assert got == _expected_batch_hashes(STEPS)
    final = third.summary()
    assert final["step"] == STEPS and final["params_sha256"] == reference["params_sha256"]


def test_fsdp_with_model_registration_on_two_nodes(tmp_path, s3):
    """The final full state dict is gathered on every rank (a collective), then rank 0 exports and registers it:
    Hugging Face's GPT-2 layout (the tiny preset is GPT-2's architecture), read back with the safetensors package
    alone, holds exactly the trained parameters."""
    import mlflow
    from safetensors.torch import load_file

    from trainer.export import from_hf_gpt2, fuse_model_qkv, model_config_from
    from trainer.outputs import state_sha256

    nodes = _nodes(tmp_path, s3)
    nodes.overrides = [o for o in nodes.overrides if not o.startswith(("tracking.", "train.steps"))] + [
        "train.steps=6", "train.parallel=fsdp", "tracking.enabled=true", "tracking.register_name=fsdp-two-nodes",
    ]
    try:
        nodes.start(0)
        nodes.start(1)
        assert nodes.wait_all(TIMEOUT) == [0, 0], nodes.logs()
    finally:
        nodes.close()
    got = nodes.summary()
    assert got["status"] == "completed" and got["step"] == 6
    model_file = nodes._rank0_file("model/model.safetensors")
    config = json.loads((model_file.parent / "config.json").read_text())
    assert config["model_type"] == "gpt2" and config["n_layer"] == 2 and config["n_embd"] == 32
    cfg = model_config_from(config["gpu_train"]["model"], "config")
    # Hugging Face's layout holds query, key and value apart; the trained state (and its hash) holds them fused.
    state = fuse_model_qkv(from_hf_gpt2(load_file(str(model_file)), cfg), cfg.n_head)
    assert state_sha256(state) == got["params_sha256"]
    # The embedded MLflow store of the node rank 0 ran on: beside its run directory.
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{model_file.parent.parent.parent / 'mlflow.db'}")
    versions = client.search_model_versions("name='fsdp-two-nodes'")
    assert len(versions) == 1


def test_one_mlflow_run_across_a_lost_node_a_resize_and_a_relaunch(tmp_path, s3, reference):
    """Two nodes; node 1 is lost and node 0 goes on alone (2 -> 1 workers); then node 0 is lost too, and the job is
    relaunched on node 0 and a fresh node (1 -> 2). One MLflow run holds every step's metrics exactly once, and the
    run ends on the reference's parameters."""
    from tests.trainer.test_resume import metric_steps, mlflow_runs

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracked = ["tracking.enabled=true", f"tracking.uri={uri}", "tracking.log_every=1", "eval.sample_tokens=0"]
    first = _nodes(tmp_path, s3, nnodes="1:2", max_restarts=3, name="first")
    try:
        first.start(0, overrides=tracked)
        lost = first.start(1, overrides=tracked)
        first.wait_for(lambda: first.last_step() >= 5, 120, "step 5")
        lost.kill()
        first.wait_for(lambda: first.last_step() >= 14, 180, "step 14 on node 0 alone")
        first.agents[0].kill()
    finally:
        first.close()
    second = _nodes(tmp_path, s3, name="second", max_restarts=1)
    try:
        second.start(0, overrides=tracked)
        second.start(2, overrides=tracked)  # a new node: its own, empty directory
        assert second.wait_all(TIMEOUT) == [0, 0], second.logs()
    finally:
        second.close()
    starts = [e for e in second.events() if e.get("event") == "start"]
    assert [s["world_size"] for s in starts][-3:] == [2, 1, 2], starts
    assert second.summary()["params_sha256"] == reference["params_sha256"]
    runs = mlflow_runs(uri)
    assert len(runs) == 1, [(r.info.run_id, r.info.status) for r in runs]
    assert runs[0].info.status == "FINISHED"
    for key in ("loss", "lr", "tokens"):
        assert metric_steps(uri, runs[0].info.run_id, key) == list(range(1, STEPS + 1)), key
