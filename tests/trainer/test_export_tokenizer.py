"""A byte-level model exported in Hugging Face's layout carries its tokenizer, which Hugging Face's AutoTokenizer
loads and which encodes and decodes exactly as the trainer's byte tokenizer does.

Run: .venv/bin/pytest tests/trainer/test_export_tokenizer.py -q
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoTokenizer

from gpu_train.spec.trainer_config import ModelConfig
from trainer.data.tokenizer import ByteTokenizer
from trainer.export import ExportError, TokenizerSpec, byte_tokenizer_json, write_model_dir
from trainer.model import GPT

TEXTS = ["def f(x):\n\treturn x  # two spaces", "héllo wörld ✓ 日本", "", "\x00\x01\x7f trailing "]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=32, context=16, vocab_size=264)
    out = tmp_path_factory.mktemp("byte-export")
    assert write_model_dir(GPT(cfg).state_dict(), cfg, TokenizerSpec(), out) == "hf-gpt2"
    return out


def test_the_hugging_face_layout_holds_a_tokenizer_for_a_byte_model(exported):
    assert (exported / "tokenizer.json").is_file() and (exported / "tokenizer_config.json").is_file()
    meta = json.loads((exported / "config.json").read_text())["gpu_train"]["tokenizer"]
    assert meta == {"kind": "byte", "name": "", "vocab_size": 257, "eot_id": 256, "file": "tokenizer.json"}


@pytest.mark.parametrize("text", TEXTS)
def test_auto_tokenizer_encodes_and_decodes_like_the_byte_tokenizer(exported, text):
    hf = AutoTokenizer.from_pretrained(exported)
    ours = ByteTokenizer()
    ids = hf(text, add_special_tokens=False)["input_ids"]
    assert ids == ours.encode(text).tolist() == list(text.encode("utf-8"))
    assert hf.decode(ids) == ours.decode(ids) == text
    assert hf.eos_token_id == ours.eot_id == 256
    # End-of-text is dropped when decoding, as the trainer's decode drops it.
    assert hf.decode([*ids, 256], skip_special_tokens=True) == text


def test_the_own_format_keeps_no_tokenizer_file_for_bytes(tmp_path):
    cfg = ModelConfig(n_layer=1, n_head=2, d_model=32, context=16, vocab_size=264, pos="rope", norm="rmsnorm")
    assert write_model_dir(GPT(cfg).state_dict(), cfg, TokenizerSpec(), tmp_path) == "safetensors"
    assert not (tmp_path / "tokenizer.json").exists()


def test_a_byte_tokenizer_ends_text_with_id_256_only():
    assert json.loads(byte_tokenizer_json(256))["added_tokens"][0]["id"] == 256
    with pytest.raises(ExportError, match="end-of-text id is 256"):
        byte_tokenizer_json(300)
