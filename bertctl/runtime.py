"""Where and how a command runs: device, precision, attention, kernels, dropout masks, CUDA graphs and
compile, decided once by ``resolve`` at the top of the command and passed down as one ``Runtime``.

The model, the training engine and the inference backends read these decisions and never re-derive
them. Nothing here imports torch at module level: ``embed`` on the CPU decides its device without
loading torch.
"""
from __future__ import annotations

import functools
import os
import re
import sys
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version

from bertctl.errors import BertctlError

ATTENTION_BACKENDS = ("sdpa", "explicit", "unpadded")
EXPORTABLE_ATTENTION = ("sdpa", "explicit")  # unpadded packs by data-dependent indices: no static graph
ATTENTION_CHOICES = ("auto", *ATTENTION_BACKENDS)  # auto: see resolve_attention
KERNEL_CHOICES = ("auto", "fused", "torch")
# Whose dropout masks training draws with the compiled ops: ``fused``, bertctl's own (a hash of a seed
# and the element's index, inside the fused sub-layer op); ``torch``, torch's dropout before the fused
# LayerNorm, as fine-tuning trains.
DROPOUT_MASK_CHOICES = ("fused", "torch")
PRECISION_CHOICES = ("auto", "bf16", "fp16", "fp32")


@dataclass(frozen=True)
class Runtime:
    """A command's resolved runtime; build it with ``resolve``.

    ``device`` is a device name (``"cpu"``, ``"cuda"``, ``"cuda:1"``): on the CPU torch need not load.
    """

    device: str = "cpu"
    precision: str = "fp32"               # bf16, fp16 or fp32 (never "auto")
    attn: str = "sdpa"                    # one of ATTENTION_BACKENDS
    kernels: str = "auto"                 # as asked: auto, fused or torch
    fused: bool = False                   # the compiled kernels run the model's ops
    dropout_masks: str = "fused"
    compile: bool = False
    cuda_graphs: bool = False             # training steps replay as whole-step CUDA graphs
    graphs_unsupported: str | None = None  # why CUDA graphs cannot run this job (None: they can)

    @property
    def device_type(self) -> str:
        return self.device.split(":")[0]

    @property
    def torch_device(self):
        import torch

        return torch.device(self.device)

    @property
    def device_index(self) -> int | None:
        return device_index(self.device)

    @property
    def own_masks(self) -> bool:
        """Whether the fused ops draw their own dropout masks rather than torch's. With torch's, the sub-layer
        outputs train with torch's dropout before the fused LayerNorm; fine-tuning trains so: with the fused
        op's own masks, acceptability scores fell further below the transformers Trainer's
        (``benchmarks/results/finetune-diagnostics/README.md``)."""
        return self.fused and self.dropout_masks == "fused"


def default() -> Runtime:
    """The runtime of a model built without one (``BertModel(config)``): the CPU, SDPA attention, the
    compiled kernels where they are built and their own dropout masks."""
    return resolve("cpu", attn="sdpa")


def resolve(device: str | None = "auto", precision: str = "auto", *, attn: str = "auto", kernels: str = "auto",
            dropout_masks: str = "fused", compile: bool = False, cuda_graphs: bool | None = False,
            optimizer: str = "adamw", packed_data: bool = False) -> Runtime:
    """Every runtime decision of a command, in the order they depend on each other: the device, the
    precision on it, whether CUDA graphs run (``cuda_graphs`` None: wherever they can; True where they
    cannot: an error), then the attention backend (``auto`` depends on graphs and compile) and the
    kernels. ``packed_data``: the batches are packed to full length (pretraining)."""
    name = resolve_device(device)
    kind = name.split(":")[0]
    prec = resolve_precision(precision, kind)
    why = graphs_unsupported(device_type=kind, precision=prec, optimizer=optimizer, compile=compile)
    graphs = graphs_wanted(cuda_graphs, why)
    if kernels not in KERNEL_CHOICES:
        raise BertctlError(f"kernels must be one of {KERNEL_CHOICES}, not {kernels!r}")
    if dropout_masks not in DROPOUT_MASK_CHOICES:
        raise BertctlError(f"dropout_masks must be one of {DROPOUT_MASK_CHOICES}, not {dropout_masks!r}")
    fused = fused_kernels(kernels)
    backend = resolve_attention(attn, kind, compiled=compile, packed_data=packed_data, graphs=graphs,
                                fused_kernels=kernels != "torch" and kernels_built())
    return Runtime(device=name, precision=prec, attn=backend, kernels=kernels, fused=fused,
                   dropout_masks=dropout_masks, compile=compile, cuda_graphs=graphs, graphs_unsupported=why)


