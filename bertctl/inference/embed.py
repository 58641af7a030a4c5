"""``embed``'s pipeline: the paper's feature-based use of BERT (§5.3, Table 7).

Texts are read, tokenised (in ``workers`` processes for large inputs, in the background while the
encoder loads: ``Tokenizing``), sorted by token count and cut into batches of at most ``batch_size``
texts and ``batch_tokens`` padded tokens (short texts go many to a batch, long ones few, and little
is padding). A text longer than the model's limit is truncated, with a warning, or cut into
overlapping windows whose vectors are pooled into one (``--long chunk``: ``embed``). A backend (``bertctl.inference.backends``) runs the encoder and pools the hidden states
that ``PoolingSpec`` names; a sentence-transformers checkpoint's Dense layers (if any) and the L2
normalisation follow, and the vectors are written in input order.
"""
from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, NamedTuple

import numpy as np

from bertctl.data.batching import BATCH_TOKENS, length_batches
from bertctl.errors import BertctlError
from bertctl.inference.backends import BACKEND_CHOICES, device_type
from bertctl.inference.encoder import Encoder, Tokens
from bertctl.inference.pooling import PoolingSpec, normalize_rows
from bertctl.io import atomic_open, atomic_path, parse_json_line
from bertctl.progress import process_age, stderr, track
from bertctl.runtime import PRECISION_CHOICES
from bertctl.text.files import iter_lines, read_lines
from bertctl.workers import worker_pool

OUTPUT_SUFFIXES = (".npy", ".jsonl", ".safetensors")
LONG_CHOICES = ("truncate", "chunk")


@dataclass
class EmbedConfig:
    layers: str = "last"
    pooling: str = "mean"
    normalize: bool = False
    batch_size: int | None = None  # texts per forward pass, at most; None: as many as batch_tokens allows
    batch_tokens: int | None = None  # padded tokens per forward pass, at most (one text always fits); None: BATCH_TOKENS
    max_length: int | None = None  # default and upper bound: the model's max_position_embeddings
    precision: str = "fp32"  # fp32, bf16 or fp16 (the weights cast once), or auto: bf16 on a GPU, fp32 on the CPU
    device: str = "auto"
    backend: str = "auto"
    workers: int = 1  # tokenising processes (the output does not depend on it)
    long: str = "truncate"  # a text past the limit: truncate (its first tokens) or chunk (overlapping windows)
    stride: int | None = None  # --long chunk's overlap between windows, in tokens; None: a quarter of the window
    # A sentence-transformers checkpoint's own steps (bertctl.inference.sentence_transformers): Dense
    # layers on the pooled vector (before normalize), and the text's lowercasing and prompt before tokenising.
    dense: tuple = ()
    lowercase: bool = False
    prompt: str = ""

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise BertctlError(f"--backend must be one of {', '.join(BACKEND_CHOICES)}, not {self.backend!r}")
        self.spec  # checks --layers and --pooling
        if self.precision not in PRECISION_CHOICES:
            raise BertctlError(f"--precision must be one of {', '.join(PRECISION_CHOICES)}, not {self.precision!r}")
        if self.batch_size is not None and self.batch_size < 1:
            raise BertctlError(f"--batch-size must be at least 1, not {self.batch_size}")
        if self.batch_tokens is not None and self.batch_tokens < 1:
            raise BertctlError(f"--batch-tokens must be at least 1, not {self.batch_tokens}")
        if self.workers < 1:
            raise BertctlError(f"--workers must be at least 1, not {self.workers}")
        if self.max_length is not None and self.max_length < 2:
            raise BertctlError(f"--max-seq-length must be at least 2 (room for [CLS] and [SEP]), not {self.max_length}")
        if self.long not in LONG_CHOICES:
            raise BertctlError(f"--long must be one of {', '.join(LONG_CHOICES)}, not {self.long!r}")
        if self.stride is not None:
            if self.long != "chunk":
                raise BertctlError("--stride is the overlap of --long chunk's windows; it needs --long chunk")
            if self.stride < 0:
                raise BertctlError(f"--stride must be 0 or more, not {self.stride}")

    @property
    def spec(self) -> PoolingSpec:
        """The layers and pooling, as every backend reads them."""
        return PoolingSpec(self.layers, self.pooling)


