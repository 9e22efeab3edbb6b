"""``prepare`` on real directories and formats: patterns, binary files, JSONL / Parquet, the held-out split,
re-runs, and GPT-2-format tokenizer files.

Run: ``.venv/bin/pytest tests/trainer/data/test_data_prepare.py -q``
"""

from __future__ import annotations

import gzip
import hashlib
import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from gpu_train.storage import open_store
from trainer.data import DataError, open_dataset
from trainer.data import inputs as inputs_mod
from trainer.data.__main__ import main as cli
from trainer.data.inputs import PrepareStats, collect_files, plan_tasks
from trainer.data.prepare import prepare
from trainer.data.shards import read_manifest
from trainer.data.synthetic import VAL_STREAM, synthetic_documents
from trainer.data.tokenizer import GPT2_MERGES_SHA256, load_gpt2, load_tokenizer


def _tree(root: Path) -> None:
    files = {
        "a.py": "print('a')\n",
        "b.txt": "plain text\n",
        "pkg/mod.py": "x = 1\n",
        "pkg/mod.pyc": "compiled",
        "pkg/__pycache__/mod.cpython-311.pyc": "compiled",
        "site-packages/lib/y.py": "y = 2\n",
        "tests/test_a.py": "def test(): pass\n",
        ".hidden/z.py": "z = 3\n",
        ".env": "SECRET=1\n",
    }
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "blob.dat").write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")


def test_directory_walk_honours_patterns_hidden_files_and_binaries(tmp_path):
    _tree(tmp_path)
    names = [f.rel for f in collect_files([tmp_path])]
    assert names == ["a.py", "b.txt", "blob.dat", "pkg/mod.py", "site-packages/lib/y.py", "tests/test_a.py"]
    stats = PrepareStats()
    picked = collect_files([tmp_path], include=["*.py"], exclude=["__pycache__/", "*.pyc", "site-packages/",
                                                                  "tests/"], stats=stats)  # fmt: skip
    assert [f.rel for f in picked] == ["a.py", "pkg/mod.py"]
    assert stats.excluded > 0
    everything = collect_files([tmp_path], exclude=())
    assert "pkg/mod.pyc" in [f.rel for f in everything]
    tasks = plan_tasks(collect_files([tmp_path]), skip_binary=True, stats=stats)
    assert stats.skipped_binary == 1 and not any(t.path.endswith("blob.dat") for t in tasks)
    assert any(t.path.endswith("blob.dat") for t in plan_tasks(collect_files([tmp_path]), skip_binary=False,
                                                               stats=PrepareStats()))  # fmt: skip
    with pytest.raises(DataError, match="no input files found"):
        collect_files([tmp_path], include=["*.rs"])


def _docs_of(uri: str, tmp_path: Path, split: str = "train") -> list[str]:
    store = open_store(uri)
    manifest, _ = read_manifest(store, "manifest.json")
    tok = load_tokenizer(manifest, store)
    with open_dataset(uri, context=1, cache_dir=str(tmp_path / "c"), split=split) as ds:
        stream = np.concatenate([np.asarray(ds._source.array(s)) for s in range(ds.num_shards)])
    return [tok.decode(d) for d in np.split(stream, np.flatnonzero(stream == tok.eot_id) + 1)[:-1]]


