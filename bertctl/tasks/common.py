"""Loading a task's model and tokenizer (a pretrained encoder with a fresh head, or a fine-tuned model whose head
must fit the task) and writing its metrics."""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Sequence

import torch

from bertctl.checkpoints.hf import MODEL_SUBDIR, model_dir_of  # noqa: F401 (the task modules use them from here)
from bertctl.errors import BertctlError
from bertctl.io import write_json
from bertctl.runtime import Runtime
from bertctl.tasks.trainer import FinetuneConfig, runtime_of

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


def emit_metrics(output: Path | None, metrics: dict) -> None:
    """Metrics JSON to stdout (results only there) and to ``OUT/metrics.json``."""
    if output is not None:
        write_json(output / "metrics.json", metrics)
    sys.stdout.write(json.dumps(metrics, indent=2) + "\n")
    sys.stdout.flush()
