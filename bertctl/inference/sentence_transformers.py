"""A sentence-transformers model directory, read for ``embed``: what ``SentenceTransformer.encode`` does.

Such a directory (all-MiniLM-L6-v2, LaBSE, the paraphrase and msmarco models) lists its modules in
``modules.json``: a BERT encoder (``Transformer``, or ``BERT`` in the oldest layouts), the token
``Pooling``, optionally ``Dense`` layers, and ``Normalize``.  Their settings are ``embed``'s defaults
for that checkpoint, so that ``bertctl embed --model DIR`` gives sentence-transformers' vectors with
no flags; a flag given overrides its setting.  What is read, and from where:

- the encoder's directory: the ``Transformer`` module's ``path`` ("" = the checkpoint itself);
- the pooling modes: ``1_Pooling/config.json``, both the ``pooling_mode`` list (sentence-transformers
  5 and later) and the older ``pooling_mode_*_tokens`` booleans, concatenated in that library's order;
- ``Dense``: a linear layer and its activation on the pooled vector (``model.safetensors`` or
  ``pytorch_model.bin``), in module order;
- ``Normalize``: L2 normalisation, which must come last;
- the token limit: ``max_seq_length`` in the encoder's ``sentence_bert_config.json``, else its
  tokenizer's ``model_max_length`` (at most the model's positions);
- lowercasing (``do_lower_case`` there) and a default prompt (``default_prompt_name`` in
  ``config_sentence_transformers.json``, whose other ``prompts`` embed's ``--prompt-name`` picks), both
  applied to the text before tokenising.

Anything else (a module type embed cannot compute, prompts excluded from pooling, a residual Dense) is
refused with a line naming the file, rather than silently giving other vectors, unless ``--pooling``
or ``--layers`` asks for the encoder's own pooled vectors instead.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bertctl.errors import BertctlError

# sentence-transformers' pooling mode names -> embed's --pooling names, in the order in which that
# library concatenates several modes (its legacy booleans map to the same order).
POOLING_NAMES = {"cls": "cls", "max": "max", "mean": "mean", "mean_sqrt_len_tokens": "mean-sqrt-len",
                 "weightedmean": "weighted-mean", "lasttoken": "last"}
LEGACY_POOLING_KEYS = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max",
                       "pooling_mode_mean_tokens": "mean", "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                       "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
# Dense activations by the class name sentence-transformers saves.
ACTIVATIONS = {"Tanh": "tanh", "Identity": "identity", "ReLU": "relu", "GELU": "gelu", "Sigmoid": "sigmoid"}
# A tokenizer_config.json without a real limit holds a huge sentinel (1e30) as model_max_length.
NO_LIMIT = 1_000_000


@dataclass(frozen=True)
class Dense:
    """y = activation(x W^T + b) on the pooled vector: sentence-transformers' ``Dense`` module."""

    weight: np.ndarray  # (out, in) float32
    bias: np.ndarray | None  # (out,) float32
    activation: str  # a value of ACTIVATIONS
    path: Path

    def __call__(self, x: np.ndarray) -> np.ndarray:
        """x (N, in) float32 -> (N, out) float32."""
        if x.shape[-1] != self.weight.shape[1]:
            raise BertctlError(f"{self.path}: the Dense module takes {self.weight.shape[1]} features; the checkpoint's "
                               f"pooling gives {x.shape[-1]}")
        y = x @ self.weight.T
        if self.bias is not None:
            y += self.bias
        if self.activation == "tanh":
            return np.tanh(y)
        if self.activation == "relu":
            return np.maximum(y, 0)
        if self.activation == "sigmoid":
            return 1 / (1 + np.exp(-y))
        if self.activation == "gelu":  # torch.nn.GELU's default, the exact erf form (numpy has no erf)
            import torch

            return torch.nn.functional.gelu(torch.from_numpy(y)).numpy()
        return y

    def describe(self) -> str:
        return f"Dense {self.weight.shape[1]}->{self.weight.shape[0]} {self.activation}"


