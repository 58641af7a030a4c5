"""The paper's GLUE protocol as one command: every task, random restarts, the hyperparameter grid,
selection on dev, the Table 1 summary and the GLUE server's submission files.

Each fine-tuning run is its own ``bertctl finetune glue`` process writing its own folder (forked from the
suite's process once torch is imported, where that is safe: ``bertctl.tasks.launch``), so one engine trains
every run, runs go side by side (several on a GPU, one per slot, together through CUDA MPS:
``bertctl.tasks.mps``) and an interrupted suite resumes
run by run: a finished run is skipped, an unfinished one continues from its checkpoint. The output folder
follows ``bertctl.rundir``'s rule with one difference: a suite is never marked finished as a whole (its runs
are), so ``--resume`` on a complete suite rewrites the summary and runs only what a larger grid adds.

Layout of the output folder::

    OUT/summary.json, OUT/summary.md        every task, the chosen run, the whole grid, the average
    OUT/submission.zip (and submission/)     test-set predictions as the GLUE server takes them
    OUT/<Task>/task.json                     this task's runs, grid and chosen run
    OUT/<Task>/best -> runs/<chosen run>     the chosen run's folder (model/ inside)
    OUT/<Task>/runs/lr2e-05-bs32-ep3-seed42/ one finetune glue output folder per run
    OUT/<Task>/logs/<run>.log                each process's stdout and stderr
    OUT/<Task>/test/<File>/                  the chosen model's predictions on a test file

The recipe (§4.1, Appendix A.3): batch 32 and 3 epochs for every task; the learning rate is
``finetune glue``'s own default, 5e-5, so a task run in the suite and alone give the same model
(the paper picks among 5e-5..2e-5 on dev: ``--lr 5e-5,4e-5,3e-5,2e-5`` runs those four, ``--grid paper`` the
whole grid).
"""
from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from bertctl import rundir
from bertctl.errors import BertctlError
from bertctl.io import atomic_open, write_json
from bertctl.progress import stderr
from bertctl.tasks import launch, mps
from bertctl.tasks.glue_tasks import GLUE_TASKS, GlueTask, task_spec
from bertctl.tasks.grid import parse_list

COMMAND = "finetune glue suite"

# Appendix A.3: "The optimal hyperparameter values are task-specific, but we found the following range of
# possible values to work well across all tasks".
PAPER_GRID = {"lr": (5e-5, 4e-5, 3e-5, 2e-5), "batch_size": (16, 32), "epochs": (2.0, 3.0, 4.0)}

# Table 1's columns, in its order: (column, task, metric key in the run's metrics.json). The paper reports F1
# for QQP and MRPC, Spearman for STS-B, Matthews correlation for CoLA and accuracy for the others; its average
# counts MNLI-m and MNLI-mm as two columns and leaves WNLI out ("the problematic WNLI set", §4.1 footnote).
TABLE1 = (("MNLI-m", "mnli", "mnli_m_accuracy"), ("MNLI-mm", "mnli", "mnli_mm_accuracy"), ("QQP", "qqp", "f1"),
          ("QNLI", "qnli", "accuracy"), ("SST-2", "sst2", "accuracy"), ("CoLA", "cola", "matthews_corrcoef"),
          ("STS-B", "stsb", "spearmanr"), ("MRPC", "mrpc", "f1"), ("RTE", "rte", "accuracy"),
          ("WNLI", "wnli", "accuracy"))
NOT_AVERAGED = ("WNLI",)
TASK_ORDER = tuple(dict.fromkeys(task for _, task, _ in TABLE1))


def selection_metric(task: str) -> str:
    """The dev metric a task's runs are ranked by: its (first) Table 1 column's."""
    return next(key for _, t, key in TABLE1 if t == task)


# ------------------------------------------------------------------------------ the runs


@dataclass(frozen=True)
class Point:
    """One run: a grid point and a seed."""

    lr: float
    batch_size: int
    epochs: float
    seed: int

    @property
    def name(self) -> str:
        return f"lr{self.lr:g}-bs{self.batch_size}-ep{self.epochs:g}-seed{self.seed}"

    @property
    def setting(self) -> tuple[float, int, float]:
        return self.lr, self.batch_size, self.epochs


