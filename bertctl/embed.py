"""Feature extraction: the paper's feature-based use of BERT (§5.3, Table 7).

Texts are tokenised (in ``workers`` processes for large inputs, while the ``embed`` command loads
torch and the model: ``Tokenizing``), sorted by
token count and cut into batches of at most ``batch_size`` texts and ``batch_tokens`` padded tokens
(short texts go many to a batch, long ones few, and little is padding); the chosen layers are
combined, pooled over real tokens, mapped by a sentence-transformers checkpoint's Dense layers (if any),
optionally L2-normalised, and written in input order.

Three backends run the encoder: PyTorch (``BertModel``, any device and dtype), ONNX Runtime on the
CPU (``bertctl.export.OnnxEncoder``) and bertctl's own CUDA encoder on a GPU
(``bertctl.native.NativeEncoder``, which pools there too).  The last two import no torch: numpy arrays
in and out, the ONNX Runtime path's pooled here with numpy (``pool`` and friends take either kind of
array).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from bertctl.errors import BertctlError
from bertctl.io import atomic_open, atomic_path, parse_json_line
from bertctl.progress import stderr, track
from bertctl.text.files import iter_lines, read_lines
from bertctl.workers import worker_pool

# Table 7 of the paper: which hidden states feed the features.
LAYER_CHOICES = ("last", "second-to-last", "sum-last-4", "concat-last-4", "embeddings")
POOLING_CHOICES = ("cls", "mean", "max", "mean-sqrt-len", "weighted-mean", "last")
OUTPUT_SUFFIXES = (".npy", ".jsonl", ".safetensors")
# auto: native (bertctl.native) on a GPU where it is built and runs the model, onnxruntime on the CPU
# in fp32 when installed (faster there: benchmarks/results/embed-backends-cpu.json), else torch.
BACKEND_CHOICES = ("auto", "torch", "onnxruntime", "native")
# Padded tokens per forward pass, by device type. On the 2-core CPU (AMD EPYC, 1 MB of L2 a core) the
# whole `embed` of 4,000 SST-2 sentences with MiniLM took 3.87 s at 1024 (batches of 512 and 768 the
# same), 4.05 s at 2048, 4.33 s at 4096 and 4.79 s at 8192 (medians of 3): small batches stay in cache.
# A GPU wants large ones: there a batch of sentences holds thousands of them (on an H100, MiniLM's
# batches of 256 SST-2 sentences took 7-10 ms of host time each for 1.2 ms of GPU work).
BATCH_TOKENS = {"cpu": 1024, "cuda": 65536}
PRECISION_CHOICES = ("fp32", "bf16", "fp16", "auto")
HALF_DTYPES = {"bf16": "bfloat16", "fp16": "float16"}  # torch dtype names (torch is imported only when needed)


@dataclass
class EmbedConfig:
    layers: str = "last"
    pooling: str = "mean"
    normalize: bool = False
    batch_size: int | None = None  # texts per forward pass, at most; None: as many as batch_tokens allows
    batch_tokens: int | None = None  # padded tokens per forward pass, at most (one text always fits); None: BATCH_TOKENS
    max_length: int | None = None  # default and upper bound: the model's max_position_embeddings
    precision: str = "fp32"  # fp32, bf16 or fp16 (autocast), or auto: bf16 on a GPU, fp32 on the CPU
    device: str = "auto"
    backend: str = "auto"
    workers: int = 1  # tokenising processes (the output does not depend on it)
    # A sentence-transformers checkpoint's own steps (bertctl.st_modules): Dense layers on the pooled
    # vector (before normalize), and the text's lowercasing and prompt before tokenising.
    dense: tuple = ()
    lowercase: bool = False
    prompt: str = ""

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise BertctlError(f"--backend must be one of {', '.join(BACKEND_CHOICES)}, not {self.backend!r}")
        if self.layers not in LAYER_CHOICES:
            raise BertctlError(f"--layers must be one of {', '.join(LAYER_CHOICES)}, not {self.layers!r}")
        if not all(mode in POOLING_CHOICES for mode in self.pooling.split(",")):
            raise BertctlError(f"--pooling must be one of {', '.join(POOLING_CHOICES)} (or several joined by ','), "
                               f"not {self.pooling!r}")
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


def cuda_possible() -> bool:
    """False where torch cannot see a GPU, told without importing torch (0.8 s on the CPU machine):
    a CPU-only torch build, or on Linux no NVIDIA (``/dev/nvidiactl``) or ROCm (``/dev/kfd``) device."""
    try:
        torch_version = version("torch")
    except PackageNotFoundError:
        return False
    if torch_version.endswith("+cpu"):
        return False
    if sys.platform.startswith("linux"):
        return os.path.exists("/dev/nvidiactl") or os.path.exists("/dev/kfd")
    return True


def resolve_device(name: str):
    """``"cpu"`` (a string: torch stays unloaded) or a ``torch.device`` for any other device."""
    if name == "cpu" or (name == "auto" and not cuda_possible()):
        return "cpu"
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BertctlError(f"--device: unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BertctlError("--device cuda: no CUDA device is available")
    return device


def device_type(device) -> str:
    """``"cpu"``, ``"cuda"``, ...: of a device name or a ``torch.device``."""
    return getattr(device, "type", None) or str(device).split(":")[0]


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


def resolve_precision(precision: str, device) -> str:
    """fp32, bf16 or fp16 on ``device`` (auto: bf16 on a GPU, fp32 on the CPU, as in pretrain and finetune)."""
    on_cpu = device_type(device) == "cpu"
    if precision == "auto":
        return "fp32" if on_cpu else "bf16"
    if precision == "fp16" and on_cpu:
        raise BertctlError("--precision fp16 needs a GPU (use fp32 or bf16 on the CPU)")
    return precision


def resolve_backend(config: EmbedConfig, device, onnx: Path | None = None) -> str:
    """``torch`` or ``onnxruntime``: what ``config.backend`` (and an ``--onnx`` file) ask for on ``device``."""
    from bertctl.export import onnx_missing

    backend = "onnxruntime" if onnx is not None and config.backend == "auto" else config.backend
    if backend == "onnxruntime":
        if device_type(device) != "cpu":
            raise BertctlError(f"--backend onnxruntime runs on the CPU, not --device {device}")
        if resolve_precision(config.precision, device) != "fp32":
            raise BertctlError(f"--backend onnxruntime runs fp32; --precision {config.precision} needs --backend torch")
        missing = onnx_missing(export=onnx is None)
        if missing:
            raise BertctlError(f"--backend onnxruntime needs {', '.join(missing)}: pip install 'bertctl[onnx]'")
        return backend
    if onnx is not None:
        raise BertctlError("--onnx runs under onnxruntime; it cannot go with --backend torch")
    if backend == "auto":
        fits = resolve_precision(config.precision, device) == "fp32" and device_type(device) == "cpu" \
            and not onnx_missing(export=True)
        return "onnxruntime" if fits else "torch"
    return backend


def native_device(config: EmbedConfig, onnx: Path | None = None) -> str | None:
    """The GPU (``cuda:N``) on which bertctl's own CUDA encoder (``bertctl.native``) is to run ``config``,
    or None where another backend runs; told without importing torch or starting CUDA (the encoder's
    start, in a thread beside the weights' read, finds a missing device).  ``--backend native`` where it
    cannot run is an error; ``auto`` goes on to the other backends."""
    from bertctl import native

    explicit = config.backend == "native"
    if explicit and onnx is not None:
        raise BertctlError("--onnx runs under onnxruntime; it cannot go with --backend native")
    if not explicit and (config.backend != "auto" or onnx is not None):
        return None
    index = native.device_index(config.device)
    if index is None:
        if explicit:
            raise BertctlError(f"--backend native runs on a GPU, not --device {config.device}")
        return None
    why = ("bertctl._encoder is not built (it builds with the CUDA kernels: BERTCTL_CUDA=1)" if not native.built()
           else "no GPU is visible" if not native.gpu_visible() else None)
    if why and explicit:
        raise BertctlError(f"--backend native: {why}")
    return None if why else f"cuda:{index}"


#: ``--backend auto`` keeps the native encoder for texts of at most this many tokens, weighted by their
#: length (sum of squares over sum: attention's cost against the rest's). Its attention runs on CUDA cores,
#: a thread a query, and was measured only on short texts (SST-2's: 20), where it is the faster;
#: longer texts go to torch's fused attention unless ``--backend native`` asks for it.
NATIVE_AUTO_TOKENS = 64


def native_suits(lengths: np.ndarray) -> bool:
    """Whether texts of these token counts are short enough for ``auto`` to run the native encoder."""
    lengths = lengths.astype(np.float64)
    return bool((lengths ** 2).sum() <= NATIVE_AUTO_TOKENS * lengths.sum())


def open_encoder(directory: str | Path, config: EmbedConfig, onnx: Path | None = None, lengths=None):
    """The encoder ``embed`` runs for ``config``: bertctl's own CUDA encoder where it serves (torch stays
    unloaded), else ``load_encoder`` on ``resolve_device``'s device with ``resolve_backend``'s backend.
    ``lengths``, a callable giving the texts' token counts (the tokenising's result, waited for once the
    native encoder has started), lets ``auto`` send long texts to torch instead (``native_suits``)."""
    where = native_device(config, onnx)
    if where is not None:
        from bertctl.native import NativeEncoder

        try:
            encoder = NativeEncoder(directory, where, resolve_precision(config.precision, where))
        except BertctlError as e:
            if config.backend != "auto":
                raise
            stderr.print(f"[yellow]native backend unavailable ({e}); embedding with torch")
        else:
            if config.backend != "auto" or lengths is None or native_suits(lengths()):
                return encoder
            del encoder  # its GPU memory
            stderr.print(f"[dim]texts longer than {NATIVE_AUTO_TOKENS} tokens (weighted by length): embedding with "
                         "torch, whose attention is the faster there (--backend native runs them on bertctl's)")
    device = resolve_device(config.device)
    return load_encoder(directory, device, resolve_backend(config, device, onnx), onnx,
                        fallback=config.backend == "auto", precision=config.precision)


def load_encoder(directory: str | Path, device, backend: str = "torch", onnx: Path | None = None,
                 fallback: bool = False, precision: str = "fp32"):
    """The encoder of any checkpoint directory (heads and pooler dropped), as a PyTorch module
    or (``backend="onnxruntime"``) an ONNX export of it: ``onnx``, or one cached on first use.
    With ``fallback`` (``--backend auto``) a model whose export fails runs on PyTorch, with a note.

    ``precision`` bf16 or fp16 casts the PyTorch module's weights once, here: inference needs no
    fp32 master copy, and autocast would cast every weight again at every batch (on an H100, 150
    kernels a MiniLM batch under autocast, 107 cast once; ``benchmarks/profile_embed.py``)."""
    from bertctl.checkpoint import load_config

    if backend == "onnxruntime":
        from bertctl.export import OnnxEncoder, cached_encoder

        if onnx is not None:
            return OnnxEncoder(onnx, load_config(directory))
        try:
            return cached_encoder(directory)
        except BertctlError as e:
            if not fallback:
                raise
            stderr.print(f"[yellow]onnxruntime backend unavailable ({e}); embedding with torch")
    from bertctl.checkpoint import load_state, on_meta, read_state_dict
    from bertctl.model import BertModel

    config = load_config(directory)
    model = load_state(on_meta(lambda: BertModel(config, add_pooling_layer=False)), read_state_dict(directory),
                       source=str(directory))
    model = model.to(device).eval()
    half = HALF_DTYPES.get(resolve_precision(precision, device))
    if half is None:
        return model
    import torch

    return model.to(getattr(torch, half))


def combine_layers(hidden_states, layers: str):
    """hidden_states: L+1 arrays (B, S, H), embeddings first (numpy or torch).  Returns (B, S, H) or (B, S, 4H)."""
    if layers == "last":
        return hidden_states[-1]
    if layers == "second-to-last":
        return hidden_states[-2]
    if layers == "embeddings":
        return hidden_states[0]
    if len(hidden_states) < 5:
        raise BertctlError(f"--layers {layers} needs at least 4 layers; the model has {len(hidden_states) - 1}")
    last4 = list(hidden_states[-4:])  # layers L-3, L-2, L-1, L in that order
    if layers == "sum-last-4":
        return last4[0] + last4[1] + last4[2] + last4[3]
    if isinstance(last4[0], np.ndarray):
        return np.concatenate(last4, axis=-1)
    import torch

    return torch.cat(last4, dim=-1)


def pool(x, mask, pooling: str):
    """x (B, S, D) float, mask (B, S) 1 = real token (padding on the right) -> (B, D), or (B, k*D) for
    k modes joined by ","; padding never contributes.  numpy arrays or torch tensors (both of one kind).
    The modes are sentence-transformers' ``Pooling``'s: cls, mean, max, mean-sqrt-len (the sum over the
    square root of the length), weighted-mean (token i weighs i, from 1), last (the last real token)."""
    numpy = isinstance(x, np.ndarray)
    if not numpy:
        import torch
    if "," in pooling:
        parts = [pool(x, mask, mode) for mode in pooling.split(",")]
        return np.concatenate(parts, axis=-1) if numpy else torch.cat(parts, dim=-1)
    if pooling == "cls":
        return x[:, 0]
    if pooling == "last":
        rows = np.arange(x.shape[0]) if numpy else torch.arange(x.shape[0], device=x.device)
        return x[rows, mask.sum(1) - 1]
    m = mask[:, :, None].astype(x.dtype) if numpy else mask.unsqueeze(-1).to(x.dtype)  # (B, S, 1)
    if pooling == "max":
        return np.where(m > 0, x, -np.inf).max(1) if numpy else x.masked_fill(m == 0, float("-inf")).amax(1)
    if pooling == "weighted-mean":
        positions = np.arange(1, x.shape[1] + 1, dtype=x.dtype) if numpy else \
            torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)
        m = m * positions[None, :, None]
    total, count = (x * m).sum(1), m.sum(1)  # (B, D), (B, 1)
    count = np.maximum(count, 1e-9) if numpy else count.clamp(min=1e-9)
    return total / (count ** 0.5 if pooling == "mean-sqrt-len" else count)


def finish_features(out: np.ndarray, config: EmbedConfig, rows: int = 65536, normalized: bool = False) -> np.ndarray:
    """A sentence-transformers checkpoint's Dense modules, then L2 normalisation (as
    ``torch.nn.functional.normalize``: norms below 1e-12 count as 1e-12; not again when ``normalized``),
    over the pooled (N, D) float32 vectors ``rows`` at a time, so that the temporaries stay small beside a
    large output; normalisation is in place."""
    for dense in config.dense:
        mapped = np.empty((len(out), dense.weight.shape[0]), np.float32)
        for i in range(0, len(out), rows):
            mapped[i:i + rows] = dense(out[i:i + rows])
        out = mapped
    if config.normalize and not normalized:
        for i in range(0, len(out), rows):
            block = out[i:i + rows]
            norms = np.sqrt(np.einsum("ij,ij->i", block, block))  # 0.05 s for 67,349 x 384, np.linalg.norm 0.08
            block /= np.maximum(norms, 1e-12)[:, None]
    return out


def length_batches(lengths: np.ndarray, batch_size: int | None, batch_tokens: int) -> list[np.ndarray]:
    """Indices into ``lengths``, longest first, cut into batches of at most ``batch_size`` texts (None:
    no limit) whose padded size (texts x longest) is at most ``batch_tokens``; a text longer than that
    goes alone."""
    order = np.argsort(-lengths, kind="stable")
    batch_size = batch_size or len(lengths)
    batches, start = [], 0
    while start < len(order):
        fit = max(1, min(batch_size, batch_tokens // int(lengths[order[start]])))  # the first is the longest
        batches.append(order[start:start + fit])
        start += fit
    return batches


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
    normalisation, token limit and default prompt (``bertctl.st_modules``), else last-layer mean
    pooling, no normalisation, the model's positions and no prompt.  ``prompt_name`` picks one of the
    checkpoint's named prompts.  Its Dense modules apply to its own pooled vectors only: not when
    ``pooling`` or ``layers`` is given."""
    from bertctl.st_modules import read_modules

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


