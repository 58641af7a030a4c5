"""Feature extraction: the paper's feature-based use of BERT (§5.3, Table 7).

Texts are encoded in batches of similar length (less padding), the chosen layers
are combined, pooled over real tokens, optionally L2-normalised, and written in
input order.
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from bertctl.checkpoint import load_config, load_state, read_state_dict
from bertctl.errors import BertctlError
from bertctl.io import atomic_open, atomic_path, parse_json_line
from bertctl.model import BertModel
from bertctl.progress import stderr, track
from bertctl.tokenizer import iter_lines

# Table 7 of the paper: which hidden states feed the features.
LAYER_CHOICES = ("last", "second-to-last", "sum-last-4", "concat-last-4", "embeddings")
POOLING_CHOICES = ("cls", "mean", "max")
OUTPUT_SUFFIXES = (".npy", ".jsonl", ".safetensors")
# auto: onnxruntime on the CPU in fp32 when installed (faster there:
# benchmarks/results/embed-backends-cpu.json), else torch.
BACKEND_CHOICES = ("auto", "torch", "onnxruntime")


@dataclass
class EmbedConfig:
    layers: str = "last"
    pooling: str = "mean"
    normalize: bool = False
    batch_size: int = 64
    max_length: int | None = None  # default and upper bound: the model's max_position_embeddings
    dtype: str = "fp32"  # or "bf16"
    device: str = "auto"
    backend: str = "auto"

    def __post_init__(self) -> None:
        if self.backend not in BACKEND_CHOICES:
            raise BertctlError(f"--backend must be one of {', '.join(BACKEND_CHOICES)}, not {self.backend!r}")
        if self.layers not in LAYER_CHOICES:
            raise BertctlError(f"--layers must be one of {', '.join(LAYER_CHOICES)}, not {self.layers!r}")
        if self.pooling not in POOLING_CHOICES:
            raise BertctlError(f"--pooling must be one of {', '.join(POOLING_CHOICES)}, not {self.pooling!r}")
        if self.dtype not in ("fp32", "bf16"):
            raise BertctlError(f"--dtype must be fp32 or bf16, not {self.dtype!r}")
        if self.batch_size < 1:
            raise BertctlError(f"--batch-size must be at least 1, not {self.batch_size}")
        if self.max_length is not None and self.max_length < 2:
            raise BertctlError(f"--max-length must be at least 2 (room for [CLS] and [SEP]), not {self.max_length}")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BertctlError(f"--device: unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BertctlError("--device cuda: no CUDA device is available")
    return device


def read_texts(path: str | Path, field: str | None = None) -> list[str]:
    """One text per line of a text file, or the ``field`` of each JSONL object (``.jsonl`` or ``field`` given).

    Lines are read as ``tokenize encode`` reads them (``iter_lines``: the same errors for a missing
    file or a line that is not UTF-8)."""
    path = Path(path)
    as_jsonl = field is not None or path.suffix == ".jsonl"
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


def resolve_backend(config: EmbedConfig, device: torch.device, onnx: Path | None = None) -> str:
    """``torch`` or ``onnxruntime``: what ``config.backend`` (and an ``--onnx`` file) ask for on ``device``."""
    from bertctl.export import onnx_missing

    backend = "onnxruntime" if onnx is not None and config.backend == "auto" else config.backend
    if backend == "onnxruntime":
        if device.type != "cpu":
            raise BertctlError(f"--backend onnxruntime runs on the CPU, not --device {device}")
        if config.dtype != "fp32":
            raise BertctlError("--backend onnxruntime runs fp32; --dtype bf16 needs --backend torch")
        missing = onnx_missing(export=onnx is None)
        if missing:
            raise BertctlError(f"--backend onnxruntime needs {', '.join(missing)}: pip install 'bertctl[onnx]'")
        return backend
    if onnx is not None:
        raise BertctlError("--onnx runs under onnxruntime; it cannot go with --backend torch")
    if backend == "auto":
        fits = device.type == "cpu" and config.dtype == "fp32" and not onnx_missing(export=True)
        return "onnxruntime" if fits else "torch"
    return backend


def load_encoder(directory: str | Path, device: torch.device, backend: str = "torch", onnx: Path | None = None,
                 fallback: bool = False):
    """The encoder of any checkpoint directory (heads and pooler dropped), as a PyTorch module
    or (``backend="onnxruntime"``) an ONNX export of it: ``onnx``, or one cached on first use.
    With ``fallback`` (``--backend auto``) a model whose export fails runs on PyTorch, with a note."""
    config = load_config(directory)
    if backend == "onnxruntime":
        from bertctl.export import OnnxEncoder, cached_encoder

        if onnx is not None:
            return OnnxEncoder(onnx, config)
        try:
            return cached_encoder(directory)
        except BertctlError as e:
            if not fallback:
                raise
            stderr.print(f"[yellow]onnxruntime backend unavailable ({e}); embedding with torch")
    model = BertModel(config, add_pooling_layer=False)
    load_state(model, read_state_dict(directory), source=str(directory))
    return model.to(device).eval()


def combine_layers(hidden_states: tuple[torch.Tensor, ...], layers: str) -> torch.Tensor:
    """hidden_states: L+1 tensors (B, S, H), embeddings first.  Returns (B, S, H) or (B, S, 4H)."""
    if layers == "last":
        return hidden_states[-1]
    if layers == "second-to-last":
        return hidden_states[-2]
    if layers == "embeddings":
        return hidden_states[0]
    if len(hidden_states) < 5:
        raise BertctlError(f"--layers {layers} needs at least 4 layers; the model has {len(hidden_states) - 1}")
    last4 = hidden_states[-4:]  # layers L-3, L-2, L-1, L in that order
    return torch.stack(last4).sum(0) if layers == "sum-last-4" else torch.cat(last4, dim=-1)


def pool(x: torch.Tensor, mask: torch.Tensor, pooling: str) -> torch.Tensor:
    """x (B, S, D), mask (B, S) 1 = real token -> (B, D); padding never contributes."""
    if pooling == "cls":
        return x[:, 0]
    m = mask.unsqueeze(-1).to(x.dtype)
    if pooling == "mean":
        return (x * m).sum(1) / m.sum(1).clamp(min=1)
    return x.masked_fill(m == 0, float("-inf")).amax(1)


@torch.no_grad()
def embed_texts(model: BertModel, tokenizer, texts: list[str], config: EmbedConfig, progress: bool = True) -> np.ndarray:
    """(N, D) float32 features, row i for texts[i]; ``model`` is a ``BertModel`` or an ``OnnxEncoder``."""
    device = model.device if hasattr(model, "runtime") else next(model.parameters()).device
    all_layers = config.layers != "last"
    limit = model.config.max_position_embeddings
    max_length = limit if config.max_length is None else min(config.max_length, limit)
    vocab_size = model.config.vocab_size
    # Sort by length so each batch pads little; restore input order at the end.
    lengths = [len(t) for t in texts]
    order = sorted(range(len(texts)), key=lengths.__getitem__, reverse=True)
    out: np.ndarray | None = None
    tokens = truncated = 0
    start = time.perf_counter()
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=config.dtype == "bf16")
    with track("embed", len(texts), disable=not progress) as advance:
        for b in range(0, len(order), config.batch_size):
            index = order[b : b + config.batch_size]
            batch = tokenizer.encode_batch([texts[i] for i in index], max_length=max_length, truncation="longest_first")
            top = int(batch["input_ids"].max())
            if top >= vocab_size:  # an index past the embedding table: a tokenizer of another model
                raise BertctlError(f"token id {top} from the tokenizer is past the model's {vocab_size:,} word "
                                   "embeddings: use the tokenizer saved with this model")
            ids = batch["input_ids"].to(device, non_blocking=True)
            mask = batch["attention_mask"].to(device, non_blocking=True)
            types = batch["token_type_ids"].to(device, non_blocking=True)
            with autocast:
                encoded = model(ids, types, mask, output_hidden_states=all_layers)
            states = encoded.hidden_states if all_layers else (encoded.last_hidden_state,)
            feats = pool(combine_layers(states, config.layers).float(), mask, config.pooling)
            if config.normalize:
                feats = torch.nn.functional.normalize(feats, dim=-1)
            if out is None:
                out = np.empty((len(texts), feats.shape[-1]), dtype=np.float32)
            out[index] = feats.cpu().numpy()
            tokens += int(mask.sum())
            truncated += int((mask.sum(1) == max_length).sum())
            advance(len(index))
    seconds = time.perf_counter() - start
    if progress:
        stderr.print(
            f"embedded {len(texts)} texts ({tokens} tokens) in {seconds:.2f} s: "
            f"{len(texts) / seconds:.1f} texts/s, {tokens / seconds:.0f} tokens/s on {device}"
            f" ({getattr(model, 'runtime', 'torch')})"
            + (f"; {truncated} filled the {max_length}-token limit (longer texts are truncated)" if truncated else "")
        )
    assert out is not None
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
