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
    src = tmp_path / "in.jsonl"
    assert f"skipped 2 line(s): not valid JSON (at {src}:3, {src}:10)\n" in p.stderr
    assert (f"skipped 1 line(s): no string field 'text' (at {src}:8); the first such object's fields: 'body' "
            f"(choose the text's with --text-field)") in p.stderr


def test_many_invalid_lines_name_the_first_three_and_count_all(tmp_path, minilm_vocab):
    good = json.dumps({"text": "One sentence here. And another one there."})
    bad = {4, 9, 11, 20, 31}  # line numbers, from 1
    (tmp_path / "in.jsonl").write_text("\n".join("[1, 2" if n in bad else good for n in range(1, 41)) + "\n")
    p = build(tmp_path, minilm_vocab, str(tmp_path / "in.jsonl"), "--format", "jsonl")
    assert p.returncode == 0, p.stderr
    src = tmp_path / "in.jsonl"
    assert f"skipped 5 line(s): not valid JSON (the first at {src}:4, {src}:9, {src}:11)" in p.stderr
    summary = json.loads(p.stdout)  # the summary keeps its layout: the count and the first place
    assert summary["skipped"]["lines"]["not valid JSON"] == {"count": 5, "first": f"{src}:4"}


def test_no_instances_names_what_was_skipped(tmp_path, minilm_vocab):
    (tmp_path / "in.jsonl").write_text("\n".join(json.dumps({"body": f"text {i}."}) for i in range(5)) + "\n")
    p = build(tmp_path, minilm_vocab, str(tmp_path / "in.jsonl"), "--format", "jsonl")
    assert p.returncode == 2
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, p.stderr
    assert "no instances" in lines[0] and "skipped 5 line(s): no string field 'text'" in lines[0]
    assert "the first such object's fields: 'body' (choose the text's with --text-field)" in lines[0]
    assert not (tmp_path / "out").exists()


def test_non_utf8_files_say_how_they_were_decoded(tmp_path, minilm_vocab):
    """Per line: UTF-8, else cp1252, else latin-1 (0x81 is one of the bytes cp1252 leaves undefined)."""
    utf8 = "The caf\u00e9 opened. It was busy.\n\n"
    (tmp_path / "a.txt").write_bytes((utf8 * 10).encode() + b"A caf\xe9 here. Two \x93quotes\x94 there.\n"
                                     + b"Odd \x81 byte. Still read.\n")
    (tmp_path / "b.txt").write_bytes(b"Plain caf\xe9 line one. And two.\n" * 3)
    (tmp_path / "c.txt").write_bytes((utf8 * 5).encode())
    p = build(tmp_path, minilm_vocab, str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), str(tmp_path / "c.txt"),
              "--format", "lines")
    assert p.returncode == 0, p.stderr
    assert (f"read 2 file(s) that are not all UTF-8: 4 line(s) decoded as cp1252 and 1 as latin-1 (bytes cp1252 "
            f"leaves undefined), every other line as UTF-8, none skipped: {tmp_path / 'a.txt'}, "
            f"{tmp_path / 'b.txt'}") in p.stderr
    assert json.loads(p.stdout)["non_utf8_files"] == [str(tmp_path / "a.txt"), str(tmp_path / "b.txt")]


@pytest.mark.parametrize("algorithm", ["wordpiece", "unigram"])
def test_tokenize_train_says_what_it_skipped_as_build_data_does(tmp_path, algorithm):
    """The vocabulary's reader is build-data's: its skips and decodings reach stderr with the same counts and places."""
    rows = [json.dumps({"text": f"Sentence number {i} about words and more words here."}) for i in range(60)]
    rows[4] = "{not json"
    rows[11] = json.dumps({"body": "no text field"})
    src = tmp_path / "in.jsonl"
    src.write_text("\n".join(rows) + "\n")
    (tmp_path / "old.txt").write_bytes(b"A caf\xe9 line to learn from. And more text.\n" * 20)
    out = tmp_path / ("v.txt" if algorithm == "wordpiece" else "v.model")
    p = subprocess.run([sys.executable, "-m", "bertctl", "tokenize", "train", "--algorithm", algorithm,
                        "--vocab-size", "80" if algorithm == "wordpiece" else "38", "--format", "jsonl", "-o",
                        str(out), str(src), "--no-progress"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert f"tokenize train: skipped 1 line(s): not valid JSON (at {src}:5)\n" in p.stderr
    assert f"tokenize train: skipped 1 line(s): no string field 'text' (at {src}:12)" in p.stderr
    p = subprocess.run([sys.executable, "-m", "bertctl", "tokenize", "train", "--vocab-size", "60", "-o",
                        str(tmp_path / "w.txt"), str(tmp_path / "old.txt"), "--no-progress"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert ("read 1 file(s) that are not all UTF-8: 20 line(s) decoded as cp1252, every other line as UTF-8, none "
            f"skipped: {tmp_path / 'old.txt'}") in p.stderr
