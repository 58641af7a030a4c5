"""What a fine-tuning task is, and the one driver that fine-tunes, evaluates and predicts with any task.

A task (GLUE, SQuAD, NER, SWAG) is its data read into a ``Task``: a featurizer, a loss on the head's
logits, a scorer and a prediction writer. It never owns a loop, a device or a second loss: ``finetune``
runs it on ``bertctl.tasks.trainer.fine_tune`` (the one engine) and ``evaluate`` scores a fine-tuned
model with it, both through ``bertctl.tasks.trainer.predict``; with ``--lr-sweep`` the driver fine-tunes once per
learning rate of the paper's grid and keeps the best on dev (``train_with_sweep``).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch

from bertctl import rundir
from bertctl.config import FinetuneConfig
from bertctl.io import write_json
from bertctl.progress import MetricsLog, stderr
from bertctl.runtime import Runtime
from bertctl.tasks import common
from bertctl.tasks.trainer import (TrainResult, device_info, fine_tune, label_loss, lr_sweep_values, runtime_of,
                                   with_lr)


class Task:
    """One task's data and rules, built from what the task module's reader returns (``glue.load_data``,
    ``squad.read_squad``, ``ner.read_conll``, ``swag.read_swag``), for fine-tuning (training and dev sets) or for
    evaluating (one set). The driver calls ``featurize``, then ``predict`` and ``score`` at each evaluation,
    then ``write_predictions``; ``outputs`` is whatever ``predict`` returns and ``score`` and
    ``write_predictions`` read: the task's own predictions, before scoring. A base class rather than a
    ``typing.Protocol``, so that the hooks most tasks leave alone (``configure``, ``adopt``, ``annotate``) have
    their one default here."""

    name: str  # metrics.json's "task"
    model_class: type  # the head, a bertctl.model class (a property: the model loads only when a run starts)
    main_metric: str = ""  # the dev metric that picks the best epoch (with select_best) and lr
    select_best: ClassVar[bool] = False  # keep the best epoch's weights rather than the last
    reuse_last: ClassVar[bool] = True  # the final outputs are the last epoch-end evaluation's when its model is kept
    loss: ClassVar[Callable[[Any, dict], torch.Tensor]] = staticmethod(label_loss)  # summed over the micro-batch
    train_features: list[dict]

    def configure(self, cfg: FinetuneConfig) -> FinetuneConfig:
        """The fine-tuning configuration this task trains with (default: as given)."""
        return cfg

    def head(self) -> dict:
        """Config fields of the fresh head (label count and names)."""
        return {}

    def head_check(self) -> dict:
        """``common.load_finetuned``'s checks that a fine-tuned head fits this task."""
        return {"task": self.name}

    def adopt(self, model: torch.nn.Module, model_dir: str | Path) -> None:
        """Take what evaluating needs from a fine-tuned model (its label names, a saved threshold)."""

    def featurize(self, tokenizer, progress: bool) -> None:
        """Features of every set: ``train_features`` when fine-tuning, the evaluation sets' own."""
        raise NotImplementedError

    def predict(self, model: torch.nn.Module, cfg: FinetuneConfig, *, progress: bool = False, shards=None,
                final: bool = False) -> Any:
        """The model's predictions on the evaluation sets (``final``: the sets reported after training)."""
        raise NotImplementedError

    def score(self, outputs: Any, *, final: bool = False) -> dict:
        """Metrics of ``outputs``: at an epoch end the dev metrics, ``final`` the reported ones."""
        raise NotImplementedError

    def annotate(self, model: torch.nn.Module) -> None:
        """Write what the task chose on dev into the model's config before it is saved."""

    def write_predictions(self, output: Path, outputs: Any) -> None:
        raise NotImplementedError

    def facts(self) -> dict:
        """The data's counts, for metrics.json."""
        return {}

    def notes(self) -> dict:
        """What reading or featurising left out (skipped rows, cut words), for metrics.json."""
        return {}


RUN_OUTPUTS = ("checkpoints", "model", "metrics.json", "metrics.jsonl", "predictions*", "tensorboard", "sweep")


def unfinished_work(folder: Path) -> str | None:
    """What an unfinished fine-tuning run left in ``folder`` (a checkpoint, its own or a sweep run's), or None."""
    from bertctl.checkpoints import training

    for run in (folder, *sorted((folder / "sweep").glob("lr-*"))):
        last = training.latest_checkpoint(run)
        if last is not None:
            return f"a checkpoint at step {last.step}" + (f" in {run.name}" if run != folder else "")
    return None


def finished_before_marker(folder: Path) -> bool:
    """A run finished before output folders had their marker: its metrics and model written."""
    return (folder / "metrics.json").is_file() and (folder / common.MODEL_SUBDIR / "config.json").is_file()


