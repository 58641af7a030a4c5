"""A SentencePiece model (unigram or BPE) behind bertctl's ``Tokenizer`` interface.

ALBERT's ``spiece.model``, XLM-R's ``sentencepiece.bpe.model``, or a model trained by
``bertctl tokenize train --algorithm unigram|bpe``. The model's own normaliser is the whole
normalisation, so ids are exactly SentencePiece's; BERT's five specials are pieces of the model.
"""
from __future__ import annotations

import bisect
import hashlib
import itertools
import os
from pathlib import Path
from typing import Iterable

from bertctl.errors import BertctlError
from bertctl.text.base import Tokenizer, read_json

SPM_MODEL_FILES = ("spiece.model", "sentencepiece.bpe.model")  # ALBERT/T5's name, XLM-R/CamemBERT's name
SPM_WORD_START = "\u2581"  # "▁": SentencePiece's mark of a word start (the space before it)
# Where each BERT special comes from in a SentencePiece vocabulary, first match wins, after a name
# that tokenizer_config.json gives (ALBERT's layout is <pad> <unk> [CLS] [SEP] [MASK] = ids 0-4, which
# is also what ``bertctl tokenize train --algorithm unigram|bpe`` writes). "pad"/"unk"/"bos"/"eos" stand
# for the model's own pad, unknown, begin- and end-of-sentence pieces.
SPM_SPECIAL_CANDIDATES = {
    "cls_token": ("[CLS]", "<cls>", "bos"),
    "sep_token": ("[SEP]", "<sep>", "eos"),
    "pad_token": ("pad", "<pad>", "[PAD]"),
    "mask_token": ("[MASK]", "<mask>"),
    "unk_token": ("unk",),
}


def sentencepiece_module():
    """The ``sentencepiece`` package, imported when first needed; an error saying how to install it."""
    try:
        import sentencepiece
    except ImportError:  # a declared dependency; only a broken install lacks it
        raise BertctlError("the sentencepiece package is not installed (pip install sentencepiece)") from None
    return sentencepiece


