"""What a fine-tuning task is, and the one driver that fine-tunes, evaluates and predicts with any task.

A task (GLUE, SQuAD, NER, SWAG) is its data read into a ``Task``: a featurizer, a loss on the head's
logits, a scorer and a prediction writer. It never owns a loop, a device or a second loss: ``finetune``
runs it on ``bertctl.tasks.trainer.fine_tune`` (the one engine) and ``evaluate`` scores a fine-tuned
model with it, both through ``bertctl.tasks.trainer.predict``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, ClassVar

import torch

from bertctl.config import FinetuneConfig
from bertctl.progress import MetricsLog
from bertctl.tasks import common
from bertctl.tasks.trainer import device_info, label_loss, runtime_of


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


def finetune(task: Task, model_dir: str | Path, output: str | Path, cfg: FinetuneConfig, *, lr_sweep: bool = False,
             resume: bool = False, dropout: float | None = None) -> dict:
    """Fine-tune ``task``'s head on its training set, evaluating on dev after every epoch; write the model
    (``OUT/model``), the predictions and the metrics (``OUT/metrics.json``, also on stdout)."""
    from bertctl.checkpoints.hf import save_pretrained

    cfg = task.configure(cfg)  # before any work: it may refuse the configuration
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = common.load_tokenizer(model_dir)
    task.featurize(tokenizer, cfg.train.show_progress)
    head = task.head()
    runtime = runtime_of(cfg)  # resolved once: every model built (each lr of a sweep) and the engine read it

    def build():
        return common.load_for_finetuning(task.model_class, model_dir, dropout=dropout, cfg=cfg, runtime=runtime,
                                          **head)

    last = common.LastEvaluation()

    def evaluate(model, shards):
        return task.score(last.keep(model, task.predict(model, cfg, shards=shards)))

    with MetricsLog(output / "metrics.jsonl", tensorboard=cfg.train.tensorboard) as log:
        outcome = common.train_with_sweep(build, task.train_features, cfg, evaluate=evaluate,
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
                  "seconds": common.run_seconds(outcome), "device": device_info(), **task.notes()}
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
