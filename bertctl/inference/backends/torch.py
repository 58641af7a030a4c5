"""The PyTorch backend: a checkpoint's ``BertModel`` (heads and pooler dropped) on any device.

bf16 and fp16 cast the weights once, at load: inference needs no fp32 master copy, and autocast would
cast every weight again at every batch (``benchmarks/results/embed-profile-h100-7e07e4b.json``).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from bertctl.errors import BertctlError
from bertctl.inference.encoder import Tokens, run_padded
from bertctl.inference.pooling import PoolingSpec, features, normalize_rows
from bertctl.runtime import Runtime, resolve

HALF_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


class TorchEncoder:
    """``model`` (a ``BertModel``) as an ``Encoder``.  ``precision`` bf16 or fp16 on an fp32 model runs
    under autocast; ``load_torch_encoder`` casts the weights instead."""

    name = "torch"

    def __init__(self, model: torch.nn.Module, precision: str = "fp32"):
        self.model, self.config, self.precision = model.eval(), model.config, precision
        self.torch_device = next(model.parameters()).device
        self.device = str(self.torch_device)

    def features(self, tokens: Tokens, batches: list[np.ndarray], spec: PoolingSpec, pad_id: int,
                 normalize: bool = False, advance=None) -> np.ndarray:
        from bertctl.nn.attention import varied_shapes  # no cuDNN attention plan per batch width

        device = self.torch_device
        half = HALF_DTYPES.get(self.precision, torch.bfloat16)
        autocast = self.precision != "fp32" and next(self.model.parameters()).dtype == torch.float32
        # From pinned memory the copy is queued behind the GPU's work; from pageable memory the host
        # would first wait for that work to finish, every batch.
        pin = device.type == "cuda"

        def forward(ids: np.ndarray, mask: np.ndarray) -> torch.Tensor:
            ids_t, mask_t = ((torch.from_numpy(a).pin_memory() if pin else torch.from_numpy(a))
                             .to(device, non_blocking=True) for a in (ids, mask))
            try:
                encoded = self.model(ids_t, torch.zeros_like(ids_t), mask_t, output_hidden_states=spec.all_layers)
            except torch.OutOfMemoryError:
                raise BertctlError(f"out of {device.type.upper()} memory embedding {ids.shape[0]} texts of "
                                   f"{ids.shape[1]} tokens in one forward pass: pass a smaller --batch-tokens") from None
            states = encoded.hidden_states if spec.all_layers else (encoded.last_hidden_state,)
            # Left on the device: run_padded copies many batches to the host at once (one wait, not one a batch).
            return features(states, mask_t, spec)

        with torch.no_grad(), varied_shapes(), torch.autocast(device.type, dtype=half, enabled=autocast):
            out = run_padded(tokens, batches, pad_id, forward, advance)
        return normalize_rows(out) if normalize else out


def runtime_for(device="cpu", precision: str = "fp32") -> Runtime:
    """How the PyTorch backend runs on ``device`` (a name or a ``torch.device``) at ``precision``: the
    padded SDPA attention, since embed's batches are sorted by length and hold little padding, where
    packing the tokens costs more than it saves (``benchmarks/results/embed-profile-h100-7e07e4b.json``)."""
    return resolve(str(device), precision, attn="sdpa")


def load_torch_encoder(directory: str | Path, runtime: Runtime) -> TorchEncoder:
    """``directory``'s encoder as ``runtime`` says (``runtime_for``), its weights cast once to a half precision."""
    from bertctl.checkpoints.hf import load_config, load_state, on_meta, read_state_dict
    from bertctl.model import BertModel

    config = load_config(directory)
    model = load_state(on_meta(lambda: BertModel(config, runtime, add_pooling_layer=False)), read_state_dict(directory),
                       source=str(directory))
    model = model.to(runtime.device)
    if runtime.precision in HALF_DTYPES:
        model = model.to(HALF_DTYPES[runtime.precision])
    return TorchEncoder(model, runtime.precision)
