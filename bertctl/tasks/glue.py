"""GLUE (paper §4.1): readers for the canonical task folders and for users' own TSV/CSV/JSONL,
featurisation ([CLS] A [SEP] B [SEP]), fine-tuning and evaluation.

Canonical layouts (as distributed by the GLUE benchmark's download script):

| task | files | text A / text B | label | header |
| --- | --- | --- | --- | --- |
| cola | train/dev.tsv | column 3 | column 1 (0/1) | none |
| sst2 | train/dev.tsv | sentence | label (0/1) | yes |
| mrpc | train/dev.tsv | #1 String / #2 String | Quality (0/1) | yes |
| stsb | train/dev.tsv | sentence1 / sentence2 | score (0-5, regression) | yes |
| qqp | train/dev.tsv | question1 / question2 | is_duplicate (0/1) | yes |
| mnli | train.tsv, dev_matched.tsv, dev_mismatched.tsv | sentence1 / sentence2 | gold_label | yes |
| qnli | train/dev.tsv | question / sentence | label (entailment/not_entailment) | yes |
| rte | train/dev.tsv | sentence1 / sentence2 | label (entailment/not_entailment) | yes |
| wnli | train/dev.tsv | sentence1 / sentence2 | label (0/1) | yes |

GLUE's TSVs are read without quoting (tabs split fields; quotes are text), as the reference
loaders do.
"""
from __future__ import annotations

import csv
import functools
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from bertctl.errors import BertctlError
from bertctl.io import atomic_open, iter_jsonl
from bertctl.progress import stderr
from bertctl.tasks import common
from bertctl.tasks.base import Task
from bertctl.tasks.glue_tasks import GLUE_TASKS, TASK_ALIASES, GlueTask, find_task_files, task_spec  # noqa: F401
from bertctl.tasks.metrics import GLUE_METRICS, glue_metrics
from bertctl.tasks.trainer import FinetuneConfig, predict
from bertctl.workers import PARALLEL_CHARS, cpus_per_rank, map_in_order


@dataclass
class Example:
    guid: str  # "file:line"
    text_a: str
    text_b: str | None
    label: str | float | None


@dataclass
class ReadReport:
    path: str
    rows: int = 0
    skipped: list[str] = field(default_factory=list)  # "file:line: why"


def _label_value(raw: str, spec_labels: tuple[str, ...] | None, where: str) -> str | float:
    raw = raw.strip()
    if spec_labels is None:
        try:
            return float(raw)
        except ValueError:
            raise BertctlError(f"{where}: label {raw!r} is not a number (regression task)") from None
    if raw not in spec_labels:
        raise BertctlError(f"{where}: unknown label {raw!r}; expected one of {', '.join(spec_labels)}")
    return raw


def read_glue_tsv(path: str | Path, task: GlueTask, *, skip_bad_rows: bool = False,
                  require_labels: bool = True) -> tuple[list[Example], ReadReport]:
    """Rows of one canonical GLUE TSV. A malformed row is an error naming file and line, or with
    ``skip_bad_rows`` a counted skip (QQP's train set has a few such rows)."""
    path = Path(path)
    if not path.exists():
        raise BertctlError(f"{path}: file not found")
    report = ReadReport(str(path))
    examples: list[Example] = []
    with open(path, encoding="utf-8-sig", newline="") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    first = 0
    columns: dict[str, int] = {}
    n_cols = None
    if not task.header and not require_labels and lines and lines[0].rstrip("\r").split("\t") == ["index", "sentence"]:
        task = replace(task, text_a="sentence", header=True)  # CoLA's test.tsv: a header, no label, no source
    if task.header:
        if not lines:
            raise BertctlError(f"{path}: empty file (expected a header line)")
        header = lines[0].rstrip("\r").split("\t")
        columns = {name: i for i, name in enumerate(header)}
        n_cols = len(header)
        first = 1

    def col(key, where):
        if isinstance(key, int):
            return key
        if key not in columns:
            raise BertctlError(f"{where}: no column {key!r} in the header ({', '.join(columns)})")
        return columns[key]

    where0 = f"{path}:1"
    ia = col(task.text_a, where0)
    ib = col(task.text_b, where0) if task.text_b is not None else None
    if task.header and not require_labels and task.label not in columns:
        il = None  # an unlabelled file (GLUE test.tsv): predictions only
    else:
        il = col(task.label, where0)
    need = max(i for i in (ia, ib, il) if i is not None) + 1
    for lineno in range(first, len(lines)):
        line = lines[lineno].rstrip("\r")
        where = f"{path}:{lineno + 1}"
        if not line.strip():
            continue
        cells = line.split("\t")
        problem = None
        if (n_cols is not None and len(cells) != n_cols and task.name != "mnli") or len(cells) < need:
            problem = f"{len(cells)} columns, expected {n_cols or need}"
        label = None
        if problem is None and il is not None:
            try:
                label = _label_value(cells[il], task.labels, where)
            except BertctlError as e:
                problem = str(e).split(": ", 1)[1]
        if problem is not None:
            if not skip_bad_rows:
                raise BertctlError(f"{where}: {problem}")
            report.skipped.append(f"{where}: {problem}")
            continue
        examples.append(Example(where, cells[ia], cells[ib] if ib is not None else None, label))
    report.rows = len(examples)
    return examples, report