def test_text_jsonl_gzip_and_parquet_inputs_in_order(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    (src / "1-notes.txt").write_text("a plain text file\nwith two lines\n")
    (src / "2-docs.jsonl").write_text("\n".join(json.dumps({"content": t, "id": i}) for i, t in
                                                enumerate(["first", "second \u00e9t\u00e9"])) + "\n")  # fmt: skip
    with gzip.open(src / "3-more.jsonl.gz", "wt") as f:
        f.write(json.dumps({"content": "zipped"}) + "\n\n")
    table = pa.table({"content": ["row one", None, "row two", "row three"], "n": [1, 2, 3, 4]})
    pq.write_table(table, src / "4-rows.parquet", row_group_size=2)
    assert pq.ParquetFile(src / "4-rows.parquet").metadata.num_row_groups == 2
    uri = f"file://{tmp_path}/ds"
    prepare([src], uri, text_field="content", val_fraction=0, workers=2)
    assert _docs_of(uri, tmp_path) == [
        "a plain text file\nwith two lines\n", "first", "second \u00e9t\u00e9", "zipped",
        "row one", "row two", "row three",
    ]  # fmt: skip


def test_input_errors_name_the_file_and_line(tmp_path, monkeypatch):
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(50)]
    lines[36] = '{"text": 37'  # line 37 is cut off
    (tmp_path / "big.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.setattr(inputs_mod, "JSONL_PART_BYTES", 200)  # many parts: the error is in a later one
    for workers in (1, 2):
        with pytest.raises(DataError, match=f"{tmp_path}/big.jsonl:37: not a JSON object"):
            prepare([tmp_path / "big.jsonl"], f"file://{tmp_path}/o", workers=workers)
    pq.write_table(pa.table({"body": ["x"]}), tmp_path / "t.parquet")
    with pytest.raises(DataError, match="t.parquet: cannot read column 'text'"):
        prepare([tmp_path / "t.parquet"], f"file://{tmp_path}/o-t")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "n.parquet")
    with pytest.raises(DataError, match="n.parquet: column 'text' is int64, expected a string column"):
        prepare([tmp_path / "n.parquet"], f"file://{tmp_path}/o-n")


def test_jsonl_parts_give_the_same_dataset_as_one_part(tmp_path, monkeypatch):
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": f"document number {i}"}) + "\n"
                                              for i in range(300)))  # fmt: skip
    one = prepare([tmp_path / "d.jsonl"], f"file://{tmp_path}/one", workers=1, val_fraction=0.1)
    monkeypatch.setattr(inputs_mod, "JSONL_PART_BYTES", 256)
    many = prepare([tmp_path / "d.jsonl"], f"file://{tmp_path}/many", workers=2, val_fraction=0.1)
    assert one.to_dict()["shards"] == many.to_dict()["shards"]
    assert one.to_dict()["val"] == many.to_dict()["val"]


def test_validation_split_is_by_document_content_and_deterministic(tmp_path):
    docs = [f"document {i} " + "lorem ipsum " * (i % 7) for i in range(400)]
    docs += docs[:40]  # exact duplicates must land where their first copy did
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    (tmp_path / "b").mkdir()  # the same documents in another order
    (tmp_path / "b" / "d.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in reversed(docs)))
    m = prepare([tmp_path / "a"], f"file://{tmp_path}/ds", val_fraction=0.25, workers=2)
    train, val = (
        _docs_of(f"file://{tmp_path}/ds", tmp_path),
        _docs_of(f"file://{tmp_path}/ds", tmp_path, "val"),
    )
    assert sorted(train + val) == sorted(docs)
    assert not set(train) & set(val)  # duplicates never straddle the split
    assert 60 <= len(set(val)) <= 140  # 400 distinct documents at 25%: mean 100, sd 8.7
    assert m.val_fraction == 0.25 and m.val_documents == len(val)
    prepare([tmp_path / "b"], f"file://{tmp_path}/ds2", val_fraction=0.25, workers=1)
    assert set(_docs_of(f"file://{tmp_path}/ds2", tmp_path, "val")) == set(val)


def test_running_prepare_again_reuses_the_dataset_until_an_input_changes(tmp_path):
    (tmp_path / "in").mkdir()
    (tmp_path / "in" / "a.txt").write_text("alpha " * 100)
    uri = f"file://{tmp_path}/ds"
    first = prepare([tmp_path / "in"], uri)
    stats = PrepareStats()
    again = prepare([tmp_path / "in"], uri, stats=stats)
    assert stats.reused and again == first
    (tmp_path / "in" / "a.txt").write_text("beta " * 100)
    stats = PrepareStats()
    changed = prepare([tmp_path / "in"], uri, stats=stats)
    assert not stats.reused and changed.shards[0].data.sha256 != first.shards[0].data.sha256
    stats = PrepareStats()
    prepare([tmp_path / "in"], uri, stats=stats, force=True)
    assert not stats.reused
    stats = PrepareStats()
    prepare([tmp_path / "in"], uri, stats=stats, shard_tokens=1 << 20)  # another setting: another dataset
    assert not stats.reused


# -- GPT-2 format tokenizer files -------------------------------------------------------------------------
def _gpt2_format_files(folder: Path, names: tuple[str, str] = ("vocab.json", "merges.txt")) -> dict[str, int]:
    """A tiny vocabulary in GPT-2's file format: the 256 byte symbols, three merges, <|endoftext|>.

    In GPT-2's byte-to-symbol table printable ASCII maps to itself and the space to 'Ġ' (U+0120)
    (OpenAI gpt-2, src/encoder.py, bytes_to_unicode).
    """
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {sym: i for i, sym in enumerate(sorted(ByteLevel.alphabet()))}
    for tok in ("he", "the", "\u0120the", "<|endoftext|>"):
        vocab[tok] = len(vocab)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / names[0]).write_text(json.dumps(vocab))
    (folder / names[1]).write_text("#version: 0.2\nh e\nt he\n\u0120 the\n")
    return vocab


