"""What a fine-tuning task is, and the one driver that fine-tunes, evaluates and predicts with any task.

A task (GLUE, SQuAD, NER, SWAG) is its data read into a ``Task``: a featurizer, a loss on the head's
logits, a scorer and a prediction writer. It never owns a loop, a device or a second loss: ``finetune``
runs it on ``bertctl.tasks.trainer.fine_tune`` (the one engine) and ``evaluate`` scores a fine-tuned
model with it, both through ``bertctl.tasks.trainer.predict``. Choosing among learning rates (the paper's grid) is
the GLUE suite's (``bertctl.tasks.suite``): one ``finetune`` is one run.
"""
from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Sequence

import torch

from bertctl import faults, rundir
from bertctl.config import FinetuneConfig
from bertctl.errors import BertctlError, Stopped
from bertctl.progress import MetricsLog, process_age, stderr
from bertctl.runtime import Runtime
from bertctl.tasks import common
from bertctl.tasks.trainer import TrainResult, device_info, fine_tune, label_loss, runtime_of


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

    def check_inputs(self, tokenizer, cfg: FinetuneConfig, model_dir: str | Path) -> None:
        """Refuse, before any featurising or training, what the run could not finish with (default: a
        ``--max-seq-length`` beyond the model's positions)."""
        check_max_seq_length(getattr(self, "max_seq_length", None) or getattr(getattr(self, "cfg", None),
                                                                              "max_seq_length", None), model_dir)

    def featurize(self, tokenizer, progress: bool) -> None:
        """Features of every set: ``train_features`` when fine-tuning, the evaluation sets' own."""
        raise NotImplementedError

    def predict(self, model: torch.nn.Module, cfg: FinetuneConfig, *, progress: bool = False, shards=None,
                final: bool = False) -> Any:
        """The model's predictions on the evaluation sets (``final``: the sets reported after training)."""
        raise NotImplementedError

    def final_outputs(self, model: torch.nn.Module, cfg: FinetuneConfig, *, progress: bool = False,
                      last: Any = None) -> Any:
        """The final report's outputs (``predict(final=True)``'s); ``last``: the last dev evaluation's outputs
        when the reported model is the one it evaluated (else None), taken as they are with ``reuse_last``."""
        if self.reuse_last and last is not None:
            return last
        return self.predict(model, cfg, progress=progress, final=True)

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


def check_max_seq_length(max_seq_length: int | None, model_dir: str | Path) -> None:
    """``--max-seq-length`` must fit the model's position embeddings (a longer row would fail mid-training)."""
    if max_seq_length is None:
        return
    from bertctl.checkpoints.hf import load_config

    positions = load_config(common.model_dir_of(model_dir)).max_position_embeddings
    if max_seq_length > positions:
        raise BertctlError(f"--max-seq-length {max_seq_length} is longer than the model's {positions} positions "
                           f"(max_position_embeddings in {common.model_dir_of(model_dir) / 'config.json'}); give at "
                           f"most {positions}")


RUN_OUTPUTS = ("checkpoints", "model", "metrics.json", "metrics.jsonl", "predictions*", "null_odds.json",
               "nbest_predictions.json", "tensorboard")


def unfinished_work(folder: Path) -> str | None:
    """What an unfinished fine-tuning run left in ``folder`` (a checkpoint, or the trained model with its
    evaluation still to run), or None."""
    from bertctl.checkpoints import training
    from bertctl.tasks.trainer import is_final

    last = training.latest_checkpoint(folder)
    if last is None:
        return None
    if is_final(last):
        return "a trained model whose evaluation did not finish"
    return f"a checkpoint at step {last.step}"


def finished_before_marker(folder: Path) -> bool:
    """A run finished before output folders had their marker: its metrics and model written, no checkpoint left."""
    from bertctl.checkpoints import training

    return ((folder / "metrics.json").is_file() and (folder / common.MODEL_SUBDIR / "config.json").is_file()
            and training.latest_checkpoint(folder) is None)


#: The shared flags a resumed run may give other values than the run was made with: how it is shown, logged
#: and checkpointed, and where and how its steps run (the same maths); every other flag changes the run.
MAY_CHANGE = ("no_progress", "log_every", "tensorboard", "save_every", "device", "micro_batch_size", "compile_",
              "cuda_graphs", "graph_min_steps", "eval_batch_size", "eval_batch_tokens", "write_nbest")
