"""bertctl's own CUDA encoder for ``embed``: the compiled ``bertctl._encoder`` (csrc/encoder).

It runs a BERT encoder's forward pass and the pooling on one GPU with cuBLASLt and bertctl's kernels, on
packed tokens (no padding), and imports no torch: on an H200, ``import torch`` and torch's CUDA start-up
took 2.1 s, this module's CUDA context and cuBLASLt 0.3 s (``benchmarks/results/embed-vs-st-h200-*``), and
for a short job such as embedding SST-2's 67,349 sentences start-up is most of the run.  fp32 runs
cuBLAS's fp32 products (no TF32); bf16 and fp16 keep weights and activations in half precision, with the
LayerNorm, softmax and pooling arithmetic in fp32.

Built with the CUDA kernels (``BERTCTL_CUDA``); it links cuBLASLt, found here where the loader does
not see it: in the NVIDIA wheels beside torch (``nvidia/cu13/lib``, ``nvidia/cublas/lib``) or under
``CUDA_HOME``.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import os
import re
import sys
from pathlib import Path

import numpy as np

from bertctl.errors import BertctlError

# Hugging Face hidden_act names the encoder computes, and how.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "relu": "relu"}
HEAD_SIZES = (32, 64, 128)
MAX_HIDDEN = 1024
# bertctl.embed.POOLING_CHOICES -> csrc/encoder/kernels.h's Pool.
POOL_CODES = {"cls": 0, "mean": 1, "max": 2, "mean-sqrt-len": 3, "weighted-mean": 4, "last": 5}


def _library_dirs() -> list[str]:
    """Where a CUDA library may lie that the dynamic loader does not search."""
    dirs = []
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cublas/lib", "nvidia/cu12/lib"):
            if os.path.isdir(os.path.join(entry, sub)):
                dirs.append(os.path.join(entry, sub))
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home:
            dirs += [os.path.join(home, "lib64"), os.path.join(home, "lib")]
    return dirs


@functools.lru_cache(maxsize=1)
def _load():
    """(bertctl._encoder, None) or (None, why it is unavailable)."""
    if os.environ.get("BERTCTL_NO_EXT") == "1":
        return None, "BERTCTL_NO_EXT=1"
    try:
        from bertctl import _encoder
        return _encoder, None
    except ImportError as e:
        missing = re.search(r"(lib[\w.+-]+\.so[\d.]*): cannot open shared object file", str(e))
        if not missing:
            return None, f"bertctl._encoder did not load ({e}); it is built with the CUDA kernels (BERTCTL_CUDA=1)"
        name = missing.group(1)
    for directory in _library_dirs():
        for path in sorted(glob.glob(os.path.join(glob.escape(directory), name))):
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)  # then the module's link to it resolves
                from bertctl import _encoder
                return _encoder, None
            except (OSError, ImportError):
                continue
    return None, f"bertctl._encoder needs {name}, which is neither on the loader's path nor in an NVIDIA wheel"


def device_count() -> int:
    """CUDA devices the native encoder sees (0 without the module, a driver or a device)."""
    module, _ = _load()
    try:
        return module.device_count() if module is not None else 0
    except RuntimeError:
        return 0


def available() -> tuple[bool, str | None]:
    """Whether the native encoder can run here, and if not, why (loads the module, not torch)."""
    module, why = _load()
    if module is None:
        return False, why
    return (True, None) if device_count() else (False, "no CUDA device is available")


def device_index(name: str) -> int | None:
    """The GPU a ``--device`` name picks (auto and cuda: 0), or None for the CPU or another kind of device."""
    if name in ("auto", "cuda"):
        return 0
    match = re.fullmatch(r"cuda:(\d+)", name)
    return int(match.group(1)) if match else None


def unsupported(config) -> str | None:
    """Why the native encoder cannot run a model of ``config`` (a ``BertConfig``), or None."""
    head = config.hidden_size // config.num_attention_heads
    if config.hidden_act not in ACTIVATIONS:
        return f"hidden_act {config.hidden_act!r} (it runs {', '.join(ACTIVATIONS)})"
    if head not in HEAD_SIZES:
        return f"attention heads of {head} (it runs {', '.join(map(str, HEAD_SIZES))})"
    if config.hidden_size > MAX_HIDDEN:
        return f"hidden size {config.hidden_size} (at most {MAX_HIDDEN})"
    kind = config.extra.get("position_embedding_type", "absolute")
    if kind != "absolute":
        return f"position_embedding_type {kind!r}"
    return None


def _bf16_bits(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even, as torch's cast."""
    bits = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def encoder_weights(directory: str | Path, config, precision: str) -> dict[str, np.ndarray]:
    """The encoder's weights from ``model.safetensors``, in the layout ``_encoder.Encoder`` takes:
    matrices and biases in ``precision``'s type (bf16 as uint16 bits), the query, key and value
    projections stacked, LayerNorm parameters in float32."""
    from safetensors.numpy import load_file

    from bertctl.checkpoint import WEIGHTS, _normalise_names

    path = Path(directory) / WEIGHTS
    if not path.exists():
        raise BertctlError(f"{directory}: no {WEIGHTS} (the native encoder reads safetensors only)")
    try:
        state = _normalise_names(load_file(str(path)))
    except Exception as e:  # noqa: BLE001 - a bf16 file, which numpy cannot hold, or an unreadable one
        raise BertctlError(f"{path}: not readable without torch ({str(e).splitlines()[0]})") from None
    state = {name.removeprefix("bert."): tensor for name, tensor in state.items()}

    def get(name: str) -> np.ndarray:
        if name not in state:
            raise BertctlError(f"{path}: no tensor {name}")
        return state[name].astype(np.float32, copy=False)

    def cast(a: np.ndarray) -> np.ndarray:
        if precision == "bf16":
            return _bf16_bits(a)
        return np.ascontiguousarray(a, dtype=np.float16 if precision == "fp16" else np.float32)

    def norm(a: np.ndarray) -> np.ndarray:
        return np.ascontiguousarray(a, dtype=np.float32)

    out = {"word": cast(get("embeddings.word_embeddings.weight")),
           "position": cast(get("embeddings.position_embeddings.weight")),
           "type": cast(get("embeddings.token_type_embeddings.weight")[0]),
           "embeddings.gamma": norm(get("embeddings.LayerNorm.weight")),
           "embeddings.beta": norm(get("embeddings.LayerNorm.bias"))}
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."
        qkv = [p + f"attention.self.{part}" for part in ("query", "key", "value")]
        out |= {f"{i}.qkv.weight": cast(np.concatenate([get(n + ".weight") for n in qkv])),
                f"{i}.qkv.bias": cast(np.concatenate([get(n + ".bias") for n in qkv])),
                f"{i}.attention.weight": cast(get(p + "attention.output.dense.weight")),
                f"{i}.attention.bias": cast(get(p + "attention.output.dense.bias")),
                f"{i}.attention.gamma": norm(get(p + "attention.output.LayerNorm.weight")),
                f"{i}.attention.beta": norm(get(p + "attention.output.LayerNorm.bias")),
                f"{i}.ffn_in.weight": cast(get(p + "intermediate.dense.weight")),
                f"{i}.ffn_in.bias": cast(get(p + "intermediate.dense.bias")),
                f"{i}.ffn_out.weight": cast(get(p + "output.dense.weight")),
                f"{i}.ffn_out.bias": cast(get(p + "output.dense.bias")),
                f"{i}.ffn.gamma": norm(get(p + "output.LayerNorm.weight")),
                f"{i}.ffn.beta": norm(get(p + "output.LayerNorm.bias"))}
    return out


