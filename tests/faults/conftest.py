"""The fault-injection tier's set-up: tiny models and tiny real data, and one uninterrupted reference run per
command, each built once for every test worker (``harness.shared``); tests/conftest.py still makes a skip a
failure."""
from __future__ import annotations

import json
import os
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: test_finetune_support, helpers
from harness import final_results, point_counts, shared  # noqa: E402
from test_finetune_support import conll_slice, data_path, head_lines, make_tiny_model_dir, squad_slice  # noqa: E402

# A shell starts a background job with SIGINT ignored, and an ignored signal stays ignored across exec: every command
# started from here would then sit through its SIGINT cells. Python's own handler here is reset to the default there.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

@pytest.fixture(scope="session")
def shared_root(tmp_path_factory) -> Path:
    """A folder every xdist worker of this session sees (their own base folders' parent)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def inputs(shared_root) -> Path:
    """A tiny BERT (bert-base-uncased's vocabulary) and a few rows of each task's real data; pretraining shards."""
    def build(root: Path) -> None:
        root.mkdir(parents=True)
        make_tiny_model_dir(root / "tiny")
        (root / "sst2").mkdir()
        head_lines(data_path("glue", "SST-2", "train.tsv"), root / "sst2" / "train.tsv", 33)  # header + 32 rows
        head_lines(data_path("glue", "SST-2", "dev.tsv"), root / "sst2" / "dev.tsv", 17)
        squad_slice(data_path("squad", "dev-v1.1.json"), root / "squad.json", articles=1, paragraphs=2)
        (root / "conll").mkdir()
        conll_slice(data_path("conll2003", "train.txt"), root / "conll" / "train.txt", 24)
        # valid and test from train's own sentences: a tag that training never sees is refused (ner.check_tags)
        conll_slice(data_path("conll2003", "train.txt"), root / "conll" / "valid.txt", 12)
        conll_slice(data_path("conll2003", "train.txt"), root / "conll" / "test.txt", 12)
        _pretraining_data(root / "shards")

    return shared(shared_root, "inputs", build)


def _pretraining_data(out: Path) -> None:
    from bertctl.data import DataConfig, build_data
    from bertctl.text.wordpiece import BertTokenizer
    from helpers import PRETRAIN_FILES, SHARED_DATA, small_vocab

    files = [SHARED_DATA / "corpus" / "inaugural" / f"{n}.txt" for n in PRETRAIN_FILES]
    tok = BertTokenizer(small_vocab([f.read_text(encoding="utf-8", errors="replace") for f in files]))
    build_data([str(f) for f in files], out, tok, DataConfig(format="text", max_seq_length=32, dupe_factor=1,
               holdout_fraction=0.25, seed=3, short_seq_prob=0.5), progress=False)


def command(name: str, root: Path) -> list[str]:
    """Each command of the matrix, small: two epochs (or 8 steps) with a checkpoint and an evaluation inside."""
    common = ["--no-progress", "--no-tensorboard", "--device", "cpu"]
    tune = ["--model", str(root / "tiny"), "--epochs", "2", "--eval-batch-size", "8", *common]
    if name == "pretrain":
        return ["pretrain", "--data", str(root / "shards"), "--model-size", "tiny", "--batch-size", "8", "--max-steps",
                "8", "--save-every", "4", "--eval-every", "4", "--eval-batches", "2", *common]
    if name == "finetune-glue":
        return ["finetune", "glue", "--task", "sst2", "--data-dir", str(root / "sst2"), "--batch-size", "8", *tune]
    if name == "finetune-squad":
        squad = str(root / "squad.json")
        return ["finetune", "squad", "--train", squad, "--dev", squad, "--max-seq-length", "128", "--doc-stride", "64",
                "--batch-size", "8", "--epoch-evals", *tune]
    if name == "finetune-ner":
        return ["finetune", "ner", "--data-dir", str(root / "conll"), "--batch-size", "8", *tune]
    if name == "finetune-swag":
        sample = str(data_path("swag", "sample.jsonl"))
        return ["finetune", "swag", "--train", sample, "--dev", sample, "--batch-size", "4", *tune]
    raise KeyError(name)


@dataclass
class Reference:
    argv: list[str]
    results: dict  # harness.final_results of the uninterrupted run
    counts: dict   # how often the uninterrupted run reached each fault point

    def fault(self, phase: str, kind: str) -> str:
        """``BERTCTL_FAULT`` for a phase: the first step's start, a step after the first checkpoint, the first
        checkpoint's write, the final evaluation's last batch, the final model's write."""
        point = {"before-first-step": "start", "mid-step": f"step@{self.counts['step'] // 2 + 2}",
                 "checkpoint": "checkpoint@1", "evaluation": f"eval@{self.counts['eval']}",
                 "final-save": "final-save@1"}[phase]
        return f"{point}:{kind}"


_references: dict[str, Reference] = {}


@pytest.fixture(scope="session")
def reference(inputs, shared_root):
    """``reference(name)``: the command's uninterrupted run, made once for all workers."""
    def get(name: str) -> Reference:
        if name not in _references:
            argv = command(name, inputs)

            def build(folder: Path) -> None:
                r, counts = point_counts([*argv, "--output", str(folder / "out")])
                assert r.rc == 0, r.stderr[-3000:]
                (folder / "counts.json").write_text(json.dumps(counts))

            folder = shared(shared_root, f"reference-{name}", build)
            counts = json.loads((folder / "counts.json").read_text())
            assert all(counts.get(p) for p in ("start", "step", "checkpoint", "eval", "final-save")), counts
            _references[name] = Reference(argv, final_results(folder / "out"), counts)
        return _references[name]

    return get
