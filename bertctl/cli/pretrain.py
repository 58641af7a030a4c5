"""``bertctl pretrain``: MLM + NSP pretraining; with no ``--data``, the built-in default job."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from bertctl.cli import options as opt
from bertctl.errors import BertctlError

LR_DEFAULTS = "per --model-size: tiny, mini 1e-3; small 5e-4; medium 3e-4; base 1e-4; large 5e-5"


def pretrain_command(
    # data, output and model
    data: Optional[Path] = typer.Option(None, "--data", help="Shard directory from `bertctl build-data`. "
                                        "Without it, the built-in default job runs (Python's own docs as corpus)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (checkpoints, metrics, "
                                          "model/).", show_default="./bertctl-default-run for the built-in job"),
    eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="Held-out shards for evaluation.",
                                             show_default="the data's held-out part if it has one"),
    model_size: Optional[str] = typer.Option(None, "--model-size", help="Preset: tiny, mini, small, medium, base, "
                                             "large.", show_default="base on a GPU, mini on a CPU, tiny for the "
                                                                    "built-in job"),
    config: Optional[Path] = typer.Option(None, "--config", help="Model config.json (Hugging Face fields)."),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="Start from a Hugging Face BERT directory "
                                             "or a previous run's directory (e.g. phase 1 -> phase 2)."),
    keep_optimizer: bool = typer.Option(False, "--keep-optimizer", help="With --init-from a run: keep its "
                                        "optimizer moments (the new --lr and schedule still apply)."),
    # schedule and batch
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Optimizer steps.",
                                            show_default="one epoch of the data; the built-in job fits its time"),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="Time box: checkpoint and export after this long; "
                                            "without --max-steps the lr schedule is planned (from the measured pace) "
                                            "to end then.",
                                            show_default="none; 2 for the built-in job"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Global batch (sequences per step).",
                                             show_default="256 on a GPU, 32 on a CPU, 8 for the built-in job"),
    micro_batch_size: Optional[int] = opt.MICRO_BATCH,
    # optimizer
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate.", show_default=LR_DEFAULTS),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw or lamb."),
    weight_decay: float = typer.Option(0.01, "--weight-decay", help="Decoupled weight decay (not on biases and "
                                                                   "LayerNorm)."),
    schedule: str = typer.Option("linear", "--schedule", help="linear, cosine or constant (after warm-up)."),
    warmup_steps: Optional[int] = typer.Option(None, "--warmup-steps", help="Warm-up steps.",
                                               show_default="--warmup-fraction of the steps"),
    warmup_fraction: float = typer.Option(0.06, "--warmup-fraction", help="Warm-up as a fraction of the steps "
                                          "when --warmup-steps is not given."),
    max_grad_norm: float = opt.MAX_GRAD_NORM,
    seed: int = typer.Option(0, "--seed", help="Random seed (initialisation, data order, masks, dropout)."),
    # runtime
    kernels: str = opt.KERNELS,
    attn: str = opt.ATTN,
    compile: bool = opt.COMPILE,
    cuda_graphs: Optional[bool] = opt.CUDA_GRAPHS,
    bucket_lengths: bool = typer.Option(False, "--bucket-lengths", help="Length-bucketed batch order (less "
                                        "padding when sequence lengths vary; every instance still once an epoch)."),
    precision: str = opt.PRECISION,
    device: str = opt.DEVICE,
    # checkpoints
    resume: bool = opt.RESUME,
    save_every: Optional[int] = typer.Option(None, "--save-every", help="Checkpoint every N steps.",
                                             show_default="by --save-minutes"),
    save_minutes: Optional[float] = typer.Option(30.0, "--save-minutes", help="Checkpoint every N minutes."),
    keep: int = typer.Option(3, "--keep", help="Checkpoints kept (the newest)."),
    # logging and held-out evaluation
    log_every: int = typer.Option(10, "--log-every", help="Steps between metric lines (the only host syncs)."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help="Steps between held-out evaluations "
                                             "(always at the start and the end).",
                                             show_default="1000; 5 times a run for the built-in job"),
    eval_batches: int = typer.Option(20, "--eval-batches", help="Held-out batches per evaluation."),
    dropout: Optional[float] = opt.DROPOUT,
    no_progress: bool = opt.NO_PROGRESS,
    tensorboard: Optional[bool] = opt.TENSORBOARD,
) -> None:
    """Pretrain BERT with masked LM + next-sentence prediction; prints a JSON summary on stdout."""
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import PRESET_LR, pretrain

    if sum(x is not None for x in (config, init_from)) > 1:
        raise BertctlError("give at most one of --config and --init-from")
    opt.check_training(batch_size=batch_size, micro_batch_size=micro_batch_size, lr=lr, max_steps=max_steps,
                       warmup_fraction=warmup_fraction, weight_decay=weight_decay, max_grad_norm=max_grad_norm,
                       save_every=save_every, log_every=log_every, precision=precision, attn=attn, kernels=kernels,
                       dropout=dropout)
    opt.positive("--minutes", minutes)
    opt.positive("--save-minutes", save_minutes)
    opt.positive("--keep", keep)
    opt.positive("--eval-every", eval_every)
    opt.positive("--eval-batches", eval_batches)
    opt.non_negative("--warmup-steps", warmup_steps)
    opt.choice("--optimizer", optimizer, ("adamw", "lamb"))
    opt.choice("--schedule", schedule, ("linear", "cosine", "constant"))
    if model_size is not None:
        opt.choice("--model-size", model_size, tuple(PRESET_LR))
    overrides = {}
    if dropout is not None:
        overrides = {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    common = dict(
        eval_data=str(eval_data) if eval_data else None, model_size=model_size,
        model_config=str(config) if config else None, init_from=str(init_from) if init_from else None,
        keep_optimizer=keep_optimizer, model_overrides=overrides, max_steps=max_steps, minutes=minutes,
        micro_batch_size=micro_batch_size, optimizer=optimizer, weight_decay=weight_decay,
        schedule=schedule, warmup_steps=warmup_steps, warmup_fraction=warmup_fraction,
        max_grad_norm=max_grad_norm, seed=seed, precision=precision, kernels=kernels, attn=attn, compile=compile,
        cuda_graphs=cuda_graphs,
        bucket_lengths=bucket_lengths, device=None if device == "auto" else device, resume=resume,
        save_every=save_every, save_minutes=save_minutes, keep=keep, log_every=log_every, eval_every=eval_every,
        eval_batches=eval_batches, show_progress=not no_progress, tensorboard=tensorboard,
    )
    if data is None:
        from bertctl.default_job import run_default_job

        summary = run_default_job(Path(output) if output else Path("bertctl-default-run"),
                                  batch_size=batch_size, lr=lr, **common)
    else:
        if output is None:
            raise BertctlError("--output is required with --data")
        from bertctl.data.dataset import find_manifest

        find_manifest(data)  # a wrong --data fails before any note about the defaults
        size, batch = _size_and_batch(model_size, batch_size, config or init_from, device)
        common["model_size"] = size
        common["eval_every"] = eval_every or 1000
        cfg = PretrainConfig.of(output=str(output), data=str(data), batch_size=batch, lr=lr or PRESET_LR[size],
                                fit_to_minutes=minutes is not None and max_steps is None, **common)
        with opt.run_output(output):
            summary = pretrain(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 prints
        print(json.dumps(summary, indent=2, default=str))


def _size_and_batch(model_size: str | None, batch_size: int | None, model_given, device: str) -> tuple[str, int]:
    """The defaults: BERT-Base at batch 256 on a GPU; on a CPU a model and batch that fit in memory and
    train in minutes (BERT-Base at batch 256 in fp32 needs over 20 GB and minutes a step there)."""
    import torch

    from bertctl.progress import stderr

    on_gpu = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
    size = model_size or ("base" if on_gpu or model_given else "mini")
    batch = batch_size or (256 if on_gpu else 32)
    if not on_gpu and (model_size is None or batch_size is None) and int(os.environ.get("RANK", "0")) == 0:
        chosen = []
        if model_size is None and not model_given:
            chosen.append(f"--model-size {size}")
        if batch_size is None:
            chosen.append(f"--batch-size {batch}")
        if chosen:
            stderr.print(f"no GPU: using {' and '.join(chosen)}, which fit a CPU's memory "
                         f"(give them explicitly to choose; BERT-Base at 256 needs over 20 GB here)")
    return size, batch


def register(app: typer.Typer) -> None:
    app.command("pretrain")(pretrain_command)
