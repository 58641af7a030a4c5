"""build-data says on stderr what it skipped or read otherwise than given, and why it found no instances."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest


def build(tmp_path, vocab, *args):
    return subprocess.run([sys.executable, "-m", "bertctl", "build-data", *args, "-o", str(tmp_path / "out"),
                           "--vocab", str(vocab), "--no-progress", "--workers", "1"],
                          capture_output=True, text=True)


def test_prose_read_as_lines_gets_a_note(tmp_path, minilm_vocab, shared_data):
    book = sorted((shared_data / "corpus" / "gutenberg").glob("*.txt"))[0]
    p = build(tmp_path, minilm_vocab, str(book), "--format", "lines")
    assert p.returncode == 0, p.stderr
    assert "lines end mid-sentence" in p.stderr and "--format text" in p.stderr


def test_sentence_per_line_text_gets_no_note(tmp_path, minilm_vocab):
    doc = "The cat sat on the mat.\nIt was warm there.\nThen it slept.\n"
    (tmp_path / "in.txt").write_text("\n".join([doc] * 20))
    p = build(tmp_path, minilm_vocab, str(tmp_path / "in.txt"), "--format", "lines")
    assert p.returncode == 0, p.stderr
    assert "mid-sentence" not in p.stderr


def test_invalid_jsonl_lines_are_counted_on_stderr(tmp_path, minilm_vocab):
    rows = [json.dumps({"text": "One sentence here. And another one there. A third follows."})] * 30
    rows[2] = "{not json"
    rows[7] = json.dumps({"body": "no text field"})
    rows[9] = "{also not json"
    (tmp_path / "in.jsonl").write_text("\n".join(rows) + "\n")
    p = build(tmp_path, minilm_vocab, str(tmp_path / "in.jsonl"), "--format", "jsonl")
    assert p.returncode == 0, p.stderr
    assert "skipped 2 line(s): not valid JSON (the first at" in p.stderr and "in.jsonl:3" in p.stderr
    assert "skipped 1 line(s): no string field 'text'" in p.stderr and "in.jsonl:8" in p.stderr


def test_no_instances_names_what_was_skipped(tmp_path, minilm_vocab):
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"body": f"text {i}."}) for i in range(5)) + "\n")
    p = build(tmp_path, minilm_vocab, str(tmp_path / "in.jsonl"), "--format", "jsonl")
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert "no instances" in lines[0] and "skipped 5 line(s): no string field 'text'" in lines[0]
