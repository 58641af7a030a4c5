"""Model configuration: one dataclass with Hugging Face's field names.

``config.json`` written from it loads as a ``transformers.BertConfig`` and vice
versa.  It holds the architecture only: how a model runs (attention backend,
kernels, dropout masks) is its ``bertctl.runtime.Runtime``.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import ClassVar
from pathlib import Path

from bertctl.errors import BertctlError
from bertctl.io import read_json_object, write_json

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
# Runtime choices that config.json files written before the Runtime held them may carry: ignored on reading.
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
    # Unknown keys from a config.json, kept so a round trip loses nothing.
    extra: dict = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_attention_heads:
            raise BertctlError(
                f"hidden_size {self.hidden_size} is not a multiple of num_attention_heads {self.num_attention_heads}"
            )
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

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "extra"}
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
        extra = {k: v for k, v in d.items()
                 if k not in names and k not in ("model_type", "transformers_version", *RUNTIME_FIELDS)}
        model_type = d.get("model_type", "bert")
        if model_type != "bert":
            raise BertctlError(f"config model_type is {model_type!r}; bertctl reads BERT checkpoints only")
        return cls(**{**known, **overrides}, extra=extra)

    def to_json_file(self, path: str | Path) -> None:
        write_json(path, self.to_dict())

    @classmethod
    def from_json_file(cls, path: str | Path, **overrides) -> "BertConfig":
        return cls.from_dict(read_json_object(path, "config"), **overrides)


# --------------------------------------------------------------------------- training

#: Fine-tuning's default: capture a batch shape as a CUDA graph only when the run has this many steps of it.
MIN_SHAPE_STEPS = 16


@dataclass
class TrainConfig:
    """What every training run shares, and all the training engine reads: batch and accumulation, the
    optimizer and its schedule, the runtime asked for (resolved by ``bertctl.runtime.resolve``),
    checkpointing, logging and the seed. ``PretrainConfig`` and ``FinetuneConfig`` hold one."""

    # Batch and accumulation.
    batch_size: int = 32                  # global: sequences (examples) per optimizer step, all processes
    micro_batch_size: int | None = None   # per process per forward; gradients accumulate to batch_size
    max_steps: int | None = None          # None: the job's own length (pretraining: an epoch; fine-tuning: epochs)
    # Optimizer and schedule.
    optimizer: str = "adamw"              # adamw or lamb
    lr: float = 1e-4
    weight_decay: float = 0.01
    betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-6
    max_grad_norm: float = 1.0            # 0: no clipping
    schedule: str = "linear"              # after warm-up: linear, cosine or constant
    warmup_steps: int | None = None       # None: warmup_fraction of the steps
    warmup_fraction: float = 0.1
    minutes: float | None = None          # time box: stop (checkpoint and export) after this long
    fit_to_minutes: bool = False          # re-plan max_steps from the measured pace to end the schedule in time
    # Runtime asked for.
    device: str | None = "auto"           # auto (or None): cuda when available; cpu, cuda, cuda:N
    precision: str = "auto"               # auto: bf16 autocast on a GPU, fp32 on the CPU; fp16 with loss scaling
    kernels: str = "auto"                 # model ops: auto (compiled kernels where built), fused or torch
    dropout_masks: str = "fused"          # with the compiled kernels: the fused op's own masks, or torch's
    attn: str = "auto"                    # attention: auto, sdpa, explicit or unpadded
    compile: bool = False
    cuda_graphs: bool | None = None       # whole-step CUDA graphs; None: wherever they can run
    graph_min_steps: int = 1              # capture a batch shape only when the run has this many steps of it
    # Checkpoints.
    save_every: int | None = None         # also checkpoint every N optimizer steps (0 or None: not by steps)
    save_minutes: float | None = None     # and every N minutes
    keep: int = 3                         # checkpoints kept, the newest
    # Logging.
    log_every: int = 10                   # steps between logged means (the only host syncs)
    show_progress: bool = True
    tensorboard: bool | None = None       # TensorBoard events beside metrics.jsonl (None: when importable)
    seed: int = 0


def _fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _split(d: dict, own: type, strict: bool = False) -> tuple[dict, dict]:
    """A flat config into (the TrainConfig's keys, the job's own keys), older keys renamed; ``strict``:
    an unknown key is an error (options given in code), else ignored (a file saved by another version)."""
    d = dict(d)
    if "eps" in d:  # pretraining's name before the shared TrainConfig
        d.setdefault("adam_eps", d.pop("eps"))
    if "progress" in d:  # fine-tuning's
        d.setdefault("show_progress", d.pop("progress"))
    if d.get("betas") is not None:
        d["betas"] = tuple(d["betas"])
    train = {k: v for k, v in d.items() if k in _fields(TrainConfig)}
    unknown = set(d) - _fields(TrainConfig) - _fields(own) | ({"train"} & set(d))
    if strict and unknown:
        raise TypeError(f"{own.__name__}: unknown options {', '.join(sorted(unknown))}")
    return train, {k: v for k, v in d.items() if k in _fields(own) - {"train"}}


def pretraining_defaults() -> TrainConfig:
    """Pretraining's recipe (paper §A.2, with a longer warm-up for short runs): batch 256, lr 1e-4 (the
    CLI picks one per model size), 6% warm-up, a checkpoint every 30 minutes."""
    return TrainConfig(batch_size=256, lr=1e-4, warmup_fraction=0.06, save_minutes=30.0, seed=0)


def finetuning_defaults() -> TrainConfig:
    """Fine-tuning's recipe, the paper's (Appendix A.3): batch 32, lr 5e-5, 10% warm-up; torch's dropout
    masks (``bertctl.runtime.Runtime.own_masks``), one checkpoint kept."""
    return TrainConfig(batch_size=32, lr=5e-5, warmup_fraction=0.1, seed=42, dropout_masks="torch",
                       graph_min_steps=MIN_SHAPE_STEPS, log_every=50, keep=1, save_every=0)


class ExtendsTrain:
    """A command's config that holds one ``TrainConfig`` (``train``) and adds its own fields; saved as one flat
    object with the train fields, as checkpoints and ``metrics.jsonl`` have always held it."""

    defaults: ClassVar  # the command's TrainConfig defaults

    def to_dict(self) -> dict:
        d = {k: v for k, v in dataclasses.asdict(self).items() if k != "train"}
        d.update(dataclasses.asdict(self.train))
        d["betas"] = list(self.train.betas)
        return d

    @classmethod
    def from_dict(cls, d: dict, strict: bool = False):
        """From one flat object: ``to_dict``'s, one a run saved before the shared TrainConfig (``eps``),
        or options given in code (``strict``: an unknown key is an error); the train fields not given
        keep the command's defaults."""
        train, own = _split(d, cls, strict)
        return cls(**own, train=dataclasses.replace(cls.defaults(), **train))

    @classmethod
    def of(cls, **options):
        """The command's own and training options in one list, e.g. ``PretrainConfig.of(output=..., lr=1e-3)``."""
        return cls.from_dict(options, strict=True)


