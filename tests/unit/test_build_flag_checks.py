"""build-data's and tokenize's flags are checked at once: a bad range, choice or path is one line naming the
flag, exit code 2, before torch is imported, before a vocabulary is read and before any output exists."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Each run is a fresh interpreter (so "torch was not imported" means something); all cases of one command
# run in one interpreter to keep the test fast.
PROBE = """
import json, sys
from bertctl.cli.app import main
out = []
for args in json.loads(sys.argv[1]):
    try:
        main(args)
        code = 0
    except SystemExit as e:
        code = e.code
    out.append({"code": code, "torch": "torch" in sys.modules})
print(json.dumps(out), file=sys.stderr)
"""


def probe(cases: list[list[str]]) -> tuple[list[dict], list[str]]:
    p = subprocess.run([sys.executable, "-c", PROBE, json.dumps(cases)], capture_output=True, text=True)
    lines = p.stderr.strip().splitlines()
    return json.loads(lines[-1]), [ln for ln in lines[:-1] if ln.startswith("bertctl: error: ")]


@pytest.fixture
def files(tmp_path):
    text = tmp_path / "in.txt"
    text.write_text("The cat sat. It was warm.\n\nA dog ran. It barked.\n", encoding="utf-8")
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "."]) + "\n")
    return tmp_path, str(text), str(vocab)


def test_build_data_flags(files):
    tmp, text, vocab = files
    out = str(tmp / "out")
    base = ["build-data", "--vocab", vocab, "-o", out, "--no-progress"]
    cases = {
        "--max-seq-length: must be in [8, 65535], got 4": ["--max-seq-length", "4", text],
        "--masked-lm-prob: must be in (0, 1), got 1.5": ["--masked-lm-prob", "1.5", text],
        "--short-seq-prob: must be in [0, 1], got -0.1": ["--short-seq-prob", "-0.1", text],
        "--holdout-fraction: must be in [0, 1), got 1.0": ["--holdout-fraction", "1", text],
        "--dupe-factor: must be >= 1, got 0": ["--dupe-factor", "0", text],
        "--shard-size: must be >= 1, got 0": ["--shard-size", "0", text],
        "--unit-mb: must be > 0, got 0.0": ["--unit-mb", "0", text],
        "--format: unknown format 'prose'": ["--format", "prose", text],
        "--objective: unknown objective 'nsp'": ["--objective", "nsp", text],
        f"{tmp / 'missing.txt'}: no such input file or folder": [str(tmp / "missing.txt")],
        "--resume and --overwrite: choose one": ["--resume", "--overwrite", text],
    }
    results, errors = probe([base + args for args in cases.values()]
                            + [["build-data", "--vocab", str(tmp / "nope.txt"), "-o", out, text]])
    assert [r["code"] for r in results] == [2] * (len(cases) + 1), errors
    assert not any(r["torch"] for r in results)
    for want, got in zip([*cases, f"{tmp / 'nope.txt'}: --vocab: no such file or folder"], errors):
        assert want in got, (want, got)
    assert not (tmp / "out").exists()  # no refusal leaves a folder


def test_tokenize_flags(files):
    tmp, text, vocab = files
    missing_vocab = str(tmp / "nope.txt")
    cases = {
        # The flag is named even though the vocabulary is missing too: flags come before files are read.
        "--truncation must be one of longest_first, only_first, only_second, not 'middle'":
            ["encode", "--vocab", missing_vocab, "--truncation", "middle", "-o", str(tmp / "o.jsonl"), text],
        "--truncation only_second needs text pairs (--pair-separator)":
            ["encode", "--vocab", vocab, "--truncation", "only_second", "-o", str(tmp / "o.jsonl"), text],
        f"{tmp / 'o.csv'}: output must end in .jsonl or .npy":
            ["encode", "--vocab", missing_vocab, "-o", str(tmp / "o.csv"), text],
        f"{tmp / 'gone.txt'}: no such file":
            ["encode", "--vocab", missing_vocab, "-o", str(tmp / "o.jsonl"), str(tmp / "gone.txt")],
        f"{tmp}: not a file": ["decode", "--vocab", missing_vocab, str(tmp)],
        "--algorithm must be one of wordpiece, unigram, bpe, got 'wp'":
            ["train", "--algorithm", "wp", "-o", str(tmp / "v.txt"), text],
        "--format: unknown format 'prose'": ["train", "--format", "prose", "-o", str(tmp / "v.txt"), text],
        f"{tmp / 'corpus'}: no such input file or folder": ["train", "-o", str(tmp / "v.txt"), str(tmp / "corpus")],
    }
    results, errors = probe([["tokenize", *args] for args in cases.values()])
    assert [r["code"] for r in results] == [2] * len(cases), errors
    assert not any(r["torch"] for r in results)
    for want, got in zip(cases, errors):
        assert want in got, (want, got)
    assert not any((tmp / name).exists() for name in ("o.jsonl", "o.csv", "v.txt"))