def read_texts(path: str | Path, field: str | None = None) -> list[str]:
    """One text per line of a text file, or the ``field`` of each JSONL object (``.jsonl`` or ``field`` given)."""
    return read_texts_and_lines(path, field)[0]


def read_texts_and_lines(path: str | Path, field: str | None = None) -> tuple[list[str], np.ndarray]:
    """``read_texts``, and the line number of each text (JSONL skips blank lines, so they differ from
    the texts' positions there).

    Lines are read as ``tokenize encode`` reads them (``iter_lines``: the same errors for a missing
    file or a line that is not UTF-8)."""
    path = Path(path)
    as_jsonl = field is not None or path.suffix == ".jsonl"
    if not as_jsonl:
        texts = read_lines(path)
        if not texts:
            raise BertctlError(f"{path}: no texts to embed (empty input)")
        return texts, np.arange(1, len(texts) + 1)
    field = field or "text"
    texts: list[str] = []
    lines: list[int] = []
    for lineno, line, _ in iter_lines(path):
        if not line.strip():
            continue
        obj = parse_json_line(line, path, lineno)
        if not isinstance(obj.get(field), str):
            raise BertctlError(f"{path}:{lineno}: no string field {field!r}")
        texts.append(obj[field])
        lines.append(lineno)
    if not texts:
        raise BertctlError(f"{path}: no texts to embed (empty input)")
    return texts, np.array(lines, dtype=np.int64)


#: Characters of text below which tokenising stays in this process (starting workers costs more than it
#: saves); counted in characters, not texts, since 10,000 long documents take as long as 250,000 sentences.
PARALLEL_CHARACTERS = 1_000_000
_worker_tokenizer = None


def window_spans(n: int, width: int, stride: int) -> list[tuple[int, int]]:
    """The windows ``--long chunk`` cuts a text of ``n`` tokens (without [CLS] and [SEP]) into, as
    ``(start, end)`` token offsets: ``width`` tokens each (the model's limit less [CLS] and [SEP]), the
    next starting ``width - stride`` tokens after the last (consecutive windows share ``stride`` tokens),
    until one reaches the text's end; that last window holds what is left (it may be shorter). These
    are the windows Hugging Face tokenizers give with ``return_overflowing_tokens=True, stride=stride``.
    A text that fits is one window."""
    if n <= width:
        return [(0, n)]
    step = width - stride
    spans, start = [], 0
    while True:
        spans.append((start, min(start + width, n)))
        if start + width >= n:
            return spans
        start += step


class Tokenized(NamedTuple):
    """Texts tokenised as embed runs them: ``ids`` flat, each model input after the last; ``lengths``:
    each input's tokens ([CLS] and [SEP] included); ``windows``: how many inputs each text became (1,
    or more under ``--long chunk``); ``full``: each text's tokens before any cut, [CLS] and [SEP] included."""

    ids: np.ndarray
    lengths: np.ndarray
    windows: np.ndarray
    full: np.ndarray


