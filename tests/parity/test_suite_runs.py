"""The GLUE suite end to end on the CPU: real finetune glue and eval glue processes on small GLUE-layout
folders made from the shared SST-2 (an SST-2 slice, a CoLA-layout and an RTE-layout task made of its rows,
a broken MRPC), a tiny model and a few steps; then a suite killed after its first run, resumed."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.tasks import suite
from test_finetune_support import data_path, make_tiny_model_dir


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny") / "model")


def sst2_rows(name: str, n: int, skip: int = 0) -> list[tuple[str, str]]:
    lines = data_path("glue", "SST-2", name).read_text(encoding="utf-8").splitlines()[1 + skip:1 + skip + n]
    return [tuple(l.split("\t")) for l in lines]


def write(path: Path, lines: list[str]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(f"{l}\n" for l in lines), encoding="utf-8")
    return path


def glue_folder(root: Path, *, tasks=("SST-2", "CoLA", "RTE"), broken_mrpc: bool = False) -> Path:
    """GLUE's layouts with SST-2's text: SST-2 as it is, CoLA (no header: source, label, mark, sentence; test
    with index and sentence), RTE (index, sentence1, sentence2, label: a sentence and the next, entailment
    when the first is positive); each with a test.tsv and no labels in it."""
    train, dev, test = sst2_rows("train.tsv", 40), sst2_rows("dev.tsv", 20), sst2_rows("dev.tsv", 9, skip=20)

    def pairs(rows):
        return [(a, rows[(i + 1) % len(rows)][0], "entailment" if y.strip() == "1" else "not_entailment")
                for i, (a, y) in enumerate(rows)]
    if "SST-2" in tasks:
        for name, rows in (("train", train), ("dev", dev)):
            write(root / "SST-2" / f"{name}.tsv", ["sentence\tlabel"] + [f"{a}\t{y}" for a, y in rows])
        write(root / "SST-2" / "test.tsv", ["index\tsentence"] + [f"{i}\t{a}" for i, (a, _) in enumerate(test)])
    if "CoLA" in tasks:
        for name, rows in (("train", train), ("dev", dev)):
            write(root / "CoLA" / f"{name}.tsv", [f"gj04\t{y}\t\t{a}" for a, y in rows])
        write(root / "CoLA" / "test.tsv", ["index\tsentence"] + [f"{i}\t{a}" for i, (a, _) in enumerate(test)])
    if "RTE" in tasks:
        for name, rows in (("train", train), ("dev", dev)):
            write(root / "RTE" / f"{name}.tsv", ["index\tsentence1\tsentence2\tlabel"]
                  + [f"{i}\t{a}\t{b}\t{y}" for i, (a, b, y) in enumerate(pairs(rows))])
        write(root / "RTE" / "test.tsv", ["index\tsentence1\tsentence2"]
              + [f"{i}\t{a}\t{b}" for i, (a, b, _) in enumerate(pairs(test))])
    if broken_mrpc:  # a task that fails: its train.tsv lacks the MRPC columns
        write(root / "MRPC" / "train.tsv", ["sentence\tlabel", "a\t1"])
        write(root / "MRPC" / "dev.tsv", ["sentence\tlabel", "a\t1"])
    return root


@pytest.mark.long
def test_suite_over_every_task_present(tiny, tmp_path):
    data = glue_folder(tmp_path / "GLUE", broken_mrpc=True)
    out = tmp_path / "out"
    cfg = suite.SuiteConfig(data_dir=data, model=tiny, output=out, lrs=(2e-3,), batch_sizes=(8,), epochs=(1.0,),
                            device="cpu", finetune_args=("--max-steps", "2", "--eval-batch-size", "16"))
    summary = suite.run_suite(cfg)
    tasks = summary["tasks"]
    assert list(tasks) == ["sst2", "cola", "mrpc", "rte"]  # Table 1's order
    assert tasks["mrpc"]["status"] == "failed" and "MRPC" in tasks["mrpc"]["error"]
    assert "MRPC" not in summary["table1"] and "failed" in (out / "summary.md").read_text()
    for task, column, key in (("sst2", "SST-2", "accuracy"), ("cola", "CoLA", "matthews_corrcoef"),
                              ("rte", "RTE", "accuracy")):
        r = tasks[task]
        assert r["status"] == "ok" and r["metric"] == key and len(r["runs"]) == 1
        scores = {}
        for run in r["runs"]:  # each run trained as its name says, and is scored from its own metrics.json
            metrics = json.loads((out / r["folder"] / run["folder"] / "metrics.json").read_text())
            assert (metrics["lr"], metrics["batch_size"], metrics["seed"]) == (run["lr"], 8, 42)
            assert metrics["task"] == task and run["score"] == metrics[key]
            scores[run["run"]] = metrics[key]
        assert r["chosen"]["score"] == max(scores.values())
        assert summary["table1"][column] == pytest.approx(100 * r["chosen"]["score"])
        assert [(g["lr"], g["batch_size"], g["epochs"]) for g in r["grid"]] == [(2e-3, 8, 1.0)]
    assert summary["average"] == pytest.approx(sum(summary["table1"].values()) / 3)
    assert json.loads((out / "summary.json").read_text())["table1"] == summary["table1"]
    marks = summary["since_start"]  # the suite's own seconds: planning, the GPU's sharing, the runs, the predictions
    assert 0 <= marks["planned"] <= marks["gpu_sharing_ready"] <= marks["runs_done"] <= marks["predictions_done"] \
        <= summary["seconds"] + 0.05, (marks, summary["seconds"])  # seconds: rounded to 0.1
    # The submission: the chosen models' predictions of each test file, in the server's format.
    with zipfile.ZipFile(out / "submission.zip") as z:
        assert sorted(z.namelist()) == ["CoLA.tsv", "RTE.tsv", "SST-2.tsv"]
        files = {n: z.read(n).decode().splitlines() for n in z.namelist()}
    for name, labels in (("CoLA.tsv", {"0", "1"}), ("SST-2.tsv", {"0", "1"}),
                         ("RTE.tsv", {"entailment", "not_entailment"})):
        lines = files[name]
        assert lines[0] == "index\tprediction" and [l.split("\t")[0] for l in lines[1:]] == [str(i) for i in range(9)]
        assert {l.split("\t")[1] for l in lines[1:]} <= labels
    # They are what the chosen model predicts when asked on its own.
    r = CliRunner().invoke(app, ["eval", "glue", "--task", "sst2", "--data", str(data / "SST-2" / "test.tsv"),
                                 "--model", str(out / "SST-2" / "best"), "--output", str(tmp_path / "again"),
                                 "--no-progress", "--device", "cpu"])
    assert r.exit_code == 0, r.output
    again = [l.split("\t")[1] for l in (tmp_path / "again" / "predictions_sst2.tsv").read_text().splitlines()[1:]]
    assert again == [l.split("\t")[1] for l in files["SST-2.tsv"][1:]]
    assert (out / "SST-2" / "best").resolve() == (out / "SST-2" / tasks["sst2"]["chosen"]["folder"]).resolve()


def _children(pid: int) -> list[int]:
    try:
        return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie (not yet reaped by its new parent) is gone too
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True




@pytest.mark.long
def test_an_interrupted_suite_resumes_where_it_stopped(tiny, tmp_path):
    """``finetune glue --task all --restarts 2`` killed once its first run has finished and its second has a
    checkpoint: the rerun refuses without --resume, then skips the finished run and continues the other from its
    checkpoint."""
    from bertctl.checkpoints import training

    data = glue_folder(tmp_path / "GLUE", tasks=("SST-2",))
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "bertctl", "finetune", "glue", "--task", "all", "--data-dir", str(data), "--model",
            str(tiny), "--output", str(out), "--restarts", "2", "--batch-size", "8", "--lr", "1e-3", "--epochs", "2",
            "--device", "cpu", "--save-every", "1"]
    first, second = (out / "SST-2" / "runs" / f"lr0.001-bs8-ep2-seed{s}" for s in (42, 43))
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    children: set[int] = set()
    try:
        while not (suite.run_finished(first) and training.latest_checkpoint(second) is not None):
            assert p.poll() is None, "the suite ended before it could be interrupted"
            assert time.time() < deadline, "the suite's runs did not get there in 300 s"
            children.update(_children(p.pid))
            time.sleep(0.05)
        children.update(_children(p.pid))
    except BaseException:  # a stuck run would go on taking the other tests' CPUs
        for pid in [p.pid, *children]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        raise
    p.send_signal(signal.SIGKILL)
    p.wait()
    deadline = time.time() + 120
    while not all(_gone(c) for c in children):  # the running fine-tuning stops with its suite
        assert time.time() < deadline, "a fine-tuning process outlived its killed suite"
        time.sleep(0.1)
    assert not suite.run_finished(second)
    finished_at = (first / "metrics.json").stat().st_mtime_ns

    r = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "pass --resume to continue it" in " ".join(r.stderr.split()), r.stderr
    r = subprocess.run(argv + ["--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert "lr0.001-bs8-ep2-seed42: already finished" in " ".join(r.stderr.split())
    assert (first / "metrics.json").stat().st_mtime_ns == finished_at  # not redone
    log = (out / "SST-2" / "logs" / "lr0.001-bs8-ep2-seed43.log").read_text()
    assert "resuming at step" in log and log.count("$ ") == 2
    summary = json.loads((out / "summary.json").read_text())
    sst2 = summary["tasks"]["sst2"]
    assert sst2["grid"][0]["seeds"].keys() == {"42", "43"} and not sst2["failed_runs"]
    assert sst2["chosen"]["score"] == max(sst2["grid"][0]["seeds"].values())
    # A complete suite resumed with one more restart runs only the new seed.
    more = list(argv)
    more[more.index("--restarts") + 1] = "3"
    r = subprocess.run(more + ["--resume"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    said = " ".join(r.stderr.split())
    assert "seed42: already finished" in said and "seed43: already finished" in said and "1 to run" in said
    assert (first / "metrics.json").stat().st_mtime_ns == finished_at
    seeds = json.loads((out / "summary.json").read_text())["tasks"]["sst2"]["grid"][0]["seeds"]
    assert seeds.keys() == {"42", "43", "44"}


def suite_and_alone(tiny, tmp_path, device: str, restarts: int):
    """``finetune glue --restarts N`` on an SST-2 slice and seed 42's run alone: the suite's stderr, and the
    two runs' folders."""
    data = glue_folder(tmp_path / "GLUE", tasks=("SST-2",))
    common = ["--data-dir", str(data), "--model", str(tiny), "--batch-size", "8", "--lr", "1e-3", "--epochs", "2",
              "--seed", "42", "--device", device, "--max-seq-length", "128", "--no-progress"]
    bertctl = [sys.executable, "-m", "bertctl", "finetune", "glue"]
    r = subprocess.run(bertctl + ["--task", "all", "--output", str(tmp_path / "out"), "--restarts", str(restarts)]
                       + common, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    started = "forked" if device == "cuda" else "as new processes (runs on the CPU)"
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["runs_started"] == started
    alone = subprocess.run(bertctl + ["--task", "sst2", "--output", str(tmp_path / "alone")] + common,
                           capture_output=True, text=True)
    assert alone.returncode == 0, alone.stderr
    return r.stderr, tmp_path / "out" / "SST-2" / "runs" / "lr0.001-bs8-ep2-seed42", tmp_path / "alone"


@pytest.mark.long
def test_a_run_of_the_suite_on_the_cpu_trains_what_the_run_alone_trains(tiny, tmp_path):
    """On the CPU the suite starts its runs as new processes (``bertctl.tasks.launch``): the model,
    predictions and metrics are those of the same ``finetune glue`` run started by hand."""
    _, in_suite, alone = suite_and_alone(tiny, tmp_path, "cpu", 1)
    for name in ("model/model.safetensors", "predictions_sst2.tsv"):
        assert (in_suite / name).read_bytes() == (alone / name).read_bytes(), name
    timing = ("seconds", "device", "train_examples_per_second")
    a, b = (json.loads((f / "metrics.json").read_text()) for f in (in_suite, alone))
    assert {k: v for k, v in a.items() if k not in timing} == {k: v for k, v in b.items() if k not in timing}
    assert "epoch 2: accuracy" in (tmp_path / "out" / "SST-2" / "logs" / "lr0.001-bs8-ep2-seed42.log").read_text()


@pytest.mark.cuda
def test_restarts_on_a_gpu_are_forked_side_by_side_and_train_what_a_run_alone_trains(tiny, tmp_path):
    """On a GPU the suite plans without starting CUDA, so its runs fork (CUDA cannot be used in the child of a
    process that started it) and run side by side; the first seed's run is the run alone's."""
    said, forked, alone = suite_and_alone(tiny, tmp_path, "cuda", 3)
    assert "(3 at once)" in said, said
    a, b = (json.loads((f / "metrics.json").read_text()) for f in (forked, alone))
    assert a["accuracy"] == b["accuracy"] and a["device"]["device"] == b["device"]["device"]
    assert (forked / "predictions_sst2.tsv").read_text() == (alone / "predictions_sst2.tsv").read_text()
