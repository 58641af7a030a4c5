"""The native backend: bertctl's own CUDA encoder, the compiled ``bertctl._encoder`` (csrc/encoder).

It runs a BERT encoder's forward pass and the pooling on one GPU with cuBLASLt and bertctl's kernels, on
packed tokens (no padding), and imports no torch: for a short job, such as embedding a few tens of
thousands of sentences, torch's import and CUDA start-up would be most of the run
(``benchmarks/results/embed-startup-h200-native-d02edce.json`` against ``embed-startup-h200-3133cda.json``).
fp32 runs cuBLAS's fp32 products (no TF32); bf16 and fp16 keep weights and activations in half
precision, with the LayerNorm, softmax and pooling arithmetic in fp32.

Built with the CUDA kernels (``BERTCTL_CUDA``); it links cuBLASLt, found here where the loader does
not see it: in the NVIDIA wheels beside torch (``nvidia/cu13/lib``, ``nvidia/cublas/lib``) or under
``CUDA_HOME``.
"""
from __future__ import annotations

import ctypes
import functools
import glob
import json
import mmap
import os
import re
import sys
import threading
from pathlib import Path

import numpy as np

from bertctl.errors import BertctlError
from bertctl.inference.encoder import Tokens
from bertctl.inference.pooling import PoolingSpec
from bertctl.runtime import device_index

# Hugging Face hidden_act names the encoder computes, and how.
ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
               "relu": "relu"}
HEAD_SIZES = (32, 64, 128)
MAX_HIDDEN = 1024
# bertctl.inference.pooling.POOLING_CHOICES -> csrc/encoder/kernels.h's Pool.
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


def built() -> bool:
    """Whether ``bertctl._encoder`` was built (found, not loaded: loading it loads cuBLASLt)."""
    import importlib.util

    return os.environ.get("BERTCTL_NO_EXT") != "1" and importlib.util.find_spec("bertctl._encoder") is not None


