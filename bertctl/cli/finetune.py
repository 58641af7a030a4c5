"""``bertctl finetune glue|squad|ner|swag``: fine-tune a pretrained checkpoint on a task.

Each sub-command reads its data, fine-tunes with the paper's recipe (overridable) and writes to
OUT: ``model/`` (a Hugging Face-compatible directory with the task head and label names),
predictions, ``metrics.json`` (also printed on stdout), ``metrics.jsonl`` and ``checkpoint/``
(for ``--resume``).
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from bertctl.tasks.trainer import TrainConfig

finetune_app = typer.Typer(help="Fine-tune a pretrained BERT (bertctl's or Hugging Face's) on GLUE, SQuAD, NER "
                                "or SWAG.", no_args_is_help=True)

# Options every sub-command shares (the paper's defaults, Appendix A.3).
MODEL = typer.Option(..., "--model", help="Pretrained checkpoint directory (bertctl's or Hugging Face's).")
OUTPUT = typer.Option(..., "--output", "-o", help="Output directory.")
EPOCHS = typer.Option(3.0, "--epochs", help="Training epochs (fractions allowed).")
LR = typer.Option(5e-5, "--lr", help="Peak learning rate (AdamW).")
LR_SWEEP = typer.Option(False, "--lr-sweep", help="Try lr 5e-5, 4e-5, 3e-5, 2e-5 and keep the best on dev.")
BATCH = typer.Option(32, "--batch-size", help="Training batch size.")
EVAL_BATCH = typer.Option(128, "--eval-batch-size", help="Evaluation batch size.")
WARMUP = typer.Option(0.1, "--warmup", help="Fraction of steps with linear lr warm-up.")
WD = typer.Option(0.01, "--weight-decay", help="AdamW weight decay (not on biases and LayerNorm).")
DROPOUT = typer.Option(None, "--dropout", help="Override hidden and attention dropout (default: the checkpoint's, "
                                               "0.1 for BERT).")
SEED = typer.Option(42, "--seed", help="Random seed (initialisation, data order, dropout).")
DEVICE = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")
NO_BF16 = typer.Option(False, "--no-bf16", help="Train in fp32 on GPU (default: bf16 autocast).")
NO_GROUP = typer.Option(False, "--no-group-by-length", help="Plain random batches (default: length-grouped).")
COMPILE = typer.Option(False, "--compile", help="torch.compile the model.")
KERNELS = typer.Option("auto", "--kernels", help="Model ops: auto (compiled kernels where built), fused or torch.")
ATTENTION = typer.Option("sdpa", "--attention", help="Attention: sdpa (PyTorch's fused attention) or explicit.")
MAX_STEPS = typer.Option(None, "--max-steps", help="Stop after this many optimizer steps.")
SAVE_STEPS = typer.Option(0, "--save-steps", help="Also checkpoint every N steps (0: at epoch ends only).")
RESUME = typer.Option(False, "--resume", help="Continue from the last checkpoint in OUT.")
QUIET = typer.Option(False, "--quiet", "-q", help="No progress bars.")
LOG_STEPS = typer.Option(50, "--log-steps", help="Log the mean training loss every N steps (metrics.jsonl).")


def _train_config(epochs, lr, batch_size, eval_batch_size, warmup, weight_decay, seed, device, no_bf16,
                  no_group_by_length, compile_, max_steps, save_steps, quiet, log_steps=50, kernels="auto",
                  attention="sdpa") -> TrainConfig:
    from bertctl.errors import BertctlError

    if batch_size < 1 or eval_batch_size < 1:
        raise BertctlError("--batch-size and --eval-batch-size must be >= 1")
    if epochs <= 0:
        raise BertctlError("--epochs must be > 0")
    if not 0 <= warmup < 1:
        raise BertctlError("--warmup must be in [0, 1)")
    return TrainConfig(epochs=epochs, lr=lr, batch_size=batch_size, eval_batch_size=eval_batch_size,
                       warmup_ratio=warmup, weight_decay=weight_decay, seed=seed, device=device, bf16=not no_bf16,
                       group_by_length=not no_group_by_length, compile=compile_, max_steps=max_steps,
                       save_steps=save_steps, progress=not quiet,
                       log_steps=max(1, log_steps), kernels=kernels, attention=attention)


@finetune_app.command("glue")
def glue(
    task: Optional[str] = typer.Option(None, "--task", help="cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli "
                                                            "(omit for your own data with --text-column)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="GLUE folder (the task's or the parent)."),
    train: Optional[Path] = typer.Option(None, "--train", help="Own data: training TSV/CSV/JSONL."),
    dev: Optional[Path] = typer.Option(None, "--dev", help="Own data: dev file (or a GLUE dev file to use instead)."),
    text_column: Optional[str] = typer.Option(None, "--text-column", help="Own data: the text column."),
    text_pair_column: Optional[str] = typer.Option(None, "--text-pair-column", help="Own data: second text column."),
    label_column: Optional[str] = typer.Option(None, "--label-column", help="Own data: the label column."),
    regression: bool = typer.Option(False, "--regression", help="Own data: the label is a number (MSE loss)."),
    skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows", help="Skip (and count) malformed rows instead of "
                                                                      "stopping."),
    max_seq_length: int = typer.Option(128, "--max-seq-length", help="Tokens per example, specials included."),
    model: Path = MODEL, output: Path = OUTPUT, epochs: float = EPOCHS, lr: float = LR, lr_sweep: bool = LR_SWEEP,
    batch_size: int = BATCH, eval_batch_size: int = EVAL_BATCH, warmup: float = WARMUP, weight_decay: float = WD,
    dropout: Optional[float] = DROPOUT, seed: int = SEED, device: str = DEVICE, no_bf16: bool = NO_BF16,
    no_group_by_length: bool = NO_GROUP, compile_: bool = COMPILE, max_steps: Optional[int] = MAX_STEPS,
    save_steps: int = SAVE_STEPS, resume: bool = RESUME, quiet: bool = QUIET,
    log_steps: int = LOG_STEPS, kernels: str = KERNELS, attention: str = ATTENTION,
) -> None:
    """Fine-tune a sentence(-pair) classifier or regressor on a GLUE task or your own data."""
    from bertctl.tasks import glue as g

    cfg = _train_config(epochs, lr, batch_size, eval_batch_size, warmup, weight_decay, seed, device, no_bf16,
                        no_group_by_length, compile_, max_steps, save_steps, quiet, log_steps, kernels, attention)
    data = g.load_data(task=task, data_dir=data_dir, train=train, dev=dev, text_column=text_column,
                       text_pair_column=text_pair_column, label_column=label_column, regression=regression,
                       skip_bad_rows=skip_bad_rows)
    g.run_finetune(data, model, output, cfg, max_seq_length=max_seq_length, lr_sweep=lr_sweep, resume=resume,
                   dropout=dropout)


@finetune_app.command("squad")
def squad(
    train: Path = typer.Option(..., "--train", help="SQuAD training JSON."),
    dev: Path = typer.Option(..., "--dev", help="SQuAD dev JSON."),
    train_articles: Optional[str] = typer.Option(None, "--train-articles", help="FILE:KEY, e.g. split.json:train; train "
                                                                                "only on the articles listed there."),
    dev_articles: Optional[str] = typer.Option(None, "--dev-articles", help="FILE:KEY, e.g. split.json:eval; "
                                                                            "evaluate only on these articles."),
    version_2: bool = typer.Option(False, "--version-2", help="SQuAD 2.0: unanswerable questions, null threshold."),
    max_seq_length: int = typer.Option(384, "--max-seq-length"),
    doc_stride: int = typer.Option(128, "--doc-stride", help="Context tokens between window starts."),
    max_query_length: int = typer.Option(64, "--max-query-length"),
    n_best_size: int = typer.Option(20, "--n-best-size"),
    max_answer_length: int = typer.Option(30, "--max-answer-length"),
    write_nbest: bool = typer.Option(False, "--write-nbest", help="Also write nbest_predictions.json."),
    epochs: float = typer.Option(3.0, "--epochs", help="Training epochs (the paper: 3 for v1.1, 2 for v2.0)."),
    model: Path = MODEL, output: Path = OUTPUT, lr: float = LR,
    lr_sweep: bool = LR_SWEEP, batch_size: int = BATCH, eval_batch_size: int = EVAL_BATCH, warmup: float = WARMUP,
    weight_decay: float = WD, dropout: Optional[float] = DROPOUT, seed: int = SEED, device: str = DEVICE,
    no_bf16: bool = NO_BF16, no_group_by_length: bool = NO_GROUP, compile_: bool = COMPILE,
    max_steps: Optional[int] = MAX_STEPS, save_steps: int = SAVE_STEPS, resume: bool = RESUME, quiet: bool = QUIET,
    log_steps: int = LOG_STEPS, kernels: str = KERNELS, attention: str = ATTENTION,
) -> None:
    """Fine-tune span question answering on SQuAD v1.1 or v2.0 (windows of 384 tokens, stride 128)."""
    from bertctl.tasks import squad as s

    cfg = _train_config(epochs, lr, batch_size, eval_batch_size, warmup, weight_decay, seed, device, no_bf16,
                        no_group_by_length, compile_, max_steps, save_steps, quiet, log_steps, kernels, attention)
    scfg = s.SquadConfig(max_seq_length, doc_stride, max_query_length, n_best_size, max_answer_length, version_2)
    train_data = s.read_squad(train, articles=train_articles, version_2=version_2, training=True)
    dev_data = s.read_squad(dev, articles=dev_articles, version_2=version_2)
    s.run_finetune(train_data, dev_data, model, output, cfg, scfg, lr_sweep=lr_sweep, resume=resume, dropout=dropout,
                   write_nbest=write_nbest)


@finetune_app.command("ner")
def ner(
    data_dir: Path = typer.Option(..., "--data-dir", help="Folder with train.txt, valid.txt, test.txt (CoNLL)."),
    max_seq_length: int = typer.Option(128, "--max-seq-length"),
    model: Path = MODEL, output: Path = OUTPUT, epochs: float = EPOCHS, lr: float = LR, lr_sweep: bool = LR_SWEEP,
    batch_size: int = BATCH, eval_batch_size: int = EVAL_BATCH, warmup: float = WARMUP, weight_decay: float = WD,
    dropout: Optional[float] = DROPOUT, seed: int = SEED, device: str = DEVICE, no_bf16: bool = NO_BF16,
    no_group_by_length: bool = NO_GROUP, compile_: bool = COMPILE, max_steps: Optional[int] = MAX_STEPS,
    save_steps: int = SAVE_STEPS, resume: bool = RESUME, quiet: bool = QUIET,
    log_steps: int = LOG_STEPS, kernels: str = KERNELS, attention: str = ATTENTION,
) -> None:
    """Fine-tune NER on CoNLL-format data; the epoch is chosen on valid, scores reported on test."""
    from bertctl.tasks import ner as n

    cfg = _train_config(epochs, lr, batch_size, eval_batch_size, warmup, weight_decay, seed, device, no_bf16,
                        no_group_by_length, compile_, max_steps, save_steps, quiet, log_steps, kernels, attention)
    n.run_finetune(data_dir, model, output, cfg, max_seq_length=max_seq_length, lr_sweep=lr_sweep, resume=resume,
                   dropout=dropout)


@finetune_app.command("swag")
def swag(
    train: Path = typer.Option(..., "--train", help="SWAG training JSONL or CSV."),
    dev: Path = typer.Option(..., "--dev", help="SWAG dev JSONL or CSV."),
    max_seq_length: int = typer.Option(128, "--max-seq-length"),
    model: Path = MODEL, output: Path = OUTPUT, epochs: float = EPOCHS, lr: float = LR, lr_sweep: bool = LR_SWEEP,
    batch_size: int = BATCH, eval_batch_size: int = EVAL_BATCH, warmup: float = WARMUP, weight_decay: float = WD,
    dropout: Optional[float] = DROPOUT, seed: int = SEED, device: str = DEVICE, no_bf16: bool = NO_BF16,
    no_group_by_length: bool = NO_GROUP, compile_: bool = COMPILE, max_steps: Optional[int] = MAX_STEPS,
    save_steps: int = SAVE_STEPS, resume: bool = RESUME, quiet: bool = QUIET,
    log_steps: int = LOG_STEPS, kernels: str = KERNELS, attention: str = ATTENTION,
) -> None:
    """Fine-tune multiple choice (four endings, softmax over [CLS] scores) on SWAG."""
    from bertctl.tasks import swag as w

    cfg = _train_config(epochs, lr, batch_size, eval_batch_size, warmup, weight_decay, seed, device, no_bf16,
                        no_group_by_length, compile_, max_steps, save_steps, quiet, log_steps, kernels, attention)
    w.run_finetune(train, dev, model, output, cfg, max_seq_length=max_seq_length, lr_sweep=lr_sweep, resume=resume,
                   dropout=dropout)


def register(app: typer.Typer) -> None:
    app.add_typer(finetune_app, name="finetune")
