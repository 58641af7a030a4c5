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

``optimize_encoder`` fuses an encoder export's attention and GELU for ``embed``'s ONNX Runtime backend
(``bertctl.inference.backends.onnx``), which caches both files. Importing this module imports no
torch: serving needs only ONNX Runtime and numpy (torch only to make the export).
"""
from __future__ import annotations

import ast
import contextlib
import io
import json
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass
from importlib import import_module
from pathlib import Path

import numpy as np

from bertctl.runtime import EXPORTABLE_ATTENTION
from bertctl.errors import BertctlError
from bertctl.io import atomic_path
from bertctl.progress import stderr

INPUT_NAMES = ("input_ids", "attention_mask", "token_type_ids")
DEFAULT_OPSET = 18
TOLERANCE = 1e-4


@dataclass(frozen=True)
class Head:
    class_name: str  # in bertctl.model (imported when a head is exported: it needs torch)
    outputs: tuple[str, ...]
    axes: tuple[str, ...] = ("batch", "sequence")  # the input dimensions, all dynamic

    @property
    def cls(self):
        return getattr(import_module("bertctl.model"), self.class_name)


HEADS = {
    "BertModel": Head("BertModel", ("last_hidden_state", "pooler_output")),
    "BertForPreTraining": Head("BertForPreTraining", ("prediction_logits", "seq_relationship_logits")),
    "BertForSequenceClassification": Head("BertForSequenceClassification", ("logits",)),
    "BertForTokenClassification": Head("BertForTokenClassification", ("logits",)),
    "BertForQuestionAnswering": Head("BertForQuestionAnswering", ("start_logits", "end_logits")),
    "BertForMultipleChoice": Head("BertForMultipleChoice", ("logits",), ("batch", "choices", "sequence")),
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


def check_export(directory: Path, output: Path, architecture: str | None, attn_implementation: str,
                 opset: int) -> str:
    """Every check ``export_onnx`` can make before its work (and before torch loads): the flags, the
    packages, the checkpoint's architecture, and the output (``probe_output``). Returns the architecture."""
    require_onnx()
    if attn_implementation not in EXPORTABLE_ATTENTION:
        raise BertctlError(f"--attn must be one of {', '.join(EXPORTABLE_ATTENTION)} for an exported graph, "
                           f"not {attn_implementation!r}")
    if opset < 17:
        raise BertctlError(f"--opset must be at least 17 (LayerNormalization), not {opset}")
    architecture = resolve_architecture(directory, architecture)
    probe_output(output, directory)
    return architecture


def export_bytes(config) -> int:
    """About the bytes an fp32 export of a model of ``config`` (a ``BertConfig``) holds: its weights."""
    h, layers = config.hidden_size, config.num_hidden_layers
    embeddings = (config.vocab_size + config.max_position_embeddings + config.type_vocab_size) * h
    return 4 * (embeddings + layers * (4 * h * h + 2 * h * config.intermediate_size) + h * h)


def probe_output(output: Path, directory: Path) -> None:
    """Refuse, before any work, an ``output`` that cannot be written (a real file created and removed
    beside it) or whose file system has less free space than the export will take; the errors name
    ``output``, the user's path."""
    import shutil

    from bertctl.checkpoints.hf import load_config
    from bertctl.io import check_writable

    check_writable(output)
    base = output.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    need, free = export_bytes(load_config(directory)), shutil.disk_usage(base).free
    if free < need:
        raise BertctlError(f"{output}: no room for the export: about {need / 2 ** 20:,.0f} MiB, and {base} has "
                           f"{free / 2 ** 20:,.0f} MiB free; free some space or write somewhere else")


def resolve_architecture(directory: str | Path, architecture: str | None) -> str:
    """``architecture`` if given, else the first of config.json's ``architectures`` bertctl exports.

    A class bertctl has no head for (``BertForMaskedLM``, say) exports its encoder, with a note.
    """
    from bertctl.checkpoints.hf import load_config

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


