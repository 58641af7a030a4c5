"""The GLUE suite's bookkeeping (bertctl.tasks.suite) and the GLUE server's submission format
(bertctl.tasks.leaderboard), on run folders and prediction files written here; the end-to-end suite,
with real fine-tuning processes and an interrupted run, is in tests/parity/test_suite_runs.py."""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Optional

import numpy as np
import pytest
import typer
from typer.testing import CliRunner

from bertctl.errors import BertctlError
from bertctl.tasks import glue, leaderboard, suite
from test_finetune_support import data_path


def fake_run(folder: Path, **metrics) -> None:
    """A finished finetune glue folder: the model's config and metrics.json, as the command leaves them."""
    (folder / "model").mkdir(parents=True)
    (folder / "model" / "config.json").write_text("{}")
    (folder / "metrics.json").write_text(json.dumps(metrics))


def test_paper_grid_and_lists():
    g = suite.PAPER_GRID
    points = suite.grid_points(g["lr"], g["batch_size"], g["epochs"], restarts=3, seed=7)
    assert len(points) == 4 * 2 * 3 * 3  # Appendix A.3: 24 settings, each with every seed
    assert len({p.name for p in points}) == len(points)
    assert {p.setting for p in points} == {(lr, bs, ep) for lr in (5e-5, 4e-5, 3e-5, 2e-5) for bs in (16, 32)
                                           for ep in (2.0, 3.0, 4.0)}
    assert sorted({p.seed for p in points}) == [7, 8, 9]
    assert suite.parse_list("--lr", "5e-5, 3e-5", float) == (5e-5, 3e-5)
    assert suite.parse_list("--batch-size", "16,32", int) == (16, 32)
    assert suite.parse_list("--epochs", 3.0, float) == (3.0,)
    for bad, why in (("5e-5,x", "not a number"), ("0", "greater than 0"), ("16,16", "twice"), ("", "not a")):
        with pytest.raises(BertctlError, match=why):
            suite.parse_list("--lr" if why != "twice" else "--batch-size", bad, float)
    with pytest.raises(BertctlError, match="not an integer"):
        suite.parse_list("--batch-size", "16.5", int)
    with pytest.raises(BertctlError, match="--restarts"):
        suite.grid_points((5e-5,), (32,), (3.0,), restarts=0, seed=1)
    with pytest.raises(BertctlError, match="--batch-size is the suite's"):
        suite.check_finetune_args(["--max-steps", "3", "--batch-size=8"])


def test_restarts_choose_the_best_on_dev_and_report_every_seed(tmp_path):
    points = suite.grid_points((5e-5, 2e-5), (32,), (3.0,), restarts=4, seed=1)
    plan = suite.TaskPlan(glue.task_spec("mrpc"), tmp_path / "MRPC", points)
    rng = np.random.default_rng(0)
    f1 = {p.name: float(rng.uniform(0.6, 0.9)) for p in points}
    missing = points[5]  # a run that never finished is reported, not scored
    for p in points:
        if p != missing:
            fake_run(plan.run_dir(p), f1=f1[p.name], accuracy=0.99 - f1[p.name])  # ranked by F1, not accuracy
    plan.failed[missing.name] = "exit 1: boom"
    result = suite.collect_task(plan)
    done = [p for p in points if p != missing]
    best = max(done, key=lambda p: f1[p.name])
    assert result["status"] == "ok" and result["metric"] == "f1"
    assert result["chosen"]["run"] == best.name and result["chosen"]["score"] == f1[best.name]
    assert (plan.folder / "best").resolve() == plan.run_dir(best).resolve()
    assert result["failed_runs"] == {missing.name: "exit 1: boom"}
    assert len(result["grid"]) == 2
    for row in result["grid"]:
        mine = [p for p in done if p.lr == row["lr"]]
        scores = [f1[p.name] for p in mine]
        assert row["seeds"] == {str(p.seed): f1[p.name] for p in mine}
        assert row["mean"] == pytest.approx(np.mean(scores))
        assert row["std"] == pytest.approx(np.std(scores, ddof=1))
        assert (row["min"], row["max"]) == (min(scores), max(scores))
        assert row["best_seed"] == max(mine, key=lambda p: f1[p.name]).seed
    assert json.loads((plan.folder / "task.json").read_text())["chosen"]["run"] == best.name
    # Every run failed: the task is reported failed, with why.
    lost = suite.TaskPlan(glue.task_spec("rte"), tmp_path / "RTE", points[:1], failed={points[0].name: "exit 2: x"})
    r = suite.collect_task(lost)
    assert r["status"] == "failed" and "exit 2: x" in r["error"]


