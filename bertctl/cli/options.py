"""The training flags that ``pretrain`` and ``finetune`` share: one name, one meaning, one check.

Each flag is a ``typer.Option`` constant declared once here; the commands take them as defaults.
Numbers are checked by flag name: 0 and negatives are refused where the help does not give them a
meaning.
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import typer

from bertctl.errors import BertctlError
from bertctl.workers import usable_cpus

ATTN = typer.Option("auto", "--attn", help="Attention: sdpa (PyTorch's fused attention), explicit, unpadded (the "
                    "encoder runs on the real tokens only; on a GPU with FlashAttention's variable-length kernel), "
                    "or auto: unpadded, but sdpa under --compile or CUDA graphs and for pretraining on a GPU, explicit for "
                    "pretraining on a CPU with the compiled kernels.")
CUDA_GRAPHS = typer.Option(None, "--cuda-graphs/--no-cuda-graphs", help="Replay each training step as one CUDA "
                           "graph (one launch instead of ~1,000: batch-32 steps are bound by the host); under torchrun the "
                           "gradient all-reduce is in the graph. Needs GPUs, bf16 or fp32, AdamW, padded attention and "
                           "no --compile; --attn auto then picks sdpa.",
                           show_default="on where it applies")
PRECISION = typer.Option("auto", "--precision", help="auto (bf16 autocast on GPU, fp32 on CPU), bf16, fp16 (with "
                                                     "loss scaling) or fp32.")
NO_PROGRESS = typer.Option(False, "--no-progress", help="No progress bar (metrics are still logged).")
KERNELS = typer.Option("auto", "--kernels", help="Model ops: auto (compiled kernels where built), fused or torch.")
DROPOUT_MASKS = typer.Option("torch", "--dropout-masks", help="Training's dropout masks with the compiled kernels: "
                             "torch's, or fused (the fused sub-layer op's own: faster, but 0.3 MCC lower on an "
                             "acceptability task over 160 seeds).")
COMPILE = typer.Option(False, "--compile", help="torch.compile the model.")
DEVICE = typer.Option("auto", "--device", help="auto (cuda when available), cpu, cuda or cuda:N; under torchrun "
                                               "each process takes its own GPU.")
MICRO_BATCH = typer.Option(None, "--micro-batch-size", help="Examples per process per forward; gradients "
                                                            "accumulate to --batch-size.", show_default="--batch-size "
                                                                                                        "/ processes")
MAX_GRAD_NORM = typer.Option(1.0, "--max-grad-norm", help="Gradient clipping (0 = off).")
RESUME = typer.Option(False, "--resume", help="Continue the unfinished run in --output from its newest checkpoint.")


def resume_option(may_change: str) -> typer.Option:
    """``--resume``, its help naming the flags a resumed run may change (``may_change``); any other flag given
    another value than the run was made with is refused."""
    return typer.Option(False, "--resume", help="Continue the unfinished run in --output from its newest "
                        f"checkpoint. Every flag must be as the run was made, except {may_change}, which may "
                        "change (the run says when one does).")
EXTEND_SCHEDULE = typer.Option(False, "--extend-schedule", help="With --resume and another --max-steps (finetune: or "
                               "--epochs): re-plan the lr decay from the step reached to end at the new last step.")
OVERWRITE = typer.Option(False, "--overwrite", help="Replace the run in --output (its files are kept in "
                         "OUT/.replaced/ until the new run finishes).")
TENSORBOARD = typer.Option(None, "--tensorboard/--no-tensorboard", help="TensorBoard event files in "
                           "OUT/tensorboard/ beside metrics.jsonl.", show_default="on when tensorboard is installed")
DROPOUT = typer.Option(None, "--dropout", help="Override hidden and attention dropout.",
                       show_default="the checkpoint's, 0.1 for BERT")


WORKERS = typer.Option(None, "--workers", min=1, help="Worker processes (the output does not depend on it).",
                       show_default=f"the usable CPUs, {usable_cpus()} here")


def positive(flag: str, value, *, allow_none: bool = True):
    """``value`` > 0 (``None`` allowed where it means "not given"); else one line naming the flag."""
    if value is None:
        if allow_none:
            return None
        raise BertctlError(f"{flag} is required")
    if value <= 0:
        raise BertctlError(f"{flag} must be greater than 0, not {value:g}")
    return value


def non_negative(flag: str, value):
    if value is not None and value < 0:
        raise BertctlError(f"{flag} must be 0 or more, not {value:g}")
    return value


def fraction(flag: str, value: float, *, upper: float = 1.0):
    if not 0 <= value < upper:
        raise BertctlError(f"{flag} must be in [0, {upper:g}), not {value:g}")
    return value


def choice(flag: str, value: str, allowed: tuple[str, ...]) -> str:
    if value not in allowed:
        raise BertctlError(f"{flag} must be one of {', '.join(allowed)}, not {value!r}")
    return value


def check_training(*, batch_size=None, micro_batch_size=None, lr=None, max_steps=None, epochs=None,
                   warmup_fraction=None, weight_decay=None, max_grad_norm=None, save_every=None, log_every=None,
                   precision=None, attn=None, kernels=None, dropout_masks=None, dropout=None, eval_batch_size=None,
                   eval_batch_tokens=None) -> None:
    """The shared training flags, checked by name (``None`` = not given, the default applies)."""
    positive("--batch-size", batch_size)
    positive("--micro-batch-size", micro_batch_size)
    if batch_size is not None and micro_batch_size is not None and micro_batch_size > batch_size:
        raise BertctlError(f"--micro-batch-size {micro_batch_size} is larger than --batch-size {batch_size}")
    positive("--eval-batch-size", eval_batch_size)
    positive("--eval-batch-tokens", eval_batch_tokens)
    positive("--lr", lr)
    positive("--max-steps", max_steps)
    positive("--epochs", epochs)
    if warmup_fraction is not None:
        fraction("--warmup-fraction", warmup_fraction)
    non_negative("--weight-decay", weight_decay)
    non_negative("--max-grad-norm", max_grad_norm)
    non_negative("--save-every", save_every)
    positive("--log-every", log_every)
    if dropout is not None:
        fraction("--dropout", dropout)
    from bertctl.runtime import ATTENTION_CHOICES, DROPOUT_MASK_CHOICES, KERNEL_CHOICES, PRECISION_CHOICES

    if precision is not None:
        choice("--precision", precision, PRECISION_CHOICES)
    if attn is not None:
        choice("--attn", attn, ATTENTION_CHOICES)
    if kernels is not None:
        choice("--kernels", kernels, KERNEL_CHOICES)
    if dropout_masks is not None:
        choice("--dropout-masks", dropout_masks, DROPOUT_MASK_CHOICES)


@contextlib.contextmanager
def run_output(output: Path) -> Iterator[None]:
    """A training command's output folder: a run that fails before its first checkpoint leaves nothing
    (when the folder is its own); one that fails later keeps its checkpoints or trained model and says so."""
    existed = output.exists()
    try:
        yield
    except Exception:
        if int(os.environ.get("RANK", "0")) == 0 and not existed and output.is_dir():
            kept = sorted(output.rglob("step-*"))
            model = output / "model"
            if not kept and not model.is_dir():
                shutil.rmtree(output, ignore_errors=True)
            else:
                from bertctl.progress import stderr

                what = f"checkpoints up to {kept[-1].name} (continue with --resume)" if kept else f"the trained {model}"
                stderr.print(f"kept {output}: {what}")
        raise