#: The run's length, which a resumed run may change with ``extend_schedule`` (its lr decay re-planned).
SCHEDULE = ("max_steps", "epochs")
#: Flags that say where and how to run the command, not what the run is.
NOT_THE_RUN = ("output", "resume", "overwrite", "extend_schedule", "restarts", "grid", "devices", "parallel")


def finetune(task: Task, model_dir: str | Path, output: str | Path, cfg: FinetuneConfig, *, resume: bool = False,
             overwrite: bool = False, dropout: float | None = None, flags: dict | None = None,
             extend_schedule: bool = False) -> dict:
    """Fine-tune ``task``'s head on its training set, evaluating on dev after every epoch; write the model
    (``OUT/model``), the predictions and the metrics (``OUT/metrics.json``, also on stdout). The output folder
    follows bertctl.rundir's rule: an unfinished run needs ``resume``, a finished one ``overwrite``. ``flags``:
    the command's flags by name, saved with every checkpoint; a resumed run must give the same values, except
    ``MAY_CHANGE``'s (``rundir.check_resume``), and ``SCHEDULE``'s with ``extend_schedule``, which re-plans the
    lr decay to end at the new last step."""
    from bertctl.tasks.trainer import kept_state
    from bertctl.train.engine import Interrupted, StopSignal

    cfg = task.configure(cfg)  # before any work: it may refuse the configuration
    output = Path(output)
    flags = {k: v for k, v in (flags or {}).items() if k not in NOT_THE_RUN}
    with rundir.claim(output, command=f"finetune {task.name}", resume=resume, overwrite=overwrite,
                      started=unfinished_work, finished_before=finished_before_marker, outputs=RUN_OUTPUTS,
                      main=is_main_process(), marks=True) as claim:
        if claim.state == "resume" and flags:
            saved = _saved_flags(output)
            if not extend_schedule:
                _check_schedule(saved, flags, output)
            rundir.check_resume(saved, flags, MAY_CHANGE + SCHEDULE * extend_schedule, folder=output,
                                command="finetune")
        with StopSignal(kept=lambda: kept_state(output)) as stop:
            try:
                with stop.phase(lambda: "stopping now: training has not started", at_once=True):
                    faults.point("start")
                    prepared = _prepare(task, model_dir, cfg, dropout)
            except Interrupted as e:
                stderr.print(f"stopped ({e.signal}) before training started: {kept_state(output)}")
                raise Stopped() from None
            try:
                result = _finetune(task, prepared, output, cfg, resume=resume and unfinished_work(output) is not None,
                                   stop=stop, meta={"flags": flags} if flags else {}, extend_schedule=extend_schedule)
            except OSError as e:
                raise BertctlError(disk_error(e, kept_state(output))) from None
        if result:
            from bertctl.checkpoints import training

            shutil.rmtree(output / training.CHECKPOINT_DIR, ignore_errors=True)  # complete: nothing to resume
            claim.finish(task=task.name)
    return result


def disk_error(e: OSError, kept: str) -> str:
    """One line for a write that failed (a full disk, a file-size limit, permissions): what, what is kept, and how
    to go on."""
    from bertctl.io import describe_os_error

    return f"{describe_os_error(e)}; {kept}"


def _check_schedule(saved: dict | None, given: dict, output: Path) -> None:
    """A resumed run given another length is refused, pointing at ``--extend-schedule``: its lr would stop
    mid-decay, or sit at 0."""
    for name in SCHEDULE:
        if saved and name in saved and name in given and saved[name] != given[name]:
            flag = rundir.flag_name(name)
            raise BertctlError(f"{flag} {given[name]}: the finetune run in {output} was planned with {flag} "
                               f"{saved[name]} (its lr decays to 0 there); add --extend-schedule to re-plan the decay "
                               f"to the new end, or resume with {flag} {saved[name]}")


def _saved_flags(output: Path) -> dict | None:
    """The flags the run in ``output`` was made with, from its newest checkpoint (None: recorded by none)."""
    from bertctl.checkpoints import training

    last = training.latest_checkpoint(output)
    if last is None:
        return None
    try:
        return json.loads((last.path / "meta.json").read_text()).get("flags")
    except (OSError, ValueError):
        return None


