"""The three embedding backends, each an ``Encoder`` (``bertctl.inference.encoder``), and which one runs.

- ``native`` (``native.py``): bertctl's own CUDA encoder on one GPU, on packed tokens; imports no torch.
- ``torch`` (``torch.py``): ``BertModel`` on any device, in fp32, bf16 or fp16.
- ``onnxruntime`` (``onnx.py``): an ONNX export of the encoder on the CPU, in fp32; imports no torch.

``auto`` picks the native encoder on a GPU where it is built and runs the model, for short texts
(``native_suits``); onnxruntime on the CPU in fp32 when installed (it is the faster there:
``benchmarks/results/embed-backends-cpu.json``); torch otherwise. ``open_encoder`` says on stderr
when it passes over the backend ``auto`` would have picked, and why.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bertctl.errors import BertctlError
from bertctl.progress import stderr
from bertctl.runtime import device_index, resolve_device, resolve_precision

BACKEND_CHOICES = ("auto", "torch", "onnxruntime", "native")
#: ``auto`` keeps the native encoder for texts of at most this many tokens, weighted by their length
#: (sum of squares over sum: attention's cost against the rest's). Its attention runs on CUDA cores, a
#: thread a query, and was measured only on short texts, where it is the faster; longer texts go to
#: torch's fused attention unless ``--backend native`` asks for it.
NATIVE_AUTO_TOKENS = 64


def device_type(device: str) -> str:
    """``"cpu"``, ``"cuda"``, ...: of a device name."""
    return str(device).split(":")[0]


def resolve_backend(config, device: str, onnx: Path | None = None) -> str:
    """``torch`` or ``onnxruntime``: what ``config.backend`` (and an ``--onnx`` file) ask for on ``device``
    (``config``: an ``EmbedConfig``)."""
    from bertctl.inference import onnx_export

    backend = "onnxruntime" if onnx is not None and config.backend == "auto" else config.backend
    if backend == "onnxruntime":
        if device_type(device) != "cpu":
            raise BertctlError(f"--backend onnxruntime runs on the CPU, not --device {device}")
        if resolve_precision(config.precision, "cpu") != "fp32":
            raise BertctlError(f"--backend onnxruntime runs fp32; --precision {config.precision} needs --backend torch")
        missing = onnx_export.onnx_missing(export=onnx is None)
        if missing:
            raise BertctlError(f"--backend onnxruntime needs {', '.join(missing)}: pip install 'bertctl[onnx]'")
        return backend
    if onnx is not None:
        raise BertctlError("--onnx runs under onnxruntime; it cannot go with --backend torch")
    if backend == "auto":
        fits = resolve_precision(config.precision, device_type(device)) == "fp32" and device_type(device) == "cpu" \
            and not onnx_export.onnx_missing(export=True)
        return "onnxruntime" if fits else "torch"
    return backend


def native_device(config, onnx: Path | None = None) -> str | None:
    """The GPU (``cuda:N``) on which the native encoder is to run ``config`` (an ``EmbedConfig``), or None
    where another backend runs; told without importing torch or starting CUDA (the encoder's start, in
    a thread beside the weights' read, finds a missing device).  ``--backend native`` where it cannot
    run is an error; ``auto`` goes on to the other backends."""
    from bertctl.inference.backends import native

    explicit = config.backend == "native"
    if explicit and onnx is not None:
        raise BertctlError("--onnx runs under onnxruntime; it cannot go with --backend native")
    if not explicit and (config.backend != "auto" or onnx is not None):
        return None
    index = device_index(config.device)
    if index is None:
        if explicit:
            raise BertctlError(f"--backend native runs on a GPU, not --device {config.device}")
        return None
    why = ("bertctl._encoder is not built (it builds with the CUDA kernels: BERTCTL_CUDA=1)" if not native.built()
           else "no GPU is visible" if not native.gpu_visible() else None)
    if why and explicit:
        raise BertctlError(f"--backend native: {why}")
    return None if why else f"cuda:{index}"


def native_suits(lengths: np.ndarray) -> bool:
    """Whether texts of these token counts are short enough for ``auto`` to run the native encoder."""
    lengths = lengths.astype(np.float64)
    return bool((lengths ** 2).sum() <= NATIVE_AUTO_TOKENS * lengths.sum())


def open_encoder(directory: str | Path, config, onnx: Path | None = None, lengths=None):
    """The ``Encoder`` ``embed`` runs for ``config`` (an ``EmbedConfig``): the native encoder where it
    serves (torch stays unloaded), else ``load_encoder`` on ``config.device`` with ``resolve_backend``'s
    backend.  ``lengths``, a callable giving the texts' token counts (the tokenising's result, waited
    for once the native encoder has started), lets ``auto`` send long texts to torch instead."""
    where = native_device(config, onnx)
    if where is not None:
        from bertctl.inference.backends.native import NativeEncoder

        try:
            encoder = NativeEncoder(directory, where, resolve_precision(config.precision, "cuda"))
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


def load_encoder(directory: str | Path, device: str = "cpu", backend: str = "torch", onnx: Path | None = None,
                 fallback: bool = False, precision: str = "fp32"):
    """The encoder of any checkpoint directory (heads and pooler dropped) on ``device``: a ``TorchEncoder``,
    or (``backend="onnxruntime"``) an ``OnnxEncoder`` of ``onnx`` or of an export cached on first use.
    With ``fallback`` (``--backend auto``) a model whose export fails runs on PyTorch, with a note."""
    if backend == "onnxruntime":
        from bertctl.checkpoints.hf import load_config
        from bertctl.inference.backends.onnx import OnnxEncoder, cached_encoder

        if onnx is not None:
            return OnnxEncoder(onnx, load_config(directory))
        try:
            return cached_encoder(directory)
        except BertctlError as e:
            if not fallback:
                raise
            stderr.print(f"[yellow]onnxruntime backend unavailable ({e}); embedding with torch")
    from bertctl.inference.backends.torch import load_torch_encoder, runtime_for

    return load_torch_encoder(directory, runtime_for(device, precision))