def exported_module(model, architecture: str, hidden_states: bool):
    """``model`` as an ``nn.Module`` of ``INPUT_NAMES`` returning a tuple in its ``output_names`` order."""
    import torch
    from torch import nn

    class Exported(nn.Module):
        def __init__(self):
            super().__init__()
            self.model = model
            names = list(HEADS[architecture].outputs)
            if architecture == "BertModel" and not model.has_pooler:
                names.remove("pooler_output")
            if hidden_states:
                names.append("hidden_states")
            self.output_names = tuple(names)

        def forward(self, input_ids, attention_mask, token_type_ids):
            out = self.model(input_ids, token_type_ids, attention_mask, output_hidden_states=hidden_states)
            if architecture == "BertModel":
                outs = [out.last_hidden_state] + ([out.pooler_output] if self.model.has_pooler else [])
            elif architecture == "BertForPreTraining":
                outs = [out.prediction_logits, out.seq_relationship_logits]
            elif architecture == "BertForQuestionAnswering":
                outs = [out.start_logits, out.end_logits]
            else:
                outs = [out.logits]
            if hidden_states:
                outs.append(torch.stack(out.hidden_states))  # (L+1, B, S, H): embeddings, then each layer
            return tuple(outs)

    return Exported()


def load_for_export(directory: str | Path, architecture: str, attn_implementation: str = "sdpa",
                    hidden_states: bool = False):
    """The checkpoint's ``architecture`` on plain PyTorch ops (kernels ``torch``), in eval mode,
    wrapped by ``exported_module``.

    The encoder keeps its pooler only where the checkpoint has one (a token-classification
    or QA checkpoint has none).
    """
    from bertctl.checkpoints.hf import load_config, load_state, on_meta, read_state_dict
    from bertctl.model import BertModel
    from bertctl.runtime import resolve

    if hidden_states and architecture != "BertModel":
        raise BertctlError("--hidden-states applies to the encoder (--architecture BertModel) only")
    config = load_config(directory)
    runtime = resolve("cpu", attn=attn_implementation, kernels="torch")
    state = read_state_dict(directory)
    if architecture == "BertModel":
        has_pooler = any(k.startswith(("pooler.", "bert.pooler.")) for k in state)
        model = on_meta(lambda: BertModel(config, runtime, add_pooling_layer=has_pooler))
    else:
        model = on_meta(lambda: HEADS[architecture].cls(config, runtime))
    model = load_state(model, state, source=str(directory))
    return exported_module(model, architecture, hidden_states).eval()


def sample_inputs(config, architecture: str, batch: int, seq: int, rng: np.random.Generator,
                  choices: int = 3) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Random ids, a second segment from the middle on, and rows padded to decreasing lengths (int64)."""
    shape = (batch, choices, seq) if architecture == "BertForMultipleChoice" else (batch, seq)
    ids = rng.integers(0, config.vocab_size, shape, dtype=np.int64)
    types = np.zeros(shape, dtype=np.int64)
    if config.type_vocab_size > 1:
        types[..., seq // 2:] = 1
    mask = np.ones(shape, dtype=np.int64)
    rows = mask.reshape(-1, seq)
    for r in range(1, rows.shape[0]):
        rows[r, max(1, seq - 3 * r):] = 0  # at least [CLS] is real
    return ids, mask, types


def ort_session(path: str | Path, threads: int | None = None):
    """An ONNX Runtime CPU session: all graph optimisations but SkipLayerNormFusion, ``threads``
    intra-op threads (default: ONNX Runtime's, one per physical core).

    ONNX Runtime's SkipLayerNormalization CPU kernel is slower than the Add and LayerNormalization
    it replaces, for a single op and for a whole MiniLM embedding run."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.inter_op_num_threads = 1
    if threads:
        options.intra_op_num_threads = threads
    options.log_severity_level = 3  # errors only
    try:
        return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"],
                                    disabled_optimizers=["SkipLayerNormFusion"])
    except Exception as e:  # onnxruntime's own exception classes
        raise BertctlError(f"{path}: onnxruntime cannot load it ({str(e).splitlines()[0]})") from None