def _tokenize_chunk(tokenizer, texts: list[str], max_length: int, long: str = "truncate",
                    stride: int = 0) -> Tokenized:
    """``texts`` as model inputs of at most ``max_length`` tokens: [CLS] text [SEP], its first
    ``max_length - 2`` tokens (``truncate``), or one input a window (``chunk``: ``window_spans``)."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    width = max_length - 2
    rows, windows, full = [], [], []
    for text in texts:
        ids = tokenizer.ids(text)
        full.append(len(ids) + 2)
        spans = window_spans(len(ids), width, stride) if long == "chunk" else [(0, min(len(ids), width))]
        windows.append(len(spans))
        rows.extend([cls, *ids[a:b], sep] for a, b in spans)
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    return Tokenized(np.fromiter((i for r in rows for i in r), dtype=np.int64, count=int(lengths.sum())), lengths,
                     np.array(windows, dtype=np.int64), np.array(full, dtype=np.int64))


def _init_tokenizer(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _tokenize_in_worker(args: tuple) -> Tokenized:
    return _tokenize_chunk(_worker_tokenizer, *args)


class Tokenizing:
    """Texts being tokenised: in ``workers`` processes once there are enough texts (chunks in order,
    so the result does not depend on their number), in the background while the caller goes on (the
    ``embed`` command imports torch and loads the model meanwhile, and forks its workers before that,
    when forking is cheap); otherwise here, at once. ``result()``: a ``Tokenized``. ``long`` and
    ``stride``: ``--long`` and ``--stride`` (``_tokenize_chunk``). Use it as a context manager: leaving
    it stops any workers."""

    def __init__(self, tokenizer, texts: list[str], max_length: int, workers: int = 1, long: str = "truncate",
                 stride: int = 0):
        self.max_length, self.long, self.stride = max_length, long, stride
        self._pool = self._pending = self._done = None
        if workers <= 1 or sum(map(len, texts)) < PARALLEL_CHARACTERS:
            self._done = _tokenize_chunk(tokenizer, texts, max_length, long, stride)
            return
        size = -(-len(texts) // (8 * workers))  # 8 chunks a worker: an even finish
        self._pool = worker_pool(workers, _init_tokenizer, (tokenizer,))
        self._pending = self._pool.map_async(_tokenize_in_worker, [(texts[i:i + size], max_length, long, stride)
                                                                   for i in range(0, len(texts), size)])

    def result(self) -> Tokenized:
        if self._done is None:
            parts = self._pool.wait(self._pending)
            self.close()
            self._done = Tokenized(*(np.concatenate(column) for column in zip(*parts)))
        return self._done

    def close(self) -> None:
        if self._pool is not None:
            if self._pending.ready():  # idle workers leave at the sentinel close() sends them
                self._pool.close()
            else:
                self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __enter__(self) -> Tokenizing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def tokenize_texts(tokenizer, texts: list[str], max_length: int, workers: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """All texts' token ids, flat in input order, and each text's length, truncated to ``max_length``
    (``Tokenizing``, waited for)."""
    with Tokenizing(tokenizer, texts, max_length, workers) as tokenizing:
        return tokenizing.result()[:2]


def prepare_texts(texts: list[str], config: EmbedConfig) -> list[str]:
    """The texts as the tokenizer gets them: after the prompt and a sentence-transformers checkpoint's
    lowercasing (which, as there, lowercases the prompt too)."""
    if config.prompt:
        texts = [config.prompt + t for t in texts]
    return [t.lower() for t in texts] if config.lowercase else texts


def checkpoint_config(directory: str | Path, *, pooling: str | None = None, layers: str | None = None,
                      normalize: bool | None = None, max_length: int | None = None, prompt: str | None = None,
                      prompt_name: str | None = None, **settings):
    """``(EmbedConfig, encoder directory, sentence-transformers modules or None)`` for ``directory``.

    Settings left None take the checkpoint's: a sentence-transformers directory's pooling,
    normalisation, token limit and default prompt (``bertctl.inference.sentence_transformers``), else last-layer mean
    pooling, no normalisation, the model's positions and no prompt.  ``prompt_name`` picks one of the
    checkpoint's named prompts.  Its Dense modules apply to its own pooled vectors only: not when
    ``pooling`` or ``layers`` is given."""
    from bertctl.inference.sentence_transformers import read_modules

    st = read_modules(directory)
    if prompt is not None and prompt_name is not None:
        raise BertctlError("--prompt and --prompt-name: give one")
    if prompt_name is not None:
        named = dict(st.prompts) if st else {}
        if prompt_name not in named:
            where = st.prompts_file if st else f"{directory} (no sentence-transformers modules.json)"
            raise BertctlError(f"--prompt-name {prompt_name}: no such prompt in {where}"
                               + (f" (it has {', '.join(named)})" if named else ""))
        prompt = named[prompt_name]
    if prompt is None:
        prompt = st.prompt if st else ""
    if prompt and st and not st.include_prompt:
        raise BertctlError(f"{Path(directory) / 'modules.json'}: its Pooling leaves out the prompt's tokens, which "
                           "embed does not support; embed without a prompt (--prompt '')")
    own = pooling is None and layers is None
    if own and st and st.unsupported:
        raise BertctlError(st.unsupported)
    config = EmbedConfig(
        layers=layers or "last",
        pooling=pooling or (st.pooling if st else "mean"),
        normalize=normalize if normalize is not None else bool(st and st.normalize),
        max_length=max_length if max_length is not None else (st.max_length if st else None),
        dense=st.dense if st and own else (),
        lowercase=bool(st and st.lowercase),
        prompt=prompt,
        **settings,
    )
    return config, (st.encoder if st else Path(directory)), st


def token_limit(config: EmbedConfig, max_positions: int) -> int:
    """Tokens a text keeps, [CLS] and [SEP] included: ``--max-seq-length``, at most the model's positions."""
    return max_positions if config.max_length is None else min(config.max_length, max_positions)


