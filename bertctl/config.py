"""Model configuration: one dataclass with Hugging Face's field names.

``config.json`` written from it loads as a ``transformers.BertConfig`` and vice
versa.  Runtime choices (attention backend, kernels) are not architecture and
are never written to ``config.json``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from bertctl.errors import BertctlError
from bertctl.io import read_json_object, write_json
from bertctl.runtime import ATTENTION_BACKENDS, DROPOUT_MASK_CHOICES, KERNEL_CHOICES

# (layers, hidden, heads): BERT-Base/Large from the paper (§3), the small sizes from
# Turc et al. 2019 ("Well-Read Students Learn Better").  Intermediate = 4 * hidden.
PRESETS: dict[str, tuple[int, int, int]] = {
    "tiny": (2, 128, 2),
    "mini": (4, 256, 4),
    "small": (4, 512, 8),
    "medium": (8, 512, 8),
    "base": (12, 768, 12),
    "large": (24, 1024, 16),
}

# hidden_act names (Hugging Face's) -> GELU approximation used by the fused op.
GELU_APPROXIMATION = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu_fast": "tanh"}
# The label of a slot that carries no prediction (padding, unmasked tokens, a word's later pieces):
# collation pads labels with it and every loss skips it, as torch's cross_entropy does by default.
IGNORE_INDEX = -100
RUNTIME_FIELDS = ("attn_implementation", "kernels", "dropout_masks")


@dataclass
class BertConfig:
    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    initializer_range: float = 0.02
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0
    classifier_dropout: float | None = None
    # Task heads (Hugging Face semantics).
    num_labels: int = 2
    id2label: dict[int, str] | None = None
    label2id: dict[str, int] | None = None
    problem_type: str | None = None
    architectures: list[str] | None = None
    # Runtime (not saved): attention backend over the same weights, which ops run it, and whose
    # dropout masks training draws with the compiled ops (``fused``: bertctl's own, a hash of a seed and
    # the element's index, inside the fused sub-layer op; ``torch``: torch's dropout before the fused
    # LayerNorm, as fine-tuning trains; see ``bertctl.nn.fused.own_masks``).
    attn_implementation: str = "sdpa"
    kernels: str = "auto"
    dropout_masks: str = "fused"
    # Unknown keys from a config.json, kept so a round trip loses nothing.
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise BertctlError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
        if self.attn_implementation not in ATTENTION_BACKENDS:
            raise BertctlError(f"attention backend must be one of {ATTENTION_BACKENDS}, not {self.attn_implementation!r}")
        if self.kernels not in KERNEL_CHOICES:
            raise BertctlError(f"kernels must be one of {KERNEL_CHOICES}, not {self.kernels!r}")
        if self.dropout_masks not in DROPOUT_MASK_CHOICES:
            raise BertctlError(f"dropout_masks must be one of {DROPOUT_MASK_CHOICES}, not {self.dropout_masks!r}")
        if self.id2label is not None:
            self.id2label = {int(k): v for k, v in self.id2label.items()}
            self.num_labels = len(self.id2label)
            if self.label2id is None:
                self.label2id = {v: k for k, v in self.id2label.items()}

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def preset(cls, name: str, **overrides) -> "BertConfig":
        if name not in PRESETS:
            raise BertctlError(f"unknown model size {name!r}; choose one of {', '.join(PRESETS)}")
        layers, hidden, heads = PRESETS[name]
        base = dict(num_hidden_layers=layers, hidden_size=hidden, num_attention_heads=heads, intermediate_size=4 * hidden)
        return cls(**{**base, **overrides})

    def to_dict(self, runtime: bool = False) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
        if not runtime:
            for name in RUNTIME_FIELDS:
                d.pop(name)
        for key in ("id2label", "label2id", "architectures", "problem_type"):
            if d[key] is None:
                d.pop(key)
        if "id2label" in d:
            d["id2label"] = {str(k): v for k, v in d["id2label"].items()}
        d = {**self.extra, **d}
        d["model_type"] = "bert"
        return d

    @classmethod
    def from_dict(cls, d: dict, **overrides) -> "BertConfig":
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        known = {k: v for k, v in d.items() if k in names}
        extra = {k: v for k, v in d.items() if k not in names and k not in ("model_type", "transformers_version")}
        model_type = d.get("model_type", "bert")
        if model_type != "bert":
            raise BertctlError(f"config model_type is {model_type!r}; bertctl reads BERT checkpoints only")
        return cls(**{**known, **overrides}, extra=extra)

    def to_json_file(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_json_file(cls, path: str | Path, **overrides) -> "BertConfig":
        return cls.from_dict(read_json_object(path, "config"), **overrides)