def compare(session, module, inputs: tuple[np.ndarray, ...]) -> dict[str, float]:
    """Max |ONNX Runtime - PyTorch| per output of ``module`` (an ``exported_module``) on ``inputs``."""
    import torch

    with torch.no_grad():
        want = module(*(torch.from_numpy(x) for x in inputs))
    got = session.run(list(module.output_names), dict(zip(INPUT_NAMES, inputs)))
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
    directory, output = Path(directory), Path(output)
    architecture = check_export(directory, output, architecture, attn_implementation, opset)
    import torch

    module = load_for_export(directory, architecture, attn_implementation, hidden_states)
    config = module.model.config
    head = HEADS[architecture]
    rng = np.random.default_rng(0)
    # Trace at batch 2, sequence 8 (a size-1 dimension would be specialised, not dynamic);
    # the sequence axis is bounded by the position table.
    trace = sample_inputs(config, architecture, 2, min(8, config.max_position_embeddings), rng, choices=2)
    dims = {a: torch.export.Dim(a, max=config.max_position_embeddings) if a == "sequence" else torch.export.Dim(a)
            for a in head.axes}
    dynamic = {name: {i: dims[a] for i, a in enumerate(head.axes)} for name in INPUT_NAMES}
    start = time.perf_counter()
    try:
        with _quiet():
            program = torch.onnx.export(module, tuple(torch.from_numpy(x) for x in trace), None,
                                        input_names=list(INPUT_NAMES), output_names=list(module.output_names),
                                        opset_version=opset, dynamo=True, dynamic_shapes=dynamic, optimize=True)
    except Exception as e:
        raise BertctlError(f"{directory}: ONNX export of {architecture} failed: {str(e).splitlines()[0]}") from e
    export_seconds = time.perf_counter() - start
    program.model.metadata_props.update({"bertctl.architecture": architecture, "bertctl.source": str(directory),
                                         "bertctl.attn_implementation": attn_implementation})
    with atomic_path(output) as tmp:
        try:
            program.save(tmp, external_data=False)
        except OSError as e:  # named by the user's path, not the temporary one it was written under
            raise OSError(e.errno, e.strerror, str(output)) from None
        session = ort_session(tmp)
        check = sample_inputs(config, architecture, 3, min(13, config.max_position_embeddings), rng)
        diffs = compare(session, module, check)
        worst = max(diffs.values())
        if not worst <= tolerance:  # NaN fails too
            raise BertctlError(f"{directory}: the exported {architecture} differs from PyTorch under onnxruntime by "
                               f"{worst:.3g} (> {tolerance:g}): {diffs}; nothing written to {output}")
    import onnxruntime

    return {
        "output": str(output), "source": str(directory), "architecture": architecture,
        "inputs": {n: list(head.axes) for n in INPUT_NAMES}, "outputs": list(module.output_names),
        "opset": opset, "attn_implementation": attn_implementation,
        "check": {"shape": list(check[0].shape), "max_abs_diff": diffs, "tolerance": tolerance},
        "export_seconds": round(export_seconds, 2), "bytes": output.stat().st_size,
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__},
    }


# --------------------------------------------------------------------------- fused operators for serving

# A self-attention block in the exporter's graph: its nodes carry the module path in their
# ``pkg.torch.onnx.name_scopes`` metadata (``model.encoder.layer.3.attention.self``, say).
_ATTENTION_SCOPE = re.compile(r"(?:^|\.)encoder\.layer\.(\d+)\.attention\.self$")


def _attention_layer(node) -> int | None:
    """The layer index of the self-attention module that made ``node``, if any."""
    for prop in node.metadata_props:
        if prop.key == "pkg.torch.onnx.name_scopes":
            for scope in ast.literal_eval(prop.value):
                match = _ATTENTION_SCOPE.search(scope)
                if match:
                    return int(match.group(1))
    return None