# ------------------------------------------------------------------------------ generic files


def read_table(path: str | Path, *, text_column: str, text_pair_column: str | None, label_column: str | None,
               skip_bad_rows: bool = False) -> tuple[list[Example], ReadReport]:
    """Users' own data: TSV, CSV (with quoting) or JSONL, with named text and label columns.
    Labels are kept as strings (or raw numbers from JSON); the caller decides the label set."""
    path = Path(path)
    if not path.exists():
        raise BertctlError(f"{path}: file not found")
    report = ReadReport(str(path))
    examples: list[Example] = []
    suffix = path.suffix.lower()
    wanted = [c for c in (text_column, text_pair_column, label_column) if c]

    def add(row: dict, where: str):
        missing = [c for c in wanted if c not in row or row[c] is None]
        if missing:
            msg = f"{where}: missing column(s) {', '.join(missing)}"
            if not skip_bad_rows:
                raise BertctlError(msg)
            report.skipped.append(msg)
            return
        label = row[label_column] if label_column else None
        if isinstance(label, str):
            label = label.strip()
        examples.append(Example(where, str(row[text_column]),
                                str(row[text_pair_column]) if text_pair_column else None, label))

    if suffix in (".jsonl", ".json", ".ndjson"):
        for lineno, row in iter_jsonl(path):
            add(row, f"{path}:{lineno}")
    elif suffix in (".tsv", ".csv", ".txt"):
        delimiter = "," if suffix == ".csv" else "\t"
        with open(path, encoding="utf-8-sig", newline="") as f:
            reader = csv.reader(f, delimiter=delimiter)
            header = next(reader, None)
            if header is None:
                raise BertctlError(f"{path}: empty file (expected a header line)")
            for c in wanted:
                if c not in header:
                    raise BertctlError(f"{path}:1: no column {c!r} in the header ({', '.join(header)})")
            for cells in reader:
                where = f"{path}:{reader.line_num}"
                if not any(cells):
                    continue
                if len(cells) != len(header):
                    msg = f"{where}: {len(cells)} columns, expected {len(header)}"
                    if not skip_bad_rows:
                        raise BertctlError(msg)
                    report.skipped.append(msg)
                    continue
                add(dict(zip(header, cells)), where)
    else:
        raise BertctlError(f"{path}: unknown format {suffix!r} (use .tsv, .csv or .jsonl)")
    report.rows = len(examples)
    return examples, report


def labels_are_scores(examples: Sequence[Example]) -> bool:
    """Whether the labels read as a column of floats, as Hugging Face's run_glue takes a regression: every
    label a finite number, one at least written with a decimal point or an exponent (3.4, 1.0, 2e-1)."""
    raw = [str(e.label).strip() for e in examples if e.label is not None]
    try:
        if not raw or not all(math.isfinite(float(r)) for r in raw):
            return False
    except ValueError:
        return False
    return any("." in r or "e" in r.lower() for r in raw)


def custom_task(train: Sequence[Example], regression: bool, labels: Sequence[str] | None = None) -> GlueTask:
    """A task spec for users' data: labels sorted as strings (numbers numerically) unless given."""
    if regression:
        return GlueTask("custom", "", None, "", None, "", dev_files=())
    if labels is None:
        found = {str(e.label) for e in train}
        try:
            labels = sorted(found, key=float)
        except ValueError:
            labels = sorted(found)
    return GlueTask("custom", "", tuple(labels), "", None, "", dev_files=())