def _features_torch(model, ids: np.ndarray, mask: np.ndarray, config: EmbedConfig):
    import torch

    device = next(model.parameters()).device
    all_layers = config.layers != "last"
    # From pinned memory the copy is queued behind the GPU's work; from pageable memory the host
    # would first wait for that work to finish, every batch.
    pin = device.type == "cuda"
    ids_t, mask_t = ((torch.from_numpy(a).pin_memory() if pin else torch.from_numpy(a)).to(device, non_blocking=True)
                     for a in (ids, mask))
    types = torch.zeros_like(ids_t)
    precision = resolve_precision(config.precision, device)
    half = torch.float16 if precision == "fp16" else torch.bfloat16
    # A model cast once by load_encoder runs as it is; an fp32 one runs under autocast.
    autocast = precision != "fp32" and next(model.parameters()).dtype == torch.float32
    from bertctl.nn.attention import varied_shapes  # no cuDNN attention plan per batch width (6.25 s against 7.35 s)

    with torch.no_grad(), varied_shapes(), torch.autocast(device.type, dtype=half, enabled=autocast):
        try:
            encoded = model(ids_t, types, mask_t, output_hidden_states=all_layers)
        except torch.OutOfMemoryError:
            raise BertctlError(f"out of {device.type.upper()} memory embedding {ids.shape[0]} texts of {ids.shape[1]} "
                               f"tokens in one forward pass: pass a smaller --batch-tokens") from None
    states = encoded.hidden_states if all_layers else (encoded.last_hidden_state,)
    # On the device: the caller copies many batches at once (one wait, not one a batch).
    return pool(combine_layers(states, config.layers).float(), mask_t, config.pooling)


