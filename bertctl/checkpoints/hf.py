"""Hugging Face-compatible checkpoint directories: read and write.

A directory holds ``config.json``, ``model.safetensors`` (``pytorch_model.bin`` is read
too), and the tokenizer files (``vocab.txt``, ``tokenizer_config.json``,
``special_tokens_map.json``).  All renaming between checkpoint tensor names and
bertctl's parameter names lives here, in ``_normalise_names`` and ``_match``.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Callable, TypeVar

from bertctl import faults
from bertctl.checkpoints.writes import write_errors
from bertctl.config import BertConfig
from bertctl.errors import BertctlError
from bertctl.io import atomic_dir

if TYPE_CHECKING:  # torch and the model load with the weights: reading a config (embed on ONNX Runtime) needs neither
    import torch

    from bertctl.model import BertPreTrainedModel
    from bertctl.runtime import Runtime

M = TypeVar("M", bound="BertPreTrainedModel")

WEIGHTS = "model.safetensors"
LEGACY_WEIGHTS = "pytorch_model.bin"
# Buffers some writers save that carry no learned state.
IGNORED_SUFFIXES = ("position_ids", "token_type_ids")
# Every task head bertctl or transformers may put beside the encoder: dropping one is always
# safe (loading a fine-tuned or pretraining checkpoint as a plain encoder, say).
ALL_HEAD_PREFIXES = ("cls.", "classifier.", "qa_outputs.")

#: Where a fine-tuning run writes its model in its output folder.
MODEL_SUBDIR = "model"


def model_dir_of(path: str | Path) -> Path:
    """A fine-tuning output folder holds the model in ``model/``, and an older sentence-transformers
    checkpoint its encoder in the folder its ``modules.json`` names (``0_Transformer/``); accept each."""
    from bertctl.inference.sentence_transformers import encoder_dir

    path = Path(path)
    if not (path / "config.json").exists() and (path / MODEL_SUBDIR / "config.json").exists():
        return path / MODEL_SUBDIR
    encoder = encoder_dir(path) if path.is_dir() and not (path / "config.json").exists() else None
    if encoder is not None and (encoder / "config.json").exists():
        return encoder
    if not path.is_dir():
        raise BertctlError(f"{path}: model directory not found")
    if not (path / "config.json").exists():
        raise BertctlError(f"{path}: no config.json (not a model directory)")
    return path


def load_config(directory: str | Path, **overrides) -> BertConfig:
    """The directory's ``config.json``; an error if its tokenizer holds more tokens than the model has embeddings."""
    directory = Path(directory)
    if not directory.is_dir():
        raise BertctlError(f"{directory}: model directory not found")
    config = BertConfig.from_json_file(directory / "config.json", **overrides)
    check_vocabulary_fits(directory, config)
    return config


def tokenizer_vocab_size(directory: str | Path) -> tuple[Path, int] | None:
    """(file, token count) of the tokenizer that ``load_tokenizer`` would load here: a SentencePiece
    model, else ``tokenizer.json``, else ``vocab.txt``; None when there is none (or it is unreadable:
    loading the tokenizer reports that)."""
    from bertctl.text import load_tokenizer
    from bertctl.text.sentencepiece import find_spm_model

    directory = Path(directory)
    tokenizer_json, vocab_txt = directory / "tokenizer.json", directory / "vocab.txt"
    try:
        spm = find_spm_model(directory)
        if spm is not None:
            return spm, load_tokenizer(directory).vocab_size
        if tokenizer_json.is_file():
            vocab = json.loads(tokenizer_json.read_text(encoding="utf-8")).get("model", {}).get("vocab")
            return (tokenizer_json, len(vocab)) if isinstance(vocab, dict) else None
        if vocab_txt.is_file():
            with open(vocab_txt, "rb") as f:
                return vocab_txt, sum(1 for _ in f)
    except (OSError, ValueError, AttributeError, BertctlError):
        return None
    return None