@dataclass
class Prepared:
    tokenizer: Any
    model: torch.nn.Module
    runtime: Runtime


def _prepare(task: Task, model_dir: str | Path, cfg: FinetuneConfig, dropout: float | None) -> Prepared:
    """The tokenizer, the features of every set and the model with its fresh head (seeded: the head's
    initialisation is the run's)."""
    tokenizer = common.load_tokenizer(model_dir)
    task.check_inputs(tokenizer, cfg, model_dir)
    task.featurize(tokenizer, cfg.train.show_progress)
    runtime = runtime_of(cfg)  # resolved once: the model built and the engine read it
    torch.manual_seed(cfg.train.seed)
    model = common.load_for_finetuning(task.model_class, model_dir, dropout=dropout, cfg=cfg, runtime=runtime,
                                       **task.head())
    return Prepared(tokenizer, model, runtime)


def _finetune(task: Task, prepared: Prepared, output: Path, cfg: FinetuneConfig, *, resume: bool, stop,
              meta: dict, extend_schedule: bool = False) -> dict:
    from bertctl.checkpoints.hf import save_pretrained

    tokenizer = prepared.tokenizer
    last = LastEvaluation()

    def evaluate(model, shards):
        return task.score(last.keep(model, task.predict(model, cfg, shards=shards)))

    def save_model(model) -> None:  # the trained model, before its final evaluation
        save_pretrained(model, output / common.MODEL_SUBDIR, tokenizer=tokenizer)

    with MetricsLog(output / "metrics.jsonl", tensorboard=cfg.train.tensorboard) as log:
        def finish(result: TrainResult) -> dict:
            """The final evaluation's report: predictions, scores and what the task chose, then the outputs."""
            if not is_main_process():  # under torchrun rank 0 writes the outputs
                return {}
            model = result.model
            outputs = task.final_outputs(model, cfg, progress=cfg.train.show_progress, last=last.reuse(result))
            metrics = task.score(outputs, final=True)
            before = model.config.to_dict()
            task.annotate(model)
            run = {"lr": cfg.train.lr, "epochs": result.epochs}
            if task.select_best:
                run["best_epoch"] = (result.best or {}).get("epoch")
            report = {"task": task.name, **metrics, **run, "batch_size": cfg.train.batch_size, "seed": cfg.train.seed,
                      **task.facts(), "train_examples_per_second": result.examples_per_second,
                      "seconds": run_seconds(result), "device": device_info(), **task.notes()}
            with stop.writing():  # the outputs agree with each other: none is cut by a signal
                if result.reloaded or model.config.to_dict() != before:  # another epoch's weights, or a choice made
                    save_model(model)
                task.write_predictions(output, outputs)
                log.log(event="final", **{k: v for k, v in report.items() if not k.endswith("per_type")})
                common.emit_metrics(output, report)
            return report

        result = fine_tune(prepared.model, task.train_features, cfg, evaluate=evaluate, main_metric=task.main_metric,
                           output_dir=output, resume=resume, log=log, runtime=prepared.runtime, loss=task.loss,
                           save_model=save_model, finish=finish, stop=stop, meta=meta,
                           extend_schedule=extend_schedule)
    return result.outcome or {}


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


def is_main_process() -> bool:
    """Whether this process writes the outputs (rank 0 under torchrun; the only process otherwise)."""
    return int(os.environ.get("RANK", "0")) == 0


class LastEvaluation:
    """The outputs of the last dev evaluation, reused for the final report when the returned model is
    the one evaluated last (no second pass over the dev set after training)."""

    def __init__(self):
        self.model = None
        self.outputs = None

    def keep(self, model, outputs):
        self.model, self.outputs = model, outputs
        return outputs

    def reuse(self, r: TrainResult):
        if self.model is r.model and r.history and r.best is r.history[-1]:
            return self.outputs
        return None


def run_seconds(r: TrainResult) -> dict:
    """Where the run's wall time went, for ``metrics.json``: since this process started (None where
    /proc is not there), in training steps (CUDA-graph captures included) and in the epoch-end
    evaluations."""
    return {"since_process_start": process_age(), "training_steps": round(r.train_seconds, 3),
            "evaluations": round(r.eval_seconds, 3)}