def test_gpt2_format_files_encode_by_their_merges(tmp_path):
    vocab = _gpt2_format_files(tmp_path / "hf")
    tok = load_gpt2(tmp_path / "hf")
    assert (tok.vocab_size, tok.eot_id, tok.name) == (260, vocab["<|endoftext|>"], "gpt2-format")
    # By hand: "the" -> t,h,e -> t,he (rank 0) -> the (rank 1); " the" -> Ġ,t,h,e -> ... -> Ġthe (rank 2).
    assert tok.encode("the the").tolist() == [vocab["the"], vocab["\u0120the"]]
    assert tok.encode("hello").tolist() == [vocab["he"], vocab["l"], vocab["l"], vocab["o"]]
    for text in ["the theory", "caf\u00e9 \U0001f600 <tag>", "  spaces\n\ttabs"]:
        assert tok.decode(tok.encode(text)) == text
    literal = tok.encode("a <|endoftext|> b").tolist()
    assert tok.eot_id not in literal  # text is never mistaken for a document boundary
    assert tok.decode(literal) == "a <|endoftext|> b"
    _gpt2_format_files(tmp_path / "openai", ("encoder.json", "vocab.bpe"))
    assert load_gpt2(tmp_path / "openai").encode("the the").tolist() == tok.encode("the the").tolist()
    # GPT-2's own files are recognised by their digests; these are not them.
    assert hashlib.sha256((tmp_path / "hf" / "merges.txt").read_bytes()).hexdigest() != GPT2_MERGES_SHA256


def test_gpt2_tokenizer_file_errors(tmp_path):
    with pytest.raises(DataError, match=f"--tokenizer-file {tmp_path}: expected a folder with vocab.json"):
        load_gpt2(tmp_path)
    vocab = _gpt2_format_files(tmp_path / "noeot")
    del vocab["<|endoftext|>"]
    (tmp_path / "noeot" / "vocab.json").write_text(json.dumps(vocab))
    with pytest.raises(DataError, match="has no '<\\|endoftext\\|>' token"):
        load_gpt2(tmp_path / "noeot")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "vocab.json").write_text("{not json")
    (tmp_path / "bad" / "merges.txt").write_text("")
    with pytest.raises(DataError, match="not a readable GPT-2 tokenizer"):
        load_gpt2(tmp_path / "bad")
    with pytest.raises(DataError, match="--tokenizer gpt2 needs --tokenizer-file"):
        prepare([tmp_path / "hf"], f"file://{tmp_path}/o", tokenizer="gpt2")


def test_prepare_with_gpt2_format_files_and_two_workers(tmp_path):
    _gpt2_format_files(tmp_path / "tok")
    texts = [f"the {i} theme, then <|endoftext|> there\n" * 5 for i in range(12)]
    (tmp_path / "in").mkdir()
    for i, t in enumerate(texts):
        (tmp_path / "in" / f"{i:02d}.txt").write_text(t)
    outs = []
    for workers in (1, 2):
        uri = f"file://{tmp_path}/ds{workers}"
        m = prepare([tmp_path / "in"], uri, tokenizer="gpt2", tokenizer_file=tmp_path / "tok", val_fraction=0,
                    workers=workers, shard_tokens=300)  # fmt: skip
        assert (m.tokenizer.kind, m.tokenizer.name, m.tokenizer.vocab_size, m.dtype) == (
            "bpe",
            "gpt2-format",
            260,
            "uint16",
        )
        outs.append([s.data.sha256 for s in m.shards])
        assert _docs_of(uri, tmp_path) == texts
    assert outs[0] == outs[1]


