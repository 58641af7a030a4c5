"""SWAG (paper §4.4): multiple choice as four sequence pairs scored through [CLS].

Each example gives ``sent1`` (context), ``sent2`` (the start of the next sentence) and four
endings. Choice i is ``[CLS] sent1 [SEP] sent2 + " " + ending_i [SEP]``; the model's one score
per choice goes through a softmax across the four. Files: JSONL with ``sent1``, ``sent2``,
``ending0..3`` and ``label`` keys, or the SWAG release CSV (same column names, plus
``video-id``, ``fold-ind``, ``startphrase``, ``gold-source``; the test CSV has no label).
"""
from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from bertctl.errors import BertctlError
from bertctl.io import atomic_open, iter_jsonl
from bertctl.progress import track
from bertctl.tasks.base import Task
from bertctl.tasks.metrics import accuracy
from bertctl.tasks.trainer import FinetuneConfig, predict

NUM_CHOICES = 4
COLUMNS = ("sent1", "sent2", "ending0", "ending1", "ending2", "ending3")


@dataclass
class SwagExample:
    where: str
    context: str
    start: str
    endings: list[str]
    label: int | None


def _example(row: dict, where: str, need_label: bool) -> SwagExample:
    missing = [c for c in COLUMNS if row.get(c) is None]
    if missing:
        raise BertctlError(f"{where}: missing {', '.join(missing)}")
    label = row.get("label")
    if label in (None, "") and need_label:
        raise BertctlError(f"{where}: missing label")
    if label not in (None, ""):
        try:
            label = int(label)
        except (TypeError, ValueError):
            raise BertctlError(f"{where}: label {label!r} is not an integer 0-3") from None
        if not 0 <= label < NUM_CHOICES:
            raise BertctlError(f"{where}: label {label} is not in 0-3")
    else:
        label = None
    return SwagExample(where, str(row["sent1"]), str(row["sent2"]), [str(row[f"ending{i}"]) for i in range(4)], label)


def read_swag(path: str | Path, need_label: bool = True) -> list[SwagExample]:
    path = Path(path)
    if not path.exists():
        raise BertctlError(f"{path}: file not found")
    out = []
    if path.suffix.lower() == ".csv":
        with open(path, encoding="utf-8", newline="") as f:
            reader = csv.DictReader(f)
            if reader.fieldnames is None:
                raise BertctlError(f"{path}: empty file")
            missing = [c for c in COLUMNS if c not in reader.fieldnames]
            if missing:
                raise BertctlError(f"{path}:1: no column(s) {', '.join(missing)} in the header")
            for row in reader:
                where = f"{path}:{reader.line_num}"
                if None in row:  # more cells than header columns
                    raise BertctlError(f"{where}: {len(reader.fieldnames) + len(row[None])} columns, expected "
                                       f"{len(reader.fieldnames)}")
                out.append(_example(row, where, need_label))
    else:
        for lineno, row in iter_jsonl(path):
            out.append(_example(row, f"{path}:{lineno}", need_label))
    if not out:
        raise BertctlError(f"{path}: no examples")
    return out


def featurize(examples: Sequence[SwagExample], tokenizer, max_seq_length: int = 128,
              progress: bool = False) -> list[dict]:
    """(C, S) input ids per example, padded within the example; ``lengths`` per choice."""
    feats = []
    with track("tokenize", len(examples), disable=not progress) as advance:
        for e in examples:
            encs = [tokenizer.encode(e.context, f"{e.start} {ending}", max_length=max_seq_length,
                                     truncation="longest_first") for ending in e.endings]
            n = max(len(x.input_ids) for x in encs)
            ids = np.full((NUM_CHOICES, n), tokenizer.pad_token_id, dtype=np.int32)
            types = np.zeros((NUM_CHOICES, n), dtype=np.int8)
            for c, x in enumerate(encs):
                ids[c, : len(x.input_ids)] = x.input_ids
                types[c, : len(x.input_ids)] = x.token_type_ids
            f = {"input_ids": ids, "token_type_ids": types, "lengths": [len(x.input_ids) for x in encs]}
            if e.label is not None:
                f["labels"] = e.label
            feats.append(f)
            advance(1)
    return feats


def _choices(model, feats, tcfg: FinetuneConfig, progress: bool, shards=None) -> np.ndarray:
    out = predict(model, feats, outputs=("logits",), batch_size=max(1, tcfg.eval_batch_size // NUM_CHOICES),
                  batch_tokens=tcfg.eval_batch_tokens, precision=tcfg.train.precision, progress=progress,
                  description="evaluate", shards=shards)
    return np.stack([o[0] for o in out])  # (N, 4)


def write_predictions(path: Path, examples: Sequence[SwagExample], logits: np.ndarray) -> None:
    """TSV: index, predicted choice, gold label, the four softmax probabilities, source row."""
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write("index\tprediction\tlabel\tp0\tp1\tp2\tp3\tsource\n")
        for i, (e, p) in enumerate(zip(examples, probs)):
            gold = "" if e.label is None else str(e.label)
            f.write(f"{i}\t{int(p.argmax())}\t{gold}\t" + "\t".join(f"{x:.4f}" for x in p) + f"\t{e.where}\n")


class Swag(Task):
    """SWAG as a ``Task``: fine-tuning on ``train`` with ``dev`` scored, or (``train`` None) evaluating on
    ``dev``, whose labels may be absent (the test CSV)."""

    main_metric = "accuracy"

    def __init__(self, train: str | Path | None, dev: str | Path, max_seq_length: int = 128):
        self.name, self.max_seq_length = "swag", max_seq_length
        self.train = read_swag(train) if train is not None else None
        self.dev = read_swag(dev, need_label=train is not None)
        self.train_features: list[dict] = []

    @property
    def model_class(self):
        from bertctl.model import BertForMultipleChoice

        return BertForMultipleChoice

    def featurize(self, tokenizer, progress: bool) -> None:
        if self.train is not None:
            self.train_features = featurize(self.train, tokenizer, self.max_seq_length, progress=progress)
        self.dev_features = featurize(self.dev, tokenizer, self.max_seq_length)

    def predict(self, model, cfg: FinetuneConfig, *, progress=False, shards=None, final=False):
        return _choices(model, self.dev_features, cfg, progress, shards)

    def score(self, logits, *, final=False) -> dict:
        labelled = [i for i, e in enumerate(self.dev) if e.label is not None]
        if not labelled:
            return {}
        return {"accuracy": accuracy(logits[labelled].argmax(-1), [self.dev[i].label for i in labelled])}

    def write_predictions(self, output: Path, logits) -> None:
        write_predictions(output / ("predictions_dev.tsv" if self.train is not None else "predictions.tsv"), self.dev,
                          logits)

    def facts(self) -> dict:
        if self.train is None:
            return {"examples": len(self.dev)}
        return {"train_examples": len(self.train), "dev_examples": len(self.dev)}
