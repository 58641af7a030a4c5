"""The ONNX Runtime backend: an exported encoder on the CPU, numpy in and out (no torch).

``embed`` serves a checkpoint's encoder from a cache (``cached_encoder``): its export
(``bertctl.inference.onnx_export``), made once with torch, and beside it a copy with fused operators
(``optimize_encoder``), checked against the export; both are made again when the weights, torch or
onnxruntime change.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import numpy as np

from bertctl.errors import BertctlError
from bertctl.inference import onnx_export
from bertctl.inference.encoder import Tokens, run_padded
from bertctl.inference.pooling import PoolingSpec, features, normalize_rows
from bertctl.progress import stderr

# Bump when the exported graph changes, so cached exports are made anew.
EXPORT_FORMAT = 1
# Bump when optimize_encoder's output changes (the export stays).
OPTIMIZE_FORMAT = 1


class OnnxEncoder:
    """An exported encoder under ONNX Runtime on the CPU, as an ``Encoder``: numpy in and out.

    Any ONNX file with ``input_ids``/``attention_mask``/``token_type_ids`` inputs and a
    ``last_hidden_state`` output serves (``optimum``'s exports too); layers other than the
    last need the ``hidden_states`` output (``export onnx --hidden-states``).
    """

    name = "onnxruntime"
    device = "cpu"
    precision = "fp32"

    def __init__(self, path: str | Path, config, threads: int | None = None):
        self.path, self.config = Path(path), config
        if not self.path.is_file():
            raise BertctlError(f"{self.path}: --onnx: no such file")
        if threads is None and os.environ.get("OMP_NUM_THREADS", "").isdigit():
            threads = int(os.environ["OMP_NUM_THREADS"])  # what torch would use
        self.session = onnx_export.ort_session(self.path, threads)
        self.inputs = [i.name for i in self.session.get_inputs()]
        outputs = [o.name for o in self.session.get_outputs()]
        if "last_hidden_state" not in outputs or not set(self.inputs) <= set(onnx_export.INPUT_NAMES):
            raise BertctlError(f"{self.path}: not an exported BERT encoder (inputs {self.inputs}, outputs {outputs}; "
                               f"want inputs among {list(onnx_export.INPUT_NAMES)} and a last_hidden_state output)")
        self.has_hidden_states = "hidden_states" in outputs

    def hidden_states(self, input_ids: np.ndarray, attention_mask: np.ndarray, token_type_ids: np.ndarray,
                      all_layers: bool = False) -> tuple[np.ndarray, ...]:
        """(B, S) int64 inputs -> (last_hidden_state,), or with ``all_layers`` the L+1 hidden states
        (embeddings first), each (B, S, H) float32."""
        given = {"input_ids": input_ids, "attention_mask": attention_mask, "token_type_ids": token_type_ids}
        feeds = {name: given[name] for name in self.inputs}
        if not all_layers:
            return tuple(self.session.run(["last_hidden_state"], feeds))
        if not self.has_hidden_states:
            raise BertctlError(f"{self.path}: no hidden_states output, which layers other than the last need "
                               "(export it with: bertctl export onnx --architecture BertModel --hidden-states)")
        (states,) = self.session.run(["hidden_states"], feeds)  # (L+1, B, S, H)
        return tuple(states)

    def features(self, tokens: Tokens, batches: list[np.ndarray], spec: PoolingSpec, pad_id: int,
                 normalize: bool = False, advance=None) -> np.ndarray:
        def forward(ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
            return features(self.hidden_states(ids, mask, np.zeros_like(ids), all_layers=spec.all_layers), mask, spec)

        out = run_padded(tokens, batches, pad_id, forward, advance)
        return normalize_rows(out) if normalize else out


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bertctl" / "onnx"


def _version(package: str) -> str:
    try:
        return version(package)
    except PackageNotFoundError:
        return "none"


def cached_encoder_path(directory: str | Path) -> Path:
    """Where the encoder export of ``directory`` is cached: ``NAME-PATHKEY-KEY.onnx``, PATHKEY from its
    path, KEY from its config, weights (size and modification time), torch version and ``EXPORT_FORMAT``."""
    from bertctl.checkpoints.hf import LEGACY_WEIGHTS, WEIGHTS

    directory = Path(directory).resolve()
    where = hashlib.sha256(str(directory).encode()).hexdigest()[:8]
    key = hashlib.sha256(json.dumps([EXPORT_FORMAT, _version("torch")]).encode())
    key.update((directory / "config.json").read_bytes())
    for name in (WEIGHTS, LEGACY_WEIGHTS):
        if (directory / name).exists():
            st = (directory / name).stat()
            key.update(f"{name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return cache_dir() / f"{directory.name}-{where}-{key.hexdigest()[:16]}.onnx"


def optimized_path(export: Path) -> Path:
    """The fused copy of a cached export, beside it, keyed by the onnxruntime version."""
    key = hashlib.sha256(json.dumps([OPTIMIZE_FORMAT, _version("onnxruntime")]).encode()).hexdigest()[:8]
    return export.with_name(f"{export.stem}.fused-{key}.onnx")


def cached_encoder(directory: str | Path, threads: int | None = None) -> OnnxEncoder:
    """``directory``'s encoder (with ``hidden_states``) under ONNX Runtime, with fused operators:
    exported and fused on first use, the fused copy made again when onnxruntime changes."""
    from bertctl.checkpoints.hf import load_config

    config = load_config(directory)
    path = cached_encoder_path(directory)
    fused = optimized_path(path)
    if not fused.exists():
        if not path.exists():
            onnx_export.require_onnx()
            stderr.print(f"exporting the encoder of {directory} to ONNX (once; cached as {path})")
            onnx_export.export_onnx(directory, path, architecture="BertModel", hidden_states=True)
        onnx_export.optimize_encoder(path, fused, config)
        # Exports (and fused copies) of earlier weights or versions of the same directory are stale now.
        for old in path.parent.glob(glob.escape(path.name.rsplit("-", 1)[0]) + "-*.onnx"):
            if old not in (path, fused):
                old.unlink(missing_ok=True)
    return OnnxEncoder(fused, config, threads)
