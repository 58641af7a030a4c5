"""The edges a newcomer hits: unwritable outputs, mismatched vocabularies, 0 and negative sizes,
permissions, half-made folders, help rendering. Each failure is one line naming the file or flag,
with exit code 2, and leaves nothing behind."""
from __future__ import annotations

import ast
import errno
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.errors import BertctlError
from helpers import read_only_folder
from test_cli import all_command_paths
from test_finetune_support import data_path

ROOT = Path(__file__).resolve().parents[2]
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "##s", "."]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def invoke(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def one_line_error(result, *needles: str) -> str:
    """Exit 2, one stderr line ``bertctl: error: ...`` holding every needle (after any progress lines), no
    traceback."""
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and result.stderr.count("bertctl: error: ") == 1, result.stderr
    err = result.stderr.rstrip("\n").splitlines()[-1]
    assert err.startswith("bertctl: error: "), result.stderr
    for needle in needles:
        assert needle in err, (needle, err)
    return err.removeprefix("bertctl: error: ")


def tiny_model(directory: Path, extra_tokens: int = 0) -> Path:
    """A 1-layer, 16-wide random BertModel over a 15-token vocabulary, saved with its tokenizer;
    ``extra_tokens`` more tokens go into the saved vocabulary than the model has embeddings."""
    from bertctl.checkpoints.hf import save_pretrained
    from bertctl.config import BertConfig
    from bertctl.model import BertModel
    from bertctl.text.wordpiece import BertTokenizer

    torch.manual_seed(0)
    tokens = SPECIALS + WORDS
    config = BertConfig(vocab_size=len(tokens), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    extra = [f"extra{i}" for i in range(extra_tokens)]
    save_pretrained(BertModel(config), directory, tokenizer=BertTokenizer(tokens + extra))
    return directory


@pytest.fixture(scope="module")
def embed_model(tmp_path_factory) -> Path:
    """``tiny_model``, one for the tests that only read it: embed's first run exports it to ONNX (auto takes
    onnxruntime on the CPU), the others on the same worker find the export in the session's cache."""
    return tiny_model(tmp_path_factory.mktemp("embed-model") / "model")


@pytest.fixture
def texts(tmp_path) -> Path:
    path = tmp_path / "in.txt"
    path.write_text("the cat sat on the mat .\na dog ran\n", encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- help (item 19)


def test_help_shows_no_type_on_flags_and_element_types_on_lists():
    """Typer 0.2x printed ``<bool>`` beside every flag and ``<list[Path]>`` beside lists."""
    for path in all_command_paths():
        result = invoke(*path, "--help")
        assert result.exit_code == 0, (path, result.output)
        assert "<bool>" not in result.output and "list[" not in result.output, (path, result.output)
    rows = {line.split()[1]: line for line in invoke("embed", "--help").output.splitlines()
            if line.startswith("│") and len(line.split()) > 2}
    assert "<" not in rows["--normalize"].split("L2")[0]  # a flag: no value, no type
    assert "<int>" in rows["--batch-size"]
    inputs = next(line for line in invoke("embed", "--help").output.splitlines() if "inputs..." in line)
    assert "<path>" in inputs


# ----------------------------------------------------------------------------- unwritable outputs (item 12)


def test_output_under_a_file_is_one_line_before_any_work(tmp_path, texts, monkeypatch):
    """encode, embed, build-data, tokenize train: the output's folder is a regular file."""
    import bertctl.inference.embed

    model = tiny_model(tmp_path / "model")
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")

    def must_not_run(*a, **k):
        raise AssertionError("the model ran before the output was checked")

    monkeypatch.setattr(bertctl.inference.embed, "embed_texts", must_not_run)
    cases = [
        ("tokenize", "encode", "--model", model, "-o", blocker / "out.jsonl", texts),
        ("embed", "--model", model, "-o", blocker / "sub" / "out.npy", texts),
        ("build-data", "--vocab", model, "--no-progress", "-o", blocker / "data", texts),
        ("tokenize", "train", "--vocab-size", "40", "-o", blocker / "vocab.txt", texts),
    ]
    for args in cases:
        one_line_error(invoke(*args), str(blocker), "not a folder")
    assert blocker.read_text() == "not a folder"


def test_read_only_output_is_one_line(tmp_path, texts, monkeypatch):
    """A read-only mount (simulated: creating a file there fails with EROFS; the tests run as root,
    where permission bits would not stop a write)."""
    model = tiny_model(tmp_path / "model")
    ro = read_only_folder(tmp_path / "ro", monkeypatch)
    for args in [("tokenize", "encode", "--model", model, "-o", ro / "out.npy", texts),
                 ("embed", "--model", model, "-o", ro / "out.npy", texts),
                 ("build-data", "--vocab", model, "--no-progress", "-o", ro / "data", texts)]:
        one_line_error(invoke(*args), str(ro), "read-only file system")
    assert list(ro.iterdir()) == []


def test_late_os_errors_are_one_line_naming_the_path(tmp_path, texts, monkeypatch, embed_model):
    """Past the early check (the disk fills, the folder goes away): the general handler names the path."""
    import bertctl.io

    model = embed_model
    monkeypatch.setattr(bertctl.io, "check_writable", lambda *a, **k: None, raising=False)
    blocker = tmp_path / "file"
    blocker.write_text("x")
    one_line_error(invoke("embed", "--model", model, "-o", blocker / "out.npy", texts), str(blocker))

    def full_disk(*a, **k):  # a write error carries no file name; the atomic writer adds the target's
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(np, "save", full_disk)
    out = tmp_path / "deep" / "er" / "out.npy"
    one_line_error(invoke("embed", "--model", model, "-o", out, texts), str(out), "no space left")
    assert not (tmp_path / "deep").exists()  # the folders made for it are gone too


# ----------------------------------------------------------------------------- umask (item 14)


@pytest.mark.parametrize("umask", [0o022, 0o077])
def test_written_files_follow_the_callers_umask(tmp_path, umask):
    """mkstemp/mkdtemp create 0600/0700; published outputs must look like plain open()/mkdir() ones."""
    from bertctl.io import atomic_open, write_json

    old = os.umask(umask)
    try:
        open(tmp_path / "plain.txt", "w").close()
        (tmp_path / "plain_dir").mkdir()
        model = tiny_model(tmp_path / "model")
        write_json(tmp_path / "metrics.json", {"a": 1})
        with atomic_open(tmp_path / "x.npy", "wb") as f:
            np.save(f, np.zeros(3))
    finally:
        os.umask(old)
    file_mode = stat.S_IMODE((tmp_path / "plain.txt").stat().st_mode)
    dir_mode = stat.S_IMODE((tmp_path / "plain_dir").stat().st_mode)
    assert file_mode == 0o666 & ~umask and dir_mode == 0o777 & ~umask
    for path in [model / "model.safetensors", model / "vocab.txt", model / "config.json", model / "tokenizer.json",
                 tmp_path / "metrics.json", tmp_path / "x.npy"]:
        assert stat.S_IMODE(path.stat().st_mode) == file_mode, (path, oct(path.stat().st_mode))
    assert stat.S_IMODE(model.stat().st_mode) == dir_mode


def test_a_killed_writers_debris_goes_at_the_next_write_of_its_target(tmp_path):
    """A KILLed writer leaves its temporary file or folder; the next write of the same target removes those
    of writers on this host that no longer run, and leaves a running writer's, another host's, another
    target's and names it cannot read alone."""
    import socket
    import subprocess
    import sys

    from bertctl.io import atomic_dir, atomic_open

    host = socket.gethostname()
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead = int(gone.stdout)  # that process has ended: its pid is free
    debris = [tmp_path / f".x.npy.{host}-{dead}.abc123.tmp", tmp_path / f".model.{host}-{dead}.def456.tmp"]
    kept = [tmp_path / f".x.npy.{host}-{os.getpid()}.zzz.tmp", tmp_path / f".x.npy.otherhost-{dead}.q.tmp",
            tmp_path / f".y.npy.{host}-{dead}.r.tmp", tmp_path / ".x.npy.s0m3th1ng.tmp"]
    debris[0].write_bytes(b"half the vectors")
    debris[1].mkdir()
    (debris[1] / "model.safetensors").write_bytes(b"half a model")
    for path in kept:
        path.write_bytes(b"not ours to remove")
    with atomic_open(tmp_path / "x.npy", "wb") as f:
        np.save(f, np.zeros(3))
    with atomic_dir(tmp_path / "model") as d:
        (d / "config.json").write_text("{}")
    assert not any(p.exists() for p in debris)
    assert all(p.exists() for p in kept)
    assert np.load(tmp_path / "x.npy").shape == (3,) and (tmp_path / "model" / "config.json").exists()


# ----------------------------------------------------------------------------- vocabulary vs model (item 10)


def test_vocabulary_larger_than_the_embedding_is_one_line(tmp_path, texts):
    model = tiny_model(tmp_path / "model", extra_tokens=3)  # tokenizer.json: 18 tokens, embedding: 15 rows
    err = one_line_error(invoke("embed", "--model", model, "-o", tmp_path / "o.npy", texts),
                         str(model / "tokenizer.json"), str(model / "config.json"), "18", "15")
    assert "vocabulary" in err
    (model / "tokenizer.json").unlink()  # now vocab.txt is what the tokenizer reads
    one_line_error(invoke("embed", "--model", model, "-o", tmp_path / "o.npy", texts),
                   str(model / "vocab.txt"), str(model / "config.json"))
    assert not (tmp_path / "o.npy").exists()

    from bertctl.model import BertForSequenceClassification
    from bertctl.tasks.common import load_for_finetuning

    with pytest.raises(BertctlError, match="vocab.txt has 18 tokens"):  # finetune loads the pair here
        load_for_finetuning(BertForSequenceClassification, model, num_labels=2)


def test_smaller_vocabulary_is_fine(tmp_path, texts):
    model = tiny_model(tmp_path / "model")
    lines = (model / "vocab.txt").read_text(encoding="utf-8").splitlines()
    (model / "tokenizer.json").unlink()
    (model / "vocab.txt").write_text("\n".join(lines[:-2]) + "\n", encoding="utf-8")  # drops "##s" and "."
    result = invoke("embed", "--model", model, "-o", tmp_path / "o.npy", texts)
    assert result.exit_code == 0, result.output
    assert np.load(tmp_path / "o.npy").shape == (2, 16)


def test_token_ids_past_the_embedding_at_encode_time(tmp_path):
    """A tokenizer handed in by a library caller: ids past the table are an error, not an IndexError."""
    from bertctl.inference.backends import load_encoder
    from bertctl.inference.embed import EmbedConfig, embed_texts
    from bertctl.text.wordpiece import BertTokenizer

    model = load_encoder(tiny_model(tmp_path / "model"), torch.device("cpu"))
    tokenizer = BertTokenizer(SPECIALS + WORDS + ["zebra"])
    assert embed_texts(model, tokenizer, ["the cat"], EmbedConfig(), progress=False).shape == (1, 16)
    with pytest.raises(BertctlError, match="token id 15 .* 15 word embeddings"):
        embed_texts(model, tokenizer, ["the zebra"], EmbedConfig(), progress=False)


# ----------------------------------------------------------------------------- embed --max-seq-length (item 7)


@pytest.mark.parametrize("value", ["0", "1", "-3"])
def test_embed_max_seq_length_below_two_is_refused_by_name(tmp_path, texts, value, flag="--max-seq-length"):
    model = tiny_model(tmp_path / "model")
    one_line_error(invoke("embed", "--model", model, flag, value, "-o", tmp_path / "o.npy", texts),
                   "--max-seq-length", value)


def test_embed_max_seq_length_truncates(tmp_path, texts, embed_model, flag="--max-seq-length"):
    """--max-seq-length 3 keeps [CLS] the [SEP] of the first text: the same row as embedding "the" alone."""
    model = embed_model
    (tmp_path / "the.txt").write_text("the\n", encoding="utf-8")
    for args, out in [((flag, "3"), "cut.npy"), ((), "the.npy")]:
        src = texts if out == "cut.npy" else tmp_path / "the.txt"
        assert invoke("embed", "--model", model, *args, "-o", tmp_path / out, src).exit_code == 0
    np.testing.assert_allclose(np.load(tmp_path / "cut.npy")[0], np.load(tmp_path / "the.npy")[0], atol=1e-6)


# ----------------------------------------------------------------------------- eval squad -o (item 9)


def test_eval_squad_predictions_writes_metrics_to_output(tmp_path):
    out = tmp_path / "scores"
    result = invoke("eval", "squad", "--data", data_path("squad", "dev-v1.1.json"),
                    "--predictions", data_path("squad", "predictions-v1.1-bert-ensemble.json"), "-o", out)
    assert result.exit_code == 0, result.output
    written = json.loads((out / "metrics.json").read_text(encoding="utf-8"))
    assert written == json.loads(result.stdout)
    assert round(written["exact_match"], 2) == 86.21 and round(written["f1"], 2) == 92.20


# ----------------------------------------------------------------------------- bench ops device (item 16)


@pytest.mark.parametrize("cuda", [False, True])
def test_bench_ops_defaults_to_cuda_only_when_available(monkeypatch, cuda):
    import bertctl.bench.ops

    seen = {}

    def fake_bench(cfg):
        seen["device"], seen["dtypes"] = cfg.device, cfg.dtypes
        return {"device": cfg.device}

    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(bertctl.bench.ops, "run_ops_bench", fake_bench)
    result = invoke("bench", "ops", "--tiny")
    assert result.exit_code == 0, result.output
    assert seen == ({"device": "cuda", "dtypes": ("bfloat16",)} if cuda else {"device": "cpu", "dtypes": ("float32",)})
    help_text = " ".join(invoke("bench", "ops", "--help").output.replace("│", " ").split())
    assert "auto: cuda when a GPU is available, else cpu. [default: auto]" in help_text


# ----------------------------------------------------------------------------- half-made folders (item 17)


def test_failed_build_data_leaves_nothing(tmp_path):
    """An input error: no instances from a one-sentence document. The output and the parents made
    for it are removed; before, ``.build/state.json`` stayed behind."""
    model = tiny_model(tmp_path / "model")
    (tmp_path / "one.txt").write_text("the cat sat .\n", encoding="utf-8")
    out = tmp_path / "new" / "data"
    one_line_error(invoke("build-data", "--vocab", model, "--no-progress", "-o", out, tmp_path / "one.txt"),
                   "no instances")
    assert not (tmp_path / "new").exists()
    (tmp_path / "empty").mkdir()  # an existing empty folder is emptied, not removed
    one_line_error(invoke("build-data", "--vocab", model, "--no-progress", "-o", tmp_path / "empty",
                          tmp_path / "one.txt"), "no instances")
    assert (tmp_path / "empty").is_dir() and not any((tmp_path / "empty").iterdir())


def test_interrupted_build_data_says_what_it_kept(tmp_path, monkeypatch, minilm_vocab):
    """Finished work units survive an operating-system error, and the message says how to continue."""
    import bertctl.data.build as build

    real = build.build_data
    corpus = data_path("corpus", "inaugural")
    units = []

    def disk_fills_after_two_units(*args, **kwargs):
        def on_unit_done(record):
            units.append(record)
            if len(units) == 2:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        return real(*args, **kwargs, on_unit_done=on_unit_done)

    out = tmp_path / "data"
    # One worker: with several, units in flight when the error comes may finish too (the count varies).
    args = ("build-data", "--vocab", minilm_vocab, "--format", "text", "--dupe-factor", "1", "--unit-mb", "0.2",
            "--workers", "1", "--no-progress", "-o", out, corpus)
    monkeypatch.setattr(build, "build_data", disk_fills_after_two_units)
    result = invoke(*args)
    assert result.exit_code == 2
    kept, error = result.stderr.splitlines()
    assert f"kept the partial build in {out} (2 finished work units)" in kept and "--resume" in kept
    assert error.startswith("bertctl: error: no space left")
    monkeypatch.setattr(build, "build_data", real)
    result = invoke(*args, "--resume")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["resumed_units"] == 2 and not (out / ".build").exists()


# ----------------------------------------------------------------------------- non-UTF-8 wording (item 18)


def test_non_utf8_input_reads_the_same_in_encode_and_embed(tmp_path):
    model = tiny_model(tmp_path / "model")
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("the cat\ncaf\xe9\n".encode("latin-1"))
    encode = one_line_error(invoke("tokenize", "encode", "--model", model, "-o", tmp_path / "o.jsonl", bad))
    embed = one_line_error(invoke("embed", "--model", model, "-o", tmp_path / "o.npy", bad))
    assert encode == embed and encode.startswith(f"{bad}:2: not valid UTF-8")


# ----------------------------------------------------------------------------- curves.png (item 2)


def test_matplotlib_is_a_main_dependency():
    tree = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    call = next(n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "setup")
    requires = next(k.value for k in call.keywords if k.arg == "install_requires")
    assert any(ast.literal_eval(r).startswith("matplotlib") for r in requires.elts)


def test_curves_draw_without_a_display_or_pyplot(tmp_path):
    """In a fresh process with an interactive backend asked for and no display: a PNG, and pyplot
    (which would pick that backend) never imported."""
    log = tmp_path / "metrics.jsonl"
    rows = [{"event": "train", "step": s, "loss": 9 - s, "mlm_loss": 8 - s, "nsp_loss": 0.7, "mlm_acc": s / 10,
             "nsp_acc": 0.5, "lr": 1e-4} for s in range(1, 6)]
    rows.append({"event": "eval", "step": 5, "mlm_loss": 4.0, "nsp_loss": 0.6, "mlm_acc": 0.3, "nsp_acc": 0.6})
    log.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    code = ("import sys; from bertctl.train.metrics import plot_curves; "
            f"print(plot_curves({str(log)!r}, {str(tmp_path / 'curves.png')!r})); "
            "print('matplotlib.pyplot' in sys.modules)")
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    proc = subprocess.run([sys.executable, "-c", code], env={**env, "MPLBACKEND": "TkAgg"}, capture_output=True,
                          text=True, check=True)
    assert proc.stdout.split() == [str(tmp_path / "curves.png"), "False"]
    assert (tmp_path / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_training_command_keeps_only_what_is_worth_keeping(tmp_path):
    """run_output: a new folder with nothing of value is removed on failure; checkpoints or a trained
    model/ are kept; a folder that existed before is never removed."""
    from bertctl.cli.options import run_output

    def fail(out, make=()):
        with pytest.raises(RuntimeError):
            with run_output(out):
                out.mkdir()
                for rel in make:
                    (out / rel).mkdir(parents=True)
                raise RuntimeError("boom")

    fail(tmp_path / "empty", ["work"])
    assert not (tmp_path / "empty").exists()
    fail(tmp_path / "ckpt", ["checkpoints/step-00000004"])
    assert (tmp_path / "ckpt" / "checkpoints" / "step-00000004").is_dir()
    fail(tmp_path / "model", ["model"])
    assert (tmp_path / "model" / "model").is_dir()
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(RuntimeError):
        with run_output(mine):
            raise RuntimeError("boom")
    assert mine.is_dir()


@pytest.mark.parametrize("make", ["missing", "empty"])
def test_pretrain_on_a_folder_that_is_not_data_says_only_that(tmp_path, make, monkeypatch):
    """A wrong ``--data`` is the one line, before any note about the defaults it would have chosen (on a
    CPU: the model size and batch), and nothing is written."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    data = tmp_path / "data"
    if make == "empty":
        data.mkdir()
    r = invoke("pretrain", "--data", data, "--output", tmp_path / "run", "--no-progress")
    one_line_error(r, str(data), "not a pretraining data folder")
    assert "no GPU" not in r.stderr and not (tmp_path / "run").exists()