def grid_points(lrs: Sequence[float], batch_sizes: Sequence[int], epochs: Sequence[float], restarts: int,
                seed: int) -> list[Point]:
    """Every grid point times ``restarts`` seeds (``seed``, ``seed`` + 1, ...): the same seeds at every point."""
    if restarts < 1:
        raise BertctlError(f"--restarts must be 1 or more, not {restarts}")
    return [Point(lr, bs, float(ep), seed + i)
            for lr, bs, ep in itertools.product(lrs, batch_sizes, epochs) for i in range(restarts)]


def finetune_finished(folder: Path) -> bool:
    """A finetune glue folder finished before the run marker existed: its metrics.json is written last."""
    return (folder / "metrics.json").is_file() and (folder / "model" / "config.json").is_file()


def run_finished(folder: Path) -> bool:
    return rundir.is_finished(folder, finetune_finished)


# ------------------------------------------------------------------------------ processes side by side


@dataclass
class Job:
    """One process of the suite: ``argv`` run with ``log`` as its stdout and stderr; ``--resume`` is added when
    ``resume_dir`` exists at the start (an earlier try's folder, with its checkpoint if it got that far)."""

    name: str
    argv: list[str]
    log: Path
    resume_dir: Path | None = None
    returncode: int | None = None
    seconds: float = 0.0
    tries: int = 0


@dataclass
class Slot:
    """Where processes run: ``device`` is "cpu" or a CUDA device id as this process sees it."""

    device: str
    capacity: int
    running: int = 0


def _out_of_memory(log: Path) -> bool:
    try:
        tail = log.read_bytes()[-20000:].decode("utf-8", "replace")
    except OSError:
        return False
    return "out of memory" in tail.lower()