def _features_onnx(model, ids: np.ndarray, mask: np.ndarray, config: EmbedConfig) -> np.ndarray:
    states = model.hidden_states(ids, mask, np.zeros_like(ids), all_layers=config.layers != "last")
    return pool(combine_layers(states, config.layers), mask, config.pooling)


#: Pooled values (texts x features) a native run queues on the GPU at once: its device-side output.
NATIVE_CHUNK_VALUES = 1 << 25


def _embed_native(model, flat: np.ndarray, lengths: np.ndarray, batches: list[np.ndarray], config: EmbedConfig,
                  advance) -> tuple[np.ndarray, bool]:
    """(N, D) features on bertctl's own CUDA encoder, and whether they are L2-normalised yet (on the GPU,
    unless Dense modules come first): the batches queued a chunk at a time, with one wait a chunk; a
    single chunk (SST-2's 67,349 texts at 384 features) writes straight into the output."""
    normalize = config.normalize and not config.dense
    width = model.width(config.layers, config.pooling)
    per_chunk = max(1, NATIVE_CHUNK_VALUES // width)
    chunks, current, held = [], [], 0
    for batch in batches:
        if current and held + len(batch) > per_chunk:
            chunks.append(current)
            current, held = [], 0
        current.append(batch)
        held += len(batch)
    chunks.append(current)
    if len(chunks) == 1:
        out = model.embed(flat, lengths, batches, config.layers, config.pooling, normalize)
        advance(len(lengths))
        return out, normalize
    out = np.empty((len(lengths), width), np.float32)
    for chunk in chunks:
        order = np.concatenate(chunk)
        out[order] = model.embed(flat, lengths, chunk, config.layers, config.pooling, normalize, local=True)
        advance(len(order))
    return out, normalize


def embed_texts(model, tokenizer, texts: list[str], config: EmbedConfig, progress: bool = True,
                summary: bool | None = None, tokenizing: Tokenizing | None = None) -> np.ndarray:
    """(N, D) float32 features, row i for texts[i]; ``model`` is a ``BertModel``, an ``OnnxEncoder`` or a
    ``NativeEncoder``.
    ``progress`` shows a bar on stderr, ``summary`` (default: as ``progress``) a closing line there.
    ``tokenizing``: the texts' tokenising, begun by the caller (of ``prepare_texts``, at this model's
    ``token_limit``)."""
    runtime = getattr(model, "runtime", "torch")
    features = {"torch": _features_torch, "onnxruntime": _features_onnx}.get(runtime)  # native: _embed_native
    device = next(model.parameters()).device if runtime == "torch" else model.device
    max_length = token_limit(config, model.config.max_position_embeddings)
    vocab_size = model.config.vocab_size
    batch_tokens = config.batch_tokens or BATCH_TOKENS.get(device_type(device), BATCH_TOKENS["cuda"])
    start = time.perf_counter()
    if tokenizing is not None and tokenizing.max_length != max_length:
        raise ValueError(f"texts tokenised to {tokenizing.max_length} tokens, the model takes {max_length}")
    flat, lengths = (tokenizing.result() if tokenizing is not None
                     else tokenize_texts(tokenizer, prepare_texts(texts, config), max_length, config.workers))
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) if len(lengths) else lengths
    tokenized = time.perf_counter() - start
    out: np.ndarray | None = None
    pending: list = []  # (indices, device features) not yet copied to the host
    held = 0  # their rows

    def flush() -> None:
        nonlocal held
        for idx, feats in pending:
            out[idx] = feats if isinstance(feats, np.ndarray) else feats.cpu().numpy()
        pending.clear()
        held = 0

    normalized = False
    with track("embed", len(texts), disable=not progress) as advance:
        batches = length_batches(lengths, config.batch_size, batch_tokens)
        if runtime == "native":
            top = int(flat.max())
            if top >= vocab_size:
                raise BertctlError(f"token id {top} from the tokenizer is past the model's {vocab_size:,} word "
                                   "embeddings: use the tokenizer saved with this model")
            out, normalized = _embed_native(model, flat, lengths, batches, config, advance)
            batches = []
        for index in batches:
            width = int(lengths[index[0]])
            mask = np.arange(width)[None, :] < lengths[index, None]  # (B, S) bool
            ids = np.full(mask.shape, tokenizer.pad_token_id, dtype=np.int64)
            counts = lengths[index]  # the rows' tokens, gathered from flat at once (not a slice a row)
            ids[mask] = flat[np.repeat(starts[index] - (np.cumsum(counts) - counts), counts) + np.arange(counts.sum())]
            top = int(ids.max())
            if top >= vocab_size:  # an index past the embedding table: a tokenizer of another model
                raise BertctlError(f"token id {top} from the tokenizer is past the model's {vocab_size:,} word "
                                   "embeddings: use the tokenizer saved with this model")
            feats = features(model, ids, mask.astype(np.int64), config)
            if out is None:
                out = np.empty((len(texts), feats.shape[-1]), dtype=np.float32)
            pending.append((index, feats))
            held += len(index)
            if len(pending) >= 32 or held >= 65536:  # bounds the device memory the features hold
                flush()
            advance(len(index))
        flush()
    assert out is not None
    out = finish_features(out, config, normalized=normalized)
    bad = int((~np.isfinite(out)).any(axis=1).sum())
    if bad:  # fp16's range ends at 65504: a checkpoint with large activations overflows it
        precision = resolve_precision(config.precision, device)
        raise BertctlError(f"{bad} of the {len(texts)} embeddings are not finite (NaN or inf) at --precision "
                           f"{precision}: " + ("the checkpoint's activations overflow" if precision == "fp32" else
                                               "embed them with --precision fp32 (or bf16, which has its range)"))
    seconds = time.perf_counter() - start
    if progress if summary is None else summary:
        tokens, truncated = int(lengths.sum()), int((lengths == max_length).sum())
        stderr.print(
            f"embedded {len(texts)} texts ({tokens} tokens) in {seconds:.2f} s ({tokenized:.2f} s tokenising): "
            f"{len(texts) / seconds:.1f} texts/s, {tokens / seconds:.0f} tokens/s on {device}"
            f" ({getattr(model, 'runtime', 'torch')})"
            + (f"; {truncated} filled the {max_length}-token limit (longer texts are truncated)" if truncated else "")
        )
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