def test_summary_is_table1_with_the_papers_average(tmp_path):
    """BERT-Base's Table 1 row fed through the summary gives the paper's average, 79.6 (MNLI-m and -mm two
    columns, WNLI left out)."""
    row = {"mnli": {"mnli_m_accuracy": .846, "mnli_mm_accuracy": .834}, "qqp": {"f1": .712, "accuracy": .9},
           "qnli": {"accuracy": .905}, "sst2": {"accuracy": .935}, "cola": {"matthews_corrcoef": .521},
           "stsb": {"spearmanr": .858, "pearson": .87}, "mrpc": {"f1": .889, "accuracy": .85},
           "rte": {"accuracy": .664}, "wnli": {"accuracy": .10}}
    results = []
    for task, metrics in row.items():
        p = suite.grid_points((2e-5,), (32,), (3.0,), 1, 42)
        plan = suite.TaskPlan(glue.task_spec(task), tmp_path / glue.task_spec(task).folder, p)
        fake_run(plan.run_dir(p[0]), **metrics)
        results.append(suite.collect_task(plan))
    qqp = results.pop(1)  # QQP failed: its column says so, and the average is over the others
    results.append({"task": "qqp", "status": "failed", "error": "exit 1", "folder": "QQP", "metric": "f1",
                    "runs": [], "grid": [], "failed_runs": {}})
    cfg = suite.SuiteConfig(data_dir=tmp_path, model=tmp_path / "bert-base", output=tmp_path)
    summary = suite.summarise(cfg, results, {"zip": None, "files": [], "missing": []})
    assert summary["table1"]["STS-B"] == pytest.approx(85.8) and "WNLI" not in summary["average_over"]
    assert "QQP" not in summary["table1"]
    assert summary["average"] == pytest.approx(np.mean([84.6, 83.4, 90.5, 93.5, 52.1, 85.8, 88.9, 66.4]))
    full = suite.summarise(cfg, results[:-1] + [qqp], {"zip": None, "files": [], "missing": []})
    assert round(full["average"], 1) == 79.6  # the paper's BERT-Base average
    md = suite.summary_markdown(summary)
    header, _, line = md.split("\n")[4:7]
    cells = dict(zip([c.strip() for c in header.split("|")[1:-1]], [c.strip() for c in line.split("|")[1:-1]]))
    assert cells["MNLI-(m/mm)"] == "84.6/83.4" and cells["QQP"] == "failed" and cells["CoLA"] == "52.1"
    assert cells["WNLI"] == "10.0" and cells["Average"] == f"{summary['average']:.1f}"


def glue_test_layout(root: Path, rows: int = 7) -> dict[str, Path]:
    """Test files in the GLUE download's layouts (its headers, an index column, no labels), from SST-2 text."""
    text = [l.split("\t")[0] for l in data_path("glue", "SST-2", "dev.tsv").read_text().splitlines()[1:rows + 1]]
    pairs = list(zip(text, text[1:] + text[:1]))
    layouts = {
        "CoLA": ("CoLA/test.tsv", "index\tsentence", [f"{i}\t{a}" for i, a in enumerate(text)]),
        "SST-2": ("SST-2/test.tsv", "index\tsentence", [f"{i}\t{a}" for i, a in enumerate(text)]),
        "MRPC": ("MRPC/test.tsv", "index\t#1 ID\t#2 ID\t#1 String\t#2 String",
                 [f"{i}\t{100 + i}\t{200 + i}\t{a}\t{b}" for i, (a, b) in enumerate(pairs)]),
        "STS-B": ("STS-B/test.tsv", "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2",
                  [f"{i}\tmain\tf\t2012\t{i}\tnone\tnone\t{a}\t{b}" for i, (a, b) in enumerate(pairs)]),
        "QQP": ("QQP/test.tsv", "id\tquestion1\tquestion2", [f"{i}\t{a}\t{b}" for i, (a, b) in enumerate(pairs)]),
        "MNLI-m": ("MNLI/test_matched.tsv", "index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\t"
                   "sentence2_binary_parse\tsentence1_parse\tsentence2_parse\tsentence1\tsentence2",
                   [f"{i}\t{i}\t{i}e\tfiction\t(a)\t(b)\t(a)\t(b)\t{a}\t{b}" for i, (a, b) in enumerate(pairs)]),
        "QNLI": ("QNLI/test.tsv", "index\tquestion\tsentence", [f"{i}\t{a}\t{b}" for i, (a, b) in enumerate(pairs)]),
        "RTE": ("RTE/test.tsv", "index\tsentence1\tsentence2", [f"{i}\t{a}\t{b}" for i, (a, b) in enumerate(pairs)]),
        "WNLI": ("WNLI/test.tsv", "index\tsentence1\tsentence2", [f"{i}\t{a}\t{b}" for i, (a, b) in enumerate(pairs)]),
        "AX": ("diagnostic/diagnostic.tsv", "index\tsentence1\tsentence2",
               [f"{i}\t{a}\t{b}" for i, (a, b) in enumerate(pairs)]),
    }
    layouts["MNLI-mm"] = ("MNLI/test_mismatched.tsv", layouts["MNLI-m"][1], layouts["MNLI-m"][2])
    paths = {}
    for name, (rel, header, lines) in layouts.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join([header, *lines]) + "\n", encoding="utf-8")
        paths[name] = path
    return paths


