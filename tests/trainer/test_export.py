"""Export: safetensors that load with the safetensors package alone, and Hugging Face's GPT-2 layout checked
against Hugging Face's own GPT-2 classes (names, shapes, logits, tokenizer).

Run: .venv/bin/pytest tests/trainer/test_export.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

from gpu_train.spec.trainer_config import ModelConfig
from trainer.data.prepare import prepare
from trainer.export import (
    ExportError,
    TokenizerSpec,
    from_hf_gpt2,
    fuse_model_qkv,
    hf_gpt2_config,
    load_model_dir,
    newest_checkpoint,
    split_model_qkv,
    to_hf_gpt2,
    write_model_dir,
)
from trainer.export import main as export_main
from trainer.model import GPT
from trainer.sample import main as sample_main

REPO = Path(__file__).resolve().parents[2]


def _model(cfg: ModelConfig, seed: int = 0) -> GPT:
    """A model with every parameter moved off its initial value (LayerNorm gains and biases too)."""
    torch.manual_seed(seed)
    m = GPT(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return m.eval()


@pytest.mark.parametrize("cfg", [ModelConfig(), ModelConfig(n_layer=3, n_head=2, d_model=48, context=40,
                                                              vocab_size=300, mlp_ratio=2)])  # fmt: skip
def test_hf_layout_has_the_names_and_shapes_of_hugging_faces_gpt2(cfg):
    ours = to_hf_gpt2(GPT(cfg).state_dict(), cfg)
    # The reference is Hugging Face's own GPT-2 built from the exported config (its lm_head is tied to wte).
    ref = GPT2LMHeadModel(GPT2Config(**hf_gpt2_config(cfg, eot_id=256))).state_dict()
    want = {k: tuple(v.shape) for k, v in ref.items() if k != "lm_head.weight"}
    assert {k: tuple(v.shape) for k, v in ours.items()} == want


def test_hf_gpt2_gives_our_logits(tmp_path):
    cfg = ModelConfig(n_layer=2, n_head=4, d_model=64, context=32, vocab_size=264)
    m = _model(cfg)
    assert write_model_dir(m.state_dict(), cfg, TokenizerSpec(), tmp_path / "hf") == "hf-gpt2"
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 257, (3, 32), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, m(x)[0], atol=2e-5, rtol=1e-5)
    back = load_model_dir(tmp_path / "hf").model
    with torch.no_grad():
        torch.testing.assert_close(back(x)[0], m(x)[0])


def test_conversion_round_trips_and_refuses_what_does_not_fit():
    cfg = ModelConfig()
    sd = _model(cfg).state_dict()
    back = from_hf_gpt2(to_hf_gpt2(sd, cfg), cfg)
    # Back in the exported layout (query, key and value as three matrices), which fuses to the model's exactly.
    split = split_model_qkv(sd, cfg.n_head)
    assert back.keys() == split.keys() and all(torch.equal(back[k], split[k]) for k in split)
    fused = fuse_model_qkv(back, cfg.n_head)
    assert fused.keys() == sd.keys() and all(torch.equal(fused[k], sd[k]) for k in sd)
    hf = to_hf_gpt2(sd, cfg)
    hf["transformer.h.1.mlp.c_fc.bias"][3] = 0.5
    with pytest.raises(ExportError, match="non-zero transformer.h.1.mlp.c_fc.bias"):
        from_hf_gpt2(hf, cfg)
    rope = ModelConfig(pos="rope", norm="rmsnorm")
    with pytest.raises(ExportError, match="model.norm=rmsnorm .*; model.pos=rope"):
        to_hf_gpt2(GPT(rope).state_dict(), rope)


def test_other_architectures_export_as_safetensors_that_load_without_torch(tmp_path):
    cfg = ModelConfig(pos="rope", norm="rmsnorm")
    m = _model(cfg)
    assert write_model_dir(m.state_dict(), cfg, TokenizerSpec(), tmp_path / "st") == "safetensors"
    script = textwrap.dedent(
        """
        import json, sys
        from safetensors.numpy import load_file
        tensors = load_file(sys.argv[1] + "/model.safetensors")
        config = json.load(open(sys.argv[1] + "/config.json"))
        assert "torch" not in sys.modules
        print(json.dumps({"shapes": {k: list(v.shape) for k, v in tensors.items()}, "config": config,
                          "emb0": tensors["tok_emb.weight"][0, :4].tolist()}))
        """
    )
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "st")], capture_output=True, text=True,
                         timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    want = {k: list(v.shape) for k, v in split_model_qkv(m.state_dict(), cfg.n_head).items() if k != "lm_head.weight"}
    assert "blocks.0.attn.q.weight" in want and "blocks.0.attn.wqkv.weight" not in want
    assert got["shapes"] == want
    assert got["emb0"] == pytest.approx(m.tok_emb.weight[0, :4].tolist())
    assert got["config"]["format"] == "gpu-train-gpt" and got["config"]["model"]["pos"] == "rope"
    assert got["config"]["tied_embeddings"] is True and got["config"]["tokenizer"]["kind"] == "byte"
    back = load_model_dir(tmp_path / "st").model
    x = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(back(x)[0], m(x)[0])
    with pytest.raises(ExportError, match="--dtype must be one of"):
        write_model_dir(m.state_dict(), cfg, TokenizerSpec(), tmp_path / "x", dtype="int8")


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> tuple[Path, str]:
    """A two-step run of the trainer on a BPE dataset (checkpoints at steps 1 and 2)."""
    root = tmp_path_factory.mktemp("export")
    (root / "corpus").mkdir()
    for i in range(20):
        (root / "corpus" / f"{i}.txt").write_text(f"the quick brown fox {i} jumps over the lazy dog. " * 30)
    data = f"file://{root}/data"
    prepare([root / "corpus"], data, tokenizer="bpe", vocab_size=300, val_fraction=0, workers=1)
    run = root / "run"
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "--preset", "tiny", "--run-dir", str(run), "train.steps=2",
         "checkpoint.every_steps=1", "tracking.enabled=false", f"data.uri={data}", "model.vocab_size=320",
         f"data.cache_dir={root / 'cache'}"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    return run, data


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_export_cli_writes_hugging_face_gpt2_with_the_datasets_tokenizer(bpe_run, tmp_path, capsys):
    run, data = bpe_run
    assert export_main(["--run-dir", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert "hf-gpt2" in capsys.readouterr().out
    files = sorted(p.name for p in (tmp_path / "hf").iterdir())
    assert files == ["config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    # Every file readable by the same people (safetensors alone would leave its weights at 0600).
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "hf").iterdir()}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] & 0o044 == 0o044, modes
    hf_tok = PreTrainedTokenizerFast.from_pretrained(tmp_path / "hf")
    from trainer.data import open_tokenizer

    ours = open_tokenizer(data)
    text = "the lazy fox jumps"
    assert hf_tok(text)["input_ids"] == ours.encode(text).tolist()
    assert hf_tok.eos_token_id == ours.eot_id
    from trainer.export import load_checkpoint

    model = load_checkpoint(newest_checkpoint(run)).model
    hf = GPT2LMHeadModel.from_pretrained(tmp_path / "hf").eval()
    x = torch.tensor([ours.encode(text).tolist()])
    with torch.no_grad():
        torch.testing.assert_close(hf(x).logits, model(x)[0], atol=2e-5, rtol=1e-5)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["gpu_train"]["origin"]["step"] == 2 and config["gpu_train"]["origin"]["dataset_uri"] == data
    # The exported directory samples like the checkpoint does.
    args = ["--max-tokens", "12", "--prompt", "the", "--seed", "3"]
    assert sample_main(["--run-dir", str(run), *args]) == 0
    from_ckpt = capsys.readouterr().out
    assert sample_main(["--model-dir", str(tmp_path / "hf"), *args]) == 0
    assert capsys.readouterr().out == from_ckpt


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_newest_checkpoint_that_verifies_is_used(bpe_run, tmp_path, capsys):
    run, _ = bpe_run
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    newest = copy / "checkpoints" / "step_000000002"
    victim = next(p for p in newest.glob("*.distcp"))
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0xFF
    victim.write_bytes(bytes(data))
    assert newest_checkpoint(copy).name == "step_000000001"
    assert export_main(["--run-dir", str(copy), "--out", str(tmp_path / "o"), "--format", "safetensors"]) == 0
    out, err = capsys.readouterr()
    assert "step_000000001" in out
    # The fallback is said, once: which checkpoint was skipped, why, and which one is used instead.
    assert err.strip().splitlines() == [f"python -m trainer.export: warning: skipping checkpoint {newest}: {victim}: "
                                        "sha256 differs from manifest.json (corrupted); using the older step_000000001"]
    assert sample_main(["--run-dir", str(copy), "--max-tokens", "4"]) == 0
    warnings = [line for line in capsys.readouterr().err.splitlines() if "warning" in line]
    assert warnings == [f"python -m trainer.sample: warning: skipping checkpoint {newest}: {victim}: sha256 differs "
                        "from manifest.json (corrupted); using the older step_000000001"]
    shutil.rmtree(copy / "checkpoints" / "step_000000001")
    assert export_main(["--run-dir", str(copy), "--out", str(tmp_path / "o2")]) == 2
    err = capsys.readouterr().err
    assert "no complete checkpoint" in err and "sha256 differs" in err and len(err.strip().splitlines()) == 1


def _unreachable_data(step_dir: Path) -> None:
    """Make a checkpoint look like a cluster job's: its dataset behind the in-cluster cache endpoint."""
    manifest = json.loads((step_dir / "manifest.json").read_text())
    manifest["config"]["data"].update(uri="s3://datasets/corpus", endpoint_url="http://127.0.0.1:9/api/v1/s3")
    (step_dir / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_sampling_and_export_need_only_the_checkpoint(bpe_run, tmp_path, capsys, monkeypatch):
    """A checkpoint whose dataset is behind an endpoint this machine cannot reach samples and exports at once: the
    BPE tokenizer travels with the checkpoint, and no store is ever opened. Before, sampling waited for the
    endpoint and ended in a botocore traceback."""
    import shutil

    import gpu_train.storage as storage

    run, data = bpe_run
    step = tmp_path / "step_000000002"
    shutil.copytree(run / "checkpoints" / "step_000000002", step)
    manifest = json.loads((step / "manifest.json").read_text())
    assert manifest["tokenizer"] == {"kind": "bpe", "name": "trained", "vocab_size": 300, "eot_id": 0,
                                     "file": "tokenizer.json"}
    assert "tokenizer.json" in manifest["files"]  # verified and uploaded with the weights
    _unreachable_data(step)

    def no_store(*args, **kwargs):
        raise AssertionError(f"a store was opened: {args}")

    monkeypatch.setattr(storage, "open_store", no_store)
    args = ["--checkpoint", str(step), "--prompt", "the", "--max-tokens", "12", "--seed", "3", "--no-stop"]
    assert sample_main(args) == 0
    offline = capsys.readouterr().out
    monkeypatch.undo()
    assert sample_main([*args, "--data-uri", data]) == 0  # the dataset's own tokenizer: the same text
    assert capsys.readouterr().out == offline
    monkeypatch.setattr(storage, "open_store", no_store)
    assert export_main(["--checkpoint", str(step), "--out", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "tokenizer.json").read_text() == (step / "tokenizer.json").read_text()


@pytest.mark.integration  # real trainer processes or a training run: too slow for the fast lane
def test_an_older_checkpoint_without_its_tokenizer_says_what_to_do_in_one_line(bpe_run, tmp_path, capsys):
    """A checkpoint written before checkpoints carried their tokenizer, its dataset unreachable: one line naming
    the URI and --data-uri, at once, no traceback."""
    import shutil
    import time

    run, data = bpe_run
    step = tmp_path / "step_000000002"
    shutil.copytree(run / "checkpoints" / "step_000000002", step)
    _unreachable_data(step)
    manifest = json.loads((step / "manifest.json").read_text())
    del manifest["tokenizer"]
    (step / "manifest.json").write_text(json.dumps(manifest))
    t0 = time.monotonic()
    assert sample_main(["--checkpoint", str(step)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert time.monotonic() - t0 < 30
    assert len(err) == 1 and "does not carry its tokenizer" in err[0] and "s3://datasets/corpus" in err[0]
    assert "--data-uri" in err[0]
    assert sample_main(["--checkpoint", str(step), "--data-uri", data, "--max-tokens", "4"]) == 0
