"""Inputs as they come: gzip/bzip2/xz/zstd files and stdin, parquet and Arrow IPC files, WikiExtractor output.

Independent references: the plain file (the same text, uncompressed) and the JSON-lines file (the
same documents) must give byte-identical shards and the same vocabulary; the compressed files are
made by the codecs' own libraries, the parquet and Arrow files by pyarrow, here in the tests.
"""
from __future__ import annotations

import bz2
import gzip
import json
import lzma
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.data.build import build_data
from bertctl.data.config import DataConfig
from bertctl.data.documents import ReadStats, list_inputs, open_input, read_documents, read_lines
from bertctl.errors import BertctlError
from bertctl.text.vocab_training import VocabConfig, train_vocab
from bertctl.text.wordpiece import BertTokenizer

COMPRESS = {
    "gz": gzip.compress,
    "bz2": bz2.compress,
    "xz": lzma.compress,
    "zst": lambda data: zstandard.ZstdCompressor().compress(data),
}
INAUGURAL = ("1789-Washington", "1861-Lincoln", "1933-Roosevelt", "1961-Kennedy", "1801-Jefferson", "1913-Wilson",
             "1981-Reagan", "1865-Lincoln")


@pytest.fixture(scope="module")
def tokenizer(minilm_vocab):
    return BertTokenizer.from_vocab_file(minilm_vocab)


@pytest.fixture(scope="module")
def texts(shared_data) -> dict[str, bytes]:
    return {name: (shared_data / "corpus" / "inaugural" / f"{name}.txt").read_bytes() for name in INAUGURAL}


