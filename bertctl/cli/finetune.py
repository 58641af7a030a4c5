"""``bertctl finetune glue|squad|ner|swag``: fine-tune a pretrained checkpoint on a task.

Each sub-command reads its data, fine-tunes with the paper's recipe (overridable) and writes to
OUT: ``model/`` (a Hugging Face-compatible directory with the task head and label names),
predictions, ``metrics.json`` (also printed on stdout), ``metrics.jsonl`` and ``checkpoint/``
(for ``--resume``).

Every command takes its own options, then the fine-tuning options they all share (declared once
below, written out in each signature), and hands them to ``finetune_config``.
"""
from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from bertctl.cli import options as opt
from bertctl.errors import BertctlError

if TYPE_CHECKING:  # the config module loads only when a command runs
    from bertctl.config import FinetuneConfig

finetune_app = typer.Typer(help="Fine-tune a pretrained BERT (bertctl's or Hugging Face's) on GLUE, SQuAD, NER "
                                "or SWAG.", no_args_is_help=True)

# Options every sub-command shares (the paper's defaults, Appendix A.3); the flags that pretrain
# shares too are declared once in bertctl.cli.options.
MODEL = typer.Option(..., "--model", help="Pretrained checkpoint directory (bertctl's or Hugging Face's).")
OUTPUT = typer.Option(..., "--output", "-o", help="Output directory.")
EPOCHS = typer.Option(3.0, "--epochs", help="Training epochs (fractions allowed).")
SQUAD_EPOCHS = typer.Option(3.0, "--epochs", help="Training epochs (the paper: 3 for v1.1, 2 for v2.0).")
LR = typer.Option(5e-5, "--lr", help="Peak learning rate (AdamW).")
RESUME = opt.resume_option("--no-progress, --log-every, --tensorboard, --save-every, --device, "
                           "--micro-batch-size, --compile, --cuda-graphs, --graph-min-steps, --eval-batch-size, "
                           "--eval-batch-tokens and (squad) --write-nbest; --max-steps and --epochs may change with "
                           "--extend-schedule")
BATCH = typer.Option(32, "--batch-size", help="Global training batch (examples per optimizer step, all processes).")
EVAL_BATCH = typer.Option(128, "--eval-batch-size", help="Evaluation batch size.")
EVAL_TOKENS = typer.Option(None, "--eval-batch-tokens", help="Padded tokens (examples x longest) per evaluation "
                           "forward pass, at most; examples are sorted by length first.",
                           show_default="1024 on the CPU, 65536 on a GPU")
WARMUP = typer.Option(0.1, "--warmup-fraction", help="Fraction of the steps with linear lr warm-up.")
WD = typer.Option(0.01, "--weight-decay", help="AdamW weight decay (not on biases and LayerNorm).")
SEED = typer.Option(42, "--seed", help="Random seed (head initialisation, data order, dropout).")
REGRESSION = typer.Option(None, "--regression/--no-regression", help="Own data: the label is a number (one output, "
                          "MSE loss; Pearson and Spearman) or a class.",
                          show_default="a number when every label is one and some are written with a decimal "
                                       "point, e.g. 3.4 or 1.0 (a float column, as run_glue reads it)")
GROUP = typer.Option(False, "--group-by-length/--no-group-by-length", help="Batches of similar length (Hugging "
                     "Face's mega-batch scheme): less padding, slightly less random order.")
MAX_STEPS = typer.Option(None, "--max-steps", help="Stop after this many optimizer steps.",
                         show_default="the --epochs")
SAVE_EVERY = typer.Option(0, "--save-every", help="Also checkpoint every N steps (0: at epoch ends only).")
FROM_SCRATCH = typer.Option(False, "--from-scratch", help="Take only the architecture from --model and start from "
                             "random weights (the no-pretraining baseline).")
GRAPH_MIN_STEPS = typer.Option(16, "--graph-min-steps", help="With CUDA graphs: pad a batch whose padded length "
                               "fewer steps of the run share up to a longer common one, and capture a batch shape only "
                               "when the run has at least this many steps of it; rarer shapes train eagerly, with the "
                               "same maths (a capture costs 0.1-0.3 s). 1: every shape, as padded.")
