"""The README's worked examples, run as pasted in a fresh folder, so that none of them rots.

The folder first gets what a fresh clone has after the quickstart: `bertctl pretrain`'s
`./bertctl-default-run`. Then every ```bash block under "## Worked examples" runs, in order, in one
bash script (so `MINILM=...` carries over) with `set -euo pipefail`. The one change is the one the
README itself states: `--minutes 0.25` in place of each pretraining time box.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SECTION = "## Worked examples"
SHORT_BOX = "--minutes 0.25"


def bash_blocks(text: str, section: str = SECTION) -> list[str]:
    """The ```bash blocks between `section` and the next level-2 heading, in order."""
    start = text.index(section + "\n")
    end = text.find("\n## ", start + len(section))
    body = text[start: end if end >= 0 else len(text)]
    return re.findall(r"^```bash\n(.*?)^```$", body, flags=re.S | re.M)


def shortened(block: str) -> str:
    """The README's stated change for a test run: a short pretraining time box."""
    return re.sub(r"--minutes \S+", SHORT_BOX, block)


def test_readme_says_what_the_test_changes():
    text = README.read_text(encoding="utf-8")
    assert f"`{SHORT_BOX}` in place of the pretraining time boxes" in text
    assert "tests/parity/test_readme_examples.py" in text


def test_the_blocks_are_found():
    blocks = bash_blocks(README.read_text(encoding="utf-8"))
    commands = " ".join(blocks)
    # One worked example per command (the list); a block lost to a formatting slip fails here.
    for command in ("env", "tokenize", "build-data", "pretrain", "finetune glue", "finetune squad",
                    "finetune ner", "finetune swag", "eval", "embed", "export onnx", "bench"):
        assert f"bertctl {command}" in commands, command
    assert "GLUE/SST-2" not in commands  # a placeholder path fails as pasted


@pytest.mark.long
def test_every_worked_example_runs_as_pasted(tmp_path):
    blocks = bash_blocks(README.read_text(encoding="utf-8"))
    bin_dir = Path(sys.executable).parent  # the bertctl and python of this environment
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "XDG_CACHE_HOME": str(tmp_path / "cache"), "PIP_NO_INPUT": "1"}
    lines = ["set -euo pipefail", f"bertctl pretrain {SHORT_BOX} --no-progress > pretrain.json"]
    for i, block in enumerate(blocks):
        lines += [f"echo '=== README block {i + 1} at' $SECONDS s >&2", shortened(block)]
    lines.append("echo '=== done at' $SECONDS s >&2")
    script = tmp_path / "examples.sh"
    script.write_text("\n".join(lines) + "\n")
    work = tmp_path / "fresh"
    work.mkdir()
    run = subprocess.run(["bash", str(script)], cwd=work, env=env, capture_output=True, text=True)
    failed_at = re.findall(r"=== README block (\d+) at", run.stderr)
    assert run.returncode == 0, (
        f"README block {failed_at[-1] if failed_at else '?'} failed (exit {run.returncode}):\n"
        + (blocks[int(failed_at[-1]) - 1] if failed_at else "") + "\n--- stderr (tail):\n" + run.stderr[-4000:])
    # What the README says each example gives.
    assert (work / "bertctl-default-run" / "model" / "config.json").is_file()
    assert (work / "vocab.txt").is_file() and (work / "data" / "manifest.json").is_file()
    assert (work / "run" / "model" / "model.safetensors").is_file()
    for out in ("sst2", "mine", "squad-out", "ner", "swag", "sst2-eval"):
        assert (work / out / "metrics.json").is_file(), out
    assert (work / "squad-out" / "predictions.json").is_file()
    assert (work / "vectors.npy").is_file() and (work / "minilm.onnx").is_file()
    import numpy as np

    vectors = np.load(work / "vectors.npy")
    assert vectors.shape == (3, 384)
    # The two guitar sentences are closer to each other than either is to the stock market.
    sims = vectors @ vectors.T
    assert sims[0, 1] > sims[0, 2] and sims[0, 1] > sims[1, 2]