def normalise_labels(examples: Sequence[Example], task: GlueTask, path: str) -> None:
    """Check/convert the labels of generic examples against the task's label set."""
    for e in examples:
        if e.label is None:
            continue
        if task.labels is None:
            try:
                e.label = float(e.label)
            except (TypeError, ValueError):
                raise BertctlError(f"{e.guid}: label {e.label!r} is not a number (regression)") from None
        else:
            e.label = str(e.label)
            if e.label not in task.labels:
                raise BertctlError(f"{e.guid}: unknown label {e.label!r}; the labels are {', '.join(task.labels)}")


# ------------------------------------------------------------------------------ features


def _feature_chunk(tokenizer, max_seq_length: int, pairs: Sequence[tuple[str, str | None]]):
    """One chunk's token ids and segment ids end to end, with each example's length: three arrays travel back
    from a worker far faster than a pair of small arrays an example."""
    ids, types, lengths = [], [], []
    for a, b in pairs:
        enc = tokenizer.encode(a, b, max_length=max_seq_length, truncation="longest_first")
        ids += enc.input_ids
        types += enc.token_type_ids
        lengths.append(len(enc.input_ids))
    return np.asarray(ids, dtype=np.int32), np.asarray(types, dtype=np.int8), np.asarray(lengths, dtype=np.int64)