def window_stride(config: EmbedConfig, limit: int) -> int:
    """The overlap ``--long chunk`` cuts with at a ``limit``-token model input: ``--stride``, or a quarter
    of the window; refused unless less than the window (``limit`` less [CLS] and [SEP])."""
    width = limit - 2
    if config.long != "chunk":
        return 0
    if width < 1:
        raise BertctlError(f"--long chunk needs windows of at least one token; the limit of {limit} tokens "
                           "leaves none beside [CLS] and [SEP] (raise --max-seq-length)")
    stride = width // 4 if config.stride is None else config.stride
    if stride >= width:
        raise BertctlError(f"--stride {stride} must be less than the window's {width} tokens (the {limit}-token "
                           "limit less [CLS] and [SEP])")
    return stride


@dataclass
class Embedded:
    """``embed``'s result: (N, D) float32 ``vectors``, row i for text i, and the run's ``summary`` (texts,
    tokens, windows, how many texts were chunked or truncated, the backend, seconds)."""

    vectors: np.ndarray
    summary: dict = field(default_factory=dict)


#: Line numbers a truncation warning lists, at most.
FIRST_LINES = 5


def embed_texts(encoder: Encoder, tokenizer, texts: list[str], config: EmbedConfig, progress: bool = True,
                summary: bool | None = None, tokenizing: Tokenizing | None = None) -> np.ndarray:
    """(N, D) float32 features, row i for texts[i]: ``embed(...).vectors``."""
    return embed(encoder, tokenizer, texts, config, progress, summary, tokenizing).vectors


