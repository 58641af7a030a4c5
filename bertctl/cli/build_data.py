"""``bertctl build-data``: raw text -> sharded BERT pretraining instances (summary JSON on stdout)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import List, Optional

import typer

from bertctl.cli.options import OVERWRITE, WORKERS
from bertctl.workers import usable_cpus


def register(app: typer.Typer) -> None:
    @app.command("build-data")
    def build_data_command(
        inputs: List[Path] = typer.Argument(..., help="Input files or folders (folders are walked recursively); gzip, "
                                                      "bzip2, xz and zstd files are decompressed as they are read; "
                                                      "- reads stdin."),
        output: Path = typer.Option(..., "--output", "-o", help="Output folder: manifest.json, vocab.txt and shards."),
        vocab: Optional[Path] = typer.Option(None, "--vocab", show_default=False,
                                             help="WordPiece vocab.txt, or a tokenizer folder (WordPiece or SentencePiece)."),
        spm_model: Optional[Path] = typer.Option(None, "--spm-model", show_default=False,
                                                 help="SentencePiece .model file (instead of --vocab)."),
        cased: bool = typer.Option(False, "--cased", help="Keep case and accents (cased vocabularies)."),
        objective: str = typer.Option("mlm-nsp", "--objective",
                                      help="mlm-nsp: the paper's sentence pairs with next-sentence labels; mlm: "
                                           "masked LM only (the paper's No NSP ablation), [CLS] whole sentences of "
                                           "one document packed to --max-seq-length [SEP], one segment."),
        fmt: str = typer.Option("lines", "--format",
                                help="lines: one sentence per line, blank line between documents; "
                                     "text: raw prose, one document per file; jsonl: one document per line; "
                                     "wikiextractor: <doc> blocks; parquet, arrow (a datasets cache): one document "
                                     "per row."),
        text_field: str = typer.Option("text", "--text-field",
                                       help="jsonl, parquet, arrow: field holding the document text."),
        doc_separator: Optional[str] = typer.Option(None, "--doc-separator",
                                                    help="text: a line equal to this ends a document."),
        pattern: str = typer.Option("*", "--pattern",
                                    help="File-name pattern inside input folders, e.g. '*.txt' (a.txt.gz matches "
                                         "too); '*' means *.parquet / *.arrow for those formats."),
        max_seq_length: int = typer.Option(128, "--max-seq-length", help="Tokens per instance, [CLS] and [SEP]s included."),
        max_predictions_per_seq: Optional[int] = typer.Option(
            None, "--max-predictions-per-seq", help="Default: 15% of the length rounded up to 4 (20 at 128, 80 at 512)."),
        masked_lm_prob: float = typer.Option(0.15, "--masked-lm-prob", help="Share of tokens chosen for prediction "
                                             "(of those: 80% [MASK], 10% a random token, 10% kept)."),
        short_seq_prob: float = typer.Option(0.1, "--short-seq-prob", help="Share of instances given a shorter, random "
                                             "target length, so that the model also sees short inputs, as fine-tuning "
                                             "gives it."),
        dupe_factor: Optional[int] = typer.Option(
            None, "--dupe-factor", help="Passes over the data with different masks/pairs. Default 10 (static), 1 (dynamic). "
                                        "Next-sentence pairs are drawn here even with --dynamic-masking: more passes give "
                                        "the NSP task more distinct pairs, each seen less often."),
        whole_word_mask: bool = typer.Option(False, "--whole-word-mask", help="Mask all pieces of a word together (a word: a piece and its ## pieces; SentencePiece: from a ▁ piece)."),
        dynamic_masking: bool = typer.Option(False, "--dynamic-masking",
                                             help="Store unmasked instances; the loader draws new masks every epoch."),
        seed: int = typer.Option(12345, "--seed", help="Random seed (segment lengths, next-sentence pairs, masks); "
                                  "the reference's default."),
        shard_size: int = typer.Option(65536, "--shard-size", help="Instances per shard file at most."),
        unit_mb: float = typer.Option(0.5, "--unit-mb",
                                      help="Raw text per work unit in MiB."),
        random_next_pool: int = typer.Option(
            4096, "--random-next-pool",
            help="Documents sampled (as excerpts) per split for random next segments; memory ~ this x 16 x seq length."),
        random_next_per_unit: int = typer.Option(
            32, "--random-next-per-unit",
            help="Excerpts of that sample given to each work unit (0: random segments from the unit's own documents)."),
        holdout_fraction: float = typer.Option(0.0, "--holdout-fraction",
                                               help="Share of documents written to a separate 'eval' split."),
        workers: Optional[int] = WORKERS,
        resume: bool = typer.Option(False, "--resume", help="Continue the interrupted build in --output: finished "
                                                            "work units are kept, the rest built as before."),
        overwrite: bool = OVERWRITE,
        no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar on stderr."),
    ) -> None:
        """Build BERT pretraining data (masked LM + next sentence, or masked LM only) as the paper's create_pretraining_data.

        Writes shards and manifest.json to --output; prints summary statistics as JSON on stdout.
        """
        from bertctl.data.build import build_data
        from bertctl.data.config import DataConfig
        from bertctl.errors import BertctlError
        from bertctl.io import check_writable
        from bertctl.text import load_tokenizer

        if vocab is None and spm_model is None:
            raise BertctlError("give --vocab VOCAB.txt|DIR or --spm-model FILE.model (train a vocabulary from the same "
                               "text with `bertctl tokenize train --vocab-size 30522 -o vocab.txt INPUTS`, or take a "
                               "model directory's: --vocab DIR)")
        if vocab is not None and spm_model is not None:
            raise BertctlError("give exactly one of --vocab VOCAB.txt|DIR or --spm-model FILE.model")
        if spm_model is not None:
            if cased:
                raise BertctlError("--cased applies to --vocab; a SentencePiece model does its own normalisation")
            if not spm_model.is_file():
                raise BertctlError(f"{spm_model}: --spm-model: no such file")
            tokenizer = load_tokenizer(spm_model)
        elif vocab.is_dir() or vocab.is_file():
            tokenizer = load_tokenizer(vocab, do_lower_case=not cased)
        else:
            raise BertctlError(f"{vocab}: --vocab: no such file or folder")
        if unit_mb <= 0:
            raise BertctlError(f"--unit-mb: must be > 0, got {unit_mb}")
        config = DataConfig(objective=objective, format=fmt, text_field=text_field, doc_separator=doc_separator, pattern=pattern,
                            max_seq_length=max_seq_length, max_predictions_per_seq=max_predictions_per_seq,
                            masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob, dupe_factor=dupe_factor,
                            whole_word_mask=whole_word_mask, dynamic_masking=dynamic_masking, seed=seed,
                            shard_size=shard_size, chunk_bytes=max(1, int(unit_mb * (1 << 20))),
                            random_next_pool=random_next_pool, random_next_per_unit=random_next_per_unit,
                            holdout_fraction=holdout_fraction)
        check_writable(output, folder=True)  # before reading any input
        summary = build_data([str(p) for p in inputs], output, tokenizer, config, workers=workers or usable_cpus(),
                             resume=resume, overwrite=overwrite, progress=not no_progress)
        typer.echo(json.dumps(summary, indent=2))