def shard_bytes(out: Path) -> dict[str, bytes]:
    """Every file a build wrote except the manifest (which names the input files)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name != "manifest.json"}


def summary_without_inputs(out: Path) -> dict:
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["build_state"].pop("inputs")
    return manifest


SAMPLE = ("First line, plain ASCII.\n\nCaf\u00e9 cr\u00e8me, na\u00efve \u2014 UTF-8.\n".encode()
          + b"cp1252 \x93quoted\x94 caf\xe9\n" + b"no newline at the end")


@pytest.mark.parametrize("codec", sorted(COMPRESS))
def test_compressed_lines_equal_plain(tmp_path, codec):
    """Decoded lines, byte counts and encoding statistics of a compressed file equal the plain file's,
    also for concatenated streams with zero padding after them and for output far larger than a block."""
    compress = COMPRESS[codec]
    big = SAMPLE + b"\n" + b"".join(b"line %d of a long file\n" % k for k in range(200_000)) + b"\0" * 0 + b"z" * 3_000_000
    for k, data in enumerate([SAMPLE, big]):
        plain = tmp_path / f"p{k}.txt"
        plain.write_bytes(data)
        packed = tmp_path / f"c{k}.txt.{codec}"
        packed.write_bytes(compress(data[:100]) + compress(data[100:]) + b"\0" * 8)
        expected, got = ReadStats(), ReadStats()
        assert list(read_lines([packed], "text", got)) == list(read_lines([plain], "text", expected))
        assert (got.bytes, got.files, len(got.non_utf8_files)) == (expected.bytes, 1, 1)
        with open_input(packed) as f:
            assert f.read() == data


def test_list_inputs_matches_compressed_names(tmp_path):
    for name in ("a.txt", "b.txt.gz", "c.txt.zst", "d.json", "e.gz", ".hidden.txt"):
        (tmp_path / name).write_bytes(b"")
    assert [p.name for p in list_inputs([tmp_path], "*.txt")] == ["a.txt", "b.txt.gz", "c.txt.zst"]
    assert [p.name for p in list_inputs([tmp_path], "*.gz")] == ["b.txt.gz", "e.gz"]
    assert [str(p) for p in list_inputs(["-", tmp_path / "a.txt"])] == ["-", str(tmp_path / "a.txt")]
    with pytest.raises(BertctlError, match="given twice"):
        list_inputs(["-", "-"])
    with pytest.raises(BertctlError, match=r"^-: parquet cannot be read from stdin \(it needs to seek\)"):
        list_inputs(["-"], fmt="parquet")


def test_build_is_byte_identical_for_plain_and_compressed(tmp_path, texts, tokenizer):
    """The same text, plain or compressed (every codec, one per file), gives the same shards with 1 and 2 workers."""
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    codecs = sorted(COMPRESS)
    for k, (name, data) in enumerate(texts.items()):
        (plain / f"{name}.txt").write_bytes(data)
        codec = codecs[k % len(codecs)]
        (packed / f"{name}.txt.{codec}").write_bytes(COMPRESS[codec](data))
    cfg = DataConfig(format="text", pattern="*.txt", max_seq_length=64, dupe_factor=1, seed=3, chunk_bytes=25_000,
                     shard_size=50)
    a = build_data([plain], tmp_path / "a", tokenizer, cfg, progress=False)
    b = build_data([packed], tmp_path / "b", tokenizer, cfg, progress=False)
    c = build_data([packed], tmp_path / "c", tokenizer, cfg, workers=2, progress=False)
    assert a["files"] == b["files"] == len(texts) and a["bytes"] == b["bytes"] == sum(map(len, texts.values()))
    assert a["instances"] > 100 and a["shards"] > 4
    reference = shard_bytes(tmp_path / "a")
    assert shard_bytes(tmp_path / "b") == reference and shard_bytes(tmp_path / "c") == reference
    assert summary_without_inputs(tmp_path / "b") == summary_without_inputs(tmp_path / "a")
    assert b["instances"] == c["instances"] == a["instances"]


def truncated(tmp_path: Path, codec: str, data: bytes) -> tuple[Path, int]:
    packed = COMPRESS[codec](data)
    path = tmp_path / f"cut.txt.{codec}"
    path.write_bytes(packed[: len(packed) * 2 // 3])
    return path, len(packed) * 2 // 3


CODEC_NAMES = {"gz": "gzip", "bz2": "bzip2", "xz": "xz", "zst": "zstd"}


@pytest.mark.parametrize("codec", sorted(COMPRESS))
def test_truncated_file_is_one_line_error_and_leaves_nothing(tmp_path, texts, tokenizer, minilm_vocab, codec):
    """Work units finish before the truncated file is reached; the error names it and the byte offset at
    which it ends, and the output folder is gone."""
    data = b"\n=====\n".join(texts.values())
    good = tmp_path / "a-good.txt"
    good.write_bytes(data)
    bad, size = truncated(tmp_path, codec, data)
    message = f"{bad}: truncated {CODEC_NAMES[codec]} file: it ends at byte offset {size} inside a compressed stream"
    done = []
    cfg = DataConfig(format="text", doc_separator="=====", dupe_factor=1, max_seq_length=32, chunk_bytes=20_000)
    with pytest.raises(BertctlError) as e:
        build_data([good, bad], tmp_path / "library", tokenizer, cfg, progress=False, on_unit_done=done.append)
    assert e.value.args[0] == message and len(done) >= 2  # shards were written before the error

    out = tmp_path / "out" / "data"
    args = ["build-data", "--vocab", str(minilm_vocab), "--format", "text", "--doc-separator", "=====",
            "--dupe-factor", "1", "--max-seq-length", "32", "--unit-mb", "0.02", "--no-progress", "-o", str(out),
            str(good), str(bad)]
    result = CliRunner().invoke(app, args + (["--workers", "2"] if codec in ("zst", "bz2") else []))
    assert result.exit_code == 2, result.output
    assert result.stderr == f"bertctl: error: {message}\n"
    assert not (tmp_path / "out").exists()


def test_corrupt_file_named_with_offset(tmp_path, texts):
    data = b"".join(texts.values())
    for codec in COMPRESS:
        packed = bytearray(COMPRESS[codec](data))
        for i in range(len(packed) // 2, len(packed) // 2 + 64):
            packed[i] ^= 0xA5
        path = tmp_path / f"bad.txt.{codec}"
        path.write_bytes(bytes(packed))
        with pytest.raises(BertctlError, match=rf"^{path}: corrupt \w+ data, detected at byte offset (\d+) ") as e:
            list(read_lines([path], "text", ReadStats()))
        offset = int(e.value.args[0].split("byte offset ")[1].split()[0])
        assert len(packed) // 2 < offset <= len(packed)  # at or after the damage, never past the end
    fake = tmp_path / "plain.gz"
    fake.write_text("not compressed\n")
    with pytest.raises(BertctlError, match=r"plain.gz: byte offset 0: not gzip data, although the name ends in .gz"):
        list(read_lines([fake], "text", ReadStats()))


def test_bad_file_via_installed_entry_point(tmp_path, texts, minilm_vocab):
    """`python -m bertctl`: exit code 2, one line on stderr, nothing on stdout, for build-data and tokenize train."""
    bad, size = truncated(tmp_path, "xz", b"".join(texts.values()))
    for args in (["build-data", "--vocab", str(minilm_vocab), "--no-progress", "-o", str(tmp_path / "out"), str(bad)],
                 ["tokenize", "train", "--vocab-size", "200", "-o", str(tmp_path / "vocab.txt"), str(bad)]):
        proc = subprocess.run([sys.executable, "-m", "bertctl", *args], capture_output=True, text=True)
        assert proc.returncode == 2 and proc.stdout == ""
        # the last line (tokenize train draws a progress bar on stderr before it), and the only error line
        assert proc.stderr.splitlines()[-1] == (f"bertctl: error: {bad}: truncated xz file: it ends at byte offset "
                                                f"{size} inside a compressed stream")
        assert proc.stderr.count("bertctl: error:") == 1
    assert not (tmp_path / "out").exists() and not (tmp_path / "vocab.txt").exists()


DOCS = [
    "The first document opens here. It has a second sentence.\n\nA new paragraph follows. And ends.",
    "Second document. Two sentences.",
    None,  # a null text: counted, skipped
    "Only one sentence here",
    "Fourth document, first sentence. Then another one! And a question?",
]


def write_jsonl(path: Path, docs) -> None:
    path.write_text("".join(json.dumps({"body": d, "id": k}) + "\n" for k, d in enumerate(docs) if d is not None))


def test_parquet_and_arrow_equal_jsonl(tmp_path, tokenizer):
    """The same documents as JSON lines, parquet (several row groups), an Arrow IPC stream (what the datasets
    cache holds) and an IPC file give the same shards."""
    docs = DOCS * 40
    write_jsonl(tmp_path / "docs.jsonl", docs)
    table = pa.table({"id": list(range(len(docs))), "body": docs})
    pq.write_table(table, tmp_path / "docs.parquet", row_group_size=32)
    cache = tmp_path / "cache"
    cache.mkdir()
    with pa.ipc.new_stream(cache / "data-train.arrow", table.schema) as writer:
        for batch in table.to_batches(max_chunksize=25):
            writer.write_batch(batch)
    (cache / "dataset_info.json").write_text("{}")  # beside the data in a datasets cache folder
    (cache / "state.json").write_text("{}")
    with pa.ipc.new_file(tmp_path / "docs.feather", table.schema) as writer:
        writer.write_table(table, max_chunksize=40)

    def build(name, inputs, fmt):
        cfg = DataConfig(format=fmt, text_field="body", max_seq_length=32, dupe_factor=2, seed=1)
        return build_data(inputs, tmp_path / name, tokenizer, cfg, progress=False)

    reference = build("jsonl", [tmp_path / "docs.jsonl"], "jsonl")
    assert reference["documents_read"] == 160 and reference["documents"] == 120
    for name, inputs, fmt in [("parquet", [tmp_path / "docs.parquet"], "parquet"), ("stream", [cache], "arrow"),
                              ("file", [tmp_path / "docs.feather"], "arrow")]:
        summary = build(name, inputs, fmt)
        assert summary["files"] == 1 and summary["documents_read"] == reference["documents_read"], name
        assert summary["skipped"]["lines"]["null 'body'"]["count"] == 40
        assert shard_bytes(tmp_path / name) == shard_bytes(tmp_path / "jsonl"), name

    with pytest.raises(BertctlError, match=r"docs.parquet: no column 'text' \(--text-field\); columns: id, body$"):
        list(read_documents([tmp_path / "docs.parquet"], "parquet", ReadStats()))
    with pytest.raises(BertctlError, match=r"data-train.arrow: column 'id' holds int64, not strings"):
        list(read_documents([cache / "data-train.arrow"], "arrow", ReadStats(), text_field="id"))
    with pytest.raises(BertctlError, match=r"docs.jsonl: not a readable parquet file"):
        list(read_documents([tmp_path / "docs.jsonl"], "parquet", ReadStats(), text_field="body"))
    cut = tmp_path / "cut.arrow"
    cut.write_bytes((cache / "data-train.arrow").read_bytes()[:-300])
    with pytest.raises(BertctlError, match=r"cut.arrow: not a readable arrow file \(Expected to be able to read"):
        list(read_documents([cut], "arrow", ReadStats(), text_field="body"))


WIKI = """<doc id="12" url="https://en.wikipedia.org/wiki?curid=12" title="Anarchism">
Anarchism

