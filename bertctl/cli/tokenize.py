"""``bertctl tokenize``: encode, decode, inspect text with a WordPiece vocabulary or a SentencePiece model, and train either."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from bertctl.cli.options import NO_PROGRESS, WORKERS
from bertctl.workers import usable_cpus
from bertctl.errors import BertctlError

tokenize_app = typer.Typer(
    name="tokenize",
    help="BERT WordPiece tokenisation (ids equal Hugging Face's BertTokenizerFast), SentencePiece models, "
         "and vocabulary training.",
    no_args_is_help=True,
)

_VOCAB = typer.Option(None, "--vocab", help="vocab.txt (one token per line).", show_default=False)
_MODEL = typer.Option(None, "--model", show_default=False,
                      help="Model or tokenizer directory (spiece.model, sentencepiece.bpe.model, tokenizer.json "
                           "or vocab.txt; casing from it).")
_SPM = typer.Option(None, "--spm-model", help="SentencePiece .model file.", show_default=False)
_CASED = typer.Option(False, "--cased", help="Keep case and accents (with --vocab; a --model directory says itself).")


def _tokenizer(vocab: Path | None, model: Path | None, cased: bool, spm_model: Path | None = None):
    from bertctl.text import load_tokenizer
    from bertctl.text.wordpiece import BertTokenizer

    if sum(x is not None for x in (vocab, model, spm_model)) != 1:
        raise BertctlError("give exactly one of --vocab VOCAB.txt, --spm-model FILE.model or --model DIR")
    if vocab is not None:
        return BertTokenizer.from_vocab_file(vocab, do_lower_case=not cased)
    if cased:
        raise BertctlError("--cased applies to --vocab; a --model directory or SentencePiece model stores its own casing")
    if spm_model is not None:
        if not spm_model.is_file():
            raise BertctlError(f"{spm_model}: --spm-model: no such file")
        return load_tokenizer(spm_model)
    if not model.is_dir():
        raise BertctlError(f"{model}: --model: no such directory")
    return load_tokenizer(model)


def _input_file(path: Path) -> None:
    if not path.exists():
        raise BertctlError(f"{path}: no such file")
    if not path.is_file():
        raise BertctlError(f"{path}: not a file")


def register(app: typer.Typer) -> None:
    app.add_typer(tokenize_app)


@tokenize_app.command("encode")
def encode(
    input: Path = typer.Argument(..., help="UTF-8 text, one example per line.", show_default=False),
    output: Path = typer.Option(..., "--output", "-o", help="OUT.jsonl (one JSON object per line) or OUT.npy.",
                                show_default=False),
    vocab: Path = _VOCAB,
    model: Path = _MODEL,
    spm_model: Path = _SPM,
    cased: bool = _CASED,
    pair_separator: str = typer.Option(None, "--pair-separator",
                                       help='Split each line into a text pair at the first SEP (TAB or "\\t" for a tab).'),
    max_seq_length: int = typer.Option(None, "--max-seq-length", help="Truncate to N tokens, [CLS]/[SEP] included.",
                                       min=2),
    truncation: str = typer.Option("longest_first", "--truncation",
                                   help="longest_first, only_first or only_second (pairs)."),
    offsets: bool = typer.Option(False, "--offsets", help="Add character offsets to each JSON line."),
    no_progress: bool = NO_PROGRESS,
) -> None:
    """Encode each line into input_ids, token_type_ids and attention_mask.

    .jsonl: one object per input line. .npy: the input_ids as an int32 (lines, longest) array
    right-padded with [PAD] (attention mask = ids != [PAD] id); with --pair-separator the segment ids
    go beside it in OUT.token_type_ids.npy. Every line is encoded (an empty one gives [CLS] [SEP]);
    a line that is not UTF-8, or lacks the pair separator, stops with an error naming the line.
    """
    from bertctl.io import check_writable
    from bertctl.text.base import TRUNCATION_STRATEGIES
    from bertctl.text.files import encode_file

    # The flags and paths first: a mistake is named before a vocabulary is read or a line encoded.
    if truncation not in TRUNCATION_STRATEGIES:
        raise BertctlError(f"--truncation must be one of {', '.join(TRUNCATION_STRATEGIES)}, not {truncation!r}")
    if truncation == "only_second" and pair_separator is None:
        raise BertctlError("--truncation only_second needs text pairs (--pair-separator)")
    if output.suffix.lower() not in (".jsonl", ".npy"):
        raise BertctlError(f"{output}: output must end in .jsonl or .npy")
    _input_file(input)
    check_writable(output)
    tok = _tokenizer(vocab, model, cased, spm_model)
    summary = encode_file(tok, input, output, pair_separator=pair_separator, max_length=max_seq_length,
                          truncation=truncation, offsets=offsets, progress=not no_progress)
    typer.echo(json.dumps(summary))


@tokenize_app.command("decode")
def decode(
    input: Path = typer.Argument(..., help="JSONL with input_ids per line (or a JSON id list per line), or .npy.",
                                 show_default=False),
    vocab: Path = _VOCAB,
    model: Path = _MODEL,
    spm_model: Path = _SPM,
    keep_special: bool = typer.Option(False, "--keep-special", help="Keep [CLS], [SEP], [PAD], ... in the text."),
    output: Path = typer.Option(None, "--output", "-o", help="Write the text here instead of stdout."),
) -> None:
    """Turn ids back into text, one line per input row (Hugging Face's decode)."""
    from bertctl.io import atomic_open
    from bertctl.text.files import decode_file

    _input_file(input)
    if output is not None:
        from bertctl.io import check_writable

        check_writable(output)
    tok = _tokenizer(vocab, model, False, spm_model)
    lines = decode_file(tok, input, skip_special_tokens=not keep_special)
    if output is None:
        for line in lines:
            typer.echo(line)
        return
    with atomic_open(output, "w", encoding="utf-8") as f:
        for line in lines:
            f.write(line + "\n")
    typer.echo(str(output))


@tokenize_app.command("inspect")
def inspect(
    text: str = typer.Argument(..., help="Text to tokenise.", show_default=False),
    pair: str = typer.Option(None, "--pair", help="Second text of a pair."),
    vocab: Path = _VOCAB,
    model: Path = _MODEL,
    spm_model: Path = _SPM,
    cased: bool = _CASED,
) -> None:
    """Show pieces, ids, segment ids and character offsets: a table on stderr, TSV on stdout."""
    from rich.table import Table

    from bertctl.progress import stderr

    tok = _tokenizer(vocab, model, cased, spm_model)
    enc = tok.encode(text, pair, return_offsets=True)
    table = Table("#", "piece", "id", "segment", "start", "end", "source text")
    rows = []
    for k, (i, seg, seq, (a, b)) in enumerate(zip(enc.input_ids, enc.token_type_ids, enc.sequence_ids, enc.offsets)):
        source = "" if seq is None else (text if seq == 0 else pair)[a:b]
        piece = tok.ids_to_tokens[i]
        table.add_row(str(k), piece, str(i), str(seg), str(a), str(b), source)
        rows.append(f"{piece}\t{i}\t{seg}\t{a}\t{b}")
    stderr.print(table)
    typer.echo("\n".join(rows))


@tokenize_app.command("train")
def train(
    inputs: list[Path] = typer.Argument(..., help="Text files or folders (searched recursively for --pattern); gzip, "
                                        "bzip2, xz and zstd files are decompressed as they are read; - reads stdin.",
                                        show_default=False),
    output: Path = typer.Option(..., "--output", "-o", show_default=False,
                                help="VOCAB.txt to write (wordpiece), or FILE.model (unigram, bpe)."),
    algorithm: str = typer.Option("wordpiece", "--algorithm",
                                  help="wordpiece (BERT's), or unigram / bpe: a SentencePiece model trained by "
                                       "sentencepiece's trainer, with [CLS] [SEP] [MASK] <pad> <unk> inside."),
    vocab_size: int = typer.Option(30522, "--vocab-size", help="Tokens in the vocabulary, specials included.", min=8),
    cased: bool = typer.Option(False, "--cased", help="Keep case (default: lower-case, as bert-base-uncased)."),
    no_strip_accents: bool = typer.Option(False, "--no-strip-accents", help="Keep accents when lower-casing."),
    min_frequency: int = typer.Option(2, "--min-frequency", help="A merged piece must occur this often.", min=1),
    limit_alphabet: int = typer.Option(1000, "--limit-alphabet", help="Keep the A most frequent characters.", min=1),
    reserved_unused: int = typer.Option(0, "--reserved-unused", help="Reserve K \\[unusedN] slots after [PAD].", min=0),
    sample_bytes: int = typer.Option(None, "--sample-bytes",
                                     help="Read about this many bytes, sampling lines evenly over all inputs.", min=1),
    max_sentences: int = typer.Option(None, "--max-sentences", help="Stop after this many (sampled) lines.", min=1),
    seed: int = typer.Option(0, "--seed", help="Seed of the line sampling."),
    fmt: str = typer.Option("text", "--format",
                            help="text (or lines): every line of the files; jsonl, wikiextractor, parquet, arrow: "
                                 "the paragraphs of their documents, read as build-data reads them."),
    text_field: str = typer.Option("text", "--text-field", help="jsonl, parquet, arrow: field holding the text."),
    pattern: str = typer.Option(None, "--pattern", show_default=False,
                                help="File-name pattern inside input folders (a.txt.gz matches *.txt too); default "
                                     "*.txt for text and lines, *.parquet / *.arrow for those formats, else *."),
    character_coverage: float = typer.Option(0.9995, "--character-coverage", min=0.5, max=1.0,
                                             help="unigram/bpe: share of characters covered; rarer ones are <unk>."),
    save_dir: Path = typer.Option(None, "--save-dir",
                                  help="Also write a tokenizer directory (vocab.txt, tokenizer.json, tokenizer_config.json; "
                                       "SentencePiece: spiece.model, tokenizer_config.json)."),
    workers: int = WORKERS,
    no_progress: bool = NO_PROGRESS,
) -> None:
    """Learn a BERT WordPiece vocabulary: [PAD], \\[unused0..K-1], [UNK], [CLS], [SEP], [MASK], characters, pieces.

    Words come from BERT's basic tokenizer (same casing and accent options as encoding); pieces
    are learnt by frequency merges with ## continuations, as Hugging Face's WordPieceTrainer does.
    Lines that are not UTF-8 are read as cp1252, else ISO-8859-1. With --algorithm unigram or bpe, sentencepiece's
    trainer learns a SentencePiece model instead (NFKC normalisation, case-folded unless --cased):
    <pad> 0, <unk> 1, [CLS] 2, [SEP] 3, [MASK] 4, \\[unused0..K-1], then the pieces.
    """
    from bertctl.data.documents import FORMATS
    from bertctl.io import check_writable
    from bertctl.text.vocab_training import ALGORITHMS, VocabConfig, train_sentencepiece, train_vocab, write_vocab

    if algorithm not in ALGORITHMS:
        raise BertctlError(f"--algorithm must be one of {', '.join(ALGORITHMS)}, got {algorithm!r}")
    if fmt not in FORMATS:
        raise BertctlError(f"--format: unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    for path in inputs:
        if str(path) != "-" and not path.exists():
            raise BertctlError(f"{path}: no such input file or folder")
    check_writable(output)  # before the (long) training, not after
    if save_dir is not None:
        check_writable(save_dir, folder=True, what="--save-dir")
    config = VocabConfig(
        vocab_size=vocab_size, do_lower_case=not cased, strip_accents=False if no_strip_accents else None,
        min_frequency=min_frequency, limit_alphabet=limit_alphabet, reserved_unused=reserved_unused,
        sample_bytes=sample_bytes, max_sentences=max_sentences, seed=seed,
        format=fmt, text_field=text_field, pattern=pattern, character_coverage=character_coverage,
    )
    from bertctl.data.documents import ReadStats

    read = ReadStats()  # what the reader skipped or decoded otherwise, said as build-data says it
    if algorithm != "wordpiece":
        from bertctl.io import atomic_open
        from bertctl.text.sentencepiece import SentencePieceTokenizer

        wordpiece_only = [flag for flag, given in (("--no-strip-accents", no_strip_accents),
                                                   ("--min-frequency", min_frequency != 2),
                                                   ("--limit-alphabet", limit_alphabet != 1000),
                                                   ("--workers", workers is not None)) if given]
        if wordpiece_only:
            raise BertctlError(f"{', '.join(wordpiece_only)} applies to --algorithm wordpiece only")
        if output.suffix != ".model":
            raise BertctlError(f"--output {output}: a SentencePiece model file must end in .model")
        model = train_sentencepiece(inputs, config, algorithm, progress=not no_progress, stats=read)
        _say_skips(read, fmt)
        tokenizer = SentencePieceTokenizer(model, filename=output.name)  # checks that the specials are in place
        with atomic_open(output, "wb") as f:
            f.write(model)
        if save_dir is not None:
            tokenizer.save_pretrained(save_dir)
        typer.echo(json.dumps({"output": str(output), "algorithm": algorithm, "vocab_size": tokenizer.vocab_size}))
        return
    if character_coverage != 0.9995:
        raise BertctlError("--character-coverage applies to --algorithm unigram or bpe only")
    tokens = train_vocab(inputs, config, progress=not no_progress, workers=workers or usable_cpus(), stats=read)
    _say_skips(read, fmt)
    write_vocab(tokens, output)
    if save_dir is not None:
        from bertctl.text.wordpiece import BertTokenizer

        BertTokenizer(tokens, do_lower_case=config.do_lower_case, strip_accents=config.strip_accents).save_pretrained(
            save_dir)
    typer.echo(json.dumps({"output": str(output), "vocab_size": len(tokens)}))


def _say_skips(read, fmt: str) -> None:
    """Every line the vocabulary's reader skipped or decoded otherwise, on stderr (``ReadStats.notes``)."""
    from bertctl.progress import stderr

    for note in read.notes(fmt):
        stderr.print(f"tokenize train: {note}", markup=False, highlight=False, soft_wrap=True)