LOG_EVERY = typer.Option(50, "--log-every", help="Steps between logged mean training losses (metrics.jsonl).")
EPOCH_EVALS = typer.Option(True, "--epoch-evals/--no-epoch-evals", help="Score the dev set after every epoch (a "
                           "learning curve in metrics.jsonl), or once, after training.")
# glue's --lr, --batch-size and --epochs take lists too; lists, --task all, --restarts and --grid run the protocol
# (bertctl.tasks.suite: every run its own finetune glue process, the best on dev kept).
GLUE_LR = typer.Option(5e-5, "--lr", help="Peak learning rate (AdamW); a list (5e-5,3e-5) runs each.")
GLUE_BATCH = typer.Option(32, "--batch-size", help="Global training batch (examples per optimizer step, all "
                          "processes); a list (16,32) runs each.")
GLUE_EPOCHS = typer.Option(3.0, "--epochs", help="Training epochs (fractions allowed); a list (2,3,4) runs each.")
RESTARTS = typer.Option(1, "--restarts", help="Fine-tune this many seeds (--seed, --seed + 1, ...) and keep the best "
                        "on dev (§4.1); every seed's score is reported.")
GRID = typer.Option(None, "--grid", help="paper: Appendix A.3's grid (lr 5e-5,4e-5,3e-5,2e-5; batch 16,32; epochs "
                    "2,3,4), the best on dev.")
DEVICES = typer.Option(None, "--devices", help="With several runs: the GPUs they spread over, e.g. 0,1.",
                       show_default="every visible GPU")
PARALLEL = typer.Option(None, "--parallel", help="With several runs: how many run side by side on each GPU (one at a "
                        "time on the CPU).", show_default="as many as fit in its memory")
SQUAD_EPOCH_EVALS = typer.Option(False, "--epoch-evals/--no-epoch-evals", help="Score the dev set after every epoch "
                                 "(a learning curve in metrics.jsonl), or once, after training (as the paper's and "
                                 "Hugging Face's scripts do; each evaluation decodes every dev question's answer).")


@dataclass(frozen=True)
class Run:
    """What a fine-tuning command hands its task from the shared options."""

    model: Path
    output: Path
    cfg: FinetuneConfig
    resume: bool
    overwrite: bool
    dropout: Optional[float]
    extend_schedule: bool = False


def finetune_run(*, model: Path, from_scratch: bool, output: Path, epochs: float, lr: float,
                 batch_size: int, micro_batch_size: Optional[int], eval_batch_size: int,
                 eval_batch_tokens: Optional[int], warmup_fraction: float, weight_decay: float, max_grad_norm: float,
                 dropout: Optional[float], seed: int, device: str, precision: str, group_by_length: bool,
                 compile_: bool, max_steps: Optional[int], save_every: int, resume: bool, overwrite: bool, no_progress: bool,
                 extend_schedule: bool, log_every: int, epoch_evals: bool, kernels: str, dropout_masks: str, attn: str,
                 cuda_graphs: Optional[bool], graph_min_steps: int, tensorboard: Optional[bool]) -> Run:
    """The shared options, every number checked, as the task's ``Run`` (its ``FinetuneConfig``)."""
    from bertctl.config import FinetuneConfig, finetuning_defaults

    opt.check_training(batch_size=batch_size, micro_batch_size=micro_batch_size, lr=lr, max_steps=max_steps,
                       epochs=epochs, warmup_fraction=warmup_fraction, weight_decay=weight_decay,
                       max_grad_norm=max_grad_norm, save_every=save_every, log_every=log_every, precision=precision,
                       attn=attn, kernels=kernels, dropout_masks=dropout_masks, dropout=dropout,
                       eval_batch_size=eval_batch_size, eval_batch_tokens=eval_batch_tokens)
    opt.positive("--graph-min-steps", graph_min_steps)
    if extend_schedule and not resume:
        raise BertctlError("--extend-schedule continues a run: give it with --resume")
    train = dataclasses.replace(  # the recipe's other fields (optimizer, schedule, checkpoints kept) as they are
        finetuning_defaults(), batch_size=batch_size, micro_batch_size=micro_batch_size, max_steps=max_steps, lr=lr,
        weight_decay=weight_decay, max_grad_norm=max_grad_norm, warmup_fraction=warmup_fraction, device=device,
        precision=precision, kernels=kernels, dropout_masks=dropout_masks, attn=attn, compile=compile_,
        cuda_graphs=cuda_graphs, graph_min_steps=graph_min_steps, save_every=save_every, log_every=log_every,
        show_progress=not no_progress, tensorboard=tensorboard, seed=seed)
    cfg = FinetuneConfig(epochs=epochs, eval_batch_size=eval_batch_size, eval_batch_tokens=eval_batch_tokens,
                         group_by_length=group_by_length, from_scratch=from_scratch, epoch_evals=epoch_evals,
                         train=train)
    return Run(model=model, output=output, cfg=cfg, resume=resume, overwrite=overwrite,
               dropout=dropout, extend_schedule=extend_schedule)