def test_every_test_layout_reads_as_eval_glue_reads_it(tmp_path):
    """``eval glue --task T --data test.tsv`` (read_glue_tsv without labels) takes each GLUE test file,
    CoLA's header-and-index layout too, in its row order."""
    paths = glue_test_layout(tmp_path)
    tasks = {name: task for name, task, _ in leaderboard.SUBMISSION}
    for name, path in paths.items():
        examples, _ = glue.read_glue_tsv(path, glue.task_spec(tasks[name]), require_labels=False)
        first = path.read_text().splitlines()[1].split("\t")
        assert len(examples) == 7 and all(e.label is None for e in examples), name
        assert examples[0].text_a in first and (examples[0].text_b is None) == (name in ("CoLA", "SST-2")), name


def test_submission_files_in_the_glue_servers_format(tmp_path):
    data = tmp_path / "GLUE"
    paths = glue_test_layout(data)
    for spec in glue.GLUE_TASKS.values():  # the task folders the test files sit in
        for name in ("train.tsv", *spec.dev_files):
            (data / spec.folder / name).write_text("")
    out = tmp_path / "out"
    rng = np.random.default_rng(1)
    tasks, expected = [], {}
    for spec in (glue.task_spec(t) for t in ("cola", "sst2", "mrpc", "stsb", "qqp", "mnli", "qnli", "rte", "wnli")):
        folder = out / spec.folder
        folder.mkdir(parents=True)
        (folder / "task.json").write_text(json.dumps({"chosen": {"run": "r1"}}))
        files = leaderboard.test_files(spec, data)
        assert [n for n, _ in files] == [n for n, t, _ in leaderboard.SUBMISSION if t == spec.name]
        for name, path in files:
            pred = out / spec.folder / "test" / name
            pred.mkdir(parents=True)
            (pred / "chosen.json").write_text(json.dumps(leaderboard._stamp(path, "r1")))
            (pred / "metrics.json").write_text("{}")
            if spec.labels is None:
                values = rng.uniform(-1, 6, 7)  # a regression head strays outside [0, 5]
                labels = [f"{v:.6f}" for v in values]
                expected[name] = [f"{min(5, max(0, v)):.3f}" for v in values]
            else:
                labels = [spec.labels[i] for i in rng.integers(0, len(spec.labels), 7)]
                expected[name] = labels
            rows = ["index\tprediction\tlabel\tsource"] + [f"{i}\t{l}\t\t{path}:{i + 2}" for i, l in enumerate(labels)]
            (pred / f"predictions_{spec.name}.tsv").write_text("\n".join(rows) + "\n")
        tasks.append((spec, folder))
    report = leaderboard.write_submission(out, tasks)
    names = [n for n, _, _ in leaderboard.SUBMISSION]
    assert report["files"] == names and report["missing"] == [] and report["errors"] == {}
    with zipfile.ZipFile(out / "submission.zip") as z:
        assert sorted(z.namelist()) == sorted(f"{n}.tsv" for n in names)  # at the zip's root, no folder
        for name in names:
            lines = z.read(f"{name}.tsv").decode().splitlines()
            assert lines[0] == "index\tprediction"
            indices = [l.split("\t")[0] for l in paths[name].read_text().splitlines()[1:]]
            assert [l.split("\t")[0] for l in lines[1:]] == indices  # one row per test row, its index
            preds = [l.split("\t")[1] for l in lines[1:]]
            assert preds == expected[name]
            allowed = {"CoLA": {"0", "1"}, "SST-2": {"0", "1"}, "MRPC": {"0", "1"}, "QQP": {"0", "1"},
                       "WNLI": {"0", "1"}, "QNLI": {"entailment", "not_entailment"},
                       "RTE": {"entailment", "not_entailment"}}.get(name, {"entailment", "neutral", "contradiction"})
            if name == "STS-B":
                assert all(0.0 <= float(p) <= 5.0 for p in preds)
            else:
                assert set(preds) <= allowed, name
    # A prediction file that does not match its test file is an error for that file; the others are written.
    bad = out / "RTE" / "test" / "RTE" / "predictions_rte.tsv"
    bad.write_text("index\tprediction\tlabel\tsource\n0\tentailment\t\tx\n")
    report = leaderboard.write_submission(out, tasks)
    assert "RTE" in report["missing"] and "1 predictions for the 7 rows" in report["errors"]["RTE"]
    bad.write_text("index\tprediction\tlabel\tsource\n" + "".join(f"{i}\tneutral\t\tx\n" for i in range(7)))
    report = leaderboard.write_submission(out, tasks)
    assert "'neutral' is not one of entailment, not_entailment" in report["errors"]["RTE"]
    # Predictions of a run that is no longer the chosen one are not submitted.
    (out / "SST-2" / "task.json").write_text(json.dumps({"chosen": {"run": "r2"}}))
    assert "SST-2" not in leaderboard.write_submission(out, tasks)["files"]