# --------------------------------------------------------------------------- device


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


def resolve_device(name: str | None = "auto") -> str:
    """The device a ``--device`` name picks (``auto`` or None: CUDA when available), as a name; ``cpu``
    is told without importing torch."""
    name = "auto" if name is None else name
    if name == "cpu" or (name == "auto" and not cuda_possible()):
        return "cpu"
    import torch

    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise BertctlError(f"--device: unknown device {name!r}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise BertctlError(f"--device {name}: no CUDA device is available")
    return str(device)


def device_index(name: str) -> int | None:
    """The GPU a ``--device`` name picks (auto and cuda: 0), or None for the CPU or another kind of device."""
    if name in ("auto", "cuda"):
        return 0
    match = re.fullmatch(r"cuda:(\d+)", name)
    return int(match.group(1)) if match else None


# --------------------------------------------------------------------------- precision


def resolve_precision(precision: str, device_type: str) -> str:
    """bf16, fp16 or fp32 on a device of ``device_type`` (auto: bf16 on a GPU, fp32 on the CPU)."""
    if precision == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    if precision not in PRECISION_CHOICES:
        raise BertctlError(f"--precision must be auto, bf16, fp16 or fp32, not {precision!r}")
    if precision == "fp16" and device_type != "cuda":
        raise BertctlError("--precision fp16 needs a GPU (use fp32 or bf16 on the CPU)")
    return precision


# --------------------------------------------------------------------------- kernels and attention


@functools.lru_cache(maxsize=1)
def kernels_built() -> bool:
    """Whether bertctl's compiled ops loaded, all of them (what ``kernels="auto"`` runs); known once the
    ops module has loaded, so asked once (the model asks at every sub-layer)."""
    from bertctl import ops

    return ops.fused_available()


def fused_kernels(kernels: str) -> bool:
    """Whether the model's ops run bertctl's compiled kernels: ``auto`` where they are built, ``fused``
    always (each op falls back to its PyTorch reference where its kernel is missing), ``torch`` never."""
    if kernels == "torch":
        return False
    return kernels == "fused" or kernels_built()


def resolve_attention(name: str, device_type: str, compiled: bool = False, packed_data: bool = False,
                      fused_kernels: bool = False, graphs: bool = False) -> str:
    """``auto`` -> ``unpadded``, except ``sdpa`` under torch.compile (its graphs break at unpadded's
    data-dependent sizes) and whole-step CUDA graphs (which need fixed sizes), and, for ``packed_data``
    (pretraining's sequences, packed to length), ``sdpa`` on a GPU and ``explicit`` on the CPU when the
    compiled kernels are there (``fused_kernels``): on nearly full batches packing saves nothing, and
    on the CPU the fused softmax and dropout beat SDPA's."""
    if name != "auto":
        if name not in ATTENTION_BACKENDS:
            raise BertctlError(f"attention backend must be one of {ATTENTION_BACKENDS}, not {name!r}")
        return name
    if compiled or graphs:
        return "sdpa"
    if packed_data and device_type != "cpu":
        return "sdpa"
    if packed_data and fused_kernels:
        return "explicit"
    return "unpadded"


# --------------------------------------------------------------------------- CUDA graphs


def graphs_unsupported(*, device_type: str, precision: str, optimizer: str = "adamw",
                       compile: bool = False) -> str | None:
    """Why whole-step CUDA graphs cannot run this job, or None when they can."""
    if device_type != "cuda":
        return "they need a CUDA device"
    if precision == "fp16":
        return "not with fp16 (the loss scaler decides on the host)"
    if optimizer.lower() != "adamw":
        return "only with AdamW"
    if compile:
        return "not with --compile"
    return None


def graphs_wanted(requested: bool | None, why_not: str | None) -> bool:
    """``--cuda-graphs`` resolved: False when turned off; None (the default) where they can run; asked
    for (True) where they cannot (``why_not``), one clear error."""
    if requested is False:
        return False
    if why_not and requested:
        raise BertctlError(f"--cuda-graphs: {why_not}")
    return why_not is None
