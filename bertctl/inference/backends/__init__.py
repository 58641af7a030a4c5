"""The three embedding backends, each an ``Encoder`` (``bertctl.inference.encoder``), and which one runs.

- ``native`` (``native.py``): bertctl's own CUDA encoder on one GPU, on packed tokens; imports no torch.
- ``torch`` (``torch.py``): ``BertModel`` on any device, in fp32, bf16 or fp16.
- ``onnxruntime`` (``onnx.py``): an ONNX export of the encoder on the CPU, in fp32; imports no torch.

``auto`` takes, of the backends that can run the job here (``auto_candidates``), the one with the
least predicted time for its texts (``bertctl.inference.costs``, a model fitted to measured runs),
and says on stderr which one it chose and why.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from bertctl.errors import BertctlError
from bertctl.progress import stderr
from bertctl.runtime import device_index, resolve_device, resolve_precision

BACKEND_CHOICES = ("auto", "torch", "onnxruntime", "native")


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


def auto_candidates(directory: str | Path, config, device: str, native_at: str | None) -> tuple[list[str], dict]:
    """The backends ``auto`` may run ``config`` (an ``EmbedConfig``) on, for ``device``, told without
    starting any (``native_at``: ``native_device``'s answer), and why each other one cannot."""
    from bertctl.checkpoints.hf import WEIGHTS, load_config
    from bertctl.inference import onnx_export
    from bertctl.inference.backends import native

    why: dict[str, str] = {}
    out = []
    if native_at is None:
        why["native"] = "it runs on a GPU" if device_type(device) == "cpu" else "not built, or no GPU visible"
    else:
        reason = native.unsupported(load_config(directory))
        if reason is None and not (Path(directory) / WEIGHTS).exists():
            reason = f"no {WEIGHTS}"
        if reason:
            why["native"] = reason
        else:
            out.append("native")
    if device_type(device) != "cpu":
        why["onnxruntime"] = "it runs on the CPU"
    elif resolve_precision(config.precision, "cpu") != "fp32":
        why["onnxruntime"] = "it runs fp32"
    elif onnx_export.onnx_missing(export=True):
        why["onnxruntime"] = "not installed"
    else:
        out.append("onnxruntime")
    return out + ["torch"], why


def choose_auto(directory: str | Path, config, device: str, candidates: list[str], lengths=None,
                why: dict | None = None) -> str:
    """The backend ``auto`` runs, of ``candidates``: the least predicted time for texts of ``lengths``
    tokens (``bertctl.inference.costs``; without ``lengths``, the first candidate); says which, and why,
    in one stderr line (``why``: why the other backends cannot run)."""
    from bertctl.checkpoints.hf import load_config
    from bertctl.data.batching import BATCH_TOKENS
    from bertctl.inference import costs

    kind = device_type(device)
    if len(candidates) == 1 or lengths is None:
        chosen = candidates[0]
        reason = "the only backend that runs here" if len(candidates) == 1 else "the first that runs here"
    else:
        model = load_config(directory)
        work = costs.Workload.of(lengths, model.num_hidden_layers, model.hidden_size,
                                 config.batch_tokens or BATCH_TOKENS.get(kind, BATCH_TOKENS["cuda"]), config.batch_size)
        chosen, reason = costs.choose(candidates, work, kind)
    others = "; ".join(f"{b}: {w}" for b, w in (why or {}).items())
    stderr.print(f"[dim]--backend auto: {chosen} ({reason}{'; not ' + others if others else ''})")
    return chosen


def open_encoder(directory: str | Path, config, onnx: Path | None = None, lengths=None):
    """The ``Encoder`` ``embed`` runs for ``config`` (an ``EmbedConfig``): the backend asked for on
    ``config.device``, or for ``auto`` (without ``--onnx``) the one ``choose_auto`` predicts fastest for
    the texts. ``lengths``, a callable giving their token counts (the tokenising's result), is waited
    for once the native encoder (where it may run) has begun its start, so that the two overlap; torch
    stays unloaded when the native encoder runs."""
    where = native_device(config, onnx)
    if config.backend == "native":
        from bertctl.inference.backends.native import NativeEncoder

        return NativeEncoder(directory, where, resolve_precision(config.precision, "cuda"))
    if config.backend != "auto" or onnx is not None:
        device = resolve_device(config.device)
        return load_encoder(directory, device, resolve_backend(config, device, onnx), onnx,
                            precision=config.precision)
    device = where or resolve_device(config.device)
    candidates, why = auto_candidates(directory, config, device, where)
    encoder = None
    if "native" in candidates:
        from bertctl.inference.backends.native import NativeEncoder

        try:
            encoder = NativeEncoder(directory, where, resolve_precision(config.precision, "cuda"))
        except BertctlError as e:
            candidates.remove("native")
            why["native"] = str(e)
    chosen = choose_auto(directory, config, device, candidates, None if lengths is None else lengths(), why)
    if chosen == "native":
        return encoder
    del encoder  # its GPU memory
    return load_encoder(directory, resolve_device(config.device), chosen, fallback=True, precision=config.precision)


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