def test_runs_side_by_side_one_at_a_time_on_the_cpu_and_again_after_running_out_of_memory(tmp_path):
    """Each slot holds up to its capacity of processes at once; a GPU process that ran out of memory beside
    others runs again once its GPU holds fewer."""
    def job(name, seconds, oom_once=False):
        script = (f"import time, pathlib, sys; p = pathlib.Path({str(tmp_path / name)!r}); "
                  f"t = time.time(); time.sleep({seconds}); "
                  + ("m = p.with_suffix('.tried')\nif not m.exists():\n    m.mkdir()\n    "
                     "print('torch.OutOfMemoryError: CUDA out of memory.'); sys.exit(1)\n" if oom_once else "")
                  + "p.write_text(f'{t} {time.time()}')")
        return suite.Job(name, [sys.executable, "-c", script], tmp_path / f"{name}.log",
                         resume_dir=tmp_path / f"{name}.tried")

    def spans(names):
        return [tuple(map(float, (tmp_path / n).read_text().split())) for n in names]

    done = []
    jobs = [job(f"a{i}", 0.5) for i in range(3)]
    suite.run_jobs(jobs, [suite.Slot("cpu", 1)], on_done=lambda j: done.append(j.name), poll=0.02)
    s = spans(["a0", "a1", "a2"])
    assert done == ["a0", "a1", "a2"] and all(s[i][1] <= s[i + 1][0] for i in range(2))  # one after another
    jobs = [job(f"b{i}", 1.0) for i in range(3)]
    t0 = time.time()
    suite.run_jobs(jobs, [suite.Slot("0", 3)], poll=0.02)
    s = spans(["b0", "b1", "b2"])
    assert max(a for a, _ in s) < min(b for _, b in s)  # all three at once
    assert time.time() - t0 < 2.9 and all(j.returncode == 0 for j in jobs)
    slot = suite.Slot("0", 2)
    jobs = [job("c0", 1.0), job("c1", 0.1, oom_once=True)]
    suite.run_jobs(jobs, [slot], poll=0.02)
    assert [j.returncode for j in jobs] == [0, 0] and jobs[1].tries == 2 and slot.capacity == 1
    log = (tmp_path / "c1.log").read_text()
    assert "CUDA out of memory" in log
    tries = log.split("$ ")[1:]  # each try's command line and output; the second continues the first's folder
    assert len(tries) == 2 and "--resume" not in tries[0] and "--resume" in tries[1]