@dataclass
class PretrainConfig(ExtendsTrain):
    """A pretraining run (saved in every checkpoint): its data, its model, its evaluation; ``train``
    holds the rest."""

    output: str
    data: str | None = None
    eval_data: str | None = None          # held-out shards; default: the data's held-out part if it has one
    # Model: a preset, a config.json, or initialised from a HF directory / previous run.
    model_size: str = "base"
    model_config: str | None = None
    init_from: str | None = None
    keep_optimizer: bool = False          # with init_from = a previous run: keep its optimizer moments
    model_overrides: dict = field(default_factory=dict)  # e.g. {"hidden_dropout_prob": 0.0}
    bucket_lengths: bool = False          # length-bucketed batch order (less padding for varied lengths)
    resume: bool = False
    overwrite: bool = False               # replace the run in output (kept aside until this one finishes)
    # Held-out evaluation.
    eval_every: int | None = None
    eval_batches: int = 20
    eval_batch_size: int | None = None
    eval_at_start: bool = True
    train: TrainConfig = field(default_factory=pretraining_defaults)

    defaults: ClassVar = staticmethod(pretraining_defaults)


@dataclass
class FinetuneConfig(ExtendsTrain):
    """Fine-tuning on a task: epochs, evaluation and batch order; ``train`` holds the rest."""

    epochs: float = 3.0
    eval_batch_size: int = 128
    eval_batch_tokens: int | None = None  # padded tokens per evaluation batch; None: predict's default
    group_by_length: bool = False
    from_scratch: bool = False            # the model's architecture with random weights (no pretraining)
    select_best: bool = False             # keep the epoch with the best dev score (NER: chosen on valid)
    epoch_evals: bool = True              # evaluate on dev after every epoch; False: once, after training
    train: TrainConfig = field(default_factory=finetuning_defaults)

    defaults: ClassVar = staticmethod(finetuning_defaults)
