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
    resume: bool = opt.resume_option("--no-progress, --log-every, --tensorboard, --save-every, --save-minutes, "
                                     "--keep, --device, --micro-batch-size, --compile, --cuda-graphs, --eval-every, "
                                     "--eval-batches and --minutes; flags not given take the run's values, and "
                                     "--max-steps may change with --extend-schedule"),
    extend_schedule: bool = opt.EXTEND_SCHEDULE,
    overwrite: bool = opt.OVERWRITE,
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
    flags = dict(locals())
    extend = flags.pop("extend_schedule")
    if extend and not resume:
        raise BertctlError("--extend-schedule continues a run: give it with --resume")
    options = _config_options(**flags)  # every flag above, by name
    if data is None:
        from bertctl.default_job import run_default_job

        summary = run_default_job(output or Path("bertctl-default-run"), **options)
    else:
        summary = _pretrain_on(data, output, options, extend)
    if int(os.environ.get("RANK", "0")) == 0:  # under torchrun only rank 0 prints
        print(json.dumps(summary, indent=2, default=str))


def _config_options(*, data, output, config, init_from, eval_data, dropout, no_progress, device, **flags) -> dict:
    """The flags as ``PretrainConfig`` options, checked before torch loads (a wrong flag fails at once).

    The flags that are named and valued as the config's fields pass as they are; the others are
    translated here; ``data`` and ``output`` are checked, and left to the caller."""
    from bertctl.config import PRESETS

    if config is not None and init_from is not None:
        raise BertctlError("give at most one of --config and --init-from")
    opt.check_training(dropout=dropout, **{name: flags[name] for name in (
        "batch_size", "micro_batch_size", "lr", "max_steps", "warmup_fraction", "weight_decay", "max_grad_norm",
        "save_every", "log_every", "precision", "attn", "kernels")})
    for flag in ("minutes", "save_minutes", "keep", "eval_every", "eval_batches"):
        opt.positive(f"--{flag.replace('_', '-')}", flags[flag])
    opt.non_negative("--warmup-steps", flags["warmup_steps"])
    opt.choice("--optimizer", flags["optimizer"], ("adamw", "lamb"))
    opt.choice("--schedule", flags["schedule"], ("linear", "cosine", "constant"))
    if flags["model_size"] is not None:
        opt.choice("--model-size", flags["model_size"], tuple(PRESETS))
    if data is not None and output is None:
        raise BertctlError("--output is required with --data")
    dropouts = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    return dict(flags, eval_data=_str(eval_data), model_config=_str(config), init_from=_str(init_from),
                model_overrides=dropouts, device=None if device == "auto" else device, show_progress=not no_progress)


def _str(path: Path | None) -> str | None:
    return None if path is None else str(path)


#: The flags whose default is "not given" (None): a resumed run takes the run's own values for them.
RUN_VALUES = ("model_size", "batch_size", "lr", "eval_every", "max_steps", "warmup_steps", "minutes", "micro_batch_size")


def saved_options(output: Path) -> dict:
    """The options of the run in ``output``, from its newest checkpoint's meta.json (read without torch)."""
    steps = sorted((output / "checkpoints").glob("step-*/meta.json"))
    for meta in reversed(steps):
        if (meta.parent / "state.pt").is_file():
            try:
                return json.loads(meta.read_text())["configs"]["training"]
            except (OSError, ValueError, KeyError):
                return {}
    return {}


def _pretrain_on(data: Path, output: Path, options: dict, extend_schedule: bool = False) -> dict:
    """Pretraining on ``data``'s shards, with this machine's defaults for what was not given (a resumed run:
    the run's own values)."""
    from bertctl.config import PretrainConfig
    from bertctl.data.dataset import find_manifest
    from bertctl.train.pretrain import PRESET_LR, pretrain

    if options["resume"]:
        saved = saved_options(output)
        options = {**options, **{k: saved[k] for k in RUN_VALUES if options[k] is None and saved.get(k) is not None}}
    find_manifest(data)  # a wrong --data fails before any note about the defaults
    size, batch = _size_and_batch(options["model_size"], options["batch_size"],
                                  options["model_config"] or options["init_from"], options["device"] or "auto")
    chosen = {"model_size": size, "batch_size": batch, "lr": options["lr"] or PRESET_LR[size],
              "eval_every": options["eval_every"] or 1000}
    cfg = PretrainConfig.of(**{**options, **chosen}, output=str(output), data=str(data),
                            fit_to_minutes=options["minutes"] is not None and options["max_steps"] is None)
    with opt.run_output(output):
        return pretrain(cfg, extend_schedule=extend_schedule)


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
