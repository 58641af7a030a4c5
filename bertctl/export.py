"""ONNX export of a checkpoint directory, checked against PyTorch under ONNX Runtime.

The encoder (``BertModel``: ``last_hidden_state``, ``pooler_output``) or the task head that
``config.json``'s ``architectures`` names is exported with torch's dynamo exporter (it needs
``onnxscript``), batch and sequence axes dynamic (choices too for multiple choice), int64 inputs
``input_ids``, ``attention_mask``, ``token_type_ids`` (``optimum``'s names and order).

The graph is traced with ``kernels="torch"`` (no ``bertctl::`` custom ops, which ONNX Runtime
does not have) over the same weights; the default attention is ``sdpa``, which the exporter
lowers to MatMul/Softmax.  Before the file is published (written under a temporary name and
renamed) it runs under ONNX Runtime on inputs of another shape than the trace, with padding,
and every output must match the PyTorch model within ``tolerance`` (1e-4, fp32).
"""
from __future__ import annotations

import contextlib
import glob
import hashlib
import io
import json
import logging
import os
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from bertctl.checkpoint import load_config, load_state, read_state_dict
from bertctl.config import ATTENTION_BACKENDS
from bertctl.errors import BertctlError
from bertctl.io import atomic_path
from bertctl.model import (
    BertForMultipleChoice,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    BertPreTrainedModel,
)
from bertctl.progress import stderr

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
DEFAULT_OPSET = 18
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Head:
    cls: type[BertPreTrainedModel]
    outputs: tuple[str, ...]
    axes: tuple[str, ...] = ("batch", "sequence")  # the input dimensions, all dynamic


HEADS = {
    "BertModel": Head(BertModel, ("last_hidden_state", "pooler_output")),
    "BertForPreTraining": Head(BertForPreTraining, ("prediction_logits", "seq_relationship_logits")),
    "BertForSequenceClassification": Head(BertForSequenceClassification, ("logits",)),
    "BertForTokenClassification": Head(BertForTokenClassification, ("logits",)),
    "BertForQuestionAnswering": Head(BertForQuestionAnswering, ("start_logits", "end_logits")),
    "BertForMultipleChoice": Head(BertForMultipleChoice, ("logits",), ("batch", "choices", "sequence")),
}


def onnx_missing(export: bool = True) -> list[str]:
    """The packages ONNX Runtime inference (and with ``export``, the export) needs that are not installed."""
    import importlib.util

    names = ("onnx", "onnxscript", "onnxruntime") if export else ("onnxruntime",)
    return [name for name in names if importlib.util.find_spec(name) is None]


def require_onnx() -> None:
    missing = onnx_missing()
    if missing:
        raise BertctlError(f"ONNX export needs {', '.join(missing)}: pip install 'bertctl[onnx]'")


def resolve_architecture(directory: str | Path, architecture: str | None) -> str:
    """``architecture`` if given, else the first of config.json's ``architectures`` bertctl exports.

    A class bertctl has no head for (``BertForMaskedLM``, say) exports its encoder, with a note.
    """
    if architecture is not None:
        if architecture not in HEADS:
            raise BertctlError(f"--architecture must be one of {', '.join(HEADS)}, not {architecture!r}")
        return architecture
    declared = load_config(directory).architectures or ["BertModel"]
    for name in declared:
        if name in HEADS:
            return name
    stderr.print(f"{directory}: config.json architectures {declared} has no head bertctl exports; exporting the encoder")
    return "BertModel"


class _Exported(nn.Module):
    """The model as a function of ``INPUT_NAMES`` returning a tuple in ``output_names`` order."""

    def __init__(self, model: BertPreTrainedModel, architecture: str, hidden_states: bool):
        super().__init__()
        self.model, self.architecture, self.hidden_states = model, architecture, hidden_states
        names = list(HEADS[architecture].outputs)
        if architecture == "BertModel" and not model.has_pooler:
            names.remove("pooler_output")
        if hidden_states:
            names.append("hidden_states")
        self.output_names = tuple(names)

    def forward(self, input_ids, attention_mask, token_type_ids):
        out = self.model(input_ids, token_type_ids, attention_mask, output_hidden_states=self.hidden_states)
        if self.architecture == "BertModel":
            outs = [out.last_hidden_state] + ([out.pooler_output] if self.model.has_pooler else [])
        elif self.architecture == "BertForPreTraining":
            outs = [out.prediction_logits, out.seq_relationship_logits]
        elif self.architecture == "BertForQuestionAnswering":
            outs = [out.start_logits, out.end_logits]
        else:
            outs = [out.logits]
        if self.hidden_states:
            outs.append(torch.stack(out.hidden_states))  # (L+1, B, S, H): embeddings, then each layer
        return tuple(outs)


