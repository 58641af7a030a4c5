"""What the fine-tuning driver (``bertctl.tasks.base``) shares: loading model and tokenizer, the head check, the lr
sweep, the outputs."""
from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from bertctl.errors import BertctlError
from bertctl.io import write_json
from bertctl.progress import MetricsLog, stderr
from bertctl.runtime import Runtime
from bertctl.tasks.trainer import (FinetuneConfig, TrainResult, fine_tune, label_loss, lr_sweep_values, runtime_of,
                                   with_lr)

MODEL_SUBDIR = "model"


def model_dir_of(path: str | Path) -> Path:
    """A fine-tuning output folder holds the model in ``model/``, and an older sentence-transformers
    checkpoint its encoder in the folder its ``modules.json`` names (``0_Transformer/``); accept each."""
    from bertctl.inference.sentence_transformers import encoder_dir

    path = Path(path)
    if not (path / "config.json").exists() and (path / MODEL_SUBDIR / "config.json").exists():
        return path / MODEL_SUBDIR
    encoder = encoder_dir(path) if path.is_dir() and not (path / "config.json").exists() else None
    if encoder is not None and (encoder / "config.json").exists():
        return encoder
    if not path.is_dir():
        raise BertctlError(f"{path}: model directory not found")
    if not (path / "config.json").exists():
        raise BertctlError(f"{path}: no config.json (not a model directory)")
    return path


def load_tokenizer(model_dir: str | Path):
    from bertctl.text import load_tokenizer

    return load_tokenizer(model_dir_of(model_dir))


def load_for_finetuning(model_cls, model_dir: str | Path, *, dropout: float | None = None,
                        cfg: FinetuneConfig | None = None, runtime: Runtime | None = None, **head) -> torch.nn.Module:
    """A pretrained encoder (bertctl's or Hugging Face's) with a freshly initialised task head.

    ``head`` sets num_labels / id2label / label2id / problem_type in the config, so the saved
    model carries its label names. ``dropout`` overrides hidden and attention dropout. With
    ``cfg.from_scratch`` the directory gives only the architecture (config.json): every weight is
    initialised afresh, the paper's "no pretraining" baseline. ``runtime``: the command's, resolved once
    (default: ``cfg``'s).
    """
    from bertctl.checkpoints.hf import load_config, load_pretrained

    overrides = dict(head)
    if cfg is not None:
        runtime = runtime or runtime_of(cfg)
    if dropout is not None:
        overrides.update(hidden_dropout_prob=dropout, attention_probs_dropout_prob=dropout)
    if cfg is not None and cfg.from_scratch:
        return model_cls(load_config(model_dir_of(model_dir), **overrides), runtime)
    return load_pretrained(model_cls, model_dir_of(model_dir), fresh_heads=True, runtime=runtime, **overrides)


def load_finetuned(model_cls, model_dir: str | Path, *, labels: Sequence[str] | None = None,
                   regression: bool = False, task: str = "") -> torch.nn.Module:
    """A fine-tuned model for evaluation; its head must fit the task (label count and names)."""
    from bertctl.checkpoints.hf import load_config, load_pretrained

    directory = model_dir_of(model_dir)
    config = load_config(directory)
    archs = config.architectures or []
    if archs and model_cls.__name__ not in archs:
        raise BertctlError(f"{directory}: model is a {', '.join(archs)}, but {task or 'this task'} needs a "
                           f"{model_cls.__name__}")
    if regression and config.num_labels != 1:
        raise BertctlError(f"{directory}: the head has {config.num_labels} labels, but {task} is a regression task "
                           "(1 output)")
    if labels is not None:
        have = [config.id2label[i] for i in range(config.num_labels)] if config.id2label else None
        if config.num_labels != len(labels):
            raise BertctlError(f"{directory}: the head has {config.num_labels} labels"
                               + (f" ({', '.join(map(str, have))})" if have else "")
                               + f", but {task or 'the task'} has {len(labels)} ({', '.join(labels)})")
    return load_pretrained(model_cls, directory)


def head_labels(model: torch.nn.Module) -> list[str]:
    config = model.config
    if config.id2label:
        return [str(config.id2label[i]) for i in range(config.num_labels)]
    return [str(i) for i in range(config.num_labels)]


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
                save_pretrained(result.model, run_dir / MODEL_SUBDIR)
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
        load_state(model, read_state_dict(run_dir / MODEL_SUBDIR), source=str(run_dir))
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


def emit_metrics(output: Path | None, metrics: dict) -> None:
    """Metrics JSON to stdout (results only there) and to ``OUT/metrics.json``."""
    if output is not None:
        write_json(output / "metrics.json", metrics)
    sys.stdout.write(json.dumps(metrics, indent=2) + "\n")
    sys.stdout.flush()


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