def gpu_visible() -> bool:
    """Whether a GPU may be there, told without starting CUDA: an NVIDIA driver's device node (Linux;
    assumed elsewhere) and CUDA_VISIBLE_DEVICES not emptied, as a user hides the GPUs."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", "0").strip() in ("", "-1"):
        return False
    return os.path.exists("/dev/nvidiactl") if sys.platform.startswith("linux") else True


_loading = threading.Lock()
#: Whether this process started a CUDA context: then the command line ends without CUDA's teardown
#: (``bertctl.cli.app.main``).
context_started = False


def _load():
    with _loading:  # the encoder's start loads it in a thread while another may ask
        return _load_once()


@functools.lru_cache(maxsize=1)
def _load_once():
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


_starts: dict[int, tuple[threading.Thread, list]] = {}


def start(device: str) -> None:
    """Load the module (and cuBLASLt) and start ``device``'s CUDA context in a thread, once, while the
    encoder maps its weights (``started`` waits for it)."""
    index = device_index(device)
    with _loading:
        if index in _starts:
            return
        outcome: list = []

        def run() -> None:
            global context_started
            try:
                module, why = _load()
                if module is not None:
                    module.start_device(index)
                    context_started = True
                outcome.append(why)
            except RuntimeError as e:
                outcome.append(str(e))

        thread = threading.Thread(target=run, daemon=True)
        _starts[index] = thread, outcome
        thread.start()


def started(device: str) -> str | None:
    """Waits for ``start(device)``: None once the context runs, else why it does not."""
    thread, outcome = _starts[device_index(device)]
    thread.join()
    return outcome[0]


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


SAFETENSORS_TYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}  # bfloat16 as its bits


def read_safetensors(path: Path) -> dict[str, np.ndarray]:
    """The float tensors of a safetensors file as read-only views of it, memory-mapped (nothing is
    copied or converted here: the native encoder converts on the GPU); BF16 as uint16 bits."""
    try:
        with open(path, "rb") as f:
            mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        size = int.from_bytes(mapped[:8], "little")
        header = json.loads(mapped[8:8 + size])
        out = {}
        for name, info in header.items():
            dtype = SAFETENSORS_TYPES.get(info["dtype"]) if name != "__metadata__" else None
            if dtype is None:
                continue  # metadata, or an integer buffer (position_ids) the encoder does not use
            begin, end = info["data_offsets"]
            out[name] = np.frombuffer(mapped, dtype, (end - begin) // np.dtype(dtype).itemsize,
                                      8 + size + begin).reshape(info["shape"])
        return out
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise BertctlError(f"{path}: unreadable weights ({e})") from None


def encoder_weights(directory: str | Path, config) -> dict[str, list[np.ndarray]]:
    """The encoder's weights from ``model.safetensors``, in the layout ``_encoder.Encoder`` takes: a
    list of arrays a tensor, concatenated there (the query, key and value projections stacked), each
    array as the file holds it."""
    from bertctl.checkpoints.hf import WEIGHTS, _normalise_names

    path = Path(directory) / WEIGHTS
    if not path.exists():
        raise BertctlError(f"{directory}: no {WEIGHTS} (the native encoder reads safetensors only)")
    state = {name.removeprefix("bert."): tensor for name, tensor in _normalise_names(read_safetensors(path)).items()}

    def get(*names: str) -> list[np.ndarray]:
        for name in names:
            if name not in state:
                raise BertctlError(f"{path}: no tensor {name}")
        return [state[name] for name in names]

    out = {"word": get("embeddings.word_embeddings.weight"),
           "position": get("embeddings.position_embeddings.weight"),
           "type": [get("embeddings.token_type_embeddings.weight")[0][0]],  # every token's type is 0
           "embeddings.gamma": get("embeddings.LayerNorm.weight"),
           "embeddings.beta": get("embeddings.LayerNorm.bias")}
    for i in range(config.num_hidden_layers):
        p = f"encoder.layer.{i}."
        qkv = [p + f"attention.self.{part}" for part in ("query", "key", "value")]
        out |= {f"{i}.qkv.weight": get(*(n + ".weight" for n in qkv)),
                f"{i}.qkv.bias": get(*(n + ".bias" for n in qkv)),
                f"{i}.attention.weight": get(p + "attention.output.dense.weight"),
                f"{i}.attention.bias": get(p + "attention.output.dense.bias"),
                f"{i}.attention.gamma": get(p + "attention.output.LayerNorm.weight"),
                f"{i}.attention.beta": get(p + "attention.output.LayerNorm.bias"),
                f"{i}.ffn_in.weight": get(p + "intermediate.dense.weight"),
                f"{i}.ffn_in.bias": get(p + "intermediate.dense.bias"),
                f"{i}.ffn_out.weight": get(p + "output.dense.weight"),
                f"{i}.ffn_out.bias": get(p + "output.dense.bias"),
                f"{i}.ffn.gamma": get(p + "output.LayerNorm.weight"),
                f"{i}.ffn.beta": get(p + "output.LayerNorm.bias")}
    return out


#: Pooled values (texts x features) a run queues on the GPU at once: its device-side output.
CHUNK_VALUES = 1 << 25


class NativeEncoder:
    """A checkpoint's encoder on one GPU under ``bertctl._encoder``, as an ``Encoder``: packed token ids
    in, pooled (and, when asked, L2-normalised) float32 features out, computed on the GPU."""

    name = "native"

    def __init__(self, directory: str | Path, device: str, precision: str):
        from bertctl.checkpoints.hf import load_config

        self.config = config = load_config(directory)
        reason = unsupported(config)
        if reason:
            raise BertctlError(f"{directory}: the native encoder does not run {reason}")
        self.device, self.precision = device, precision
        start(device)  # if the caller has not already
        weights = encoder_weights(directory, config)
        why = started(device)
        if why is not None:
            raise BertctlError(f"{device}: the native encoder did not start ({why})")
        module = _load()[0]
        try:
            self.encoder = module.Encoder(device_index(device), precision, config.num_hidden_layers,
                                          config.hidden_size, config.num_attention_heads, config.intermediate_size,
                                          config.layer_norm_eps, ACTIVATIONS[config.hidden_act], weights)
        except MemoryError:
            raise BertctlError(f"out of GPU memory loading {directory} on {device}") from None
        except (RuntimeError, ValueError) as e:
            raise BertctlError(f"{device}: the native encoder did not start ({e})") from None

    def features(self, tokens: Tokens, batches: list[np.ndarray], spec: PoolingSpec, pad_id: int = 0,
                 normalize: bool = False, advance=None) -> np.ndarray:
        """The batches queued a chunk at a time (``CHUNK_VALUES`` pooled values), with one wait a chunk;
        a single chunk writes straight into the output. Packed tokens: ``pad_id`` is not used."""
        width = spec.width(self.config.hidden_size, self.config.num_hidden_layers)
        per_chunk = max(1, CHUNK_VALUES // width)
        chunks, current, held = [], [], 0
        for batch in batches:
            if current and held + len(batch) > per_chunk:
                chunks.append(current)
                current, held = [], 0
            current.append(batch)
            held += len(batch)
        chunks.append(current)
        if len(chunks) == 1:
            out = self._embed(tokens, batches, spec, normalize)
            if advance is not None:
                advance(len(tokens.lengths))
            return out
        out = np.empty((len(tokens.lengths), width), np.float32)
        for chunk in chunks:
            order = np.concatenate(chunk)
            out[order] = self._embed(tokens, chunk, spec, normalize, local=True)
            if advance is not None:
                advance(len(order))
        return out

    def _embed(self, tokens: Tokens, batches: list[np.ndarray], spec: PoolingSpec, normalize: bool,
               local: bool = False) -> np.ndarray:
        """``batches`` (lists of text indices, each a forward pass) queued on the GPU at once, with one
        wait: (texts, width) float32, row i for text i (``local``: row i for the batches' i-th text)."""
        keep, summed = spec.hidden_states(self.config.num_hidden_layers)
        modes = [POOL_CODES[mode] for mode in spec.modes]
        order = np.concatenate(batches)
        counts = tokens.lengths[order]
        rows = np.arange(len(order)) if local else order
        out = np.empty((len(order) if local else len(tokens.lengths),
                        spec.width(self.config.hidden_size, self.config.num_hidden_layers)), np.float32)
        try:
            self.encoder.embed(tokens.packed(order).astype(np.int32), counts.astype(np.int32), rows.astype(np.int32),
                               np.cumsum([len(b) for b in batches]).astype(np.int32), out, keep, summed, modes,
                               normalize)
        except MemoryError:
            raise BertctlError(f"out of GPU memory embedding batches of up to {max(len(b) for b in batches)} texts: "
                               "pass a smaller --batch-tokens") from None
        except ValueError as e:
            raise BertctlError(f"the native encoder refused its input ({e})") from None
        return out