def embed(encoder: Encoder, tokenizer, texts: list[str], config: EmbedConfig, progress: bool = True,
          summary: bool | None = None, tokenizing: Tokenizing | None = None,
          where: Callable[[int], str] | None = None, between_batches: Callable[[], None] | None = None) -> Embedded:
    """The texts' features on ``encoder`` (any backend's: ``open_encoder``), and the run's summary.

    ``progress`` shows a bar on stderr, ``summary`` (default: as ``progress``) a closing line there.
    ``tokenizing``: the texts' tokenising, begun by the caller (of ``prepare_texts``, at this model's
    ``token_limit``, with ``config.long`` and ``window_stride``). ``where(i)`` names text i in messages
    (default "text i+1"). ``between_batches`` is called after each batch.

    A text longer than the limit is truncated to its first tokens (``--long truncate``: a warning on
    stderr counts them and names the first few), or (``--long chunk``) embedded whole: cut into
    overlapping windows (``window_spans``), each window a model input of its own ([CLS] window [SEP])
    embedded as a text is (pooling, a checkpoint's Dense modules, normalisation), and the text's vector
    is the mean of its windows' vectors weighted by their tokens ([CLS] and [SEP] included), normalised
    again under ``--normalize``: what embedding the windows one by one and pooling them by hand gives."""
    max_length = token_limit(config, encoder.config.max_position_embeddings)
    stride = window_stride(config, max_length)
    vocab_size = encoder.config.vocab_size
    batch_tokens = config.batch_tokens or BATCH_TOKENS.get(device_type(encoder.device), BATCH_TOKENS["cuda"])
    start = time.perf_counter()
    if tokenizing is not None and (tokenizing.max_length, tokenizing.long, tokenizing.stride) != \
            (max_length, config.long, stride):
        raise ValueError(f"texts tokenised to {tokenizing.max_length} tokens ({tokenizing.long}, stride "
                         f"{tokenizing.stride}), the model takes {max_length} ({config.long}, stride {stride})")
    tokenized = (tokenizing.result() if tokenizing is not None else
                 _tokenize_all(tokenizer, prepare_texts(texts, config), max_length, config.workers, config.long,
                               stride))
    tokens = Tokens(tokenized.ids, tokenized.lengths)
    tokenize_seconds = time.perf_counter() - start
    top = int(tokens.ids.max()) if len(tokens.ids) else 0
    if top >= vocab_size:  # an index past the embedding table: a tokenizer of another model
        raise BertctlError(f"token id {top} from the tokenizer is past the model's {vocab_size:,} word "
                           "embeddings: use the tokenizer saved with this model")
    where = where or (lambda i: f"text {i + 1}")
    long_texts = np.flatnonzero(tokenized.full > max_length)
    if config.long == "truncate" and len(long_texts):
        shown = ", ".join(where(int(i)) for i in long_texts[:FIRST_LINES])
        more = f" and {len(long_texts) - FIRST_LINES} more" if len(long_texts) > FIRST_LINES else ""
        stderr.print(f"[yellow]truncated {len(long_texts)} of the {len(texts)} texts to the {max_length}-token "
                     f"limit ({shown}{more}); --long chunk embeds them whole, in overlapping windows")
    # L2 normalisation comes after the Dense modules; without them the backend may do it (on the device).
    normalize = config.normalize and not config.dense
    with track("embed", len(tokens.lengths), disable=not progress) as advance:
        if between_batches is not None:
            step = advance

            def advance(n: int) -> None:
                step(n)
                between_batches()
        batches = length_batches(tokens.lengths, config.batch_size, batch_tokens)
        out = encoder.features(tokens, batches, config.spec, tokenizer.pad_token_id, normalize=normalize,
                               advance=advance)
    out = pool_windows(finish_features(out, config, normalized=normalize), tokenized.windows, tokens.lengths,
                       config.normalize)
    bad = int((~np.isfinite(out)).any(axis=1).sum())
    if bad:  # fp16's range ends at 65504: a checkpoint with large activations overflows it
        raise BertctlError(f"{bad} of the {len(texts)} embeddings are not finite (NaN or inf) at --precision "
                           f"{encoder.precision}: " + ("the checkpoint's activations overflow"
                                                       if encoder.precision == "fp32" else
                                                       "embed them with --precision fp32 (or bf16, which has its range)"))
    seconds = time.perf_counter() - start
    count = int(tokens.lengths.sum())
    chunked = int((tokenized.windows > 1).sum())
    report = {"texts": len(texts), "tokens": count, "max_length": max_length, "long": config.long,
              "truncated": len(long_texts) if config.long == "truncate" else 0, "chunked": chunked,
              "windows": len(tokens.lengths), **({"stride": stride} if config.long == "chunk" else {}),
              "backend": encoder.name, "device": str(encoder.device), "precision": encoder.precision,
              "seconds": round(seconds, 3), "tokenize_seconds": round(tokenize_seconds, 3)}
    if progress if summary is None else summary:
        what = (f"; {chunked} longer than the {max_length}-token limit embedded in {len(tokens.lengths) - len(texts) + chunked} "
                "windows" if chunked else "")
        stderr.print(
            f"embedded {len(texts)} texts ({count} tokens) in {seconds:.2f} s ({tokenize_seconds:.2f} s tokenising): "
            f"{len(texts) / seconds:.1f} texts/s, {count / seconds:.0f} tokens/s on {encoder.device} ({encoder.name})"
            + what)
    return Embedded(out, report)