def check_vocabulary_fits(directory: str | Path, config: BertConfig) -> None:
    """A tokenizer with more tokens than the model's word embeddings gives ids that index past the
    embedding table (an IndexError deep in the forward pass); say so when the pair is loaded.
    Fewer tokens are fine (vocabularies are often padded to a multiple of 8 rows)."""
    found = tokenizer_vocab_size(directory)
    if found is not None and found[1] > config.vocab_size:
        path, n = found
        raise BertctlError(
            f"{path} has {n:,} tokens but {Path(directory) / 'config.json'} gives the model {config.vocab_size:,} "
            f"word embeddings (vocab_size): ids from {config.vocab_size:,} on have no embedding; put back the "
            f"vocabulary this model was trained with (at most {config.vocab_size:,} tokens)")


def read_state_dict(directory: str | Path) -> dict[str, torch.Tensor]:
    """Tensors of ``model.safetensors`` (preferred) or ``pytorch_model.bin``."""
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    path = directory / WEIGHTS
    try:
        if path.exists():
            return load_file(path)
        legacy = directory / LEGACY_WEIGHTS
        if legacy.exists():
            return torch.load(legacy, map_location="cpu", weights_only=True)
    except (SafetensorError, RuntimeError, OSError) as e:
        raise BertctlError(f"{path}: unreadable weights ({str(e).splitlines()[0]})") from None
    raise BertctlError(f"{directory}: no {WEIGHTS} or {LEGACY_WEIGHTS}")


def _normalise_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """TF-era names (LayerNorm.gamma/beta) to current ones; drop non-learned buffers."""
    out = {}
    for name, tensor in state.items():
        if name.endswith(IGNORED_SUFFIXES):
            continue
        name = name.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        out[name] = tensor
    return out


def _match(model: BertPreTrainedModel, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename checkpoint tensors to ``model``'s parameter names (adding or removing ``bert.``)."""
    from bertctl.model import BertModel

    wants_prefix = not isinstance(model, BertModel)
    out = {}
    for name, tensor in state.items():
        has_prefix = name.startswith("bert.")
        is_head = name.startswith(ALL_HEAD_PREFIXES)
        if wants_prefix and not has_prefix and not is_head:
            name = "bert." + name
        elif not wants_prefix and has_prefix:
            name = name[len("bert."):]
        out[name] = tensor
    # The MLM decoder is tied to the word embeddings, and its bias to cls.predictions.bias.
    out.pop("cls.predictions.decoder.weight", None)
    bias = out.pop("cls.predictions.decoder.bias", None)
    if bias is not None:
        out.setdefault("cls.predictions.bias", bias)
    return out


def summary(names: list[str], first: int = 4) -> str:
    """A list for a one-line error: all of a short one, else the first few and how many (a foreign checkpoint can
    miss every one of a model's hundreds of tensors)."""
    if len(names) <= first + 1:
        return ", ".join(names)
    return f"{len(names)} tensors ({', '.join(names[:first])}, and {len(names) - first} more)"


def load_state(model: M, state: dict[str, torch.Tensor], *, fresh_heads: bool = False, source: str = "checkpoint") -> M:
    """Copy ``state`` into ``model`` with full checking; one error lists every problem."""
    from bertctl.model import BertModel

    state = _match(model, _normalise_names(state))
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("decoder.weight")}
    missing = [k for k in own if k not in state]
    unexpected = [k for k in state if k not in own]
    pooler = "pooler." if isinstance(model, BertModel) else "bert.pooler."
    # Tensors the caller may initialise fresh: this class's head (e.g. a classifier on a base model),
    # and the pooler when the checkpoint has none at all (a masked-LM-only model, bertctl's or
    # transformers' BertForMaskedLM: nothing trained one), as transformers does.
    if fresh_heads:
        missing = [k for k in missing if not k.startswith(model.head_prefixes)]
        if not any(k.startswith(pooler) for k in state):
            missing = [k for k in missing if not k.startswith(pooler)]
    # Tensors safe to drop: another class's head, or a pooler this class does not have.
    unexpected = [
        k for k in unexpected
        if not (k.startswith(ALL_HEAD_PREFIXES) and not k.startswith(model.head_prefixes))
        and not (k.startswith(pooler) and not model.has_pooler)
    ]
    misshaped = [
        f"{k} {tuple(state[k].shape)} vs {tuple(own[k].shape)}" for k in own if k in state and state[k].shape != own[k].shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {summary(missing)}")
    if unexpected:
        problems.append(f"unexpected {summary(unexpected)}")
    if misshaped:
        problems.append(f"mis-shaped {summary(misshaped)}")
    if problems:
        raise BertctlError(f"{source}: weights do not fit {type(model).__name__}: " + "; ".join(problems))
    loadable = {k: v for k, v in state.items() if k in own}
    if not any(t.is_meta for t in own.values()):
        model.load_state_dict(loadable, strict=False)
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        return model
    # Built on the meta device (``on_meta``): take the checkpoint's tensors as they are, in the model's
    # dtypes; then allocate and initialise only what it did not have (a fresh head), as the model would.
    model.load_state_dict({k: v.to(own[k].dtype).contiguous() for k, v in loadable.items()}, strict=False, assign=True)
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    for module in model.modules():
        if any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False))):
            module.to_empty(device="cpu", recurse=False)
            model._init_module(module)
    return model