@dataclass(frozen=True)
class SentenceTransformerModules:
    encoder: Path  # the directory holding the BERT encoder and its tokenizer
    pooling: str | None  # embed's --pooling value: one mode or several joined by ","; None if unsupported
    dense: tuple[Dense, ...] = ()
    normalize: bool = False
    max_length: int | None = None  # None: the model's positions
    lowercase: bool = False
    prompt: str = ""  # the default prompt (default_prompt_name's), "" if none
    prompts: tuple[tuple[str, str], ...] = ()  # every named prompt, as (name, text)
    prompts_file: Path | None = None
    include_prompt: bool = True  # False: the pooling leaves out the prompt's tokens (not supported)
    unsupported: str | None = None  # why embed cannot compute the checkpoint's own pipeline, if it cannot

    def describe(self) -> str:
        parts = [f"{self.pooling} pooling" if self.pooling else "pooling embed cannot compute"]
        parts += [d.describe() for d in self.dense]
        parts += ["L2-normalised"] if self.normalize else []
        parts += [f"{self.max_length} tokens"] if self.max_length else []
        parts += ["lowercased"] if self.lowercase else []
        parts += [f"prompt {self.prompt!r}"] if self.prompt else []
        return ", ".join(parts)


def _read_json(path: Path) -> dict | list:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BertctlError(f"{path}: missing (named by the sentence-transformers modules.json beside it)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BertctlError(f"{path}: not valid JSON ({e})") from None


def _pooling(path: Path) -> str:
    config = _read_json(path / "config.json")
    modes = config.get("pooling_mode")
    if modes is None:
        modes = [mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key)] or ["mean"]
    elif isinstance(modes, str):
        modes = [modes]
    unknown = [m for m in modes if m not in POOLING_NAMES]
    if unknown:
        raise BertctlError(f"{path / 'config.json'}: pooling mode {unknown[0]!r} is not one embed computes "
                           f"({', '.join(POOLING_NAMES)})")
    return ",".join(POOLING_NAMES[m] for m in modes)


def _dense(path: Path) -> Dense:
    config = _read_json(path / "config.json")
    if config.get("use_residual"):
        raise BertctlError(f"{path / 'config.json'}: a Dense with use_residual is not supported by embed")
    name = str(config.get("activation_function", "torch.nn.modules.activation.Tanh")).rsplit(".", 1)[-1]
    if name not in ACTIVATIONS:
        raise BertctlError(f"{path / 'config.json'}: Dense activation {name!r} is not supported by embed "
                           f"({', '.join(ACTIVATIONS)})")
    if (path / "model.safetensors").exists():
        from safetensors.numpy import load_file

        state = load_file(str(path / "model.safetensors"))
    elif (path / "pytorch_model.bin").exists():
        import torch

        state = {k: v.float().numpy() for k, v in torch.load(path / "pytorch_model.bin", map_location="cpu",
                                                               weights_only=True).items()}
    else:
        raise BertctlError(f"{path}: no model.safetensors or pytorch_model.bin for the Dense module")
    try:
        weight = np.asarray(state["linear.weight"], np.float32)
    except KeyError:
        raise BertctlError(f"{path}: the Dense weights have no 'linear.weight'") from None
    bias = state.get("linear.bias")
    expected = (int(config.get("out_features", weight.shape[0])), int(config.get("in_features", weight.shape[1])))
    if weight.shape != expected:
        raise BertctlError(f"{path}: Dense weight of shape {tuple(weight.shape)}, config.json says {expected}")
    return Dense(weight, None if bias is None else np.asarray(bias, np.float32), ACTIVATIONS[name], path)