def load_for_export(directory: str | Path, architecture: str, attn_implementation: str = "sdpa",
                    hidden_states: bool = False) -> _Exported:
    """The checkpoint's ``architecture`` on plain PyTorch ops (``kernels="torch"``), in eval mode.

    The encoder keeps its pooler only where the checkpoint has one (a token-classification
    or QA checkpoint has none).
    """
    if hidden_states and architecture != "BertModel":
        raise BertctlError("--hidden-states applies to the encoder (--architecture BertModel) only")
    config = load_config(directory, kernels="torch", attn_implementation=attn_implementation)
    state = read_state_dict(directory)
    if architecture == "BertModel":
        has_pooler = any(k.startswith(("pooler.", "bert.pooler.")) for k in state)
        model = BertModel(config, add_pooling_layer=has_pooler)
    else:
        model = HEADS[architecture].cls(config)
    load_state(model, state, source=str(directory))
    return _Exported(model, architecture, hidden_states).eval()


def sample_inputs(config, architecture: str, batch: int, seq: int, generator: torch.Generator,
                  choices: int = 3) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ids, a second segment from the middle on, and rows padded to decreasing lengths."""
    shape = (batch, choices, seq) if architecture == "BertForMultipleChoice" else (batch, seq)
    ids = torch.randint(0, config.vocab_size, shape, generator=generator)
    types = torch.zeros(shape, dtype=torch.long)
    if config.type_vocab_size > 1:
        types[..., seq // 2:] = 1
    mask = torch.ones(shape, dtype=torch.long)
    rows = mask.view(-1, seq)
    for r in range(1, rows.shape[0]):
        rows[r, max(1, seq - 3 * r):] = 0  # at least [CLS] is real
    return ids, mask, types


def ort_session(path: str | Path, threads: int | None = None):
    """An ONNX Runtime CPU session (all graph optimisations; ``threads`` intra-op threads)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3  # errors only
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    except Exception as e:  # onnxruntime's own exception classes
        raise BertctlError(f"{path}: onnxruntime cannot load it ({str(e).splitlines()[0]})") from None


def compare(session, module: _Exported, inputs: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """Max |ONNX Runtime - PyTorch| per output on ``inputs``."""
    with torch.no_grad():
        want = module(*inputs)
    got = session.run(list(module.output_names), {n: t.numpy() for n, t in zip(INPUT_NAMES, inputs)})
    diffs = {}
    for name, w, g in zip(module.output_names, want, got):
        if tuple(g.shape) != tuple(w.shape):
            raise BertctlError(f"exported output {name} has shape {tuple(g.shape)}, PyTorch {tuple(w.shape)}")
        diffs[name] = float(np.abs(g.astype(np.float64) - w.double().numpy()).max())
    return diffs


@contextlib.contextmanager
def _quiet():
    """The exporter's progress prints, warnings and log lines off stdout/stderr (stdout carries results)."""
    logger = logging.getLogger("torch.onnx")
    level = logger.level
    logger.setLevel(logging.ERROR)
    sink = io.StringIO()
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)


def export_onnx(directory: str | Path, output: str | Path, *, architecture: str | None = None,
                hidden_states: bool = False, attn_implementation: str = "sdpa", opset: int = DEFAULT_OPSET,
                tolerance: float = TOLERANCE) -> dict:
    """Export ``directory``'s model to ``output`` and check it; returns a report (outputs, max diffs).

    Nothing is written under ``output`` unless every output matches within ``tolerance``.
    """
    require_onnx()
    if attn_implementation not in ATTENTION_BACKENDS:
        raise BertctlError(f"--attn must be one of {', '.join(ATTENTION_BACKENDS)}, not {attn_implementation!r}")
    if opset < 17:
        raise BertctlError(f"--opset must be at least 17 (LayerNormalization), not {opset}")
    directory, output = Path(directory), Path(output)
    architecture = resolve_architecture(directory, architecture)
    module = load_for_export(directory, architecture, attn_implementation, hidden_states)
    config = module.model.config
    head = HEADS[architecture]
    g = torch.Generator().manual_seed(0)
    # Trace at batch 2, sequence 8 (a size-1 dimension would be specialised, not dynamic);
    # the sequence axis is bounded by the position table.
    trace = sample_inputs(config, architecture, 2, min(8, config.max_position_embeddings), g, choices=2)
    dims = {a: torch.export.Dim(a, max=config.max_position_embeddings) if a == "sequence" else torch.export.Dim(a)
            for a in head.axes}
    dynamic = {name: {i: dims[a] for i, a in enumerate(head.axes)} for name in INPUT_NAMES}
    start = time.perf_counter()
    try:
        with _quiet():
            program = torch.onnx.export(module, trace, None, input_names=list(INPUT_NAMES),
                                        output_names=list(module.output_names), opset_version=opset,
                                        dynamo=True, dynamic_shapes=dynamic, optimize=True)
    except Exception as e:
        raise BertctlError(f"{directory}: ONNX export of {architecture} failed: {str(e).splitlines()[0]}") from e
    export_seconds = time.perf_counter() - start
    program.model.metadata_props.update({"bertctl.architecture": architecture, "bertctl.source": str(directory),
                                         "bertctl.attn_implementation": attn_implementation})
    with atomic_path(output) as tmp:
        program.save(tmp, external_data=False)
        session = ort_session(tmp)
        check = sample_inputs(config, architecture, 3, min(13, config.max_position_embeddings), g)
        diffs = compare(session, module, check)
        worst = max(diffs.values())
        if not worst <= tolerance:  # NaN fails too
            raise BertctlError(f"{directory}: the exported {architecture} differs from PyTorch under onnxruntime by "
                               f"{worst:.3g} (> {tolerance:g}): {diffs}; nothing written")
    import onnxruntime

    return {
        "output": str(output), "source": str(directory), "architecture": architecture,
        "inputs": {n: list(head.axes) for n in INPUT_NAMES}, "outputs": list(module.output_names),
        "opset": opset, "attn_implementation": attn_implementation,
        "check": {"shape": list(check[0].shape), "max_abs_diff": diffs, "tolerance": tolerance},
        "export_seconds": round(export_seconds, 2), "bytes": output.stat().st_size,
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
    }