def on_meta(build: Callable[[], M]) -> M:
    """``build()`` on the meta device: the modules and their shapes without memory or random draws, for
    ``load_state`` to fill, rather than drawing weights on the CPU that the checkpoint then replaces
    (``benchmarks/results/load-cpu-626e5db.json``).

    ``torch.nn.init``'s functions do nothing meanwhile: on the meta device ``normal_`` runs through
    torch's Python reference ops, whose first call imports torch._dynamo, a second of every ``embed`` or
    ``eval`` start-up on a small machine, for values nobody reads."""
    import torch

    init = torch.nn.init
    saved = {name: getattr(init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in saved:
            setattr(init, name, _leave)
        with torch.device("meta"):
            return build()
    finally:
        for name, fn in saved.items():
            setattr(init, name, fn)


_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_",
                   "xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_",
                   "sparse_")


def _leave(tensor, *args, **kwargs):
    return tensor


def load_pretrained(model_cls: type[M], directory: str | Path, *, fresh_heads: bool = False,
                    runtime: Runtime | None = None, **config_overrides) -> M:
    """Build ``model_cls`` from a checkpoint directory (bertctl's or Hugging Face's), run by ``runtime``
    (None: ``bertctl.runtime.default``).

    ``fresh_heads=True`` initialises this class's task head when the checkpoint has none;
    any other missing, unexpected or mis-shaped tensor is an error listing them all.
    """
    directory = Path(directory)
    config = load_config(directory, **config_overrides)
    state = read_state_dict(directory)
    return load_state(on_meta(lambda: model_cls(config, runtime)), state, fresh_heads=fresh_heads, source=str(directory))


def save_pretrained(model: BertPreTrainedModel, directory: str | Path, tokenizer=None) -> None:
    """Write ``config.json``, ``model.safetensors`` (and tokenizer files) as one atomic directory."""
    from safetensors.torch import save_file

    config = model.config
    architectures = [type(model).__name__]
    state = {
        k: v.detach().to("cpu").contiguous()
        for k, v in model.state_dict().items()
        if not k.endswith("decoder.weight")  # tied to the word embeddings, as transformers saves it
    }
    d = config.to_dict()
    d["architectures"] = architectures
    with atomic_dir(directory) as tmp:
        (tmp / "config.json").write_text(json.dumps(d, indent=2) + "\n", encoding="utf-8")
        with write_errors(Path(directory) / WEIGHTS):
            save_file(state, str(tmp / WEIGHTS), metadata={"format": "pt"})
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        faults.point("final-save")