def _token_limit(encoder: Path) -> int | None:
    st_config = encoder / "sentence_bert_config.json"
    if st_config.exists():
        limit = _read_json(st_config).get("max_seq_length")
        if limit is not None:
            return int(limit)
    tok_config = encoder / "tokenizer_config.json"
    if tok_config.exists():
        limit = _read_json(tok_config).get("model_max_length")
        if isinstance(limit, (int, float)) and 0 < limit < NO_LIMIT:
            return int(limit)
    return None


def _listing(directory: Path) -> tuple[list[str], list[Path]] | None:
    """modules.json's module types (class names) and folders, or None without one; the first must be
    the encoder."""
    listing = directory / "modules.json"
    if not listing.exists():
        return None
    modules = _read_json(listing)
    if not isinstance(modules, list) or not all(isinstance(m, dict) and "type" in m for m in modules):
        raise BertctlError(f"{listing}: expected a list of modules with a 'type' each")
    kinds = [str(m["type"]).rsplit(".", 1)[-1] for m in modules]
    if not kinds or kinds[0] not in ("Transformer", "BERT"):
        raise BertctlError(f"{listing}: the first module must be the Transformer encoder, not {kinds[:1] or 'none'}")
    return kinds, [directory / str(m.get("path", "")) for m in modules]


def encoder_dir(directory: str | Path) -> Path | None:
    """The folder of a sentence-transformers checkpoint's encoder (itself, or 0_Transformer/ in the
    older layout), or None when ``directory`` has no ``modules.json``."""
    found = _listing(Path(directory))
    return None if found is None else found[1][0]


def read_modules(directory: str | Path) -> SentenceTransformerModules | None:
    """The sentence-transformers pipeline of ``directory``, or None when it has no ``modules.json``.
    A pipeline embed cannot compute is kept as ``unsupported``, the line to stop with when the
    checkpoint's own pooling is asked for."""
    directory = Path(directory)
    found = _listing(directory)
    if found is None:
        return None
    kinds, paths = found
    listing = directory / "modules.json"
    encoder, pooling, dense, normalize, unsupported = paths[0], None, [], False, None
    if len(kinds) < 2 or kinds[1] != "Pooling":
        unsupported = (f"{listing}: no Pooling module after the encoder (found "
                       f"{kinds[1] if len(kinds) > 1 else 'none'}); pass --pooling")
    else:
        try:
            pooling = _pooling(paths[1])
        except BertctlError as e:
            unsupported = f"{e}; pass --pooling"
    for kind, path in zip(kinds[2:], paths[2:]):
        if unsupported:
            break
        if normalize:
            unsupported = f"{listing}: a {kind} module after Normalize is not supported by embed; pass --pooling"
        elif kind == "Dense":
            try:
                dense.append(_dense(path))
            except BertctlError as e:
                unsupported = f"{e}; pass --pooling"
        elif kind == "Normalize":
            normalize = True
        else:
            unsupported = (f"{listing}: module {kind} ({path.name}) is not one embed computes (Transformer, "
                           "Pooling, Dense, Normalize); pass --pooling to embed with the encoder's own pooled "
                           "vectors instead")
    st_config = encoder / "sentence_bert_config.json"
    lowercase = bool(_read_json(st_config).get("do_lower_case", False)) if st_config.exists() else False
    top_config = directory / "config_sentence_transformers.json"
    top = _read_json(top_config) if top_config.exists() else {}
    prompts = {str(k): str(v) for k, v in (top.get("prompts") or {}).items()}
    name = top.get("default_prompt_name")
    if name and name not in prompts:
        raise BertctlError(f"{top_config}: default_prompt_name {name!r} is not among its prompts")
    include_prompt = bool(pooling is None or _read_json(paths[1] / "config.json").get("include_prompt", True))
    return SentenceTransformerModules(encoder=encoder, pooling=pooling, dense=tuple(dense), normalize=normalize,
                                      unsupported=unsupported,
                                      max_length=_token_limit(encoder), lowercase=lowercase,
                                      prompt=prompts[name] if name else "", prompts=tuple(prompts.items()),
                                      prompts_file=top_config, include_prompt=include_prompt)