def run_jobs(jobs: Sequence[Job], slots: Sequence[Slot], *, on_done: Callable[[Job], None] | None = None,
             poll: float = 0.2, gpu_env: dict[str, str] | None = None, launcher: launch.Launcher | None = None) -> None:
    """Run ``jobs`` in order, each slot holding up to its capacity at once, GPU processes with ``gpu_env``
    added to their environment (``mps.sharing``'s), each started by ``launcher`` (default: as a new process).
    A GPU process that runs out of memory beside others is tried again once fewer share its GPU (the slot's
    capacity drops by one)."""
    launcher = launcher or launch.Launcher(preload=False)
    pending = list(jobs)
    running: list[tuple[Job, Slot, subprocess.Popen | launch.Forked, float]] = []
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",")] if visible else None
    try:
        while pending or running:
            for slot in slots:
                while pending and slot.running < slot.capacity:
                    job = pending.pop(0)
                    env = dict(os.environ)
                    if slot.device != "cpu":
                        env["CUDA_VISIBLE_DEVICES"] = ids[int(slot.device)] if ids else slot.device
                        threads = max(1, (os.cpu_count() or 1) // max(1, sum(s.capacity for s in slots)))
                        env.setdefault("OMP_NUM_THREADS", str(threads))
                        env.update(gpu_env or {})
                    argv = job.argv + (["--resume"] if job.resume_dir is not None and job.resume_dir.exists() else [])
                    job.log.parent.mkdir(parents=True, exist_ok=True)
                    with open(job.log, "ab") as log:
                        log.write(f"$ {' '.join(argv)}\n".encode())
                        log.flush()
                        p = launcher.start(argv, env=env, log=log)
                    job.tries += 1
                    slot.running += 1
                    running.append((job, slot, p, time.monotonic()))
            time.sleep(poll)
            for item in list(running):
                job, slot, p, t0 = item
                if p.poll() is None:
                    continue
                running.remove(item)
                slot.running -= 1
                job.seconds = time.monotonic() - t0
                if p.returncode != 0 and slot.device != "cpu" and slot.capacity > 1 and job.tries < 4 \
                        and _out_of_memory(job.log):
                    slot.capacity -= 1
                    stderr.print(f"{job.name}: out of GPU memory beside other runs; again with "
                                 f"{slot.capacity} at once on GPU {slot.device}")
                    pending.insert(0, job)
                    continue
                job.returncode = p.returncode
                if on_done is not None:
                    on_done(job)
    finally:
        for _, _, p, _ in running:  # interrupted: stop the runs (each resumes from its checkpoint)
            if p.poll() is None:
                p.terminate()
        for _, _, p, _ in running:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()


def _model_bytes(model_dir: Path, batch_size: int, seq: int) -> float:
    """About what one fine-tuning process holds on a GPU: fp32 weights, gradients and AdamW's two moments
    (16 bytes a parameter), the activations kept for backward (Korthikanti et al.'s 34·s·b·h + 5·a·s²·b bytes
    a layer in 16-bit), and 1.5 GB of CUDA context and allocator slack."""
    from bertctl.checkpoints.hf import model_dir_of  # torch-free: the suite's own process never imports torch

    try:
        c = json.loads((model_dir_of(model_dir) / "config.json").read_text())
        h, layers, ffn = c["hidden_size"], c["num_hidden_layers"], c["intermediate_size"]
        heads, vocab, pos = c["num_attention_heads"], c["vocab_size"], c.get("max_position_embeddings", 512)
    except (OSError, KeyError, ValueError, BertctlError):
        return 8e9  # unknown architecture: as much as a BERT-Large would need
    params = (vocab + pos + 2) * h + layers * (4 * h * h + 2 * h * ffn + 9 * h + ffn) + h * h
    activations = layers * (34 * seq * batch_size * h + 5 * heads * seq * seq * batch_size)
    return 16 * params + activations + 1.5e9


def _free_gpu_bytes(device: str) -> float | None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [d.strip() for d in visible.split(",")][int(device)] if visible else device
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i",
                              physical], capture_output=True, text=True, timeout=30, check=True).stdout
        return float(out.strip().splitlines()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    try:  # no nvidia-smi: the GPU's whole memory (reading it creates no CUDA context here)
        import torch

        return float(torch.cuda.get_device_properties(int(device)).total_memory)
    except Exception:
        return None


def _visible_gpus() -> int:
    """The CUDA GPUs visible here, counted without starting CUDA in this process (its runs are forked from it:
    ``bertctl.tasks.launch``): none where torch cannot use a GPU, else nvidia-smi's count narrowed by
    CUDA_VISIBLE_DEVICES as CUDA narrows it (up to its first entry that names no GPU), else torch's."""
    from bertctl.runtime import cuda_possible

    if not cuda_possible():
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        import torch

        return torch.cuda.device_count()
    present = len(out.split())
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return present
    count = 0
    for entry in (e.strip() for e in visible.split(",")):
        if not (entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < present)):
            break
        count += 1
    return count