def _tokenize_all(tokenizer, texts: list[str], max_length: int, workers: int, long: str, stride: int) -> Tokenized:
    with Tokenizing(tokenizer, texts, max_length, workers, long, stride) as tokenizing:
        return tokenizing.result()


def pool_windows(out: np.ndarray, windows: np.ndarray, lengths: np.ndarray, normalize: bool) -> np.ndarray:
    """(N, D): the windows' (W, D) vectors ``out``, text after text (``windows[i]`` of them for text i),
    as one row a text: a text of one window keeps its row as it is; a longer one gets the mean of its
    windows' rows weighted by their ``lengths`` (tokens), L2-normalised again with ``normalize``."""
    if len(out) == len(windows):  # nothing was chunked
        return out
    first = np.cumsum(windows) - windows
    pooled = out[first]
    many = np.flatnonzero(windows > 1)
    weights = lengths.astype(np.float64)
    for i in many:  # float64 sums: a long text's windows add without drift
        rows = slice(first[i], first[i] + windows[i])
        pooled[i] = (out[rows].astype(np.float64) * weights[rows, None]).sum(0) / weights[rows].sum()
    if normalize and len(many):
        pooled[many] = normalize_rows(np.ascontiguousarray(pooled[many]))
    return pooled


def finish_features(out: np.ndarray, config: EmbedConfig, rows: int = 65536, normalized: bool = False) -> np.ndarray:
    """A sentence-transformers checkpoint's Dense modules, then L2 normalisation (``normalize_rows``;
    not again when ``normalized``), over the pooled (N, D) float32 vectors ``rows`` at a time, so that
    the temporaries stay small beside a large output; normalisation is in place."""
    for dense in config.dense:
        mapped = np.empty((len(out), dense.weight.shape[0]), np.float32)
        for i in range(0, len(out), rows):
            mapped[i:i + rows] = dense(out[i:i + rows])
        out = mapped
    if config.normalize and not normalized:
        normalize_rows(out, rows)
    return out


def write_embeddings(array: np.ndarray, output: str | Path) -> None:
    """``.npy`` (float32 N x D), ``.jsonl`` ({"index", "embedding"} per row) or ``.safetensors`` ("embeddings"),
    written under a temporary name beside ``output`` and renamed onto it once complete."""
    from bertctl import faults

    output = Path(output)
    if output.suffix == ".npy":
        with atomic_open(output, "wb") as f:
            np.save(f, array)
            f.flush()
            faults.point("write")
    elif output.suffix == ".jsonl":
        with atomic_open(output, "w", encoding="utf-8") as f:
            for i, row in enumerate(array):
                f.write(json.dumps({"index": i, "embedding": [round(float(v), 7) for v in row]}) + "\n")
            f.flush()
            faults.point("write")
    elif output.suffix == ".safetensors":
        from safetensors.numpy import save_file

        with atomic_path(output) as tmp:
            save_file({"embeddings": np.ascontiguousarray(array)}, str(tmp))
            faults.point("write")
    else:
        raise BertctlError(f"--output {output}: suffix must be one of {', '.join(OUTPUT_SUFFIXES)}")