def finetune(task: Task, model_dir: str | Path, output: str | Path, cfg: FinetuneConfig, *, lr_sweep: bool = False,
             resume: bool = False, overwrite: bool = False, dropout: float | None = None) -> dict:
    """Fine-tune ``task``'s head on its training set, evaluating on dev after every epoch; write the model
    (``OUT/model``), the predictions and the metrics (``OUT/metrics.json``, also on stdout). The output folder
    follows bertctl.rundir's rule: an unfinished run needs ``resume``, a finished one ``overwrite``."""
    cfg = task.configure(cfg)  # before any work: it may refuse the configuration
    output = Path(output)
    with rundir.claim(output, command=f"finetune {task.name}", resume=resume, overwrite=overwrite,
                      started=unfinished_work, finished_before=finished_before_marker, outputs=RUN_OUTPUTS,
                      main=is_main_process()) as claim:
        result = _finetune(task, model_dir, output, cfg, lr_sweep=lr_sweep, resume=resume, dropout=dropout)
        if result:
            claim.finish(task=task.name)
    return result


def _finetune(task: Task, model_dir: str | Path, output: Path, cfg: FinetuneConfig, *, lr_sweep: bool, resume: bool,
              dropout: float | None) -> dict:
    from bertctl.checkpoints.hf import save_pretrained

    tokenizer = common.load_tokenizer(model_dir)
    task.featurize(tokenizer, cfg.train.show_progress)
    head = task.head()
    runtime = runtime_of(cfg)  # resolved once: every model built (each lr of a sweep) and the engine read it

    def build():
        return common.load_for_finetuning(task.model_class, model_dir, dropout=dropout, cfg=cfg, runtime=runtime,
                                          **head)

    last = LastEvaluation()

    def evaluate(model, shards):
        return task.score(last.keep(model, task.predict(model, cfg, shards=shards)))

    with MetricsLog(output / "metrics.jsonl", tensorboard=cfg.train.tensorboard) as log:
        outcome = train_with_sweep(build, task.train_features, cfg, evaluate=evaluate,
                                          main_metric=task.main_metric, output=output, lr_sweep=lr_sweep,
                                          resume=resume, log=log, runtime=runtime, loss=task.loss)
        if not outcome.is_main:  # under torchrun rank 0 writes the outputs
            return {}
        model = outcome.result.model
        outputs = last.reuse(outcome) if task.reuse_last else None
        if outputs is None:
            outputs = task.predict(model, cfg, progress=cfg.train.show_progress, final=True)
        metrics = task.score(outputs, final=True)
        task.annotate(model)
        save_pretrained(model, output / common.MODEL_SUBDIR, tokenizer=tokenizer)
        task.write_predictions(output, outputs)
        run = {"lr": outcome.lr, "epochs": outcome.result.epochs}
        if task.select_best:
            run["best_epoch"] = (outcome.result.best or {}).get("epoch")
        result = {"task": task.name, **metrics, **run, "batch_size": cfg.train.batch_size, "seed": cfg.train.seed,
                  **task.facts(), "train_examples_per_second": outcome.result.examples_per_second,
                  "seconds": run_seconds(outcome), "device": device_info(), **task.notes()}
        if len(outcome.sweep) > 1:
            result["lr_sweep"] = outcome.sweep
        log.log(event="final", **{k: v for k, v in result.items() if not k.endswith("per_type") and k != "lr_sweep"})
    common.emit_metrics(output, result)
    return result


def evaluate(task: Task, model_dir: str | Path, cfg: FinetuneConfig, *, output: str | Path | None = None) -> dict:
    """Score a fine-tuned model (its head must fit ``task``) on the task's set; with ``output``, write the
    predictions and ``metrics.json`` there. The metrics go to stdout."""
    model = common.load_finetuned(task.model_class, model_dir, **task.head_check())
    task.adopt(model, model_dir)
    tokenizer = common.load_tokenizer(model_dir)
    model.to(runtime_of(cfg).torch_device)
    task.featurize(tokenizer, False)
    outputs = task.predict(model, cfg, progress=cfg.train.show_progress, final=True)
    result = {"task": task.name, **task.score(outputs, final=True), **task.facts(), **task.notes()}
    if output is not None:
        output = Path(output)
        output.mkdir(parents=True, exist_ok=True)
        task.write_predictions(output, outputs)
    common.emit_metrics(Path(output) if output else None, result)
    return result


@dataclass
class SweepOutcome:
    result: TrainResult
    lr: float
    sweep: list[dict]  # one {"lr", "dev": metrics} per learning rate

    @property
    def is_main(self) -> bool:
        return is_main_process()


