"""Start-up: a command imports what it needs; ``bertctl embed`` on ONNX Runtime never loads torch."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bertctl.cli.app import COMMANDS, build_app
from bertctl.inference.backends.onnx import cached_encoder


def run_main(*args: str) -> dict:
    """``bertctl ARGS`` in a fresh interpreter: exit code, output, and whether torch got imported."""
    code = ("import json, sys\n"
            "from bertctl.cli.app import main\n"
            "try:\n"
            f"    main({list(args)!r})\n"
            "except SystemExit as e:\n"
            "    code = e.code\n"
            "else:\n"
            "    code = 0\n"
            "print(json.dumps({'code': code, 'torch': 'torch' in sys.modules}), file=sys.stderr)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    report = json.loads(r.stderr.strip().splitlines()[-1])
    return {**report, "stdout": r.stdout, "stderr": r.stderr}


def test_embed_help_does_not_import_torch():
    r = run_main("embed", "--help")
    assert r["code"] == 0 and "--batch-tokens" in r["stdout"], r["stderr"]
    assert not r["torch"]


def test_embed_on_onnxruntime_does_not_import_torch(tmp_path, minilm_dir):
    cached_encoder(minilm_dir)  # the export (made with torch) is cached first, in this session's cache
    texts = tmp_path / "in.txt"
    texts.write_text("a first sentence\nand a second one , longer than the first\n", encoding="utf-8")
    r = run_main("embed", "--model", str(minilm_dir), "--normalize", "-o", str(tmp_path / "o.npy"), str(texts))
    assert r["code"] == 0 and "onnxruntime" in r["stderr"], r["stderr"]
    assert not r["torch"]


def test_root_help_lists_every_command():
    r = run_main("--help")
    assert r["code"] == 0
    listed = {line.split()[1] for line in r["stdout"].splitlines() if line.startswith("│ ") and len(line.split()) > 2}
    assert set(COMMANDS) <= listed, (set(COMMANDS) - listed, r["stdout"])


def test_each_module_registers_its_command():
    """COMMANDS maps each name to the module that registers it (main imports only that module)."""
    import typer

    for name in COMMANDS:
        app = build_app([name])
        command = typer.main.get_command(app)
        assert list(command.commands) == [name], (name, list(command.commands))


@pytest.mark.parametrize("args, shown", [((), "finetune"), (("finetune", "--help"), "glue"),
                                         (("finetune", "glue", "--help"), "--from-scratch"),
                                         (("eval", "--help"), "squad"), (("pretrain", "--help"), "--minutes")])
def test_help_does_not_import_torch(args, shown):
    """Help pages come up at once: no command module imports torch at import time."""
    r = run_main(*args, "--help") if not args else run_main(*args)
    assert r["code"] == 0 and shown in r["stdout"], r["stderr"]
    assert not r["torch"]


@pytest.mark.parametrize("args, message", [
    (("finetune", "ner", "--data-dir", "D", "--model", "M", "-o", "O", "--lr", "-1"), "--lr must be greater than 0"),
    (("finetune", "glue", "--task", "sst2", "--data-dir", "D", "--model", "M", "-o", "O", "--lr", "0"),
     "--lr must be greater than 0"),
    (("finetune", "glue", "--task", "sst2", "--data-dir", "D", "--model", "M", "-o", "O", "--batch-size", "x"),
     "--batch-size: 'x' is not an integer"),
    (("finetune", "squad", "--train", "T", "--dev", "D", "--model", "M", "-o", "O", "--warmup-fraction", "2"),
     "--warmup-fraction must be in [0, 1)"),
    (("finetune", "swag", "--train", "T", "--dev", "D", "--model", "M", "-o", "O", "--precision", "fp8"),
     "--precision must be one of"),
    (("pretrain", "--data", "D", "-o", "O", "--model-size", "huge"), "--model-size must be one of"),
    (("pretrain", "--data", "D", "-o", "O", "--extend-schedule"), "--extend-schedule continues a run")])
def test_bad_training_flags_are_refused_before_torch_loads(args, message):
    r = run_main(*args)
    assert r["code"] == 2 and message in r["stderr"], r["stderr"]
    assert not r["torch"]


@pytest.mark.parametrize("args, message", [
    (("--task", "all", "--data-dir", "NO-SUCH-DIR", "--restarts", "2"), "NO-SUCH-DIR"),
    (("--task", "sst2", "--data-dir", ".", "--grid", "wide"), "--grid: 'paper'"),
    (("--task", "sst2", "--data-dir", ".", "--lr", "5e-5,x"), "--lr"),
    (("--task", "sst2", "--data-dir", ".", "--restarts", "2", "--extend-schedule"), "--extend-schedule"),
])
def test_suite_refuses_bad_flags_before_torch(tmp_path, args, message):
    r = run_main("finetune", "glue", "--model", str(tmp_path), "-o", str(tmp_path / "out"), *args)
    assert r["code"] == 2 and message in r["stderr"], r["stderr"]
    assert not r["torch"]


def test_leaves_without_cuda_teardown_only_when_no_process_group_is_held(monkeypatch):
    """A finished command that made a CUDA context skips CUDA's teardown at exit, except a torchrun rank still
    holding its process group (torch.distributed tears that down itself)."""
    import types

    from bertctl.cli import app

    monkeypatch.delitem(sys.modules, "bertctl.inference.backends.native", raising=False)
    state = {"cuda": False, "group": False}
    fake = types.SimpleNamespace(
        cuda=types.SimpleNamespace(is_initialized=lambda: state["cuda"]),
        distributed=types.SimpleNamespace(is_available=lambda: True, is_initialized=lambda: state["group"]))
    monkeypatch.setitem(sys.modules, "torch", fake)
    assert not app._cuda_context_started()  # no CUDA context: an ordinary exit
    state["cuda"] = True
    assert app._cuda_context_started()
    state["group"] = True
    assert not app._cuda_context_started()
    monkeypatch.delitem(sys.modules, "torch")
    assert not app._cuda_context_started()  # torch never imported (embed on ONNX Runtime)