# --------------------------------------------------------------------------- serving the encoder (embed)

# Bump when the exported graph changes, so cached exports are made anew.
EXPORT_FORMAT = 1


class OnnxEncoder:
    """An exported encoder under ONNX Runtime on the CPU, called as ``BertModel`` is by ``embed_texts``.

    Any ONNX file with ``input_ids``/``attention_mask``/``token_type_ids`` inputs and a
    ``last_hidden_state`` output serves (``optimum``'s exports too); layers other than the
    last need the ``hidden_states`` output (``export onnx --hidden-states``).
    """

    runtime = "onnxruntime"
    device = torch.device("cpu")

    def __init__(self, path: str | Path, config, threads: int | None = None):
        self.path, self.config = Path(path), config
        if not self.path.is_file():
            raise BertctlError(f"{self.path}: --onnx: no such file")
        self.session = ort_session(self.path, threads or torch.get_num_threads())  # as many threads as torch
        self.inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        if "last_hidden_state" not in outputs or not set(self.inputs) <= set(INPUT_NAMES):
            raise BertctlError(f"{self.path}: not an exported BERT encoder (inputs {self.inputs}, outputs {outputs}; "
                               f"want inputs among {list(INPUT_NAMES)} and a last_hidden_state output)")
        self.has_hidden_states = "hidden_states" in outputs

    def __call__(self, input_ids, token_type_ids=None, attention_mask=None, output_hidden_states: bool = False):
        from bertctl.model import BertOutput

        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        feeds = {name: given[name].cpu().numpy().astype(np.int64, copy=False) for name in self.inputs}
        if not output_hidden_states:
            (x,) = self.session.run(["last_hidden_state"], feeds)
            return BertOutput(torch.from_numpy(x), None)
        if not self.has_hidden_states:
            raise BertctlError(f"{self.path}: no hidden_states output, which layers other than the last need "
                               "(export it with: bertctl export onnx --architecture BertModel --hidden-states)")
        (states,) = self.session.run(["hidden_states"], feeds)  # (L+1, B, S, H)
        states = tuple(torch.from_numpy(states))
        return BertOutput(states[-1], None, states)


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bertctl" / "onnx"


def cached_encoder_path(directory: str | Path) -> Path:
    """Where the encoder export of ``directory`` is cached: ``NAME-PATHKEY-KEY.onnx``, PATHKEY from its
    path, KEY from its config, weights (size and modification time), torch version and ``EXPORT_FORMAT``."""
    from bertctl.checkpoint import LEGACY_WEIGHTS, WEIGHTS

    directory = Path(directory).resolve()
    where = hashlib.sha256(str(directory).encode()).hexdigest()[:8]
    key = hashlib.sha256(json.dumps([EXPORT_FORMAT, torch.__version__]).encode())
    key.update((directory / "config.json").read_bytes())
    for name in (WEIGHTS, LEGACY_WEIGHTS):
        if (directory / name).exists():
            st = (directory / name).stat()
            key.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_dir() / f"{directory.name}-{where}-{key.hexdigest()[:16]}.onnx"


def cached_encoder(directory: str | Path, threads: int | None = None) -> OnnxEncoder:
    """``directory``'s encoder (with ``hidden_states``) under ONNX Runtime, exported on first use."""
    config = load_config(directory)
    path = cached_encoder_path(directory)
    if not path.exists():
        require_onnx()
        stderr.print(f"exporting the encoder of {directory} to ONNX (once; cached as {path})")
        export_onnx(directory, path, architecture="BertModel", hidden_states=True)
        # Exports of earlier weights or versions of the same directory are stale now.
        for old in path.parent.glob(glob.escape(path.name.rsplit("-", 1)[0]) + "-*.onnx"):
            if old != path:
                old.unlink(missing_ok=True)
    return OnnxEncoder(path, config, threads)