Anarchism is a political philosophy. It is sceptical of authority.
Etymology.
The word comes from Greek. It means without a ruler.
</doc>
stray line outside any block
<doc id="25" url="https://en.wikipedia.org/wiki?curid=25" title="AT&amp;T">
AT&T
AT&T is a company. It sells telephone service.
</doc>
<doc id="39" url="https://en.wikipedia.org/wiki?curid=39" title="Albedo">
Albedo
</doc>
"""


def test_wikiextractor_format(tmp_path):
    """Blocks are documents, each line a paragraph, the title line dropped; a bzip2 file as WikiExtractor -c writes."""
    path = tmp_path / "AA" / "wiki_00.bz2"
    path.parent.mkdir()
    path.write_bytes(bz2.compress(WIKI.encode()))
    stats = ReadStats()
    docs = list(read_documents(list_inputs([tmp_path]), "wikiextractor", stats))
    assert [d.pieces for d in docs] == [
        ["Anarchism is a political philosophy. It is sceptical of authority.", "Etymology.",
         "The word comes from Greek. It means without a ruler."],
        ["AT&T is a company. It sells telephone service."],
    ]
    assert stats.skipped_lines == {"text outside <doc> ... </doc>": {"count": 1, "first": f"{path}:8"}}
    assert sum(d.nbytes for d in docs) < stats.bytes == len(WIKI.encode())


def test_stdin(tmp_path, texts, minilm_vocab):
    """`-` reads stdin, compressed or not: the same shards as the file, and the same vocabulary."""
    data = b"".join(texts.values())
    plain = tmp_path / "corpus.txt"
    plain.write_bytes(data)
    common = ["--vocab", str(minilm_vocab), "--format", "text", "--doc-separator", "=====", "--dupe-factor", "1",
              "--max-seq-length", "32", "--no-progress"]
    runs = {"file": (str(plain), None), "stdin": ("-", data), "stdin-gz": ("-", gzip.compress(data))}
    for name, (arg, stdin) in runs.items():
        proc = subprocess.run([sys.executable, "-m", "bertctl", "build-data", *common, "-o", str(tmp_path / name), arg],
                              input=stdin, capture_output=True)
        assert proc.returncode == 0, proc.stderr.decode()
    assert shard_bytes(tmp_path / "stdin") == shard_bytes(tmp_path / "file") == shard_bytes(tmp_path / "stdin-gz")
    assert json.loads((tmp_path / "stdin-gz" / "manifest.json").read_text())["build_state"]["inputs"] == ["-"]

    train = ["tokenize", "train", "--vocab-size", "300", "--min-frequency", "3"]
    subprocess.run([sys.executable, "-m", "bertctl", *train, "-o", str(tmp_path / "v-stdin.txt"), "-"], check=True,
                   input=zstandard.ZstdCompressor().compress(data), capture_output=True)
    expected = train_vocab([plain], VocabConfig(vocab_size=300, min_frequency=3))
    assert (tmp_path / "v-stdin.txt").read_text(encoding="utf-8").splitlines() == expected


def test_vocab_from_compressed_and_columnar_inputs(tmp_path, texts):
    """tokenize train reads what build-data reads: the same vocabulary from plain, compressed (with
    --sample-bytes, sized by a reading pass) and parquet inputs holding the same lines."""
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    plain.mkdir()
    packed.mkdir()
    for k, (name, data) in enumerate(texts.items()):
        (plain / f"{name}.txt").write_bytes(data)
        codec = sorted(COMPRESS)[k % len(COMPRESS)]
        (packed / f"{name}.txt.{codec}").write_bytes(COMPRESS[codec](data))
    for extra in ({}, {"sample_bytes": 100_000, "seed": 4}):
        config = VocabConfig(vocab_size=400, min_frequency=2, **extra)
        assert train_vocab([packed], config) == train_vocab([plain], config)
    lines = [line for data in texts.values() for line in data.decode("utf-8").split("\n") if line.strip()]
    pq.write_table(pa.table({"text": lines}), tmp_path / "lines.parquet")
    config = VocabConfig(vocab_size=400, min_frequency=2)
    parquet = VocabConfig(vocab_size=400, min_frequency=2, format="parquet")  # a folder: its *.parquet files
    assert train_vocab([tmp_path], parquet) == train_vocab([plain], config)
    with pytest.raises(BertctlError, match="--sample-bytes: stdin"):
        train_vocab(["-"], VocabConfig(sample_bytes=1000))


def test_gzip_input_needs_no_zstandard(tmp_path):
    """zstandard is imported only for .zst inputs: a machine without it still reads gzip (a subprocess where
    importing zstandard fails)."""
    src = tmp_path / "a.txt.gz"
    with gzip.open(src, "wt", encoding="utf-8") as f:
        f.write("First line.\nSecond line.\n")
    code = ("import sys; sys.modules['zstandard'] = None\n"
            "from pathlib import Path\n"
            "from bertctl.data.documents import ReadStats, read_lines\n"
            f"print(list(read_lines([Path({str(src)!r})], 'text', ReadStats())))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "First line." in out.stdout and "Second line." in out.stdout