def test_cli_prepare_with_patterns_and_val_fraction(tmp_path, capsys):
    _tree(tmp_path / "src")
    out = f"file://{tmp_path}/ds"
    args = ["prepare", str(tmp_path / "src"), "--out", out, "--include", "*.py", "--exclude", "site-packages/",
            "--exclude", "tests/", "--val-fraction", "0", "--workers", "2"]  # fmt: skip
    assert cli(args) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("wrote:") and "2 documents" in printed and "from 2 files" in printed
    assert cli(args) == 0
    assert capsys.readouterr().out.startswith("up to date:")
    assert _docs_of(out, tmp_path) == ["print('a')\n", "x = 1\n"]
    with pytest.raises(SystemExit) as info:
        cli(["prepare", str(tmp_path / "src"), "--out", out, "--val-fraction", "1.5"])
    assert info.value.code == 2 and "--val-fraction: must be in [0, 1) (got 1.5)" in capsys.readouterr().err
    assert cli(["prepare", str(tmp_path / "src"), "--out", out, "--tokenizer", "gpt2"]) == 2
    assert "--tokenizer-file" in capsys.readouterr().err


def test_synth_writes_a_validation_split_from_the_same_language(tmp_path):
    uri = f"file://{tmp_path}/s"
    assert cli(["synth", "--out", uri, "--tokens", "65536", "--val-tokens", "8192"]) == 0
    mem_val = open_dataset("synthetic", context=64, split="val")
    with open_dataset(uri, context=64, cache_dir=str(tmp_path / "c"), split="val") as val:
        np.testing.assert_array_equal(val.batch(range(10)), mem_val.batch(range(10)))
        assert (tmp_path / "s" / "val-shard-000000.bin").is_file()

    def words(docs: list[bytes]) -> set[bytes]:
        return {w.strip(b".\n") for d in docs for w in d.split()}

    train_docs = synthetic_documents(1 << 16, seed=0)
    val_docs = synthetic_documents(1 << 13, seed=0, stream=VAL_STREAM)
    assert words(val_docs) <= words(train_docs)  # the same 24-word language ...
    assert not set(val_docs) & set(train_docs)  # ... in other documents


