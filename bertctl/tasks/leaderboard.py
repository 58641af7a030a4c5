"""GLUE test-set predictions in the GLUE server's submission format.

The chosen model of each task predicts the task folder's test file(s) with ``bertctl eval glue`` (the
prediction path every evaluation takes, writing ``predictions_<task>.tsv``); the MNLI model also predicts
the diagnostic set (AX). Each file becomes ``<Name>.tsv`` with the header ``index<TAB>prediction``, the
index being the test file's own, and the labels as the server reads them:

| file | prediction |
| --- | --- |
| CoLA, SST-2, MRPC, QQP, WNLI | 0 or 1 |
| MNLI-m, MNLI-mm, AX | entailment, neutral or contradiction |
| QNLI, RTE | entailment or not_entailment |
| STS-B | a similarity score, clipped to [0, 5] |

The files go into ``submission.zip`` at its root, as the server takes it.
"""
from __future__ import annotations

import json
import shutil
import sys
import zipfile
from pathlib import Path
from typing import Sequence

from bertctl.errors import BertctlError
from bertctl.io import atomic_open, write_json
from bertctl.progress import stderr
from bertctl.tasks.glue_tasks import GlueTask, find_task_files

# The submission's files, in the server's order: (file name, task, test file in the task's folder).
SUBMISSION = (("CoLA", "cola", "test.tsv"), ("SST-2", "sst2", "test.tsv"), ("MRPC", "mrpc", "test.tsv"),
              ("STS-B", "stsb", "test.tsv"), ("QQP", "qqp", "test.tsv"), ("MNLI-m", "mnli", "test_matched.tsv"),
              ("MNLI-mm", "mnli", "test_mismatched.tsv"), ("QNLI", "qnli", "test.tsv"), ("RTE", "rte", "test.tsv"),
              ("WNLI", "wnli", "test.tsv"), ("AX", "mnli", "diagnostic.tsv"))
BINARY = ("0", "1")
NLI = ("entailment", "neutral", "contradiction")
PAIR = ("entailment", "not_entailment")
LABELS: dict[str, tuple[str, ...] | None] = {"CoLA": BINARY, "SST-2": BINARY, "MRPC": BINARY, "STS-B": None,
                                              "QQP": BINARY, "MNLI-m": NLI, "MNLI-mm": NLI, "QNLI": PAIR,
                                              "RTE": PAIR, "WNLI": BINARY, "AX": NLI}
STSB_RANGE = (0.0, 5.0)


def test_files(spec: GlueTask, data_dir: Path) -> list[tuple[str, Path]]:
    """The task's test files present: (submission name, path). The diagnostic set sits in MNLI's folder or,
    as GLUE's download script puts it, in ``diagnostic/`` beside the task folders."""
    train, _ = find_task_files(data_dir, spec)
    folder = train.parent
    found = []
    for name, task, file in SUBMISSION:
        if task != spec.name:
            continue
        places = [folder / file] + ([folder.parent / "diagnostic" / file] if name == "AX" else [])
        path = next((p for p in places if p.is_file()), None)
        if path is not None:
            found.append((name, path))
    return found


def _stamp(test: Path, run: str) -> dict:
    st = test.stat()
    return {"run": run, "test_file": str(test), "size": st.st_size, "mtime": st.st_mtime}


def prediction_jobs(spec: GlueTask, data_dir: Path, task_folder: Path, model_dir: Path, run: str, device: str,
                    max_seq_length: int) -> list:
    """One ``bertctl eval glue`` process per test file not yet predicted by the chosen ``run`` (a new choice,
    or a changed test file, predicts again) into ``OUT/<Task>/test/<Name>/``."""
    from bertctl.tasks.suite import Job

    jobs = []
    for name, path in test_files(spec, data_dir):
        out = task_folder / "test" / name
        stamp = _stamp(path, run)
        if (out / "metrics.json").is_file() and _read_json(out / "chosen.json") == stamp:
            continue
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir(parents=True)
        write_json(out / "chosen.json", stamp)
        argv = [sys.executable, "-m", "bertctl", "eval", "glue", "--task", spec.name, "--data", str(path),
                "--model", str(model_dir), "--output", str(out), "--device", device, "--no-progress",
                "--max-seq-length", str(max_seq_length)]
        jobs.append(Job(f"{spec.folder} {name} test predictions", argv, task_folder / "logs" / f"test-{name}.log"))
    return jobs


