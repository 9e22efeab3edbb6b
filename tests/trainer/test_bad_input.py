"""Bad trainer input, tried as a user would: every case exits 2 with one line naming the setting, file, URI or
checkpoint, and no Python traceback; a refused resume changes nothing in the run directory.

Run: .venv/bin/pytest tests/trainer/test_bad_input.py -q

Each row runs `python -m trainer` as a real process. The rows go through every config key with a range and
every input path the trainer reads or writes (--config, --run-dir, checkpoint.local_dir, data.cache_dir,
data.uri, checkpoint.remote_uri, the metrics port, the environment it reads, an existing checkpoint).
"""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.trainer.launch import FAULTS, ROOT, SMALL, child_env, run_trainer
from trainer.distributed import free_port

# Starts the trainer and its launcher as processes, one per case.
pytestmark = pytest.mark.integration

BASE = [*SMALL, "train.steps=2"]


def _synth(out: Path, tokens: int, *, shard_tokens: int | None = None, seed: int = 0,
           val_tokens: int | None = None) -> str:
    cmd = [sys.executable, "-m", "trainer.data", "synth", "--out", f"file://{out}", "--tokens", str(tokens),
           "--seed", str(seed)]
    if shard_tokens:
        cmd += ["--shard-tokens", str(shard_tokens)]
    if val_tokens is not None:
        cmd += ["--val-tokens", str(val_tokens)]
    subprocess.run(cmd, cwd=ROOT, env=child_env(), check=True, capture_output=True, timeout=120)
    return f"file://{out}"


def _altered_tokenizer(root: Path) -> str:
    """A BPE dataset whose tokenizer.json was edited after `prepare` recorded its sha256 in the manifest."""
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(40):
        (corpus / f"doc{i}.txt").write_text(f"document {i}: " + "the quick brown fox jumps over the lazy dog " * 40)
    out = root / "bpe"
    subprocess.run([sys.executable, "-m", "trainer.data", "prepare", str(corpus), "--tokenizer", "bpe",
                    "--vocab-size", "300", "--val-fraction", "0.1", "--out", f"file://{out}"],
                   cwd=ROOT, env=child_env(), check=True, capture_output=True, timeout=120)
    with (out / "tokenizer.json").open("a") as f:
        f.write(" ")
    return f"file://{out}"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("datasets")
    bad = root / "bad"
    bad.mkdir()
    (bad / "manifest.json").write_text("{not json")
    return {
        "altered-tokenizer": _altered_tokenizer(root),
        "small": _synth(root / "small", 20000, shard_tokens=10000),
        "other": _synth(root / "other", 20000, shard_tokens=10000, seed=7),  # same size, other tokens
        "short": _synth(root / "short", 600, shard_tokens=600),  # shorter than one window of 1024 + 1
        "no-val": _synth(root / "no-val", 20000, shard_tokens=10000, val_tokens=0),  # no held-out split
        "bad": f"file://{bad}",
        "missing": f"file://{root / 'nothing-here'}",
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory, data) -> Path:
    """A run directory with checkpoints of steps 1 and 2, trained on the small file:// dataset."""
    run_dir = tmp_path_factory.mktemp("trained") / "run"
    res = run_trainer(run_dir, None, [*BASE, "checkpoint.every_steps=1", f"data.uri={data['small']}"])
    assert res.returncode == 0, res.output[-3000:]
    return run_dir


@dataclass
class Case:
    args: list[str]
    needles: list[str]
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path, dict[str, str], Path], list[str]] | None = None  # (tmp, data, trained) -> more args
    resume: bool = False  # runs on a copy of `trained`; the run directory must be left exactly as it was


def _file(tmp: Path) -> Path:
    f = tmp / "a-file"
    f.write_text("x")
    return f


