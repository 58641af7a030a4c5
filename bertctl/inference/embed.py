"""``embed``'s pipeline: the paper's feature-based use of BERT (§5.3, Table 7).

Texts are read, tokenised (in ``workers`` processes for large inputs, in the background while the
encoder loads: ``Tokenizing``), sorted by token count and cut into batches of at most ``batch_size``
texts and ``batch_tokens`` padded tokens (short texts go many to a batch, long ones few, and little
is padding). A backend (``bertctl.inference.backends``) runs the encoder and pools the hidden states
that ``PoolingSpec`` names; a sentence-transformers checkpoint's Dense layers (if any) and the L2
normalisation follow, and the vectors are written in input order.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bertctl.data.batching import BATCH_TOKENS, length_batches
from bertctl.errors import BertctlError
from bertctl.inference.backends import BACKEND_CHOICES, device_type
from bertctl.inference.encoder import Encoder, Tokens
from bertctl.inference.pooling import PoolingSpec, normalize_rows
from bertctl.io import atomic_open, atomic_path, parse_json_line
from bertctl.progress import stderr, track
from bertctl.runtime import PRECISION_CHOICES
from bertctl.text.files import iter_lines, read_lines
from bertctl.workers import worker_pool

OUTPUT_SUFFIXES = (".npy", ".jsonl", ".safetensors")


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

    @property
    def spec(self) -> PoolingSpec:
        """The layers and pooling, as every backend reads them."""
        return PoolingSpec(self.layers, self.pooling)


def read_texts(path: str | Path, field: str | None = None) -> list[str]:
    """One text per line of a text file, or the ``field`` of each JSONL object (``.jsonl`` or ``field`` given).

    Lines are read as ``tokenize encode`` reads them (``iter_lines``: the same errors for a missing
    file or a line that is not UTF-8)."""
    path = Path(path)
    as_jsonl = field is not None or path.suffix == ".jsonl"
    if not as_jsonl:
        texts = read_lines(path)
        if not texts:
            raise BertctlError(f"{path}: no texts to embed (empty input)")
        return texts
    field = field or "text"
    texts: list[str] = []
    for lineno, line, _ in iter_lines(path):
        if as_jsonl:
            if not line.strip():
                continue
            obj = parse_json_line(line, path, lineno)
            if not isinstance(obj.get(field), str):
                raise BertctlError(f"{path}:{lineno}: no string field {field!r}")
            line = obj[field]
        texts.append(line)
    if not texts:
        raise BertctlError(f"{path}: no texts to embed (empty input)")
    return texts


#: Texts below which tokenising stays in this process (starting workers costs more than it saves).
PARALLEL_TEXTS = 20_000
_worker_tokenizer = None


def _tokenize_chunk(tokenizer, texts: list[str], max_length: int) -> tuple[np.ndarray, np.ndarray]:
    """Token ids of ``texts`` ([CLS] text [SEP], truncated to ``max_length``), flat, and their lengths."""
    rows = [tokenizer.encode(t, max_length=max_length, truncation="longest_first").input_ids for t in texts]
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    return np.fromiter((i for r in rows for i in r), dtype=np.int64, count=int(lengths.sum())), lengths


def _init_tokenizer(tokenizer) -> None:
    global _worker_tokenizer
    _worker_tokenizer = tokenizer


def _tokenize_in_worker(args: tuple[list[str], int]) -> tuple[np.ndarray, np.ndarray]:
    return _tokenize_chunk(_worker_tokenizer, *args)


class Tokenizing:
    """Texts being tokenised: in ``workers`` processes once there are enough texts (chunks in order,
    so the result does not depend on their number), in the background while the caller goes on (the
    ``embed`` command imports torch and loads the model meanwhile, and forks its workers before that,
    when forking is cheap); otherwise here, at once. ``result()``: all ids, flat in input order, and
    each text's length. Use it as a context manager: leaving it stops any workers."""

    def __init__(self, tokenizer, texts: list[str], max_length: int, workers: int = 1):
        self.max_length = max_length
        self._pool = self._pending = self._done = None
        if workers <= 1 or len(texts) < PARALLEL_TEXTS:
            self._done = _tokenize_chunk(tokenizer, texts, max_length)
            return
        size = -(-len(texts) // (8 * workers))  # 8 chunks a worker: an even finish
        self._pool = worker_pool(workers, _init_tokenizer, (tokenizer,))
        self._pending = self._pool.map_async(_tokenize_in_worker,
                                             [(texts[i:i + size], max_length) for i in range(0, len(texts), size)])

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        if self._done is None:
            parts = self._pending.get()
            self.close()
            self._done = np.concatenate([p[0] for p in parts]), np.concatenate([p[1] for p in parts])
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
    """All texts' token ids, flat in input order, and each text's length (``Tokenizing``, waited for)."""
    with Tokenizing(tokenizer, texts, max_length, workers) as tokenizing:
        return tokenizing.result()


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


def embed_texts(encoder: Encoder, tokenizer, texts: list[str], config: EmbedConfig, progress: bool = True,
                summary: bool | None = None, tokenizing: Tokenizing | None = None) -> np.ndarray:
    """(N, D) float32 features, row i for texts[i], on ``encoder`` (any backend's: ``open_encoder``).
    ``progress`` shows a bar on stderr, ``summary`` (default: as ``progress``) a closing line there.
    ``tokenizing``: the texts' tokenising, begun by the caller (of ``prepare_texts``, at this model's
    ``token_limit``)."""
    max_length = token_limit(config, encoder.config.max_position_embeddings)
    vocab_size = encoder.config.vocab_size
    batch_tokens = config.batch_tokens or BATCH_TOKENS.get(device_type(encoder.device), BATCH_TOKENS["cuda"])
    start = time.perf_counter()
    if tokenizing is not None and tokenizing.max_length != max_length:
        raise ValueError(f"texts tokenised to {tokenizing.max_length} tokens, the model takes {max_length}")
    tokens = Tokens(*(tokenizing.result() if tokenizing is not None
                      else tokenize_texts(tokenizer, prepare_texts(texts, config), max_length, config.workers)))
    tokenized = time.perf_counter() - start
    top = int(tokens.ids.max()) if len(tokens.ids) else 0
    if top >= vocab_size:  # an index past the embedding table: a tokenizer of another model
        raise BertctlError(f"token id {top} from the tokenizer is past the model's {vocab_size:,} word "
                           "embeddings: use the tokenizer saved with this model")
    # L2 normalisation comes after the Dense modules; without them the backend may do it (on the device).
    normalize = config.normalize and not config.dense
    with track("embed", len(texts), disable=not progress) as advance:
        batches = length_batches(tokens.lengths, config.batch_size, batch_tokens)
        out = encoder.features(tokens, batches, config.spec, tokenizer.pad_token_id, normalize=normalize,
                               advance=advance)
    out = finish_features(out, config, normalized=normalize)
    bad = int((~np.isfinite(out)).any(axis=1).sum())
    if bad:  # fp16's range ends at 65504: a checkpoint with large activations overflows it
        raise BertctlError(f"{bad} of the {len(texts)} embeddings are not finite (NaN or inf) at --precision "
                           f"{encoder.precision}: " + ("the checkpoint's activations overflow"
                                                       if encoder.precision == "fp32" else
                                                       "embed them with --precision fp32 (or bf16, which has its range)"))
    seconds = time.perf_counter() - start
    if progress if summary is None else summary:
        lengths = tokens.lengths
        count, truncated = int(lengths.sum()), int((lengths == max_length).sum())
        stderr.print(
            f"embedded {len(texts)} texts ({count} tokens) in {seconds:.2f} s ({tokenized:.2f} s tokenising): "
            f"{len(texts) / seconds:.1f} texts/s, {count / seconds:.0f} tokens/s on {encoder.device} ({encoder.name})"
            + (f"; {truncated} filled the {max_length}-token limit (longer texts are truncated)" if truncated else "")
        )
    return out


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
    """``.npy`` (float32 N x D), ``.jsonl`` ({"index", "embedding"} per row) or ``.safetensors`` ("embeddings")."""
    output = Path(output)
    if output.suffix == ".npy":
        with atomic_open(output, "wb") as f:
            np.save(f, array)
    elif output.suffix == ".jsonl":
        with atomic_open(output, "w", encoding="utf-8") as f:
            for i, row in enumerate(array):
                f.write(json.dumps({"index": i, "embedding": [round(float(v), 7) for v in row]}) + "\n")
    elif output.suffix == ".safetensors":
        from safetensors.numpy import save_file

        with atomic_path(output) as tmp:
            save_file({"embeddings": np.ascontiguousarray(array)}, str(tmp))
    else:
        raise BertctlError(f"--output {output}: suffix must be one of {', '.join(OUTPUT_SUFFIXES)}")