def hidden_states_used(layers: str, num_layers: int) -> tuple[list[int], bool]:
    """(indices of the hidden states ``--layers`` combines, 0 the embeddings' output; whether they are summed)."""
    if layers == "last":
        return [num_layers], False
    if layers == "second-to-last":
        return [num_layers - 1], False
    if layers == "embeddings":
        return [0], False
    if num_layers < 4:
        raise BertctlError(f"--layers {layers} needs at least 4 layers; the model has {num_layers}")
    return list(range(num_layers - 3, num_layers + 1)), layers == "sum-last-4"


class NativeEncoder:
    """A checkpoint's encoder on one GPU under ``bertctl._encoder``, for ``embed_texts``: padded numpy
    batches in, pooled float32 features out (``features``)."""

    runtime = "native"

    def __init__(self, directory: str | Path, device: str, precision: str):
        from bertctl.checkpoint import load_config

        module, why = _load()
        if module is None:
            raise BertctlError(why)
        self.config = config = load_config(directory)
        reason = unsupported(config)
        if reason:
            raise BertctlError(f"{directory}: the native encoder does not run {reason}")
        self.device, self.precision = device, precision
        weights = encoder_weights(directory, config, precision)
        try:
            self.encoder = module.Encoder(device_index(device), precision, config.num_hidden_layers,
                                          config.hidden_size, config.num_attention_heads, config.intermediate_size,
                                          config.layer_norm_eps, ACTIVATIONS[config.hidden_act], weights)
        except MemoryError:
            raise BertctlError(f"out of GPU memory loading {directory} on {device}") from None
        except (RuntimeError, ValueError) as e:
            raise BertctlError(f"{device}: the native encoder did not start ({e})") from None

    def features(self, ids: np.ndarray, mask: np.ndarray, layers: str, pooling: str) -> np.ndarray:
        """(B, S) ids and mask (1 = real token, padding on the right) -> (B, D) float32 features:
        ``layers`` combined, pooled by each of ``pooling``'s modes (as ``bertctl.embed``'s
        ``combine_layers`` then ``pool``)."""
        real = mask.astype(bool)
        lengths = real.sum(1)
        cu_seqlens = np.zeros(len(lengths) + 1, np.int32)
        np.cumsum(lengths, out=cu_seqlens[1:])
        positions = np.nonzero(real)[1].astype(np.int32)
        keep, summed = hidden_states_used(layers, self.config.num_hidden_layers)
        modes = [POOL_CODES[mode] for mode in pooling.split(",")]
        try:
            return self.encoder.features(ids[real].astype(np.int32), positions, cu_seqlens, int(lengths.max()),
                                         keep, summed, modes)
        except MemoryError:
            raise BertctlError(f"out of GPU memory embedding {len(lengths)} texts of up to {int(lengths.max())} "
                               "tokens in one forward pass: pass a smaller --batch-tokens") from None