def fuse_attention(model, num_heads: int) -> int:
    """Replace each self-attention block of an exported encoder by one ``com.microsoft`` Attention
    node; returns how many were replaced (0: the graph is left as it was).

    A block is the exporter's nodes of one ``BertSelfAttention``: the packed (H, 3H) QKV MatMul
    and its bias Add on the layer input, the head split, scores, the key-padding mask, softmax and
    the context, ending in the (B, S, H) reshape. ONNX Runtime's own BERT fusion looks for separate
    Q, K and V MatMuls and finds none here. The Attention node takes the same input, the packed
    weights and bias (constants folded here) and the (B, S) 0/1 attention mask, and gives the
    block's output tensor; the nodes nothing reads any more are then dropped. The caller checks
    the result numerically (``optimize_encoder``)."""
    import onnx
    from onnx import helper, numpy_helper

    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    producer = {out: node for node in graph.node for out in node.output}
    blocks: dict[int, list] = {}
    for node in graph.node:  # graph order is topological
        layer = _attention_layer(node)
        if layer is not None:
            blocks.setdefault(layer, []).append(node)

    def constant(name: str) -> np.ndarray | None:
        """The value of ``name`` when it is an initializer or Transpose/Concat/Identity of them."""
        if name in initializers:
            return numpy_helper.to_array(initializers[name])
        node = producer.get(name)
        if node is None or node.op_type not in ("Transpose", "Concat", "Identity"):
            return None
        parts = [constant(i) for i in node.input]
        if any(p is None for p in parts):
            return None
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "Transpose":
            return parts[0].transpose(attrs.get("perm"))
        if node.op_type == "Concat":
            return np.concatenate(parts, axis=attrs["axis"])
        return parts[0]

    mask_index = "attention_mask_int32"
    replaced = {}
    for layer, nodes in blocks.items():
        matmul = next((n for n in nodes if n.op_type == "MatMul"), None)
        if matmul is None:
            continue
        add = next((n for n in nodes if n.op_type == "Add" and matmul.output[0] in n.input), None)
        weight = constant(matmul.input[1])
        bias = None if add is None else constant(next(i for i in add.input if i != matmul.output[0]))
        if weight is None or bias is None or weight.ndim != 2 or bias.shape != (weight.shape[1],) \
                or weight.shape[1] != 3 * weight.shape[0] or weight.shape[0] % num_heads:
            continue
        last = nodes[-1]
        prefix = f"bertctl.fused.layer{layer}.attention"
        graph.initializer.extend([numpy_helper.from_array(np.ascontiguousarray(weight), f"{prefix}.qkv_weight"),
                                  numpy_helper.from_array(np.ascontiguousarray(bias), f"{prefix}.qkv_bias")])
        replaced[id(last)] = helper.make_node(
            "Attention", [matmul.input[0], f"{prefix}.qkv_weight", f"{prefix}.qkv_bias", mask_index], [last.output[0]],
            name=prefix, domain="com.microsoft", num_heads=num_heads)
    if not replaced:
        return 0
    cast = helper.make_node("Cast", ["attention_mask"], [mask_index], name="bertctl.fused.mask",
                            to=onnx.TensorProto.INT32)
    nodes = [cast] + [replaced.get(id(n), n) for n in graph.node]
    # Drop what no output needs any more (the old blocks), then the initializers nothing reads.
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(nodes):
        if any(out in needed for out in node.output):
            kept.append(node)
            needed.update(node.input)
    del graph.node[:]
    graph.node.extend(reversed(kept))
    unused = [t for t in graph.initializer if t.name not in needed]
    for t in unused:
        graph.initializer.remove(t)
    if not any(o.domain == "com.microsoft" for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    return len(replaced)


def optimize_encoder(source: str | Path, target: str | Path, config, tolerance: float = TOLERANCE) -> dict:
    """``source`` (an encoder export) with fused operators, written to ``target`` when every output
    matches ``source``'s under ONNX Runtime within ``tolerance``.

    - self-attention: one Attention node per layer (``fuse_attention``);
    - bias + GELU: BiasGelu, by ONNX Runtime's transformer optimizer (``onnxruntime.transformers``);
      its other BERT fusions are off: its attention pattern does not match this graph, the
      embedding fusion would change the inputs' meaning, and SkipLayerNormalization is slower
      here (``ort_session``).
    ``embed`` serves the fused copy because it takes less CPU time than the plain export."""
    import onnx
    from onnxruntime.transformers.fusion_options import FusionOptions
    from onnxruntime.transformers.optimizer import optimize_model

    model = onnx.load(str(source))
    attention = fuse_attention(model, config.num_attention_heads)
    options = FusionOptions("bert")
    for name in ("enable_attention", "enable_skip_layer_norm", "enable_bias_skip_layer_norm",
                 "enable_embed_layer_norm", "enable_shape_inference", "enable_rotary_embeddings"):
        setattr(options, name, False)
    with _quiet():
        optimized = optimize_model(model, model_type="bert", num_heads=config.num_attention_heads,
                                   hidden_size=config.hidden_size, optimization_options=options, opt_level=0)
    ops = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    ops["Attention"] = attention
    rng = np.random.default_rng(0)
    with atomic_path(target) as tmp:
        optimized.save_model_to_file(str(tmp))
        ids, mask, types = sample_inputs(config, "BertModel", 4, min(21, config.max_position_embeddings), rng)
        feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        want_session, got_session = ort_session(source), ort_session(tmp)
        names = [o.name for o in want_session.get_outputs()]
        diffs = {name: float(np.abs(g.astype(np.float64) - w).max())
                 for name, w, g in zip(names, want_session.run(names, feeds), got_session.run(names, feeds))}
        worst = max(diffs.values())
        if not worst <= tolerance:  # NaN fails too
            raise BertctlError(f"{source}: the fused encoder differs from the export by {worst:.3g} "
                               f"(> {tolerance:g}): {diffs}; nothing written")
    return {"fused": ops, "max_abs_diff": diffs}
