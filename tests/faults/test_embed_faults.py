"""embed under faults: a SIGINT, SIGTERM, SIGKILL or full disk (ENOSPC) at each of its phases.

The phases are ``bertctl.faults``' points: ``start`` (flags, inputs and output checked, no work done),
``batch`` (between two forward passes) and ``write`` (the vectors written under their temporary name,
not yet renamed onto the output). Each cell runs ``bertctl embed --overwrite`` in a subprocess with
``BERTCTL_FAULT`` set, over a previous complete output, and asserts what the one output rule promises:

- the previous output is intact, byte for byte, and no temporary file is left beside it (a SIGKILL
  gets no chance to remove one, but nothing partial is ever under the output's name);
- the message says so in one line (a SIGKILL's process says nothing);
- the same command run again gives the uninterrupted run's output, byte for byte, and removes the
  temporary file a SIGKILLed run left.

The model is a tiny random BERT under ONNX Runtime (its export made once, in this process), so that
each run starts in a fraction of a second without torch.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

KINDS = ("SIGINT", "SIGTERM", "SIGKILL", "ENOSPC")
POINTS = ("start", "batch", "write")
# Ctrl-C and TERM end as an interrupt (130, as build-data's), a KILL is the signal's, a full disk is
# bertctl's one-line error (2).
EXIT = {"SIGINT": 130, "SIGTERM": 130, "SIGKILL": -signal.SIGKILL, "ENOSPC": 2}
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "##s", "."]


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> dict:
    """A tiny model with its ONNX export cached, the texts, the previous output (of other texts) and the
    uninterrupted run's output."""
    import torch

    from bertctl.checkpoints.hf import save_pretrained
    from bertctl.config import BertConfig
    from bertctl.inference.backends.onnx import cached_encoder
    from bertctl.model import BertModel
    from bertctl.text.wordpiece import BertTokenizer

    root = tmp_path_factory.mktemp("embed-faults")
    torch.manual_seed(0)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    config = BertConfig(vocab_size=len(tokens), hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=32)
    save_pretrained(BertModel(config), root / "model", tokenizer=BertTokenizer(tokens))
    cached_encoder(root / "model")  # the export (made with torch) once; the runs then load no torch
    (root / "texts.txt").write_text("the cat sat on the mat .\na dog ran\ndogs ran on a mat\n", encoding="utf-8")
    (root / "old.txt").write_text("a cat\nthe dogs sat\n", encoding="utf-8")
    run(root, root / "old.txt", root / "previous.npy")
    run(root, root / "texts.txt", root / "reference.npy")
    return {"root": root, "previous": (root / "previous.npy").read_bytes(),
            "reference": (root / "reference.npy").read_bytes()}


def run(root: Path, texts: Path, out: Path, *flags: str, fault: str | None = None,
        check: bool = True) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "BERTCTL_FAULT"}
    if fault:
        env["BERTCTL_FAULT"] = fault
    p = subprocess.run([sys.executable, "-m", "bertctl", "embed", "--model", str(root / "model"), "--backend",
                        "onnxruntime", "--batch-size", "1", "--no-progress", "-o", str(out), *flags, str(texts)],
                       env=env, capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, p.stderr
    return p


@pytest.mark.parametrize("point", POINTS)
@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_keeps_the_previous_output_and_a_rerun_completes(setup, tmp_path, kind, point):
    root, out = setup["root"], tmp_path / "vectors.npy"
    out.write_bytes(setup["previous"])
    nth = "@2" if point == "batch" else ""  # between the first and second of three batches
    p = run(root, root / "texts.txt", out, "--overwrite", fault=f"{point}{nth}:{kind}", check=False)
    assert p.returncode == EXIT[kind], (p.returncode, p.stderr)
    assert out.read_bytes() == setup["previous"], "the previous output changed"
    left = sorted(f.name for f in tmp_path.iterdir())
    if kind == "SIGKILL":
        assert p.stderr.strip() == "" or "Traceback" not in p.stderr
        assert all(name == "vectors.npy" or name.endswith(".tmp") for name in left), left
    else:
        assert left == ["vectors.npy"], left  # no temporary file left behind
        lines = [line for line in p.stderr.splitlines() if line.startswith("bertctl: ")]
        assert len(lines) == 1 and f"{out} is as it was (the previous embeddings)" in lines[0], p.stderr
        assert "Traceback" not in p.stderr
        if kind == "ENOSPC":
            assert lines[0].startswith(f"bertctl: error: {out}: no space left on the device"), lines
    again = run(root, root / "texts.txt", out, "--overwrite")
    assert out.read_bytes() == setup["reference"], again.stderr
    assert sorted(f.name for f in tmp_path.iterdir()) == ["vectors.npy"]  # a KILLed run's debris removed too


@pytest.mark.parametrize("kind", ["SIGINT", "SIGTERM", "ENOSPC"])
def test_a_fault_with_no_previous_output_leaves_nothing(setup, tmp_path, kind):
    root, out = setup["root"], tmp_path / "vectors.npy"
    p = run(root, root / "texts.txt", out, fault=f"write:{kind}", check=False)
    assert p.returncode == EXIT[kind] and list(tmp_path.iterdir()) == [], (p.stderr, list(tmp_path.iterdir()))
    assert f"nothing was written to {out}" in p.stderr


def test_an_existing_output_needs_overwrite(setup, tmp_path):
    root, out = setup["root"], tmp_path / "vectors.npy"
    out.write_bytes(setup["previous"])
    p = run(root, root / "texts.txt", out, check=False)
    assert p.returncode == 2 and f"bertctl: error: {out}: already exists; pass --overwrite" in p.stderr, p.stderr
    assert out.read_bytes() == setup["previous"]