def test_given_flags_go_to_every_run_as_they_came():
    """Only the flags given on the command line pass through, written back as flags (both spellings of a
    --x/--no-x switch, a plain switch, numbers, paths); defaults and the suite's own parameters do not."""
    seen = {}
    app = typer.Typer()

    @app.command()
    def glue(ctx: typer.Context, lr: str = typer.Option("5e-5", "--lr"),
             max_steps: Optional[int] = typer.Option(None, "--max-steps"),
             epoch_evals: bool = typer.Option(True, "--epoch-evals/--no-epoch-evals"),
             compile_: bool = typer.Option(False, "--compile"), dropout: Optional[float] = typer.Option(None, "--dropout"),
             cuda_graphs: Optional[bool] = typer.Option(None, "--cuda-graphs/--no-cuda-graphs"),
             tokenizer: Optional[Path] = typer.Option(None, "--tokenizer"), seed: int = typer.Option(42, "--seed")):
        seen["args"] = suite.passthrough(ctx, ("lr", "seed"))

    r = CliRunner().invoke(app, ["--lr", "1e-3,2e-3", "--no-epoch-evals", "--max-steps", "7", "--compile",
                                 "--tokenizer", "/x/y", "--seed", "3", "--no-cuda-graphs"])
    assert r.exit_code == 0, r.output
    assert seen["args"] == ("--max-steps", "7", "--no-epoch-evals", "--compile", "--no-cuda-graphs",
                            "--tokenizer", "/x/y")
    CliRunner().invoke(app, ["--epoch-evals"])
    assert seen["args"] == ("--epoch-evals",)


@pytest.fixture
def captured(monkeypatch):
    """finetune glue's routing: the suite's config as the command builds it, with no run started."""
    seen = []
    monkeypatch.setattr(suite, "run_suite", lambda cfg: seen.append(cfg) or {})
    return seen


def finetune_glue(*args):
    from bertctl.cli.app import app

    return CliRunner().invoke(app, ["finetune", "glue", "--data-dir", "GLUE", "--model", "M", "-o", "OUT", *args])


def test_finetune_glue_routes_the_protocol_to_the_suite(captured):
    r = finetune_glue("--task", "all", "--restarts", "3", "--lr", "1e-3,2e-3", "--batch-size", "8", "--max-steps",
                      "2", "--no-epoch-evals", "--devices", "0,1", "--parallel", "2", "--seed", "5", "--device", "cuda",
                      "--max-seq-length", "64", "--resume")
    assert r.exit_code == 0, r.output
    cfg = captured.pop()
    assert (cfg.tasks, cfg.lrs, cfg.batch_sizes, cfg.epochs, cfg.restarts, cfg.seed) == (
        None, (1e-3, 2e-3), (8,), (3.0,), 3, 5)
    assert (cfg.devices, cfg.parallel, cfg.device, cfg.max_seq_length, cfg.resume) == (("0", "1"), 2, "cuda", 64, True)
    assert cfg.finetune_args == ("--max-steps", "2", "--no-epoch-evals")
    assert (cfg.data_dir, cfg.model, cfg.output) == (Path("GLUE"), Path("M"), Path("OUT"))
    assert finetune_glue("--task", "rte", "--grid", "paper").exit_code == 0
    cfg = captured.pop()
    assert cfg.tasks == ("rte",) and (cfg.lrs, cfg.batch_sizes, cfg.epochs) == tuple(suite.PAPER_GRID.values())
    assert finetune_glue("--task", "sst2", "--lr", "5e-5,4e-5,3e-5,2e-5", "--restarts", "2").exit_code == 0
    assert captured.pop().lrs == (5e-5, 4e-5, 3e-5, 2e-5)  # the paper's four rates, as a list
    r = finetune_glue("--task", "sst2", "--lr-sweep")
    assert r.exit_code == 2 and "No such option: --lr-sweep" in r.output  # gone: the list above is the one way
    assert finetune_glue("--task", "sst2", "--epochs", "2,3").exit_code == 0  # a list alone is a grid
    assert captured.pop().epochs == (2.0, 3.0)
    for args, why in ((("--task", "all", "--grid", "paper", "--lr", "1e-3"), "--grid paper sets"),
                      (("--task", "all", "--grid", "big"), "'paper'"),
                      (("--task", "all", "--train", "t.tsv"), "--train: the suite runs"),
                      (("--task", "all", "--devices", "a"), "--devices: CUDA device numbers"),
                      (("--task", "all", "--parallel", "0"), "--parallel must be 1 or more"),
                      (("--task", "all", "--restarts", "0"), "--restarts must be 1 or more"),
                      (("--task", "all", "--batch-size", "16,x"), "--batch-size: 'x' is not an integer")):
        r = finetune_glue(*args)
        assert r.exit_code == 2 and why in r.output, (args, r.output)
    assert not captured