def test_bpe_encoding_releases_the_gil_so_worker_threads_run_in_parallel():
    """What --workers relies on: another Python thread keeps running while a BPE batch is encoded."""
    import threading
    import time

    from trainer.data.tokenizer import train_bpe

    texts = [f"word{i % 97} and more words {i}\n" * 400 for i in range(200)]
    tok = train_bpe(texts[:20], vocab_size=500)
    count, stop = [0], threading.Event()

    def spin() -> None:
        while not stop.is_set():
            count[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        time.sleep(0.05)
        before, t0 = count[0], time.perf_counter()
        time.sleep(0.2)  # the spinner alone
        solo_rate = (count[0] - before) / (time.perf_counter() - t0)
        before, t0 = count[0], time.perf_counter()
        tok.encode_batch(texts * 2)  # one call of a few hundred milliseconds
        elapsed, during = time.perf_counter() - t0, count[0] - before
    finally:
        stop.set()
        spinner.join()
    assert elapsed > 0.2
    # A call that held the GIL would freeze the spinner for its whole duration (it could only run for
    # the few milliseconds before the call took the GIL); released, it keeps a good share of its pace.
    assert during > 0.1 * solo_rate * elapsed, (elapsed, during, solo_rate)


def _small_corpus(root: Path, files: int = 6) -> Path:
    corpus = root / "corpus"
    corpus.mkdir()
    for i in range(files):
        (corpus / f"{i}.txt").write_text(f"the quick brown fox {i} jumps over the lazy dog.\n" * 40)
    (corpus / "empty.txt").write_text("")
    (corpus / "blob.dat").write_bytes(b"PK\x03\x04\x00\x00")
    return corpus


def test_prepare_says_what_it_does_off_a_terminal(tmp_path, capsys):
    """No terminal: the BPE training is announced and timed, each skipped file is named with why, one progress line
    for the whole job (tasks, tokens, rate, time left) comes every --progress-every seconds and once at the end."""
    corpus = _small_corpus(tmp_path)
    assert cli(["prepare", str(corpus), "--out", f"file://{tmp_path}/ds", "--tokenizer", "bpe", "--vocab-size", "300",
                "--progress-every", "0", "--workers", "1", "--tasks", "6"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"prepare: skipped {corpus / 'blob.dat'}: binary (a NUL byte in its first 8000 bytes, as git decides; " \
           "--keep-binary keeps it)" in err
    assert f"prepare: skipped {corpus / 'empty.txt'}: empty" in err
    assert any(line.startswith("prepare: training a BPE tokenizer of 300 ids") for line in err)
    assert any(line.startswith("prepare: trained the BPE tokenizer in ") for line in err)
    progress = [line for line in err if " tasks, " in line]
    assert len(progress) == 6, err  # one per task at --progress-every 0, the last one not repeated
    assert progress[0].startswith("prepare: 1/6 tasks, ") and progress[-1].startswith("prepare: 6/6 tasks, ")
    assert all("tokens/s" in line and "MB/s" in line and "ETA " in line for line in progress)
    assert "100% of" in progress[-1] and "ETA 0:00:00" in progress[-1]


def test_prepare_redraws_one_progress_line_on_a_terminal(tmp_path):
    import io

    from trainer.data.prepare import Progress

    out = io.StringIO()
    progress = Progress(out, tty=True)
    progress.start(total_bytes=1000, total_tasks=2)
    progress.every_s = 0  # every call draws, as the 0.2 s of a real terminal would over a long run
    progress.advance(500, 120, 1)
    progress.advance(500, 130, 1)
    progress.say("something to say")
    progress.finish()
    text = out.getvalue()
    assert text.count("\rprepare: ") == 2 and "\x1b[K" in text  # redrawn in place, the rest of the line cleared
    assert "\rprepare: 2/2 tasks, 250 tokens" in text and "100% of 0.0 MB, ETA 0:00:00" in text
    assert text.endswith("\nprepare: something to say\n")  # a message of its own ends the progress line first


def test_plain_paths_are_taken_wherever_a_file_uri_is(tmp_path, monkeypatch, capsys):
    """`--out runs/data/x`, `verify runs/data/x`, `synth --out`, open_dataset and the trainer's data.uri and
    checkpoint.remote_uri: a plain path means the file:// URI of its absolute path. Before, prepare refused it."""
    from gpu_train.spec.trainer_config import build_config

    monkeypatch.chdir(tmp_path)
    corpus = _small_corpus(tmp_path)
    assert cli(["prepare", "corpus", "--out", "runs/data/x", "--val-fraction", "0.5"]) == 0
    assert f"to file://{tmp_path}/runs/data/x in" in capsys.readouterr().out
    assert (tmp_path / "runs" / "data" / "x" / "manifest.json").is_file()
    assert cli(["verify", "runs/data/x"]) == 0
    assert cli(["synth", "--out", "synth", "--tokens", "20000"]) == 0
    assert (tmp_path / "synth" / "manifest.json").is_file()
    ds = open_dataset("runs/data/x", context=8)
    assert ds.num_windows > 0
    ds.close()
    cfg = build_config("tiny", overrides=["data.uri=runs/data/x", f"checkpoint.remote_uri={tmp_path}/ckpt"])
    assert cfg.data.uri == f"file://{tmp_path}/runs/data/x" and cfg.checkpoint.remote_uri == f"file://{tmp_path}/ckpt"
    assert build_config("tiny").data.uri == "synthetic"
    assert corpus.is_dir()


def test_an_empty_validation_split_is_said_when_it_is_written_and_when_it_is_refused(tmp_path, capsys):
    """--val-fraction held out nothing: prepare warns at once; an evaluation asked for later says the split is
    empty and why, instead of telling the user to pass the --val-fraction they passed."""
    corpus = _small_corpus(tmp_path, files=3)
    assert cli(["prepare", str(corpus), "--out", f"file://{tmp_path}/ds", "--val-fraction", "0.0001"]) == 0
    err = capsys.readouterr().err
    assert ("prepare: warning: --val-fraction 0.0001 held out none of the 3 documents: the validation split is "
            "empty") in err
    with pytest.raises(DataError) as exc:
        open_dataset(f"file://{tmp_path}/ds", context=8, split="val")
    assert "validation split is empty: --val-fraction 0.0001 held out none of its 3 documents" in str(exc.value)
    assert "larger --val-fraction" in str(exc.value)


def test_the_help_says_what_workers_and_tasks_are(capsys):
    with pytest.raises(SystemExit):
        cli(["prepare", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--workers WORKERS tasks run at once" in text and "the output does not depend on it" in text
    assert "--tasks TASKS the job's fixed task count" in text
