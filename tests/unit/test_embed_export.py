"""``export onnx`` checks its output before the work: an output it cannot write, or a file system without
room for the export, is one line naming the user's path, before the model loads (and before torch
is imported); a write that fails later still names that path, not the temporary file it went to.
embed's and export's cheap flag checks happen before torch is imported."""
from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.inference import onnx_export
from helpers import read_only_folder


@pytest.fixture
def model(tmp_path) -> Path:
    from test_cli_edges import tiny_model

    return tiny_model(tmp_path / "model")


@pytest.fixture
def no_work(monkeypatch):
    """The export's work, which a refused output must never reach."""
    def must_not_run(*a, **k):
        raise AssertionError("the model loaded before the output was checked")

    monkeypatch.setattr(onnx_export, "load_for_export", must_not_run)


def one_line(result, *needles: str) -> str:
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("bertctl: error: ") and "Traceback" not in result.output, result.stderr
    for needle in needles:
        assert needle in lines[0], (needle, lines[0])
    return lines[0]


def export(model: Path, output: Path, *flags: str):
    return CliRunner().invoke(app, ["export", "onnx", "--model", str(model), "--output", str(output), *flags])


def test_an_unwritable_output_is_refused_before_the_work(model, tmp_path, monkeypatch, no_work):
    """A read-only mount (simulated, as the tests run as root: creating a file there fails with EROFS)."""
    ro = read_only_folder(tmp_path / "ro", monkeypatch)
    err = one_line(export(model, ro / "model.onnx"), str(ro / "model.onnx"), "read-only file system")
    assert ".tmp" not in err and list(ro.iterdir()) == []
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    one_line(export(model, blocker / "model.onnx"), str(blocker), "not a folder")
    one_line(export(model, tmp_path), str(tmp_path), "is a folder")


def test_a_file_system_without_room_is_refused_before_the_work(model, tmp_path, monkeypatch, no_work):
    import shutil

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 ** 9, 10 ** 9 - 1000, 1000))
    out = tmp_path / "deep" / "model.onnx"
    one_line(export(model, out), str(out), "no room for the export", f"{tmp_path} has 0 MiB free")
    assert not (tmp_path / "deep").exists()


def test_a_full_disk_during_the_write_names_the_output_not_its_temporary_file(model, tmp_path, monkeypatch):
    """The save fails as a full disk makes it fail, naming the file it writes (the temporary one)."""
    import torch

    class Program:
        class model:
            metadata_props: dict = {}

        def save(self, path, external_data=False):
            Path(path).write_bytes(b"half an export")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))

    monkeypatch.setattr(torch.onnx, "export", lambda *a, **k: Program())
    out = tmp_path / "model.onnx"
    err = one_line(export(model, out), f"{out}: no space left on the device")
    assert ".tmp" not in err and list(tmp_path.iterdir()) == [tmp_path / "model"]


def imports_torch(*args: str) -> tuple[int, bool, str]:
    """``bertctl ARGS`` in a fresh interpreter: exit code, whether torch got imported, stderr."""
    code = ("import json, sys\nfrom bertctl.cli.app import main\ntry:\n"
            f"    main({list(args)!r})\nexcept SystemExit as e:\n    code = e.code\nelse:\n    code = 0\n"
            "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}), file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    report = json.loads(r.stderr.strip().splitlines()[-1])
    return report["code"], report["torch"], r.stderr


def test_cheap_checks_come_before_torch(model, tmp_path):
    texts = tmp_path / "in.txt"
    texts.write_text("the cat\n", encoding="utf-8")
    (tmp_path / "old.npy").write_bytes(b"previous")
    embed = ["embed", "--model", str(model), str(texts)]
    cases = [
        (["export", "onnx", "--model", str(model), "-o", str(tmp_path / "m.onnx"), "--opset", "12"], "--opset"),
        (["export", "onnx", "--model", str(model), "-o", str(tmp_path / "m.onnx"), "--attn", "flash"], "--attn"),
        (["export", "onnx", "--model", str(model), "-o", str(tmp_path)], "is a folder"),
        ([*embed, "-o", str(tmp_path / "o.npy"), "--stride", "3"], "--stride"),
        ([*embed, "-o", str(tmp_path / "o.npy"), "--long", "chunk", "--stride", "40"], "--stride 40"),
        ([*embed, "-o", str(tmp_path / "o.npy"), "--batch-size", "0"], "--batch-size"),
        ([*embed, "-o", str(tmp_path / "o.npy"), "--precision", "fp8"], "--precision"),
        ([*embed, "-o", str(tmp_path / "old.npy")], "already exists; pass --overwrite"),
        ([*embed, "-o", str(tmp_path / "o.csv")], "suffix must be"),
    ]
    for args, needle in cases:
        code, torch_loaded, err = imports_torch(*args)
        assert code == 2 and needle in err, (args, err)
        assert not torch_loaded, args
    assert (tmp_path / "old.npy").read_bytes() == b"previous"