def test_one_run_stays_one_run(captured, tmp_path):
    """Without the protocol's flags finetune glue is one run, as before: no suite, its numbers checked as before."""
    r = finetune_glue("--task", "sst2", "--lr", "0")
    assert r.exit_code == 2 and "--lr must be greater than 0, not 0" in r.output, r.output
    r = finetune_glue("--task", "sst2", "--epochs", "abc")
    assert r.exit_code == 2 and "--epochs: 'abc' is not a number" in r.output, r.output
    assert not captured


def test_the_suite_refuses_torchrun(monkeypatch, tmp_path):
    """Under torchrun every process would start the whole suite; it starts its own processes instead."""
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(BertctlError, match="without torchrun"):
        suite.run_suite(suite.SuiteConfig(data_dir=tmp_path, model=tmp_path, output=tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_slots_one_at_a_time_on_the_cpu_and_only_gpus_that_are_there(tmp_path):
    import torch

    assert suite._visible_gpus() == torch.cuda.device_count()
    assert suite.plan_slots("cpu", None, None, tmp_path, 32, 128, runs=5) == [suite.Slot("cpu", 1)]
    if torch.cuda.device_count() == 0:  # this machine: auto is the CPU; a GPU asked for is an error
        assert suite.plan_slots("auto", None, None, tmp_path, 32, 128, runs=5) == [suite.Slot("cpu", 1)]
        with pytest.raises(BertctlError, match="no CUDA GPU is visible"):
            suite.plan_slots("cuda", None, None, tmp_path, 32, 128, runs=5)
    n = torch.cuda.device_count()
    with pytest.raises(BertctlError, match=f"{n} GPU\\(s\\) visible here, so no GPU {n}"):
        suite.plan_slots("cuda", (str(n),), None, tmp_path, 32, 128, runs=5)


def test_a_gpu_holds_the_runs_that_fit_its_memory(tmp_path, monkeypatch):
    """BERT-Base at batch 32 and 128 tokens needs about 5 GB a run (weights, gradients, AdamW's moments,
    activations, CUDA context): an H200's 141 GB holds all 5 restarts, a 12 GB GPU two."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 768, "num_hidden_layers": 12,
                                                      "intermediate_size": 3072, "num_attention_heads": 12,
                                                      "vocab_size": 30522, "max_position_embeddings": 512}))
    need = suite._model_bytes(tmp_path, 32, 128)
    params = 109_482_240 + 768 * 2  # BERT-Base's encoder and pooler (transformers' count) and the 2-label head
    assert 16 * params < need < 16 * params + 4e9
    monkeypatch.setattr(suite, "_visible_gpus", lambda: 1)
    monkeypatch.setattr(suite.os, "cpu_count", lambda: 16)
    for free, runs, expect in ((141e9, 5, 5), (12e9, 5, 2), (3e9, 5, 1), (141e9, 40, 16)):
        monkeypatch.setattr(suite, "_free_gpu_bytes", lambda d, free=free: free)
        assert suite.plan_slots("cuda", None, None, tmp_path, 32, 128, runs=runs) == [suite.Slot("0", expect)]
    assert suite.plan_slots("cuda", None, 3, tmp_path, 32, 128, runs=5) == [suite.Slot("0", 3)]  # --parallel


def test_planning_imports_no_torch(tmp_path):
    """The suite's own process plans its runs without torch (its launcher imports torch meanwhile, in a thread,
    for the runs it forks: ``bertctl.tasks.launch``)."""
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 384, "num_hidden_layers": 6,
                                                      "intermediate_size": 1536, "num_attention_heads": 12,
                                                      "vocab_size": 30522, "max_position_embeddings": 512}))
    code = ("import sys; from pathlib import Path; from bertctl.tasks import suite; "
            f"slots = suite.plan_slots('auto', None, None, Path({str(tmp_path)!r}), 32, 128, runs=5); "
            # a GPU's plan sizes the runs from the model's config too, which a CPU-only plan never reads
            "suite._visible_gpus = lambda: 1; suite._free_gpu_bytes = lambda d: 141e9; "
            f"slots += suite.plan_slots('cuda', None, None, Path({str(tmp_path)!r}), 32, 128, runs=5); "
            "assert 'torch' not in sys.modules, 'torch imported'; print(slots)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