CASES: dict[str, Case] = {
    # ---- the command line and --config
    "unknown key": Case(["train.stepz=3"], ["train.stepz: unknown key"]),
    "unknown section": Case(["optim.lr=3"], ["optim.lr: unknown section"]),
    "key without section": Case(["steps=3"], ["steps: keys are section.name"]),
    "override without value": Case(["train.steps"], ["expected section.key=value"]),
    "not an integer": Case(["train.steps=ten"], ["train.steps: expected an integer"]),
    "not a number": Case(["train.lr=fast"], ["train.lr: expected a number"]),
    "not a boolean": Case(["train.compile=maybe"], ["train.compile: expected true or false"]),
    "not a choice": Case(["train.parallel=tp"], ["train.parallel: must be one of ddp, fsdp"]),
    "unknown preset": Case(["--preset", "3b"], ["--preset", "invalid choice: '3b'"]),
    "config file missing": Case([], ["--config", "No such file"],
                                setup=lambda t, d, r: ["--config", str(t / "nope.yaml")]),
    "config file not YAML": Case([], ["--config", "not valid YAML"],
                                 setup=lambda t, d, r: ["--config", str(_write(t / "c.yaml", "train: [1,"))]),
    "config file not a mapping": Case([], ["top level must be a mapping"],
                                      setup=lambda t, d, r: ["--config", str(_write(t / "c.yaml", "- 1\n"))]),
    "config section not a mapping": Case([], ["section 'train' must be a mapping"],
                                         setup=lambda t, d, r: ["--config", str(_write(t / "c.yaml", "train: 3\n"))]),
    # ---- ranges of the model, train, checkpoint, metrics, tracking keys
    "steps zero": Case(["train.steps=0"], ["train.steps must be > 0"]),
    "heads do not divide width": Case(["model.n_head=5"], ["model.d_model (32) must be divisible by model.n_head (5)"]),
    "rope with odd head size": Case(["model.pos=rope", "model.d_model=36", "model.n_head=4"], ["even head size"]),
    "dropout out of range": Case(["model.dropout=1.0"], ["model.dropout must be in [0, 1)"]),
    "lr NaN": Case(["train.lr=nan"], ["train.lr must be a finite number (got nan)"]),
    "lr infinite": Case(["train.lr=inf"], ["train.lr must be a finite number (got inf)"]),
    "lr zero": Case(["train.lr=0"], ["train.lr must be > 0"]),
    "min_lr above lr": Case(["train.min_lr=1.0"], ["train.min_lr (1.0) must be <= train.lr"]),
    "min_lr NaN": Case(["train.min_lr=nan"], ["train.min_lr must be a finite number"]),
    "weight decay negative": Case(["train.weight_decay=-0.1"], ["train.weight_decay must be >= 0"]),
    "beta out of range": Case(["train.beta2=1.0"], ["train.beta2 must be in [0, 1)"]),
    "grad clip infinite": Case(["train.grad_clip=inf"], ["train.grad_clip must be a finite number"]),
    "dropout NaN": Case(["model.dropout=nan"], ["model.dropout must be a finite number"]),
    "seed negative": Case(["train.seed=-1"], ["train.seed must be in 0.."]),
    "batch not a multiple of context": Case(["train.global_batch_tokens=100"],
                                            ["train.global_batch_tokens (100) must be a multiple of model.context"]),
    "batch not divisible by micro batch": Case(["train.micro_batch_size=5"], ["train.micro_batch_size (5)"]),
    "keep zero": Case(["checkpoint.keep=0"], ["checkpoint.keep must be > 0"]),
    "checkpoint interval negative": Case(["checkpoint.every_steps=-1"], ["checkpoint.every_steps must be >= 0"]),
    "cache budget negative": Case(["data.cache_max_bytes=-1"], ["data.cache_max_bytes must be >= 0"]),
    "cache share of the disk above 1": Case(["data.cache_disk_fraction=1.5"],
                                            ["data.cache_disk_fraction must be in (0, 1] (got 1.5)"]),
    "block size negative": Case(["data.block_shards=-1"], ["data.block_shards must be >= 0"]),
    "read mode unknown": Case(["data.read_mode=ram"], ["data.read_mode: must be one of auto, direct, disk, memory"]),
    "direct reads of a remote dataset": Case(["data.read_mode=direct", "data.uri=s3://data/ds"],
                                             ["data.read_mode=direct", "needs a file:// data.uri",
                                              "'s3://data/ds'"]),
    "evaluation batches zero": Case(["eval.every_steps=5", "eval.batches=0"], ["eval.batches must be > 0"]),
    "early stopping without evaluations": Case(["eval.early_stopping_patience=3"],
                                               ["eval.early_stopping_patience=3 needs evaluations",
                                                "eval.every_steps > 0"]),
    "sample length negative": Case(["eval.sample_tokens=-1"], ["eval.sample_tokens must be >= 0"]),
    "watchdog factor below 1": Case(["watchdog.factor=0.5"], ["watchdog.factor must be >= 1"]),
    "watchdog start-up below its floor": Case(["watchdog.floor_s=100", "watchdog.startup_s=50"],
                                              ["watchdog.startup_s (50.0) must be >= watchdog.floor_s (100.0)"]),
    "metrics port above 65535": Case(["metrics.port=70000"], ["metrics.port must be a TCP port, 0..65535"]),
    "metrics port negative": Case(["metrics.port=-1"], ["metrics.port must be >= 0"]),
    "metrics port env not a number": Case([], ["env TRAINER_METRICS_PORT", "metrics.port: expected an integer"],
                                          env={"TRAINER_METRICS_PORT": "abc"}),
    "tracking experiment empty": Case(["tracking.enabled=true", "tracking.experiment= "],
                                      ["tracking.experiment must not be empty"]),
    "tracking URI unknown scheme": Case(["tracking.enabled=true", "tracking.uri=foo://x"],
                                        ["tracking.uri 'foo://x' is not a tracking URI"]),
    # ---- URIs and endpoints
    "data URI scheme": Case(["data.uri=ftp://host/ds"], ["data.uri: unsupported URI 'ftp://host/ds'"]),
    # A plain path is a file:// URI (docs/data.md): this one names no dataset.
    "data URI a path to nothing": Case(["data.uri=datasets/web"],
                                       ["data.uri", f"file://{ROOT}/datasets/web/manifest.json: dataset manifest not found"]),
    "data URI without bucket": Case(["data.uri=s3:///ds"], ["data.uri: 's3:///ds' names no bucket"]),
    "data endpoint not a URL": Case(["data.endpoint_url=minio:9000"], ["data.endpoint_url: expected an http(s)"]),
    "endpoint env not a URL": Case([], ["env TRAINER_S3_ENDPOINT_URL: expected an http(s)"],
                                   env={"TRAINER_S3_ENDPOINT_URL": "localhost"}),
    "checkpoint URI scheme": Case(["checkpoint.remote_uri=https://bucket/ckpt"], ["checkpoint.remote_uri: unsupported"]),
    "checkpoint endpoint port": Case(["checkpoint.endpoint_url=http://h:99999"], ["checkpoint.endpoint_url"]),
    # ---- paths the trainer writes (found by the worker's preflight)
    "run dir under a file": Case([], ["--run-dir", "not a writable directory"],
                                 setup=lambda t, d, r: ["--run-dir", str(_file(t) / "run")]),
    "run dir is a file": Case([], ["--run-dir", "not a writable directory"],
                              setup=lambda t, d, r: ["--run-dir", str(_file(t))]),
    "checkpoint dir under a file": Case([], ["checkpoint.local_dir", "not a writable directory"],
                                        setup=lambda t, d, r: [f"checkpoint.local_dir={_file(t) / 'c'}"]),
    "cache dir under a file": Case([], ["data.cache_dir", "not a writable directory"],
                                   setup=lambda t, d, r: [f"data.cache_dir={_file(t) / 'c'}", f"data.uri={d['small']}"]),
    # ---- the dataset
    "dataset manifest missing": Case([], ["data.uri", "nothing-here/manifest.json"],
                                     setup=lambda t, d, r: [f"data.uri={d['missing']}"]),
    "dataset manifest malformed": Case([], ["data.uri", "manifest.json"],
                                       setup=lambda t, d, r: [f"data.uri={d['bad']}"]),
    "dataset unreachable": Case([], ["data.uri", "s3://data/ds/manifest.json"],
                                env={"AWS_MAX_ATTEMPTS": "1", "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "x"},
                                setup=lambda t, d, r: ["data.uri=s3://data/ds",
                                                       f"data.endpoint_url=http://127.0.0.1:{free_port()}"]),
    "context longer than the data": Case(["model.context=1024", "train.global_batch_tokens=2048",
                                          "train.micro_batch_size=1"],
                                         ["model.context", "1025 tokens", "short/manifest.json"],
                                         setup=lambda t, d, r: [f"data.uri={d['short']}"]),
    "vocabulary smaller than the data's": Case(["model.vocab_size=100"],
                                               ["model.vocab_size (100) is smaller than the vocabulary"]),
    "dataset tokenizer altered": Case(["model.vocab_size=320"],
                                      ["data.uri: the dataset's tokenizer", "tokenizer.json", "sha256"],
                                      setup=lambda t, d, r: [f"data.uri={d['altered-tokenizer']}"]),
    "evaluation without a validation split": Case(["eval.every_steps=5"],
                                                  ["eval.every_steps=5 needs the validation split of data.uri",
                                                   "no-val/manifest.json", "no val split", "--val-fraction"],
                                                  setup=lambda t, d, r: [f"data.uri={d['no-val']}"]),
    # ---- the checkpoint store
    "checkpoint store unreachable": Case([], ["checkpoint.remote_uri: cannot list checkpoints", "s3://ckpt/run"],
                                         env={"AWS_MAX_ATTEMPTS": "1", "AWS_ACCESS_KEY_ID": "x",
                                              "AWS_SECRET_ACCESS_KEY": "x"},
                                         setup=lambda t, d, r: ["checkpoint.remote_uri=s3://ckpt/run",
                                                                f"checkpoint.endpoint_url=http://127.0.0.1:{free_port()}"]),
    # ---- an existing checkpoint
    "resume with another model shape": Case(["model.n_layer=3"],
                                            ["n_layer=2", "n_layer=3", "model.n_layer differ", "step_000000002"],
                                            setup=lambda t, d, r: [f"data.uri={d['small']}"], resume=True),
    "resume with another dataset": Case([], ["was trained on dataset", "other", "manifest sha256"],
                                        setup=lambda t, d, r: [f"data.uri={d['other']}"], resume=True),
    "resume with another global batch": Case(["train.global_batch_tokens=768"],
                                             ["train.global_batch_tokens=384", "train.global_batch_tokens=768"],
                                             setup=lambda t, d, r: [f"data.uri={d['small']}"], resume=True),
    "resume with another seed": Case(["train.seed=1"], ["train.seed=1234", "train.seed=1"],
                                     setup=lambda t, d, r: [f"data.uri={d['small']}"], resume=True),
    "resume with another block size": Case(["data.block_shards=1"], ["data.block_shards=4", "data.block_shards=1"],
                                           setup=lambda t, d, r: [f"data.uri={d['small']}"], resume=True),
    "resume without packing": Case(["data.packing=false"], ["data.packing=True", "data.packing=False"],
                                   setup=lambda t, d, r: [f"data.uri={d['small']}"], resume=True),
    "resume from before the block shuffle": Case([], ["step_000000002 was written before the block shuffle"],
                                                 setup=lambda t, d, r: [*_whole_dataset_shuffle(t / "run"),
                                                                        f"data.uri={d['small']}"], resume=True),
}


def _whole_dataset_shuffle(run_dir: Path) -> list[str]:
    """Make the copied checkpoints look written before the block shuffle existed: their sampler states count
    no shards (what the whole-dataset sampler wrote). No more arguments."""
    for path in (run_dir / "checkpoints").glob("step_*/manifest.json"):
        manifest = json.loads(path.read_text())
        for key in ("num_shards", "block_shards"):
            del manifest["trainer"]["sampler"][key]
        path.write_text(json.dumps(manifest))
    return []


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def _snapshot(run_dir: Path) -> dict[str, tuple[int, int]]:
    """Every file with its size and modification time (directories' own times change with the probe files
    the checks create and remove)."""
    return {str(p.relative_to(run_dir)): (p.stat().st_size, p.stat().st_mtime_ns)
            for p in sorted(run_dir.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_is_one_line_and_exit_2(name, tmp_path, data, trained):
    case = CASES[name]
    run_dir = tmp_path / "run"
    if case.resume:
        shutil.copytree(trained, run_dir)
    args = ["--run-dir", str(run_dir), *BASE, *case.args]
    if case.setup is not None:
        args += case.setup(tmp_path, data, trained)
    before = _snapshot(run_dir) if case.resume else None
    proc = subprocess.run([sys.executable, "-m", "trainer", *args], cwd=ROOT, env=child_env(case.env),
                          capture_output=True, text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, proc.stderr[-3000:]
    for needle in case.needles:
        assert needle in errors[0], errors[0]
    if before is not None:
        assert _snapshot(run_dir) == before  # config.json, checkpoints, metrics: untouched


def test_diverging_run_stops_without_saving_the_diverged_step(tmp_path):
    """An absurd learning rate: the loss turns non-finite; the trainer stops with exit 2 naming train.lr, the
    bad step is not applied and nothing after it is saved, so the newest checkpoint is still finite."""
    run_dir = tmp_path / "run"
    overrides = [*SMALL, "train.steps=20", "train.lr=1e30", "train.min_lr=0", "train.warmup_steps=1",
                 "train.grad_clip=0", "checkpoint.every_steps=1"]
    res = run_trainer(run_dir, None, overrides)
    assert res.returncode == 2, res.output[-3000:]
    assert "Traceback" not in res.output
    line = next(x for x in res.output.splitlines() if "error:" in x)
    assert "non-finite loss" in line and "train.lr (now 1e+30)" in line
    step = int(line.split("at step ")[1].split(":")[0])
    from trainer.checkpoint import list_step_dirs, verify

    saved = [int(p.name.split("_")[1]) for p in list_step_dirs(run_dir / "checkpoints")]
    assert saved and max(saved) == step - 1
    assert math.isfinite(verify(run_dir / "checkpoints" / f"step_{step - 1:09d}")["trainer"]["loss"])


LAUNCHER_CASES = ["unknown key", "lr NaN", "metrics port env not a number", "data URI scheme",
                  "tracking URI unknown scheme", "run dir under a file", "checkpoint dir under a file",
                  "dataset manifest malformed", "context longer than the data",
                  "evaluation without a validation split", "early stopping without evaluations"]


@pytest.mark.parametrize("name", LAUNCHER_CASES)
def test_the_launcher_refuses_the_same_inputs_before_torchrun(name, tmp_path, data, trained):
    """gpu-train-launch's preflight finds these before starting torchrun (which is not even on PATH here)."""
    case = CASES[name]
    args = ["--run-dir", str(tmp_path / "run"), *BASE, *case.args]
    if case.setup is not None:
        args += case.setup(tmp_path, data, trained)
    env = child_env({**case.env, "PATH": "/usr/bin:/bin"})
    proc = subprocess.run([sys.executable, "-m", "trainer.launch", "--nnodes=1:2", "--nproc-per-node=1",
                           "--rdzv-endpoint=localhost:29400", "-m", "trainer", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=180)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "torchrun is not on PATH" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpu-train-launch:"), proc.stderr
    for needle in case.needles:
        assert needle in lines[0], lines[0]


def _first_shard(uri: str, overrides: list[str]) -> str:
    """File name of the first shard the run reads: the first of the block shuffle's first block."""
    from gpu_train.sizing.layout import batch_layout
    from gpu_train.spec.trainer_config import build_config
    from trainer.data import GlobalSampler, open_dataset

    cfg = build_config("tiny", overrides=[*overrides, f"data.uri={uri}"])
    ds = open_dataset(uri, context=cfg.model.context)
    try:
        sampler = GlobalSampler(ds.num_windows, global_batch=batch_layout(cfg, 1)[0], seed=cfg.train.seed,
                                shard_windows=ds.shard_windows, block_shards=cfg.data.block_shards)
        return ds.manifest.shards[sampler.upcoming_shards(0, 1)[0]].data.file
    finally:
        ds.close()


def test_a_shard_missing_mid_run_stops_every_rank_without_retries(tmp_path):
    """Only the worker that reads the shard finds it missing: the step's all-reduce tells every rank, all of
    them stop with the same line, and the launcher exits 2 although torchrun could restart twice."""
    uri = _synth(tmp_path / "data", 200000, shard_tokens=20000)
    missing = _first_shard(uri, SMALL)
    (tmp_path / "data" / missing).unlink()
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.launch", "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
         "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=2", "--monitor-interval=0.2", "-m", "trainer",
         "--run-dir", str(tmp_path / "run"), *SMALL, "train.steps=30", f"data.uri={uri}"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "will restart worker group" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "error:" in line or "bad input" in line]
    assert lines and all(missing in line and "data.uri" in line for line in lines), lines
    assert lines[-1].startswith("gpu-train-launch: bad input, not retried:")


def _zero_hash(root: Path, shard: str) -> None:
    """The manifest's sha256 of `shard` zeroed: the shard's bytes no longer match it."""
    manifest = json.loads((root / "manifest.json").read_text())
    (entry,) = [e for e in manifest["shards"] if e["file"] == shard]
    entry["sha256"] = "0" * 64
    (root / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("fault", ["manifest deleted", "shard hash zeroed"])
def test_bad_data_under_the_launcher_is_one_attempt_one_line_and_exit_2(tmp_path, fault):
    """torchrun may restart the group 3 times, 2 workers find the fault: the first attempt is the only one, the
    message is one line (the launcher's; the workers leave it to it) and the launch exits 2, which the JobSet's
    podFailurePolicy fails at once. A deleted manifest is what the workers find when it went away after the
    launcher's own check (here the fault-injecting entry, which the launcher does not check, stands for that)."""
    uri = _synth(tmp_path / "data", 200000, shard_tokens=20000)
    if fault == "manifest deleted":
        (tmp_path / "data" / "manifest.json").unlink()
        module, needle = FAULTS, f"{uri}/manifest.json: dataset manifest not found"
    else:
        _zero_hash(tmp_path / "data", _first_shard(uri, SMALL))
        module, needle = "trainer", "manifest says " + "0" * 64
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.launch", "--nnodes=1", "--nproc-per-node=2", "--rdzv-backend=c10d",
         "--rdzv-endpoint=127.0.0.1:0", "--max-restarts=3", "--monitor-interval=0.2", "-m", module,
         "--run-dir", str(tmp_path / "run"), *SMALL, "train.steps=30", f"data.uri={uri}"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "will restart worker group" not in proc.stderr, proc.stderr[-3000:]
    lines = [line for line in proc.stderr.splitlines() if needle in line]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith("gpu-train-launch: bad input, not retried: ") and "data.uri" in lines[0], lines


def test_a_storage_outage_mid_run_is_retryable_not_bad_input(tmp_path, failing_s3):
    """One shard cannot be read (503) for longer than the data layer retries: a failure worth retrying (exit 1,
    one line), not bad input."""
    s3, proxy = failing_s3
    unavailable = _first_shard(_synth(tmp_path / "data", 200000, shard_tokens=20000), SMALL)
    client = s3.client()
    for f in (tmp_path / "data").iterdir():
        client.upload_file(str(f), s3.bucket, f"ds/{f.name}")
    proxy.unavailable = {unavailable}
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "--run-dir", str(tmp_path / "run"), *SMALL, "train.steps=30",
         f"data.uri=s3://{s3.bucket}/ds", f"data.endpoint_url={proxy.endpoint}",
         f"data.cache_dir={tmp_path / 'cache'}"],  # an empty cache: the shard must come from the store
        cwd=ROOT, env=child_env({**s3.env, "AWS_MAX_ATTEMPTS": "1"}), capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proxy.refused
    assert "Traceback" not in proc.stderr
    line = next(x for x in proc.stderr.splitlines() if "failed (will be retried)" in x)
    assert unavailable in line and "SlowDown" in line