def plan_slots(device: str, devices: Sequence[str] | None, parallel: int | None, model: Path, batch_size: int,
               seq: int, runs: int) -> list[Slot]:
    """The CPU runs one process at a time; each GPU as many as ``parallel``, or as fit in its free memory
    (by ``_model_bytes``), at most one a CPU core and no more than there are runs."""
    if device == "cpu":
        return [Slot("cpu", 1)]
    n = _visible_gpus()
    if devices is None:
        if device.startswith("cuda:"):
            devices = [device.split(":", 1)[1]]
        elif n == 0:
            if device == "cuda":
                raise BertctlError("--device cuda: no CUDA GPU is visible")
            return [Slot("cpu", 1)]
        else:
            devices = [str(i) for i in range(n)]
    unseen = [d for d in devices if int(d) >= n]
    if unseen:
        raise BertctlError(f"--devices {','.join(devices)}: {n} GPU(s) visible here, so no GPU {', '.join(unseen)}")
    per_gpu = math.ceil(runs / len(devices))
    slots = []
    for d in devices:
        if parallel is not None:
            capacity = parallel
        else:
            free = _free_gpu_bytes(d)
            fit = int(0.85 * free // _model_bytes(model, batch_size, seq)) if free is not None else 1
            capacity = max(1, min(fit, max(1, (os.cpu_count() or 1) // len(devices)), per_gpu))
        slots.append(Slot(d, capacity))
    return slots


# ------------------------------------------------------------------------------ the suite


@dataclass
class SuiteConfig:
    data_dir: Path
    model: Path
    output: Path
    tasks: tuple[str, ...] | None = None  # None: every GLUE task whose folder is in data_dir
    lrs: tuple[float, ...] = (5e-5,)
    batch_sizes: tuple[int, ...] = (32,)
    epochs: tuple[float, ...] = (3.0,)
    restarts: int = 1
    seed: int = 42
    device: str = "auto"
    devices: tuple[str, ...] | None = None  # CUDA device ids; None: every visible GPU
    parallel: int | None = None  # processes side by side on each GPU; None: as many as fit
    finetune_args: tuple[str, ...] = ()  # the other flags, given to every finetune glue
    resume: bool = False
    max_seq_length: int = 128


@dataclass
class TaskPlan:
    spec: GlueTask
    folder: Path  # OUT/<Task>
    points: list[Point]
    failed: dict[str, str] = field(default_factory=dict)  # run name: why

    def run_dir(self, point: Point) -> Path:
        return self.folder / "runs" / point.name

    def log(self, point: Point) -> Path:
        return self.folder / "logs" / f"{point.name}.log"


def find_tasks(data_dir: Path, tasks: Sequence[str] | None) -> list[GlueTask]:
    """The GLUE tasks to run: those named, or every task whose folder (with train.tsv) is in ``data_dir``."""
    if tasks is not None:
        return [task_spec(t) for t in tasks]
    present = [GLUE_TASKS[t] for t in TASK_ORDER if (data_dir / GLUE_TASKS[t].folder / "train.tsv").is_file()]
    if not present:
        names = ", ".join(GLUE_TASKS[t].folder for t in TASK_ORDER)
        raise BertctlError(f"{data_dir}: no GLUE task folder with a train.tsv here (looked for {names})")
    return present


# The flags the suite sets on each run itself; ``finetune_args`` holds the others.
OWN_FLAGS = ("--task", "--data-dir", "--model", "--output", "-o", "--lr", "--batch-size", "--epochs",
             "--seed", "--max-seq-length", "--device", "--no-progress", "--resume", "--extend-schedule")


def check_finetune_args(args: Sequence[str]) -> None:
    for a in args:
        if a.split("=", 1)[0] in OWN_FLAGS:
            raise BertctlError(f"{a.split('=', 1)[0]} is the suite's to set on each run, not a flag to pass through")


def finetune_argv(cfg: SuiteConfig, spec: GlueTask, point: Point, run_dir: Path, device: str) -> list[str]:
    return [sys.executable, "-m", "bertctl", "finetune", "glue", "--task", spec.name, "--data-dir",
            str(cfg.data_dir), "--model", str(cfg.model), "--output", str(run_dir), "--lr", f"{point.lr:g}",
            "--batch-size", str(point.batch_size), "--epochs", f"{point.epochs:g}", "--seed", str(point.seed),
            "--max-seq-length", str(cfg.max_seq_length), "--device", device, "--no-progress", *cfg.finetune_args]


def _started(folder: Path) -> str | None:
    runs = [p for p in folder.glob("*/runs/*") if p.is_dir()]
    if not runs:
        return None
    done = sum(run_finished(p) for p in runs)
    return f"{done} of {len(runs)} fine-tuning runs finished"


def _tail(log: Path, lines: int = 3) -> str:
    try:
        text = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()
    except OSError:
        return "no log"
    useful = [l for l in text if l.strip() and not l.startswith("$ ")]
    return " | ".join(useful[-lines:]) or "no output"


def run_suite(cfg: SuiteConfig) -> dict:
    """Fine-tune every run the config asks for (skipping finished ones), choose each task's best on dev,
    predict the test files, and write the summary and the submission. Returns the summary."""
    from bertctl.tasks import leaderboard

    started = time.monotonic()
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise BertctlError("the suite starts its own processes: run it without torchrun (--devices 0,1 spreads its "
                           "runs over GPUs)")
    check_finetune_args(cfg.finetune_args)
    specs = find_tasks(cfg.data_dir, cfg.tasks)
    points = grid_points(cfg.lrs, cfg.batch_sizes, cfg.epochs, cfg.restarts, cfg.seed)
    with rundir.claim(cfg.output, command=COMMAND, resume=cfg.resume, started=_started), \
            contextlib.ExitStack() as stack:
        # torch's import for the runs on a GPU starts now, beside the planning below.
        launcher = launch.for_runs_on(cfg.device)
        plans = [TaskPlan(s, cfg.output / s.folder, list(points)) for s in specs]
        slots = plan_slots(cfg.device, cfg.devices, cfg.parallel, cfg.model, max(cfg.batch_sizes),
                           cfg.max_seq_length, len(plans) * len(points))
        marks = {"planned": time.monotonic() - started}  # where the suite's own seconds go, for summary.json
        child_device = "cpu" if slots[0].device == "cpu" else "cuda"
        if child_device == "cpu":
            # One at a time, a run saves little by forking, and a child forked after torch's import has hung
            # in MKL's allocator on the CPU.
            launcher.refuse("runs on the CPU")
        where = "the CPU, one run at a time" if child_device == "cpu" else ", ".join(
            f"GPU {s.device} ({s.capacity} at once)" for s in slots)
        jobs, owner = [], {}
        for plan in plans:
            for point in plan.points:
                run_dir = plan.run_dir(point)
                if run_finished(run_dir):
                    stderr.print(f"{plan.spec.folder} {point.name}: already finished")
                    continue
                job = Job(f"{plan.spec.folder} {point.name}",  # unfinished: it continues from its checkpoint
                          finetune_argv(cfg, plan.spec, point, run_dir, child_device), plan.log(point), run_dir)
                jobs.append(job)
                owner[id(job)] = (plan, point)
        stderr.print(f"suite: {len(plans)} task(s) x {len(points)} run(s); {len(jobs)} to run on {where}")

        def done(job: Job) -> None:
            plan, point = owner[id(job)]
            if job.returncode == 0 and run_finished(plan.run_dir(point)):
                stderr.print(f"{job.name}: finished in {job.seconds:.0f} s")
            else:
                why = f"exit {job.returncode}: {_tail(job.log)}"
                plan.failed[point.name] = why
                stderr.print(f"{job.name}: failed ({why}); see {job.log}")

        shared = [s.device for s in slots if s.device != "cpu" and s.capacity > 1 and len(jobs) > 1]
        gpu_env = stack.enter_context(mps.sharing(shared))
        marks["gpu_sharing_ready"] = time.monotonic() - started
        run_jobs(jobs, slots, on_done=done, gpu_env=gpu_env, launcher=launcher)
        marks["runs_done"] = time.monotonic() - started
        if launcher.first_start is not None:
            marks["first_run_started"] = launcher.first_start - started
        if launcher.preloaded_at is not None:
            marks["preloaded"] = launcher.preloaded_at - started
        results = [collect_task(plan) for plan in plans]
        predict_jobs = []
        for plan, result in zip(plans, results):
            if result["status"] == "ok":
                predict_jobs += leaderboard.prediction_jobs(plan.spec, cfg.data_dir, plan.folder,
                                                            plan.folder / result["chosen"]["folder"],
                                                            result["chosen"]["run"], child_device,
                                                            cfg.max_seq_length)

        def predicted(job: Job) -> None:
            if job.returncode != 0:
                stderr.print(f"{job.name}: failed ({_tail(job.log)}); see {job.log}")

        run_jobs(predict_jobs, slots, on_done=predicted, gpu_env=gpu_env, launcher=launcher)
        marks["predictions_done"] = time.monotonic() - started
        submission = leaderboard.write_submission(cfg.output, [(p.spec, p.folder) for p in plans])
        summary = summarise(cfg, results, submission)
        summary["seconds"] = round(time.monotonic() - started, 1)  # this invocation's wall time, runs skipped too
        summary["since_start"] = {k: round(v, 2) for k, v in marks.items()}
        summary["runs_started"] = "forked" if launcher.why_not is None else f"as new processes ({launcher.why_not})"
        summary["preload_seconds"] = dict(launcher.imports)
        write_json(cfg.output / "summary.json", summary)
        with atomic_open(cfg.output / "summary.md", "w", encoding="utf-8") as f:
            f.write(summary_markdown(summary))
    sys.stdout.write(json.dumps({"summary": str(cfg.output / "summary.json"), "table1": summary["table1"],
                                 "average": summary["average"]}, indent=2) + "\n")
    sys.stdout.flush()
    return summary


def collect_task(plan: TaskPlan) -> dict:
    """Every finished run's dev score, the grid (per setting: each seed's score, mean ± std, min, max, the best
    seed) and the chosen run (the best on dev, §4.1); written to OUT/<Task>/task.json."""
    metric = selection_metric(plan.spec.name)
    runs, failed = [], dict(plan.failed)
    for point in plan.points:
        run_dir = plan.run_dir(point)
        if not run_finished(run_dir):
            failed.setdefault(point.name, "not finished")
            continue
        metrics = json.loads((run_dir / "metrics.json").read_text())
        if metric not in metrics:
            failed[point.name] = f"no {metric} in {run_dir / 'metrics.json'}"
            continue
        runs.append({"run": point.name, "folder": f"runs/{point.name}", "lr": point.lr,
                     "batch_size": point.batch_size, "epochs": point.epochs, "seed": point.seed,
                     "score": metrics[metric], "seconds": (metrics.get("seconds") or {}).get("since_process_start"),
                     "metrics": {k: v for k, v in metrics.items()
                                                           if isinstance(v, (int, float)) and k not in (
                                                               "lr", "batch_size", "seed", "epochs")}})
    grid = []
    for setting, group in itertools.groupby(sorted(runs, key=lambda r: (r["lr"], r["batch_size"], r["epochs"])),
                                            key=lambda r: (r["lr"], r["batch_size"], r["epochs"])):
        group = list(group)
        scores = [r["score"] for r in group]
        best = max(group, key=lambda r: r["score"])
        grid.append({"lr": setting[0], "batch_size": setting[1], "epochs": setting[2],
                     "seeds": {str(r["seed"]): r["score"] for r in group}, "mean": statistics.fmean(scores),
                     "std": statistics.stdev(scores) if len(scores) > 1 else 0.0, "min": min(scores),
                     "max": max(scores), "best_seed": best["seed"]})
    result = {"task": plan.spec.name, "folder": plan.spec.folder, "metric": metric, "runs": runs, "grid": grid,
              "failed_runs": failed}
    if not runs:
        result.update(status="failed", error="; ".join(f"{k}: {v}" for k, v in failed.items()) or "no runs")
        stderr.print(f"{plan.spec.folder}: every run failed")
    else:
        chosen = max(runs, key=lambda r: r["score"])  # the first of equal scores: the grid's order
        result.update(status="ok", chosen=chosen)
        best = plan.folder / "best"
        if best.is_symlink() or best.exists():
            best.unlink()
        try:
            best.symlink_to(Path(chosen["folder"]))
        except OSError:
            pass
        stderr.print(f"{plan.spec.folder}: chose {chosen['run']} ({metric} {chosen['score']:.4f}) of "
                     f"{len(runs)} run(s)")
    plan.folder.mkdir(parents=True, exist_ok=True)
    write_json(plan.folder / "task.json", result)
    return result


def summarise(cfg: SuiteConfig, results: Sequence[dict], submission: dict) -> dict:
    """summary.json: the chosen run's dev scores in Table 1's columns (in %) and their average, every task's
    grid and failures, and the submission's files."""
    by_task = {r["task"]: r for r in results}
    table = {}
    for column, task, key in TABLE1:
        r = by_task.get(task)
        if r is not None and r["status"] == "ok" and key in r["chosen"]["metrics"]:
            table[column] = 100 * r["chosen"]["metrics"][key]
    averaged = [c for c in table if c not in NOT_AVERAGED]
    return {"model": str(cfg.model), "data_dir": str(cfg.data_dir), "split": "dev",
            "grid": {"lr": list(cfg.lrs), "batch_size": list(cfg.batch_sizes), "epochs": list(cfg.epochs),
                     "restarts": cfg.restarts, "seeds": [cfg.seed + i for i in range(cfg.restarts)]},
            "table1": table, "average": statistics.fmean(table[c] for c in averaged) if averaged else None,
            "average_over": averaged, "tasks": {r["task"]: r for r in results}, "submission": submission}


def _pct(v: float) -> str:
    return f"{100 * v:.1f}"


def summary_markdown(summary: dict) -> str:
    """Table 1's row for this model (dev set), then each task's grid with every seed."""
    table, tasks = summary["table1"], summary["tasks"]
    present = {t for t in tasks}
    columns = [c for c in ("MNLI-(m/mm)", "QQP", "QNLI", "SST-2", "CoLA", "STS-B", "MRPC", "RTE", "WNLI")]
    cells = []
    for column in columns:
        task = "mnli" if column.startswith("MNLI") else next(t for c, t, _ in TABLE1 if c == column)
        if column.startswith("MNLI"):
            value = f"{table['MNLI-m']:.1f}/{table['MNLI-mm']:.1f}" if "MNLI-m" in table else None
        else:
            value = f"{table[column]:.1f}" if column in table else None
        cells.append(value if value is not None else ("failed" if task in present else "–"))
    average = "–" if summary["average"] is None else f"{summary['average']:.1f}"
    model = Path(summary["model"])
    name = model.parent.name if model.name == "model" else model.name  # a package's or a finetune OUT's model/
    lines = [f"# GLUE dev results: {name}", "",
             "Scores on the dev sets, as the paper's Table 1 reports them on test: F1 for QQP and MRPC, Spearman "
             "for STS-B, Matthews correlation for CoLA, accuracy for the others. The average is over the columns "
             "present, MNLI-m and MNLI-mm as two, without WNLI (as the paper's).", "",
             "| System | " + " | ".join(columns) + " | Average |", "|" + " --- |" * (len(columns) + 2),
             f"| {name} | " + " | ".join(cells) + f" | {average} |", ""]
    g = summary["grid"]
    lines += [f"Grid: lr {', '.join(f'{v:g}' for v in g['lr'])}; batch {', '.join(map(str, g['batch_size']))}; "
              f"epochs {', '.join(f'{v:g}' for v in g['epochs'])}; {g['restarts']} seed(s) each "
              f"({', '.join(map(str, g['seeds']))}); the chosen run is the best on dev (§4.1).", ""]
    for task in TASK_ORDER:
        r = tasks.get(task)
        if r is None:
            continue
        lines += [f"## {r['folder']} ({r['metric']})", ""]
        if r["status"] != "ok":
            lines += [f"Failed: {r['error']}", ""]
            continue
        lines += ["| lr | batch | epochs | seeds | mean ± std | min | max | best seed |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        chosen = r["chosen"]
        for row in r["grid"]:
            mark = " **chosen**" if (row["lr"], row["batch_size"], row["epochs"]) == (
                chosen["lr"], chosen["batch_size"], chosen["epochs"]) else ""
            seeds = ", ".join(f"{s}: {_pct(v)}" for s, v in row["seeds"].items())
            lines.append(f"| {row['lr']:g} | {row['batch_size']} | {row['epochs']:g} | {seeds} | "
                         f"{_pct(row['mean'])} ± {_pct(row['std'])} | {_pct(row['min'])} | {_pct(row['max'])} | "
                         f"{row['best_seed']}{mark} |")
        lines.append("")
        lines.append(f"Chosen: `{chosen['folder']}` ({r['metric']} {_pct(chosen['score'])}).")
        if r["failed_runs"]:
            lines.append("Failed runs: " + "; ".join(f"{k} ({v})" for k, v in r["failed_runs"].items()) + ".")
        lines.append("")
    sub = summary["submission"]
    if sub.get("zip"):
        lines += ["## Submission", "", f"`{sub['zip']}`: {', '.join(sub['files'])}."]
        if sub.get("missing"):
            lines.append(f"Not there (the GLUE server wants every file): {', '.join(sub['missing'])}.")
        lines.append("")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ from finetune glue's flags

# finetune glue's parameters the suite reads itself; its other given flags go to every run as they came.
SUITE_PARAMS = ("task", "data_dir", "model", "output", "lr", "batch_size", "epochs", "seed",
                "max_seq_length", "device", "no_progress", "resume", "restarts", "grid", "devices", "parallel")
OWN_DATA_PARAMS = ("train", "dev", "text_column", "text_pair_column", "label_column", "regression")


def _source(ctx, name: str) -> str | None:
    """Where a parameter's value came from, by name (Typer may carry its own copy of click's enum)."""
    source = ctx.get_parameter_source(name)
    return None if source is None else source.name


def passthrough(ctx, skip: Sequence[str]) -> tuple[str, ...]:
    """The flags given on the command line (not defaults), except ``skip``, written back as flags."""
    args: list[str] = []
    for param in ctx.command.params:
        if param.name in skip or _source(ctx, param.name) not in ("COMMANDLINE", "ENVIRONMENT"):
            continue
        value = ctx.params[param.name]
        if getattr(param, "is_flag", False):
            if value:
                args.append(param.opts[0])
            elif param.secondary_opts:
                args.append(param.secondary_opts[0])
        elif value is not None:
            args += [param.opts[0], str(value)]
    return tuple(args)


def from_cli(ctx) -> dict:
    """Run the suite from finetune glue's parsed flags (``ctx``: its click context)."""
    p = ctx.params

    def given(name: str) -> bool:
        return _source(ctx, name) == "COMMANDLINE"

    own = [f"--{n.replace('_', '-')}" for n in OWN_DATA_PARAMS if given(n)]
    if own:
        raise BertctlError(f"{', '.join(own)}: the suite runs the GLUE tasks of --data-dir; own data takes one run")
    if p["task"] is None or p["data_dir"] is None:
        raise BertctlError("the suite needs --task (all, or one GLUE task) and --data-dir (a GLUE folder, or the "
                           "task's)")
    lrs = parse_list("--lr", p["lr"], float)
    batch_sizes = parse_list("--batch-size", p["batch_size"], int)
    epochs = parse_list("--epochs", p["epochs"], float)
    if p["grid"] is not None:
        if p["grid"] != "paper":
            raise BertctlError(f"--grid: 'paper' (Appendix A.3), not {p['grid']!r}; lists such as --lr 5e-5,3e-5 "
                               "--batch-size 16,32 --epochs 2,3 make your own")
        clash = [f"--{n.replace('_', '-')}" for n in ("lr", "batch_size", "epochs") if given(n)]
        if clash:
            raise BertctlError(f"--grid paper sets the learning rates, batch sizes and epochs; drop {', '.join(clash)}")
        lrs, batch_sizes, epochs = PAPER_GRID["lr"], PAPER_GRID["batch_size"], PAPER_GRID["epochs"]
    devices = None
    if p["devices"] is not None:
        devices = tuple(d.strip() for d in p["devices"].split(",") if d.strip())
        if not devices or not all(d.isdigit() for d in devices):
            raise BertctlError(f"--devices: CUDA device numbers such as 0,1, not {p['devices']!r}")
    if p["restarts"] < 1:
        raise BertctlError(f"--restarts must be 1 or more, not {p['restarts']}")
    if p["parallel"] is not None and p["parallel"] < 1:
        raise BertctlError(f"--parallel must be 1 or more, not {p['parallel']}")
    cfg = SuiteConfig(data_dir=Path(p["data_dir"]), model=Path(p["model"]), output=Path(p["output"]),
                      tasks=None if p["task"] == "all" else (p["task"],), lrs=lrs, batch_sizes=batch_sizes,
                      epochs=epochs, restarts=p["restarts"], seed=p["seed"], device=p["device"], devices=devices,
                      parallel=p["parallel"], finetune_args=passthrough(ctx, SUITE_PARAMS), resume=p["resume"],
                      max_seq_length=p["max_seq_length"])
    return run_suite(cfg)
