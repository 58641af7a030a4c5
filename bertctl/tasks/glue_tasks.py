"""The GLUE tasks as the benchmark's download lays them out (``bertctl.tasks.glue``'s table): each task's
folder, label set, columns and dev files, and where a folder's files are. No torch: the suite plans and
checks its runs with these before anything heavy loads."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from bertctl.errors import BertctlError


@dataclass(frozen=True)
class GlueTask:
    name: str
    folder: str  # canonical folder name in the GLUE download
    labels: tuple[str, ...] | None  # None: regression
    text_a: str | int
    text_b: str | int | None
    label: str | int
    header: bool = True
    dev_files: tuple[str, ...] = ("dev.tsv",)


GLUE_TASKS: dict[str, GlueTask] = {t.name: t for t in (
    GlueTask("cola", "CoLA", ("0", "1"), 3, None, 1, header=False),
    GlueTask("sst2", "SST-2", ("0", "1"), "sentence", None, "label"),
    GlueTask("mrpc", "MRPC", ("0", "1"), "#1 String", "#2 String", "Quality"),
    GlueTask("stsb", "STS-B", None, "sentence1", "sentence2", "score"),
    GlueTask("qqp", "QQP", ("0", "1"), "question1", "question2", "is_duplicate"),
    GlueTask("mnli", "MNLI", ("contradiction", "entailment", "neutral"), "sentence1", "sentence2", "gold_label",
             dev_files=("dev_matched.tsv", "dev_mismatched.tsv")),
    GlueTask("qnli", "QNLI", ("entailment", "not_entailment"), "question", "sentence", "label"),
    GlueTask("rte", "RTE", ("entailment", "not_entailment"), "sentence1", "sentence2", "label"),
    GlueTask("wnli", "WNLI", ("0", "1"), "sentence1", "sentence2", "label"),
)}
TASK_ALIASES = {"sst-2": "sst2", "sts-b": "stsb", "mnli-m": "mnli", "mnli-mm": "mnli"}


def task_spec(name: str) -> GlueTask:
    key = TASK_ALIASES.get(name.lower(), name.lower())
    if key not in GLUE_TASKS:
        raise BertctlError(f"unknown GLUE task {name!r}; one of {', '.join(GLUE_TASKS)} (or use --train/--dev with "
                           "--text-column for your own data)")
    return GLUE_TASKS[key]


def find_task_files(data_dir: str | Path, task: GlueTask, need_train: bool = True) -> tuple[Path | None, list[Path]]:
    """train.tsv (None when not needed: evaluation) and the dev file(s) in ``data_dir`` or
    ``data_dir/<canonical folder>``."""
    data_dir = Path(data_dir)
    first = "train.tsv" if need_train else task.dev_files[0]
    for folder in (data_dir, data_dir / task.folder):
        if (folder / first).exists():
            devs = [folder / name for name in task.dev_files]
            missing = [str(d) for d in devs if not d.exists()]
            if missing:
                raise BertctlError(f"{', '.join(missing)}: dev file not found")
            return (folder / "train.tsv" if need_train else None), devs
    raise BertctlError(f"{data_dir}: no {first} here or in {data_dir / task.folder}")
