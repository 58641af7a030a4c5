"""``bertctl eval glue|squad|ner|swag``: score a fine-tuned model on a data file, or (SQuAD) a
predictions file against gold with the official rules. Metrics JSON goes to stdout."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Optional

import typer

from bertctl.cli import options as opt
from bertctl.errors import BertctlError
from bertctl.io import check_writable

if TYPE_CHECKING:  # the config module loads only when a command runs
    from bertctl.config import FinetuneConfig

eval_app = typer.Typer(help="Evaluate a fine-tuned model, or score SQuAD predictions with the official rules.",
                       no_args_is_help=True)

MODEL = typer.Option(None, "--model", help="Fine-tuned model directory (or a finetune OUT folder).")
OUTPUT = typer.Option(None, "--output", "-o", help="Folder for metrics.json (and the predictions, with --model).")
EVAL_BATCH = typer.Option(128, "--batch-size", help="Evaluation batch size.")
EVAL_TOKENS = typer.Option(None, "--batch-tokens", help="Padded tokens (examples x longest) per forward pass, at "
                           "most; examples are sorted by length first.", show_default="1024 on the CPU, 65536 on a GPU")
DEVICE = typer.Option("auto", "--device", help="auto, cpu, cuda or cuda:N.")


def _cfg(batch_size: int, batch_tokens: int | None, device: str, no_progress: bool) -> FinetuneConfig:
    import dataclasses

    from bertctl.config import FinetuneConfig, finetuning_defaults

    opt.positive("--batch-size", batch_size)
    opt.positive("--batch-tokens", batch_tokens)
    train = dataclasses.replace(finetuning_defaults(), device=device, show_progress=not no_progress)
    return FinetuneConfig(eval_batch_size=batch_size, eval_batch_tokens=batch_tokens, train=train)


def _need_model(model: Optional[Path], output: Optional[Path]) -> Path:
    if model is None:
        raise BertctlError("--model FINETUNED_DIR is required")
    _check_output(output)
    return model


def _check_output(output: Optional[Path]) -> None:
    """An -o folder that cannot be written fails before the evaluation, not after it."""
    if output is not None:
        check_writable(output, folder=True)


@eval_app.command("squad")
def squad(
    data: Path = typer.Option(..., "--data", help="SQuAD JSON with gold answers."),
    predictions: Optional[Path] = typer.Option(None, "--predictions", help="Score this {id: answer} JSON (official "
                                                                           "rules) instead of running a model."),
    version_2: bool = typer.Option(False, "--version-2", help="SQuAD 2.0 rules (HasAns/NoAns, thresholds)."),
    na_prob: Optional[Path] = typer.Option(None, "--na-prob", help="v2.0: {id: no-answer odds} JSON (null_odds.json)."),
    na_prob_thresh: float = typer.Option(1.0, "--na-prob-thresh", help="v2.0: odds above this count as no answer."),
    articles: Optional[str] = typer.Option(None, "--articles",
                                           help="FILE:KEY, e.g. split.json:eval; only these articles."),
    null_threshold: Optional[float] = typer.Option(None, "--null-threshold", help="v2.0 with --model: τ for "
                                                   "s_null - s_best (default: the model's, else chosen on this data)."),
    model: Optional[Path] = MODEL, output: Optional[Path] = OUTPUT, batch_size: int = EVAL_BATCH,
    batch_tokens: Optional[int] = EVAL_TOKENS,
    device: str = DEVICE, no_progress: bool = opt.NO_PROGRESS,
    max_seq_length: int = typer.Option(384, "--max-seq-length"),
    doc_stride: int = typer.Option(128, "--doc-stride"),
    max_query_length: int = typer.Option(64, "--max-query-length"),
    n_best_size: int = typer.Option(20, "--n-best-size"),
    max_answer_length: int = typer.Option(30, "--max-answer-length"),
) -> None:
    """Exact match and F1 (and HasAns/NoAns for v2.0) of predictions or of a fine-tuned model."""
    from bertctl.tasks import squad as s
    from bertctl.tasks.base import evaluate
    from bertctl.tasks.common import emit_metrics

    if predictions is not None:
        if model is not None:
            raise BertctlError("give either --predictions or --model, not both")
        _check_output(output)
        result = s.score_files(data, predictions, version_2=version_2, na_prob_path=na_prob,
                               na_prob_thresh=na_prob_thresh, articles=articles)
        emit_metrics(output, result)  # stdout, and OUT/metrics.json with -o
        return
    scfg = s.SquadConfig(max_seq_length, doc_stride, max_query_length, n_best_size, max_answer_length, version_2)
    dev = s.read_squad(data, articles=articles, version_2=version_2)
    cfg = _cfg(batch_size, batch_tokens, device, no_progress)
    evaluate(s.Squad(None, dev, scfg, threshold=null_threshold, write_nbest=False), _need_model(model, output), cfg,
             output=output)


@eval_app.command("glue")
def glue(
    task: Optional[str] = typer.Option(None, "--task", help="GLUE task (omit for your own data)."),
    data: Optional[Path] = typer.Option(None, "--data", help="A dev/test file (GLUE TSV, or own TSV/CSV/JSONL)."),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="GLUE task folder: evaluate its dev file(s)."),
    text_column: Optional[str] = typer.Option(None, "--text-column"),
    text_pair_column: Optional[str] = typer.Option(None, "--text-pair-column"),
    label_column: Optional[str] = typer.Option(None, "--label-column"),
    regression: Optional[bool] = typer.Option(None, "--regression/--no-regression", help="Own data: the label is a "
                                              "number or a class.", show_default="as the model's head: one output "
                                              "is a regression"),
    skip_bad_rows: bool = typer.Option(False, "--skip-bad-rows"),
    max_seq_length: int = typer.Option(128, "--max-seq-length"),
    model: Optional[Path] = MODEL, output: Optional[Path] = OUTPUT, batch_size: int = EVAL_BATCH,
    batch_tokens: Optional[int] = EVAL_TOKENS,
    device: str = DEVICE, no_progress: bool = opt.NO_PROGRESS,
) -> None:
    """Accuracy / F1 / MCC / correlations of a fine-tuned classifier on a GLUE dev file or your data."""
    from bertctl.tasks import glue as g
    from bertctl.tasks.base import evaluate

    if data is None and data_dir is None:
        raise BertctlError("give --data FILE or --data-dir GLUE_TASK_DIR")
    if text_column is None and task is not None and data is not None:
        spec = g.task_spec(task)
        examples, report = g.read_glue_tsv(data, spec, skip_bad_rows=skip_bad_rows, require_labels=False)
        glue_data = g.GlueData(spec, [], [(spec.name, Path(data), examples)], [report])
    else:
        if regression is None and text_column is not None:  # own data: as the fine-tuned head
            regression = g.regression_head(_need_model(model, output))
        glue_data = g.load_data(task=task, data_dir=data_dir, dev=data, text_column=text_column,
                                text_pair_column=text_pair_column, label_column=label_column, regression=regression,
                                skip_bad_rows=skip_bad_rows, need_train=False)
    cfg = _cfg(batch_size, batch_tokens, device, no_progress)
    evaluate(g.Glue(glue_data, max_seq_length, training=False), _need_model(model, output), cfg, output=output)


@eval_app.command("ner")
def ner(
    data: Path = typer.Option(..., "--data", help="CoNLL-format file with gold tags."),
    max_seq_length: int = typer.Option(128, "--max-seq-length"),
    model: Optional[Path] = MODEL, output: Optional[Path] = OUTPUT, batch_size: int = EVAL_BATCH,
    batch_tokens: Optional[int] = EVAL_TOKENS,
    device: str = DEVICE, no_progress: bool = opt.NO_PROGRESS,
) -> None:
    """Entity-level precision/recall/F1 (conlleval rules, per type too) of a fine-tuned tagger."""
    from bertctl.tasks import ner as n
    from bertctl.tasks.base import evaluate

    cfg = _cfg(batch_size, batch_tokens, device, no_progress)
    evaluate(n.Ner(data_path=data, max_seq_length=max_seq_length), _need_model(model, output), cfg, output=output)


@eval_app.command("swag")
def swag(
    data: Path = typer.Option(..., "--data", help="SWAG JSONL or CSV."),
    max_seq_length: int = typer.Option(128, "--max-seq-length"),
    model: Optional[Path] = MODEL, output: Optional[Path] = OUTPUT, batch_size: int = EVAL_BATCH,
    batch_tokens: Optional[int] = EVAL_TOKENS,
    device: str = DEVICE, no_progress: bool = opt.NO_PROGRESS,
) -> None:
    """Accuracy of a fine-tuned multiple-choice model."""
    from bertctl.tasks import swag as w
    from bertctl.tasks.base import evaluate

    cfg = _cfg(batch_size, batch_tokens, device, no_progress)
    evaluate(w.Swag(None, data, max_seq_length), _need_model(model, output), cfg, output=output)


def register(app: typer.Typer) -> None:
    app.add_typer(eval_app, name="eval")