def _read_json(path: Path):
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _test_indices(test: Path) -> list[str]:
    """The index of each row of a GLUE test file (its ``index`` or, in QQP's, ``id`` column), read as GLUE's
    TSVs are: no quoting, empty lines skipped."""
    lines = test.read_text(encoding="utf-8-sig").split("\n")
    header = lines[0].rstrip("\r").split("\t")
    column = next((header.index(c) for c in ("index", "id") if c in header), None)
    rows = [l.rstrip("\r").split("\t") for l in lines[1:] if l.strip()]
    return [r[column] for r in rows] if column is not None else [str(i) for i in range(len(rows))]


def submission_rows(name: str, test: Path, predictions: Path) -> list[tuple[str, str]]:
    """(index, prediction) for one submission file, from ``eval glue``'s predictions of ``test``; the
    labels checked against what the server reads, STS-B's scores clipped to [0, 5]."""
    indices = _test_indices(test)
    lines = predictions.read_text(encoding="utf-8").splitlines()
    if not lines or lines[0].split("\t")[:2] != ["index", "prediction"]:
        raise BertctlError(f"{predictions}: not a predictions file (no index/prediction header)")
    preds = [l.split("\t")[1] for l in lines[1:]]
    if len(preds) != len(indices):
        raise BertctlError(f"{predictions}: {len(preds)} predictions for the {len(indices)} rows of {test}")
    allowed = LABELS[name]
    rows = []
    for index, p in zip(indices, preds):
        if allowed is None:
            p = f"{min(STSB_RANGE[1], max(STSB_RANGE[0], float(p))):.3f}"
        elif p not in allowed:
            raise BertctlError(f"{predictions}: prediction {p!r} is not one of {', '.join(allowed)} ({name})")
        rows.append((index, p))
    return rows


def write_submission(output: Path, tasks: Sequence[tuple[GlueTask, Path]]) -> dict:
    """``OUT/submission/<Name>.tsv`` for every test file the chosen models predicted, zipped at
    ``OUT/submission.zip``; what is missing and what failed are reported, not fatal."""
    folder = output / "submission"
    shutil.rmtree(folder, ignore_errors=True)
    (output / "submission.zip").unlink(missing_ok=True)
    written, errors = [], {}
    for spec, task_folder in tasks:
        chosen = (_read_json(task_folder / "task.json") or {}).get("chosen")
        for name, _, _ in (s for s in SUBMISSION if s[1] == spec.name):
            out = task_folder / "test" / name
            stamp = _read_json(out / "chosen.json")
            if chosen is None or stamp is None or stamp.get("run") != chosen["run"]:
                continue
            if not (out / "metrics.json").is_file():
                errors[name] = f"the prediction failed (see {task_folder / 'logs' / f'test-{name}.log'})"
                continue
            try:
                rows = submission_rows(name, Path(stamp["test_file"]), out / f"predictions_{spec.name}.tsv")
            except (BertctlError, OSError, ValueError) as e:
                errors[name] = str(e)
                continue
            folder.mkdir(parents=True, exist_ok=True)
            with atomic_open(folder / f"{name}.tsv", "w", encoding="utf-8") as f:
                f.write("index\tprediction\n")
                f.writelines(f"{i}\t{p}\n" for i, p in rows)
            written.append(name)
    for name, why in errors.items():
        stderr.print(f"submission {name}: {why}")
    if not written:
        return {"zip": None, "files": [], "missing": [s[0] for s in SUBMISSION], "errors": errors}
    order = [s[0] for s in SUBMISSION]
    written.sort(key=order.index)
    tmp = output / "submission.zip.tmp"
    with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
        for name in written:
            z.write(folder / f"{name}.tsv", arcname=f"{name}.tsv")
    tmp.replace(output / "submission.zip")
    missing = [n for n in order if n not in written]
    stderr.print(f"submission: {output / 'submission.zip'} ({len(written)} files"
                 + (f"; not there: {', '.join(missing)}" if missing else "") + ")")
    return {"zip": str(output / "submission.zip"), "files": written, "missing": missing, "errors": errors}