def check_output(output: Path, overwrite: bool) -> bool:
    """``embed``'s one output rule, checked before any work: a known suffix, a file name (not a folder),
    a location it may write to, and an existing file only with ``--overwrite``. Returns whether a
    previous output is there (it stays untouched until the new one is complete)."""
    from bertctl.io import check_writable

    if output.suffix not in OUTPUT_SUFFIXES:
        raise BertctlError(f"--output {output}: suffix must be one of {', '.join(OUTPUT_SUFFIXES)}")
    check_writable(output)  # before the model runs, not after
    if output.exists() and not overwrite:
        raise BertctlError(f"{output}: already exists; pass --overwrite to replace it (it stays as it is until the "
                           "new embeddings are complete), or choose another --output")
    return output.exists()


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that it unwinds as a Ctrl-C does: temporary files removed."""


def _on_sigterm(signum, frame):
    raise _Terminated()


def run_embed(inputs: list[Path], model: Path, output: Path, *, field: str | None = None, onnx: Path | None = None,
              overwrite: bool = False, progress: bool = True, long: str = "truncate", stride: int | None = None,
              pooling: str | None = None, layers: str | None = None, normalize: bool | None = None,
              prompt: str | None = None, prompt_name: str | None = None, max_length: int | None = None,
              **settings) -> dict:
    """The ``embed`` command: every flag checked (before torch loads), the texts embedded, the vectors
    written to ``output`` under a temporary name and renamed onto it once complete. An interrupted run
    (SIGINT, SIGTERM, a full disk) leaves a previous ``output`` as it was and no temporary file, and says
    so in one line. Prints and returns the run's summary (JSON on stdout)."""
    import signal

    from bertctl import faults
    from bertctl.checkpoints.hf import load_config
    from bertctl.inference.backends import open_encoder
    from bertctl.io import describe_os_error
    from bertctl.text import load_tokenizer

    output = Path(output)
    config, encoder_dir, st = checkpoint_config(
        model, pooling=pooling, layers=layers, normalize=normalize, prompt=prompt, prompt_name=prompt_name,
        max_length=max_length, long=long, stride=stride, **settings)
    had_output = check_output(output, overwrite)
    texts, where = [], []
    for path in inputs:
        part, lines = read_texts_and_lines(path, field)
        texts += part
        where.append((len(texts), path, lines))
    limit = token_limit(config, load_config(encoder_dir).max_position_embeddings)
    windows_stride = window_stride(config, limit)  # refuses a --stride the window cannot take, before any work
    tokenizer = load_tokenizer(encoder_dir)

    def locate(i: int) -> str:
        begin = 0
        for end, path, lines in where:
            if i < end:
                return f"{path}:{lines[i - begin]}"
            begin = end
        return f"text {i + 1}"

    kept = (f"{output} is as it was (the previous embeddings)" if had_output else f"nothing was written to {output}")
    previous = signal.signal(signal.SIGTERM, _on_sigterm) if _main_thread() else None
    try:
        faults.point("start")
        if st is not None:
            skipped = (" (its Dense modules skipped: --pooling or --layers given)"
                       if st.dense and not config.dense else "")
            stderr.print(f"{model}: a sentence-transformers checkpoint: {st.describe()}{skipped}; flags override")
        # Tokenising starts before CUDA or torch loads (its workers fork from a small process) and runs
        # while the device and the model load. Starting the native encoder's CUDA context before the fork
        # made the whole run slower (benchmarks/results/embed-vs-st-h200-fp16-40c77c7.json).
        with Tokenizing(tokenizer, prepare_texts(texts, config), limit, config.workers, config.long,
                        windows_stride) as tokenizing:
            encoder = open_encoder(encoder_dir, config, onnx, lengths=lambda: tokenizing.result().lengths)
            ages = {"encoder_ready": process_age()}
            result = embed(encoder, tokenizer, texts, config, progress=progress, summary=True, tokenizing=tokenizing,
                           where=locate, between_batches=lambda: faults.point("batch"))
            ages["embedded"] = process_age()
        write_embeddings(result.vectors.astype(np.float32, copy=False), output)
        ages["written"] = process_age()
    except KeyboardInterrupt as e:
        terminated = isinstance(e, _Terminated)
        print(f"bertctl: {'terminated' if terminated else 'interrupted'}: {kept}", file=sys.stderr)
        raise SystemExit(130) from None  # as build-data ends on either: an interrupt, not a failure
    except OSError as e:
        what = describe_os_error(e) if e.filename is not None else f"{output}: {describe_os_error(e)}"
        raise BertctlError(f"{what}; {kept}") from None
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    # Where the command's seconds went: the process's age once the model was loaded (start-up, reading and
    # tokenising the texts meanwhile), once every text was embedded, and once the output was written.
    summary = {"output": str(output), **result.summary, "since_process_start": ages}
    print(json.dumps(summary))
    return summary


def _main_thread() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()