def featurize(examples: Sequence[Example], tokenizer, task: GlueTask, max_seq_length: int = 128,
              progress: bool = False, label_names: Sequence[str] | None = None,
              workers: int | None = None) -> list[dict]:
    """[CLS] A [SEP] (B [SEP]), truncated longest-first to ``max_seq_length`` (paper §3, Figure 2); in
    ``workers`` processes (default: the usable CPUs, shared among the ranks on this host) once there is enough
    text to pay for starting them."""
    label_index = {l: i for i, l in enumerate(label_names or task.labels or ())}
    pairs = [(e.text_a, e.text_b) for e in examples]
    workers = cpus_per_rank() if workers is None else workers
    if sum(len(a) + len(b or "") for a, b in pairs) < PARALLEL_CHARS:
        workers = 1
    size = max(1, -(-len(pairs) // (16 * workers)))
    chunks = [pairs[i:i + size] for i in range(0, len(pairs), size)]
    features = []
    for ids, types, lengths in map_in_order(functools.partial(_feature_chunk, tokenizer, max_seq_length), chunks,
                                            workers=workers, label="tokenize", progress=progress):
        cut = np.cumsum(lengths)[:-1]
        features += [{"input_ids": i, "token_type_ids": t} for i, t in zip(np.split(ids, cut), np.split(types, cut))]
    for f, e in zip(features, examples):
        if e.label is not None:
            f["labels"] = float(e.label) if task.labels is None else label_index[e.label]
    return features


def _predictions(model, features, cfg: FinetuneConfig, regression: bool, progress: bool, shards=None) -> np.ndarray:
    out = predict(model, features, outputs=("logits",), batch_size=cfg.eval_batch_size,
                  batch_tokens=cfg.eval_batch_tokens, precision=cfg.train.precision, progress=progress,
                  description="evaluate", shards=shards)
    logits = np.stack([o[0] for o in out])
    return logits[:, 0] if regression else logits.argmax(-1)


def score(task: GlueTask, preds: np.ndarray, examples: Sequence[Example], label_names: Sequence[str]) -> dict:
    if task.labels is None:
        gold = [float(e.label) for e in examples]
        return glue_metrics("stsb", preds.tolist(), gold)
    index = {l: i for i, l in enumerate(label_names)}
    gold = [index[e.label] for e in examples]
    return glue_metrics(task.name, preds.tolist(), gold)


def write_predictions(path: Path, examples: Sequence[Example], preds: np.ndarray, label_names: Sequence[str] | None):
    """TSV: index, prediction (label name, or score for regression), gold label and source row."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        f.write("index\tprediction\tlabel\tsource\n")
        for i, (e, p) in enumerate(zip(examples, preds)):
            pred = f"{float(p):.6f}" if label_names is None else label_names[int(p)]
            gold = "" if e.label is None else (f"{e.label}" if label_names is not None else f"{float(e.label):g}")
            f.write(f"{i}\t{pred}\t{gold}\t{e.guid}\n")


def _dev_names(task: GlueTask, devs: Sequence[Path]) -> list[str]:
    if task.name == "mnli":
        return ["mnli_m" if "mismatched" not in d.name else "mnli_mm" for d in devs]
    return [task.name]


@dataclass
class GlueData:
    task: GlueTask
    train: list[Example]
    devs: list[tuple[str, Path, list[Example]]]  # (name, path, examples)
    reports: list[ReadReport]


def load_data(*, task: str | None, data_dir: str | Path | None, train: str | Path | None = None,
              dev: str | Path | None = None, text_column: str | None = None, text_pair_column: str | None = None,
              label_column: str | None = None, regression: bool | None = False, skip_bad_rows: bool = False,
              need_train: bool = True) -> GlueData:
    """Either a canonical task folder (``task`` + ``data_dir``) or the user's files with named columns.

    Own data: ``regression`` None decides from the labels (``labels_are_scores``) and says so when they
    are scores."""
    if text_column is not None or (task in (None, "custom")):
        if text_column is None or label_column is None:
            raise BertctlError("own data needs --text-column and --label-column (and --train/--dev)")
        if dev is None or (need_train and train is None):
            raise BertctlError("own data needs --train and --dev files")
        kw = dict(text_column=text_column, text_pair_column=text_pair_column, label_column=label_column,
                  skip_bad_rows=skip_bad_rows)
        tr, rtr = read_table(train, **kw) if need_train else ([], None)
        dv, rdv = read_table(dev, **kw)
        if regression is None:
            regression = labels_are_scores(tr or dv)
            if regression:
                stderr.print(f"{train if tr else dev}: the labels are decimal numbers, so this is a regression (one "
                             "output, MSE loss, Pearson and Spearman); --no-regression makes them classes")
        spec = custom_task(tr or dv, regression)
        if need_train:
            normalise_labels(tr, spec, str(train))
            normalise_labels(dv, spec, str(dev))
        reports = [r for r in (rtr, rdv) if r is not None]
        _nonempty(Path(dev), dv)
        if need_train:
            _nonempty(Path(train), tr)
        return GlueData(spec, tr, [("dev", Path(dev), dv)], reports)
    spec = task_spec(task)
    if data_dir is None:
        raise BertctlError(f"glue --task {spec.name} needs --data-dir")
    train_path, dev_paths = find_task_files(data_dir, spec, need_train)
    if dev is not None:
        dev_paths = [Path(dev)]
    tr, rtr = read_glue_tsv(train_path, spec, skip_bad_rows=skip_bad_rows) if need_train else ([], None)
    devs, reports = [], [r for r in (rtr,) if r is not None]
    for name, path in zip(_dev_names(spec, dev_paths), dev_paths):
        ex, rep = read_glue_tsv(path, spec, skip_bad_rows=skip_bad_rows)
        _nonempty(Path(path), ex)
        devs.append((name, path, ex))
        reports.append(rep)
    return GlueData(spec, tr, devs, reports)


def _nonempty(path: Path, examples: Sequence[Example]) -> None:
    """A set with no rows (a header only, or every row skipped) would fail after training: refused before it."""
    if not examples:
        raise BertctlError(f"{path}: no examples (only a header line, or every row skipped)")


def _report_skips(reports: Sequence[ReadReport]) -> dict:
    skipped = {r.path: len(r.skipped) for r in reports if r.skipped}
    for r in reports:
        for msg in r.skipped[:5]:
            stderr.print(f"skipped {msg}")
        if len(r.skipped) > 5:
            stderr.print(f"... {len(r.skipped) - 5} more skipped rows in {r.path}")
    return skipped


def evaluate_devs(model, data: GlueData, cfg: FinetuneConfig, label_names, features: dict[str, list[dict]],
                  progress: bool, shards=None) -> tuple[dict, dict]:
    """Metrics per dev file (MNLI: matched and mismatched) and the predictions for writing;
    ``features``: the dev files' features by name, made once for a run's every evaluation; ``shards``:
    the processes that share the predictions (``predict``)."""
    metrics, preds = {}, {}
    regression = data.task.labels is None
    for name, _, examples in data.devs:
        p = _predictions(model, features[name], cfg, regression, progress, shards)
        preds[name] = p
        if any(e.label is None for e in examples):  # unlabelled (test) file: predictions only
            continue
        m = score(data.task, p, examples, label_names or ())
        if len(data.devs) == 1:
            metrics.update(m)
        else:
            metrics.update({f"{name}_{k}": v for k, v in m.items()})
    return metrics, preds


def main_metric_name(data: GlueData) -> str:
    first = GLUE_METRICS.get(data.task.name, ("pearson",) if data.task.labels is None else ("accuracy",))[0]
    if data.task.labels is None:
        first = "pearson"
    return f"{data.devs[0][0]}_{first}" if len(data.devs) > 1 else first


class Glue(Task):
    """A GLUE task or the user's own classification/regression data as a ``Task``: ``training`` with
    ``data.train`` and the dev file(s), else evaluating the dev/test file(s) of ``data``."""

    @property
    def model_class(self):
        from bertctl.model import BertForSequenceClassification

        return BertForSequenceClassification

    def __init__(self, data: GlueData, max_seq_length: int = 128, *, training: bool = True):
        self.data, self.max_seq_length, self.training = data, max_seq_length, training
        self.name = data.task.name
        self.skipped = _report_skips(data.reports)
        self.regression = data.task.labels is None
        self.label_names = list(data.task.labels) if not self.regression else None
        self.main_metric = main_metric_name(data) if training else ""
        self.train_features: list[dict] = []
        self.dev_features: dict[str, list[dict]] = {}

    def head(self) -> dict:
        if self.regression:
            return dict(id2label={0: "score"}, label2id={"score": 0}, problem_type="regression")
        return dict(id2label=dict(enumerate(self.label_names)), label2id={l: i for i, l in enumerate(self.label_names)},
                    problem_type="single_label_classification")

    def head_check(self) -> dict:
        task = self.data.task
        return dict(labels=task.labels if not self.regression and task.name != "custom" else None,
                    regression=self.regression, task=task.name)

    def adopt(self, model, model_dir) -> None:
        data = self.data
        if not self.regression:
            label_names = common.head_labels(model)
            generic = [str(i) for i in range(len(label_names))], [f"LABEL_{i}" for i in range(len(label_names))]
            if data.task.name == "custom":  # own data: the labels are the model's
                data.task = GlueTask("custom", "", tuple(label_names), "", None, "", dev_files=())
            elif label_names in generic:  # unnamed labels: the task's, in the task's order
                label_names = list(data.task.labels)
            elif set(label_names) != set(data.task.labels):
                raise BertctlError(f"{model_dir}: the head's labels ({', '.join(label_names)}) are not "
                                   f"{data.task.name}'s ({', '.join(data.task.labels)})")
            self.label_names = label_names
        for _, path, ex in data.devs:
            normalise_labels(ex, data.task, str(path))

    def featurize(self, tokenizer, progress: bool) -> None:
        data = self.data
        if self.training:
            self.train_features = featurize(data.train, tokenizer, data.task, self.max_seq_length, progress=progress)
        self.dev_features = {name: featurize(examples, tokenizer, data.task, self.max_seq_length,
                                             label_names=self.label_names) for name, _, examples in data.devs}

    def predict(self, model, cfg: FinetuneConfig, *, progress=False, shards=None, final=False):
        return evaluate_devs(model, self.data, cfg, self.label_names, self.dev_features, progress, shards)

    def score(self, outputs, *, final=False) -> dict:
        return outputs[0]

    def write_predictions(self, output: Path, outputs) -> None:
        for name, _, examples in self.data.devs:
            write_predictions(output / f"predictions_{name}.tsv", examples, outputs[1][name], self.label_names)

    def facts(self) -> dict:
        if self.training:
            return {"train_examples": len(self.train_features)}
        return {"examples": sum(len(e) for _, _, e in self.data.devs)}

    def notes(self) -> dict:
        return {"skipped_rows": self.skipped} if self.skipped else {}


def regression_head(model_dir: str | Path) -> bool:
    """Whether a fine-tuned classifier's head is a regression's (one output)."""
    from bertctl.checkpoints.hf import load_config

    return load_config(common.model_dir_of(model_dir)).num_labels == 1
