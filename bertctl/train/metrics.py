"""Model FLOPs, MFU, and the loss/accuracy curves picture.

FLOPs are counted analytically (as in the PaLM / Megatron papers): a matmul of
(m, k) by (k, n) is 2·m·k·n FLOPs forward, and a training step is 3× forward
(backward = 2× forward).  Two counts, both over real (non-pad) tokens:

- ``train_flops_6nt``: 6 · parameters · tokens + attention, the customary MFU count
  (reported as ``mfu``);
- ``train_flops``: only the work BERT pretraining needs, the MLM head's vocabulary
  projection at masked positions only (reported as ``mfu_useful``; lower, since
  gathering the masked positions is exactly what saves those FLOPs).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

#: Dense bf16 tensor-core peak (FLOP/s) of the GPUs we report MFU for (SXM parts, vendor datasheets).
PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}


def peak_flops(device: torch.device | None = None) -> float | None:
    """The bf16 dense peak of the current GPU, or None where unknown (CPU, other GPUs)."""
    if device is None or device.type != "cuda" or not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name(device)
    for key, peak in PEAK_BF16.items():
        if key in name:
            return peak
    return None


def forward_flops(config, tokens: float, attn_pairs: float, masked: float, sequences: float) -> float:
    """Forward FLOPs of BertForPreTraining on a batch.

    tokens: real tokens (Σ lengths); attn_pairs: Σ length² (each query attends its
    sequence's keys); masked: MLM predictions; sequences: batch size (pooler + NSP).
    """
    h, i, v, n = config.hidden_size, config.intermediate_size, config.vocab_size, config.num_hidden_layers
    per_token_layer = 2 * (4 * h * h + 2 * h * i)       # Q, K, V, O projections and the two FFN matmuls
    per_pair_layer = 2 * 2 * h                          # QK^T and probs·V, summed over heads
    encoder = n * (tokens * per_token_layer + attn_pairs * per_pair_layer)
    mlm = masked * 2 * (h * h + h * v)                  # transform dense + tied decoder
    nsp = sequences * 2 * (h * h + 2 * h)               # pooler + seq_relationship
    return encoder + mlm + nsp


def train_flops(config, tokens: float, attn_pairs: float, masked: float, sequences: float) -> float:
    """Useful training FLOPs: 3 x :func:`forward_flops` (MLM projection at masked positions only)."""
    return 3.0 * forward_flops(config, tokens, attn_pairs, masked, sequences)


def train_flops_6nt(config, n_params: int, tokens: float, attn_pairs: float) -> float:
    """The customary count: 6 · parameters · tokens, plus attention (QK^T and probs·V, ×3 for training).

    N counts every parameter (embeddings and heads too), so for BERT this is close to what a
    model that projects every position onto the vocabulary does; the MFU figure the issue
    and most reports quote.
    """
    return 6.0 * n_params * tokens + 3 * 2 * 2 * config.num_hidden_layers * config.hidden_size * attn_pairs


def batch_counts(batch: dict) -> tuple[float, float, float, float]:
    """(tokens, Σ length², masked predictions, sequences) of a loader batch (CPU tensors)."""
    lengths = batch["attention_mask"].sum(dim=1).double()
    masked = (batch["masked_lm_labels"] != -100).sum().item()
    return float(lengths.sum()), float((lengths * lengths).sum()), float(masked), float(lengths.numel())


def plot_curves(metrics_path: str | Path, png_path: str | Path) -> Path | None:
    """Draw loss / accuracy / lr from ``metrics.jsonl`` into a PNG; None when the log holds no step yet.

    matplotlib is a main dependency.  The figure is drawn on its own Agg canvas, without pyplot:
    no display is needed, and no global backend is switched under the caller."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    train, evals = [], []
    for line in Path(metrics_path).read_text(encoding="utf-8").splitlines():
        try:
            r = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a kill
            continue
        if r.get("event") == "train":
            train.append(r)
        elif r.get("event") == "eval":
            evals.append(r)
    if not train and not evals:
        return None
    fig = Figure(figsize=(15, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    steps = [r["step"] for r in train]
    nsp = any("nsp_loss" in r for r in train + evals)  # no NSP curves for masked-LM-only runs
    axes[0].plot(steps, [r["loss"] for r in train], label="train loss")
    axes[0].plot(steps, [r["mlm_loss"] for r in train], label="train MLM loss", alpha=0.7)
    if nsp:
        axes[0].plot(steps, [r["nsp_loss"] for r in train], label="train NSP loss", alpha=0.7)
    if evals:
        axes[0].plot([r["step"] for r in evals], [r["mlm_loss"] + r.get("nsp_loss", 0.0) for r in evals], "o-",
                     label="eval loss")
    axes[0].set_xlabel("step")
    axes[0].set_ylabel("loss")
    axes[0].legend()
    axes[1].plot(steps, [r["mlm_acc"] for r in train], label="train MLM acc")
    if nsp:
        axes[1].plot(steps, [r["nsp_acc"] for r in train], label="train NSP acc")
    if evals:
        es = [r["step"] for r in evals]
        axes[1].plot(es, [r["mlm_acc"] for r in evals], "o-", label="eval MLM acc")
        if nsp:
            axes[1].plot(es, [r["nsp_acc"] for r in evals], "o-", label="eval NSP acc")
    axes[1].set_xlabel("step")
    axes[1].set_ylabel("accuracy")
    axes[1].legend()
    axes[2].plot(steps, [r["lr"] for r in train])
    axes[2].set_xlabel("step")
    axes[2].set_ylabel("learning rate")
    fig.tight_layout()
    from bertctl.io import atomic_path

    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return Path(png_path)