def run_flags(ctx: typer.Context, **parsed) -> dict:
    """Every flag of the command, as given or by default (``parsed``: values the command parsed from text),
    for the resumed run's check that it continues the run as it was made."""
    from bertctl.rundir import flag_values

    return flag_values({**ctx.params, **parsed})


@contextlib.contextmanager
def _processes(output: Path):
    """The output folder as ``opt.run_output`` keeps it; under torchrun, leave the process group at the end."""
    from bertctl.train import distributed

    try:
        with opt.run_output(output):
            yield
    finally:
        import torch.distributed as td

        if td.is_available() and td.is_initialized():
            distributed.teardown(distributed.Dist(world_size=td.get_world_size()), synchronize=False)


def glue_command(
    ctx: typer.Context,
    task: Optional[str] = typer.Option(None, "--task", help="cola, sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli, or "
                                                            "all: every task folder in --data-dir (omit for your own "
                                                            "data with --text-column)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="GLUE folder (the task's or the parent)."),
    train: Optional[Path] = typer.Option(None, "--train", help="Own data: training TSV/CSV/JSONL."),
    dev: Optional[Path] = typer.Option(None, "--dev", help="Own data: dev file (or a GLUE dev file to use instead)."),
    text_column: Optional[str] = typer.Option(None, "--text-column", help="Own data: the text column."),
    text_pair_column: Optional[str] = typer.Option(None, "--text-pair-column", help="Own data: second text column."),
    label_column: Optional[str] = typer.Option(None, "--label-column", help="Own data: the label column."),
    regression: Optional[bool] = REGRESSION,
    skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows", help="Skip (and count) malformed rows instead of "
                                                                      "stopping."),
    max_seq_length: int = typer.Option(128, "--max-seq-length", help="Tokens per example, specials included."),
    restarts: int = RESTARTS, grid: Optional[str] = GRID, devices: Optional[str] = DEVICES,
    parallel: Optional[int] = PARALLEL,
    # the shared fine-tuning options (glue's --lr, --batch-size and --epochs take lists)
    model: Path = MODEL, from_scratch: bool = FROM_SCRATCH, output: Path = OUTPUT, epochs: str = GLUE_EPOCHS,
    lr: str = GLUE_LR, batch_size: str = GLUE_BATCH,
    micro_batch_size: Optional[int] = opt.MICRO_BATCH, eval_batch_size: int = EVAL_BATCH,
    eval_batch_tokens: Optional[int] = EVAL_TOKENS, warmup_fraction: float = WARMUP, weight_decay: float = WD,
    max_grad_norm: float = opt.MAX_GRAD_NORM, dropout: Optional[float] = opt.DROPOUT, seed: int = SEED,
    device: str = opt.DEVICE, precision: str = opt.PRECISION, group_by_length: bool = GROUP,
    compile_: bool = opt.COMPILE, max_steps: Optional[int] = MAX_STEPS, save_every: int = SAVE_EVERY,
    resume: bool = RESUME, extend_schedule: bool = opt.EXTEND_SCHEDULE, overwrite: bool = opt.OVERWRITE, no_progress: bool = opt.NO_PROGRESS, log_every: int = LOG_EVERY,
    epoch_evals: bool = EPOCH_EVALS, kernels: str = opt.KERNELS, dropout_masks: str = opt.DROPOUT_MASKS,
    attn: str = opt.ATTN, cuda_graphs: Optional[bool] = opt.CUDA_GRAPHS, graph_min_steps: int = GRAPH_MIN_STEPS,
    tensorboard: Optional[bool] = opt.TENSORBOARD,
) -> None:
    """Fine-tune a sentence(-pair) classifier or regressor on a GLUE task or your own data; or run the paper's
    protocol (--task all, --restarts, --grid, lists): every run, the best on dev, summary.md as Table 1."""
    from bertctl.tasks import grid as lists

    if lists.wanted(task, lr, batch_size, epochs, restarts, grid):
        from bertctl.tasks import suite

        suite.from_cli(ctx)
        return
    lr, batch_size, epochs = lists.one_setting(lr, batch_size, epochs)
    run = finetune_run(
        model=model, from_scratch=from_scratch, output=output, epochs=epochs, lr=lr, 
        batch_size=batch_size, micro_batch_size=micro_batch_size, eval_batch_size=eval_batch_size,
        eval_batch_tokens=eval_batch_tokens, warmup_fraction=warmup_fraction, weight_decay=weight_decay,
        max_grad_norm=max_grad_norm, dropout=dropout, seed=seed, device=device, precision=precision,
        group_by_length=group_by_length, compile_=compile_, max_steps=max_steps, save_every=save_every, resume=resume, overwrite=overwrite, extend_schedule=extend_schedule,
        no_progress=no_progress, log_every=log_every, epoch_evals=epoch_evals, kernels=kernels,
        dropout_masks=dropout_masks, attn=attn, cuda_graphs=cuda_graphs, graph_min_steps=graph_min_steps,
        tensorboard=tensorboard)
    # the flags are checked above, before the task's modules load torch
    from bertctl.tasks import glue as g
    from bertctl.tasks.base import finetune

    data = g.load_data(task=task, data_dir=data_dir, train=train, dev=dev, text_column=text_column,
                       text_pair_column=text_pair_column, label_column=label_column, regression=regression,
                       skip_bad_rows=skip_bad_rows)
    with _processes(run.output):
        finetune(g.Glue(data, max_seq_length), run.model, run.output, run.cfg, resume=run.resume,
                 overwrite=run.overwrite, dropout=run.dropout, extend_schedule=run.extend_schedule,
                 flags=run_flags(ctx, lr=run.cfg.train.lr, batch_size=run.cfg.train.batch_size, epochs=run.cfg.epochs))


def squad_command(
    ctx: typer.Context,
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
    # the shared fine-tuning options (SQuAD's own --epochs help and --epoch-evals default)
    model: Path = MODEL, from_scratch: bool = FROM_SCRATCH, output: Path = OUTPUT, epochs: float = SQUAD_EPOCHS,
    lr: float = LR, batch_size: int = BATCH,
    micro_batch_size: Optional[int] = opt.MICRO_BATCH, eval_batch_size: int = EVAL_BATCH,
    eval_batch_tokens: Optional[int] = EVAL_TOKENS, warmup_fraction: float = WARMUP, weight_decay: float = WD,
    max_grad_norm: float = opt.MAX_GRAD_NORM, dropout: Optional[float] = opt.DROPOUT, seed: int = SEED,
    device: str = opt.DEVICE, precision: str = opt.PRECISION, group_by_length: bool = GROUP,
    compile_: bool = opt.COMPILE, max_steps: Optional[int] = MAX_STEPS, save_every: int = SAVE_EVERY,
    resume: bool = RESUME, extend_schedule: bool = opt.EXTEND_SCHEDULE, overwrite: bool = opt.OVERWRITE, no_progress: bool = opt.NO_PROGRESS, log_every: int = LOG_EVERY,
    epoch_evals: bool = SQUAD_EPOCH_EVALS, kernels: str = opt.KERNELS, dropout_masks: str = opt.DROPOUT_MASKS,
    attn: str = opt.ATTN, cuda_graphs: Optional[bool] = opt.CUDA_GRAPHS, graph_min_steps: int = GRAPH_MIN_STEPS,
    tensorboard: Optional[bool] = opt.TENSORBOARD,
) -> None:
    """Fine-tune span question answering on SQuAD v1.1 or v2.0 (windows of 384 tokens, stride 128)."""
    run = finetune_run(
        model=model, from_scratch=from_scratch, output=output, epochs=epochs, lr=lr, 
        batch_size=batch_size, micro_batch_size=micro_batch_size, eval_batch_size=eval_batch_size,
        eval_batch_tokens=eval_batch_tokens, warmup_fraction=warmup_fraction, weight_decay=weight_decay,
        max_grad_norm=max_grad_norm, dropout=dropout, seed=seed, device=device, precision=precision,
        group_by_length=group_by_length, compile_=compile_, max_steps=max_steps, save_every=save_every, resume=resume, overwrite=overwrite, extend_schedule=extend_schedule,
        no_progress=no_progress, log_every=log_every, epoch_evals=epoch_evals, kernels=kernels,
        dropout_masks=dropout_masks, attn=attn, cuda_graphs=cuda_graphs, graph_min_steps=graph_min_steps,
        tensorboard=tensorboard)
    # the flags are checked above, before the task's modules load torch
    from bertctl.tasks import squad as s
    from bertctl.tasks.base import finetune

    scfg = s.SquadConfig(max_seq_length, doc_stride, max_query_length, n_best_size, max_answer_length, version_2)
    train_data = s.read_squad(train, articles=train_articles, version_2=version_2, training=True)
    dev_data = s.read_squad(dev, articles=dev_articles, version_2=version_2)
    with _processes(run.output):
        finetune(s.Squad(train_data, dev_data, scfg, write_nbest=write_nbest), run.model, run.output, run.cfg,
                 resume=run.resume, overwrite=run.overwrite, dropout=run.dropout, extend_schedule=run.extend_schedule, flags=run_flags(ctx))


def ner_command(
    ctx: typer.Context,
    data_dir: Path = typer.Option(..., "--data-dir", help="Folder with train.txt, valid.txt, test.txt (CoNLL)."),
    max_seq_length: int = typer.Option(128, "--max-seq-length"),
    # the shared fine-tuning options
    model: Path = MODEL, from_scratch: bool = FROM_SCRATCH, output: Path = OUTPUT, epochs: float = EPOCHS,
    lr: float = LR, batch_size: int = BATCH,
    micro_batch_size: Optional[int] = opt.MICRO_BATCH, eval_batch_size: int = EVAL_BATCH,
    eval_batch_tokens: Optional[int] = EVAL_TOKENS, warmup_fraction: float = WARMUP, weight_decay: float = WD,
    max_grad_norm: float = opt.MAX_GRAD_NORM, dropout: Optional[float] = opt.DROPOUT, seed: int = SEED,
    device: str = opt.DEVICE, precision: str = opt.PRECISION, group_by_length: bool = GROUP,
    compile_: bool = opt.COMPILE, max_steps: Optional[int] = MAX_STEPS, save_every: int = SAVE_EVERY,
    resume: bool = RESUME, extend_schedule: bool = opt.EXTEND_SCHEDULE, overwrite: bool = opt.OVERWRITE, no_progress: bool = opt.NO_PROGRESS, log_every: int = LOG_EVERY,
    epoch_evals: bool = EPOCH_EVALS, kernels: str = opt.KERNELS, dropout_masks: str = opt.DROPOUT_MASKS,
    attn: str = opt.ATTN, cuda_graphs: Optional[bool] = opt.CUDA_GRAPHS, graph_min_steps: int = GRAPH_MIN_STEPS,
    tensorboard: Optional[bool] = opt.TENSORBOARD,
) -> None:
    """Fine-tune NER on CoNLL-format data; the epoch is chosen on valid, scores reported on test."""
    run = finetune_run(
        model=model, from_scratch=from_scratch, output=output, epochs=epochs, lr=lr, 
        batch_size=batch_size, micro_batch_size=micro_batch_size, eval_batch_size=eval_batch_size,
        eval_batch_tokens=eval_batch_tokens, warmup_fraction=warmup_fraction, weight_decay=weight_decay,
        max_grad_norm=max_grad_norm, dropout=dropout, seed=seed, device=device, precision=precision,
        group_by_length=group_by_length, compile_=compile_, max_steps=max_steps, save_every=save_every, resume=resume, overwrite=overwrite, extend_schedule=extend_schedule,
        no_progress=no_progress, log_every=log_every, epoch_evals=epoch_evals, kernels=kernels,
        dropout_masks=dropout_masks, attn=attn, cuda_graphs=cuda_graphs, graph_min_steps=graph_min_steps,
        tensorboard=tensorboard)
    # the flags are checked above, before the task's modules load torch
    from bertctl.tasks import ner as n
    from bertctl.tasks.base import finetune

    with _processes(run.output):
        finetune(n.Ner(data_dir=data_dir, max_seq_length=max_seq_length), run.model, run.output, run.cfg,
                 resume=run.resume, overwrite=run.overwrite, dropout=run.dropout, extend_schedule=run.extend_schedule, flags=run_flags(ctx))


def swag_command(
    ctx: typer.Context,
    train: Path = typer.Option(..., "--train", help="SWAG training JSONL or CSV."),
    dev: Path = typer.Option(..., "--dev", help="SWAG dev JSONL or CSV."),
    max_seq_length: int = typer.Option(128, "--max-seq-length"),
    # the shared fine-tuning options
    model: Path = MODEL, from_scratch: bool = FROM_SCRATCH, output: Path = OUTPUT, epochs: float = EPOCHS,
    lr: float = LR, batch_size: int = BATCH,
    micro_batch_size: Optional[int] = opt.MICRO_BATCH, eval_batch_size: int = EVAL_BATCH,
    eval_batch_tokens: Optional[int] = EVAL_TOKENS, warmup_fraction: float = WARMUP, weight_decay: float = WD,
    max_grad_norm: float = opt.MAX_GRAD_NORM, dropout: Optional[float] = opt.DROPOUT, seed: int = SEED,
    device: str = opt.DEVICE, precision: str = opt.PRECISION, group_by_length: bool = GROUP,
    compile_: bool = opt.COMPILE, max_steps: Optional[int] = MAX_STEPS, save_every: int = SAVE_EVERY,
    resume: bool = RESUME, extend_schedule: bool = opt.EXTEND_SCHEDULE, overwrite: bool = opt.OVERWRITE, no_progress: bool = opt.NO_PROGRESS, log_every: int = LOG_EVERY,
    epoch_evals: bool = EPOCH_EVALS, kernels: str = opt.KERNELS, dropout_masks: str = opt.DROPOUT_MASKS,
    attn: str = opt.ATTN, cuda_graphs: Optional[bool] = opt.CUDA_GRAPHS, graph_min_steps: int = GRAPH_MIN_STEPS,
    tensorboard: Optional[bool] = opt.TENSORBOARD,
) -> None:
    """Fine-tune multiple choice (four endings, softmax over [CLS] scores) on SWAG."""
    run = finetune_run(
        model=model, from_scratch=from_scratch, output=output, epochs=epochs, lr=lr, 
        batch_size=batch_size, micro_batch_size=micro_batch_size, eval_batch_size=eval_batch_size,
        eval_batch_tokens=eval_batch_tokens, warmup_fraction=warmup_fraction, weight_decay=weight_decay,
        max_grad_norm=max_grad_norm, dropout=dropout, seed=seed, device=device, precision=precision,
        group_by_length=group_by_length, compile_=compile_, max_steps=max_steps, save_every=save_every, resume=resume, overwrite=overwrite, extend_schedule=extend_schedule,
        no_progress=no_progress, log_every=log_every, epoch_evals=epoch_evals, kernels=kernels,
        dropout_masks=dropout_masks, attn=attn, cuda_graphs=cuda_graphs, graph_min_steps=graph_min_steps,
        tensorboard=tensorboard)
    # the flags are checked above, before the task's modules load torch
    from bertctl.tasks import swag as w
    from bertctl.tasks.base import finetune

    with _processes(run.output):
        finetune(w.Swag(train, dev, max_seq_length), run.model, run.output, run.cfg, resume=run.resume,
                 overwrite=run.overwrite, dropout=run.dropout, extend_schedule=run.extend_schedule, flags=run_flags(ctx))


finetune_app.command("glue")(glue_command)
finetune_app.command("squad")(squad_command)
finetune_app.command("ner")(ner_command)
finetune_app.command("swag")(swag_command)


def register(app: typer.Typer) -> None:
    app.add_typer(finetune_app, name="finetune")