class SentencePieceTokenizer(Tokenizer):
    """A SentencePiece model (unigram or BPE) as a BERT tokenizer; ids equal ``sp.encode(text)``.

    The model file's own normaliser (e.g. NFKC, case folding) is the whole normalisation: no text
    processing happens before or after SentencePiece, so ids are exactly SentencePiece's. Ids are the
    model's own (no fairseq offset). The five BERT specials are pieces of the model, found by
    ``SPM_SPECIAL_CANDIDATES`` (or the names in tokenizer_config.json); a model lacking one is an
    error. Character offsets come from SentencePiece's alignment to the original text, with the
    white space a piece's ``▁`` stands for left out (as ``transformers``' trimmed offsets), so
    ``text[start:end]`` is the text the piece came from. A piece without a leading ``▁`` continues
    the word before it (whole-word masking).
    """

    kind = "sentencepiece"

    def __init__(self, model: bytes | str | os.PathLike, *, special_tokens: dict[str, str] | None = None,
                 model_max_length: int = 512, filename: str | None = None):
        if isinstance(model, (bytes, bytearray)):
            source, proto = filename or "SentencePiece model", bytes(model)
        else:
            path = Path(model)
            if not path.is_file():
                raise BertctlError(f"{path}: SentencePiece model not found" if not path.exists()
                                   else f"{path}: not a file (expected a SentencePiece .model)")
            source, proto = str(path), path.read_bytes()
            filename = filename or path.name
        # Saved under its own name when it is one of the two conventional ones (transformers looks for those).
        self.model_filename = filename if filename in SPM_MODEL_FILES else SPM_MODEL_FILES[0]
        self.model_proto = proto
        self.model_sha256 = hashlib.sha256(proto).hexdigest()
        self._source = source
        self._sp = self._load(proto, source)
        sp = self._sp
        self.ids_to_tokens = [sp.id_to_piece(i) for i in range(sp.get_piece_size())]
        self.vocab = {tok: i for i, tok in enumerate(self.ids_to_tokens)}
        self.model_max_length = int(model_max_length)
        self.special_tokens = self._special_tokens(special_tokens or {})
        self.pad_token_id = self.vocab[self.special_tokens["pad_token"]]
        self.unk_token_id = self.vocab[self.special_tokens["unk_token"]]
        self.cls_token_id = self.vocab[self.special_tokens["cls_token"]]
        self.sep_token_id = self.vocab[self.special_tokens["sep_token"]]
        self.mask_token_id = self.vocab[self.special_tokens["mask_token"]]
        self.all_special_ids = frozenset(self.vocab[t] for t in self.special_tokens.values())
        self._spaces: dict[str, bool] = {}
        self._starts_word = tuple(tok.startswith(SPM_WORD_START) for tok in self.ids_to_tokens)
        self._continues = tuple(
            not tok.startswith(SPM_WORD_START) and not sp.is_control(i) for i, tok in enumerate(self.ids_to_tokens))

    @staticmethod
    def _load(proto: bytes, source: str):
        sp = sentencepiece_module().SentencePieceProcessor()
        try:
            sp.LoadFromSerializedProto(proto)
        except (RuntimeError, OSError) as e:
            raise BertctlError(f"{source}: not a SentencePiece model ({str(e).strip() or 'unreadable'})") from None
        return sp

    def __getstate__(self) -> dict:
        # The processor is rebuilt from the model bytes (worker processes get a copy).
        state = dict(self.__dict__)
        state["_sp"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._sp = self._load(self.model_proto, self._source)

    def _special_tokens(self, named: dict[str, str]) -> dict[str, str]:
        sp = self._sp
        own = {"pad": sp.pad_id(), "unk": sp.unk_id(), "bos": sp.bos_id(), "eos": sp.eos_id()}
        found: dict[str, str] = {}
        for role, candidates in SPM_SPECIAL_CANDIDATES.items():
            name = named.get(role)
            if name is not None:
                if name not in self.vocab:
                    raise BertctlError(f"{self._source}: {role} {name!r} (from tokenizer_config.json) is not a piece "
                                       "of the SentencePiece model")
                found[role] = name
                continue
            for c in candidates:
                if c in own:
                    if own[c] >= 0:
                        found[role] = self.ids_to_tokens[own[c]]
                        break
                elif c in self.vocab:
                    found[role] = c
                    break
            else:
                looked = ", ".join(f"the model's {c} piece" if c in own else c for c in candidates)
                raise BertctlError(
                    f"{self._source}: the SentencePiece model has no {role.removesuffix('_token')} piece (looked for "
                    f"{looked}); bertctl needs [CLS], [SEP], pad, [MASK] and unknown pieces inside the model "
                    "(as ALBERT's spiece.model, or one from bertctl tokenize train --algorithm unigram)")
        return found

    @property
    def continues_word(self) -> tuple[bool, ...]:
        """Pieces without a leading ``▁`` (and not control symbols such as [CLS]) continue a word."""
        return self._continues

    @property
    def model_type(self) -> str | None:
        """"unigram", "bpe", "word" or "char" from the model's trainer spec; None without protobuf."""
        try:
            from sentencepiece import sentencepiece_model_pb2
        except ImportError:
            return None
        m = sentencepiece_model_pb2.ModelProto()
        m.ParseFromString(self.model_proto)
        return sentencepiece_model_pb2.TrainerSpec.ModelType.Name(m.trainer_spec.model_type).lower()

    # ------------------------------------------------------------------ files
    @classmethod
    def from_model_file(cls, path: str | os.PathLike, **kw) -> "SentencePieceTokenizer":
        return cls(path, **kw)

    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike) -> "SentencePieceTokenizer":
        """A directory holding ``spiece.model`` or ``sentencepiece.bpe.model`` (the first found), with the
        special-token names and ``model_max_length`` of its ``tokenizer_config.json`` when present."""
        directory = Path(directory)
        model = find_spm_model(directory)
        if model is None:
            raise BertctlError(f"{directory}: no {' or '.join(SPM_MODEL_FILES)} in this directory")
        kw: dict = {}
        config_path = directory / "tokenizer_config.json"
        if config_path.is_file():
            config = read_json(config_path)
            names = {}
            for role in SPM_SPECIAL_CANDIDATES:
                value = config.get(role)
                if isinstance(value, dict):  # transformers' AddedToken form
                    value = value.get("content")
                if isinstance(value, str):
                    names[role] = value
            kw["special_tokens"] = names
            max_len = config.get("model_max_length")
            if isinstance(max_len, int) and 0 < max_len < 1_000_000:  # see BertTokenizer.from_pretrained
                kw["model_max_length"] = max_len
        return cls(model, **kw)

    def save_pretrained(self, directory: str | os.PathLike) -> list[str]:
        """Copy the model file and write ``tokenizer_config.json`` and ``special_tokens_map.json``.

        The config names the model file and says ``"tokenizer_type": "sentencepiece"``. For a unigram
        model it also names ``AlbertTokenizer``, which ``transformers`` loads with the same ids except
        that it rewrites ``````/``''`` to ``"`` (ALBERT's preprocessing); ``transformers`` has no class
        for a BPE model without fairseq's id offset, so none is named then. Returns the file names.
        """
        from bertctl.io import atomic_open, write_json

        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        with atomic_open(directory / self.model_filename, "wb") as f:
            f.write(self.model_proto)
        write_json(directory / "tokenizer_config.json", self.config())
        write_json(directory / "special_tokens_map.json", dict(self.special_tokens))
        return [self.model_filename, "tokenizer_config.json", "special_tokens_map.json"]

    def config(self) -> dict:
        """The ``tokenizer_config.json`` content (also what data manifests store)."""
        config: dict = {"tokenizer_type": self.kind, "sentencepiece_model": self.model_filename,
                        "sentencepiece_sha256": self.model_sha256, "model_max_length": self.model_max_length}
        if self.model_type == "unigram":
            # transformers' AlbertTokenizer is a unigram model; no lower-casing or accent stripping there:
            # SentencePiece's own normaliser is the whole normalisation, as in bertctl.
            config.update(tokenizer_class="AlbertTokenizer", do_lower_case=False, keep_accents=True,
                          bos_token=self.special_tokens["cls_token"], eos_token=self.special_tokens["sep_token"])
        config.update(self.special_tokens)
        return config

    # ------------------------------------------------------------------ tokenisation
    def _encode_text(self, text: str, with_offsets: bool) -> tuple[list[int], list[tuple[int, int]] | None]:
        if not isinstance(text, str):
            raise BertctlError(f"expected text (str), got {type(text).__name__}")
        if not with_offsets:
            return self._sp.encode(text), None
        pieces = [(p.id, p.begin, p.end) for p in _spm_proto(self._sp, text).pieces]
        ids = [i for i, _, _ in pieces]
        if not text.isascii():  # SentencePiece aligns in UTF-8 bytes: byte offset -> characters before it
            ends = list(itertools.accumulate(len(c.encode("utf-8", "surrogatepass")) for c in text))
            pieces = [(i, bisect.bisect_right(ends, a), bisect.bisect_right(ends, b)) for i, a, b in pieces]
        offsets = []
        starts_word = self._starts_word
        for i, a, b in pieces:
            if starts_word[i]:  # the white space "▁" stands for is not the piece's text
                while a < b and (text[a] == " " or self._is_space(text[a])):
                    a += 1
            offsets.append((a, b))
        return ids, offsets

    def _is_space(self, c: str) -> bool:
        """Whether the model's normaliser turns ``c`` into a word boundary (cached per character)."""
        hit = self._spaces.get(c)
        if hit is None:
            hit = self._spaces[c] = c.isspace() and self._sp.encode("a" + c + "a") == self._sp.encode("a a")
        return hit

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """SentencePiece's decode (``▁`` becomes a space); kept specials appear as their pieces, space-separated."""
        if hasattr(ids, "tolist"):
            ids = ids.tolist()
        ids = [int(i) for i in ids]
        self.convert_ids_to_tokens(ids)  # range check
        if skip_special_tokens:
            return self._sp.decode([i for i in ids if i not in self.all_special_ids])
        parts: list[str] = []
        run: list[int] = []
        for i in [*ids, None]:
            if i is None or i in self.all_special_ids:
                if run:
                    parts.append(self._sp.decode(run))
                    run = []
                if i is not None:
                    parts.append(self.ids_to_tokens[i])
            else:
                run.append(i)
        return " ".join(parts)


def _spm_proto(sp, text: str):
    """SentencePiece's encoding with alignment (pieces with id, begin and end bytes)."""
    try:
        return sp.encode(text, out_type="proto")
    except ValueError:  # sentencepiece 0.2.0 calls it immutable_proto
        return sp.encode(text, out_type="immutable_proto")


def find_spm_model(directory: str | os.PathLike) -> Path | None:
    """The SentencePiece model file of a directory (``spiece.model``, then ``sentencepiece.bpe.model``)."""
    for name in SPM_MODEL_FILES:
        path = Path(directory) / name
        if path.is_file():
            return path
    return None