def is_main_process() -> bool:
    """Whether this process writes the outputs (rank 0 under torchrun; the only process otherwise)."""
    return int(os.environ.get("RANK", "0")) == 0


def train_with_sweep(build_model: Callable[[], torch.nn.Module], train_features: Sequence[dict], cfg: FinetuneConfig, *,
                     evaluate: Callable[[torch.nn.Module, Any], dict], main_metric: str, output: Path,
                     lr_sweep: bool = False, resume: bool = False, log: MetricsLog | None = None,
                     runtime: Runtime | None = None, loss: Callable = label_loss) -> SweepOutcome:
    """Fine-tune once, or once per lr of the paper's grid, with the task's ``loss``, keeping the best on dev
    (``main_metric``).

    With a sweep each run checkpoints under ``OUT/sweep/lr-X/``; a finished run leaves its model
    and ``result.json`` there, so ``resume`` skips it. Under torchrun every process trains; only
    ``SweepOutcome.is_main`` writes outputs.
    """
    lrs = lr_sweep_values(lr_sweep, cfg.train.lr)
    user_build = build_model

    def build_model():  # the seed fixes the fresh head's initialisation too
        torch.manual_seed(cfg.train.seed)
        return user_build()
    if len(lrs) == 1:
        result = fine_tune(build_model(), train_features, cfg, evaluate=evaluate, main_metric=main_metric,
                           output_dir=output, resume=resume and _has_checkpoint(output), log=log, runtime=runtime,
                           loss=loss)
        return SweepOutcome(result, cfg.train.lr, [{"lr": cfg.train.lr, "dev": result.best}])
    from bertctl.checkpoints.hf import load_state, save_pretrained

    sweep = []
    best: tuple[float, float, Path] | None = None
    best_result = None
    for lr in lrs:
        run_dir = output / "sweep" / f"lr-{lr:g}"
        done = run_dir / "result.json"
        if resume and done.exists():
            record = json.loads(done.read_text())
            stderr.print(f"lr {lr:g}: already done ({main_metric} {record['dev'][main_metric]:.4f})")
            result = None
        else:
            stderr.print(f"lr sweep: lr {lr:g}")
            result = fine_tune(build_model(), train_features, with_lr(cfg, lr), evaluate=evaluate,
                               main_metric=main_metric, output_dir=run_dir,
                               resume=resume and _has_checkpoint(run_dir), log=log, runtime=runtime, loss=loss)
            record = {"lr": lr, "dev": result.best, "examples_per_second": result.examples_per_second}
            if is_main_process():
                save_pretrained(result.model, run_dir / common.MODEL_SUBDIR)
                write_json(done, record)
        sweep.append(record)
        score = record["dev"][main_metric]
        if best is None or score > best[0]:
            best = (score, lr, run_dir)
            best_result = result
    assert best is not None
    _, lr, run_dir = best
    if best_result is None:  # the best run finished before a resume: reload its weights
        from bertctl.checkpoints.hf import read_state_dict

        model = build_model()
        load_state(model, read_state_dict(run_dir / common.MODEL_SUBDIR), source=str(run_dir))
        record = json.loads((run_dir / "result.json").read_text())
        best_result = TrainResult(model, [record["dev"]], record["dev"])
    stderr.print(f"lr sweep: best lr {lr:g} ({main_metric} {best[0]:.4f})")
    return SweepOutcome(best_result, lr, sweep)


class LastEvaluation:
    """The outputs of the last dev evaluation, reused for the final report when the returned model is
    the one evaluated last (no second pass over the dev set after training)."""

    def __init__(self):
        self.model = None
        self.outputs = None

    def keep(self, model, outputs):
        self.model, self.outputs = model, outputs
        return outputs

    def reuse(self, outcome: SweepOutcome):
        r = outcome.result
        if self.model is r.model and r.history and r.best is r.history[-1]:
            return self.outputs
        return None


def _has_checkpoint(run_dir: Path) -> bool:
    from bertctl.checkpoints import training

    return training.latest_checkpoint(run_dir) is not None


def run_seconds(outcome: SweepOutcome) -> dict:
    """Where the run's wall time went, for ``metrics.json``: since this process started (None where
    /proc is not there), in training steps (CUDA-graph captures included) and in the epoch-end
    evaluations; with an lr sweep, the kept run's steps and evaluations."""
    r = outcome.result
    return {"since_process_start": _process_age(), "training_steps": round(r.train_seconds, 3),
            "evaluations": round(r.eval_seconds, 3)}


def _process_age() -> float | None:
    """Wall seconds since this process started, from the kernel's clock (Linux)."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return round(uptime - start_ticks / os.sysconf("SC_CLK_TCK"), 2)
