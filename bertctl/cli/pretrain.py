"""``bertctl pretrain``: MLM + NSP pretraining; with no ``--data``, the built-in default job."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from bertctl.errors import BertctlError


def pretrain_command(
    data: Optional[Path] = typer.Option(None, "--data", help="Shard directory from `bertctl build-data`. "
                                        "Without it, the built-in default job runs (Python's own docs as corpus)."),
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Run directory (checkpoints, metrics, "
                                          "model/). Default job: ./bertctl-default-run."),
    eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="Held-out shards for evaluation "
                                             "(default: the data's held-out part if it has one)."),
    model_size: Optional[str] = typer.Option(None, "--model-size", help="Preset: tiny, mini, small, medium, base, "
                                             "large [default: base; default job tiny]."),
    config: Optional[Path] = typer.Option(None, "--config", help="Model config.json (Hugging Face fields)."),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="Start from a Hugging Face BERT directory "
                                             "or a previous run's directory (e.g. phase 1 -> phase 2)."),
    keep_optimizer: bool = typer.Option(False, "--keep-optimizer", help="With --init-from a run: keep its "
                                        "optimizer moments (the new --lr and schedule still apply)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", help="Optimizer steps (default: one epoch)."),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="Time box: checkpoint and export after this long."),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="Global batch (sequences per step) "
                                             "[default: 256; default job 8]."),
    micro_batch_size: Optional[int] = typer.Option(None, "--micro-batch-size", help="Sequences per process per "
                                                   "forward; gradients accumulate to --batch-size."),
    lr: Optional[float] = typer.Option(None, "--lr", help="Peak learning rate [default: 1e-4; default job 1e-3]."),
    optimizer: str = typer.Option("adamw", "--optimizer", help="adamw or lamb."),
    weight_decay: float = typer.Option(0.01, "--weight-decay"),
    schedule: str = typer.Option("linear", "--schedule", help="linear, cosine or constant (after warm-up)."),
    warmup_steps: Optional[int] = typer.Option(None, "--warmup-steps"),
    warmup_fraction: float = typer.Option(0.01, "--warmup-fraction", help="Warm-up as a fraction of the steps "
                                          "when --warmup-steps is not given."),
    max_grad_norm: float = typer.Option(1.0, "--max-grad-norm", help="Gradient clipping (0 = off)."),
    seed: int = typer.Option(0, "--seed"),
    resume: bool = typer.Option(False, "--resume", help="Continue from the newest checkpoint in --output."),
    kernels: str = typer.Option("auto", "--kernels", help="fused, torch or auto."),
    attn: str = typer.Option("sdpa", "--attn", help="sdpa or explicit."),
    compile: bool = typer.Option(False, "--compile", help="torch.compile the model."),
    bucket_lengths: bool = typer.Option(False, "--bucket-lengths", help="Length-bucketed batch order (less "
                                        "padding when sequence lengths vary; every instance still once an epoch)."),
    precision: str = typer.Option("auto", "--precision", help="bf16, fp16 (loss scaling), fp32; auto = bf16 on "
                                  "GPU, fp32 on CPU."),
    device: Optional[str] = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)."),
    save_every: Optional[int] = typer.Option(None, "--save-every", help="Checkpoint every N steps."),
    save_minutes: Optional[float] = typer.Option(30.0, "--save-minutes", help="Checkpoint every N minutes."),
    keep: int = typer.Option(3, "--keep", help="Checkpoints kept (the newest)."),
    log_every: int = typer.Option(10, "--log-every", help="Steps between metric lines (the only host syncs)."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", help="Steps between held-out evaluations "
                                             "(always at the start and the end) [default: 1000; default job: "
                                             "5 times a run]."),
    eval_batches: int = typer.Option(20, "--eval-batches"),
    dropout: Optional[float] = typer.Option(None, "--dropout", help="Override hidden and attention dropout."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar (metrics still logged)."),
) -> None:
    """Pretrain BERT with masked LM + next-sentence prediction; prints a JSON summary on stdout."""
    from bertctl.train.pretrain import TrainConfig, pretrain

    if sum(x is not None for x in (config, init_from)) > 1:
        raise BertctlError("give at most one of --config and --init-from")
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
        bucket_lengths=bucket_lengths,
        device=device, resume=resume, save_every=save_every, save_minutes=save_minutes, keep=keep,
        log_every=log_every, eval_every=eval_every, eval_batches=eval_batches, show_progress=not no_progress,
    )
    if data is None:
        from bertctl.default_job import run_default_job

        summary = run_default_job(Path(output) if output else Path("bertctl-default-run"),
                                  batch_size=batch_size, lr=lr, **common)
    else:
        if output is None:
            raise BertctlError("--output is required with --data")
        common["model_size"] = model_size or "base"
        common["eval_every"] = eval_every or 1000
        cfg = TrainConfig(output=str(output), data=str(data), batch_size=batch_size or 256, lr=lr or 1e-4, **common)
        summary = pretrain(cfg)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 prints
        print(json.dumps(summary, indent=2, default=str))


def register(app: typer.Typer) -> None:
    app.command("pretrain")(pretrain_command)
