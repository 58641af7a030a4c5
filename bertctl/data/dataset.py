"""``PretrainingData``: the reader of a ``bertctl build-data`` folder's memory-mapped shards.

It gives records by global instance index (``records``), an epoch's instance order drawn from
``(seed, epoch)`` (``permutation``) and a batch of instances (``collate``); the batch iterators
over it are ``bertctl.data.batching.pretraining_batches`` (the plain epoch order) and
``bucketed_batches``.  Shards built with dynamic masking are masked here, from
``(seed, epoch, instance index)``: new masks every epoch, the same masks on every rerun.

The data's objective (``objective``: ``"mlm-nsp"`` pairs with NSP labels, or ``"mlm"``
one-segment instances without them) comes from the manifest; folders built before
objectives existed are ``"mlm-nsp"``.  Batches of ``"mlm"`` data have no
``next_sentence_label``.

Held-out data: ``build_data(..., holdout_fraction=f)`` writes a separate "eval"
split (whole documents, never in "train"); open it with
``PretrainingData(dir, split="eval")`` for periodic evaluation.

Integrity: the manifest, the vocabulary hash (``vocab=``) and every shard's
size are checked on open; shard sha256 checksums are checked on open too when
the split is at most ``eager_verify_bytes`` (2 GiB), otherwise the first time a
shard is read, always before its data is used.  A mismatch is a
``BertctlError`` naming the shard.
"""
from __future__ import annotations

import json
import os
import random
from pathlib import Path
import numpy as np
import torch

from bertctl.errors import BertctlError

from .build import derive_seed
from .config import OBJECTIVES
from .instances import SpecialIds, mask_batch, mask_tokens, mix64
from .shards import FORMAT_NAME, FORMAT_VERSION, file_sha256, record_dtype, vocab_sha256

__all__ = ["PretrainingData"]


def _vocab_tokens(vocab) -> list[str]:
    """Vocabulary tokens from a vocab.txt path, a folder holding one, a tokenizer, or a token list."""
    if hasattr(vocab, "ids_to_tokens"):
        return list(vocab.ids_to_tokens)
    if isinstance(vocab, (list, tuple)):
        return list(vocab)
    path = Path(vocab)
    if path.is_dir():
        path = path / "vocab.txt"
    if not path.is_file():
        raise BertctlError(f"{path}: vocabulary file not found")
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\r\n") for line in f]


def find_manifest(shard_dir: str | os.PathLike) -> Path:
    """``shard_dir``'s manifest, or one clear error when it is not a ``bertctl build-data`` folder."""
    path = Path(shard_dir) / "manifest.json"
    if not path.is_file():
        raise BertctlError(f"{Path(shard_dir)}: not a pretraining data folder (no manifest.json)")
    return path


class PretrainingData:
    """Pretraining instances from a ``bertctl build-data`` folder (see the module docstring)."""

    eager_verify_bytes = 2 << 30

    def __init__(self, shard_dir: str | os.PathLike, *, vocab=None, split: str = "train", verify: str = "auto"):
        self.dir = Path(shard_dir)
        manifest_path = find_manifest(shard_dir)
        try:
            self.manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise BertctlError(f"{manifest_path}: unreadable manifest ({e})") from None
        m = self.manifest
        if m.get("format") != FORMAT_NAME or m.get("version") != FORMAT_VERSION:
            raise BertctlError(f"{manifest_path}: not a {FORMAT_NAME} v{FORMAT_VERSION} manifest")
        tok = m["tokenizer"]
        if vocab is not None:
            digest = vocab_sha256(_vocab_tokens(vocab))
            if digest != tok["vocab_sha256"]:
                raise BertctlError(f"{self.dir}: built with a different vocabulary (sha256 {tok['vocab_sha256'][:12]}..., "
                                   f"{tok['vocab_size']} tokens) than the one given (sha256 {digest[:12]}...)")
        if split not in m["splits"]:
            raise BertctlError(f"{self.dir}: no {split!r} split (has {', '.join(m['splits'])}); "
                               "build with --holdout-fraction for an eval split")
        self.split = split
        self.max_seq_length = int(m["max_seq_length"])
        self.max_predictions = int(m["max_predictions"])
        self.vocab_size = int(tok["vocab_size"])
        self.dynamic_masking = bool(m["dynamic_masking"])
        self.objective = str(m.get("objective", "mlm-nsp"))
        if self.objective not in OBJECTIVES:
            raise BertctlError(f"{manifest_path}: unknown objective {self.objective!r} (this bertctl knows "
                               f"{', '.join(OBJECTIVES)})")
        self.pad_token_id = int(tok.get("pad_token_id", 0))
        cfg = m["data_config"]
        self._masking = dict(masked_lm_prob=cfg["masked_lm_prob"], max_predictions=self.max_predictions,
                             whole_word_mask=cfg["whole_word_mask"])
        self._special = None
        self._dtype = record_dtype(self.max_seq_length, self.max_predictions, self.vocab_size, self.dynamic_masking,
                                   nsp=self.nsp)

        self._shards = m["splits"][split]["shards"]
        for shard in self._shards:
            path = self.dir / shard["file"]
            if not path.is_file():
                raise BertctlError(f"{path}: shard listed in the manifest is missing")
            if path.stat().st_size != shard["bytes"]:
                raise BertctlError(f"{path}: shard is corrupted (size {path.stat().st_size} bytes, manifest says "
                                   f"{shard['bytes']})")
        counts = np.array([s["num_instances"] for s in self._shards], dtype=np.int64)
        self._offsets = np.concatenate([[0], np.cumsum(counts)])
        self.num_instances = int(self._offsets[-1])
        self._arrays: list[np.ndarray | None] = [None] * len(self._shards)
        self._verified = [False] * len(self._shards)
        if verify not in ("auto", "eager", "lazy"):
            raise ValueError(f"verify must be auto, eager or lazy, not {verify!r}")
        total = sum(s["bytes"] for s in self._shards)
        if verify == "eager" or (verify == "auto" and total <= self.eager_verify_bytes):
            for i in range(len(self._shards)):
                self._verify(i)

    @property
    def nsp(self) -> bool:
        """Whether instances are NSP pairs with labels (objective mlm-nsp)."""
        return self.objective == "mlm-nsp"

    def __len__(self) -> int:
        return self.num_instances

    def _verify(self, i: int) -> None:
        shard = self._shards[i]
        path = self.dir / shard["file"]
        if file_sha256(path) != shard["sha256"]:
            raise BertctlError(f"{path}: shard is corrupted (sha256 does not match the manifest)")
        self._verified[i] = True

    def _shard(self, i: int) -> np.ndarray:
        if self._arrays[i] is None:
            if not self._verified[i]:
                self._verify(i)
            path = self.dir / self._shards[i]["file"]
            try:
                array = np.load(path, mmap_mode="r", allow_pickle=False)
            except ValueError as e:
                raise BertctlError(f"{path}: shard is corrupted ({e})") from None
            if array.dtype != self._dtype or len(array) != self._shards[i]["num_instances"]:
                raise BertctlError(f"{path}: shard layout does not match the manifest")
            self._arrays[i] = array
        return self._arrays[i]

    def records(self, indices: np.ndarray) -> np.ndarray:
        """Raw records of the given global instance indices, in that order."""
        indices = np.asarray(indices, dtype=np.int64)
        out = np.empty(len(indices), dtype=self._dtype)
        shard_of = np.searchsorted(self._offsets, indices, side="right") - 1
        for s in np.unique(shard_of):
            sel = np.nonzero(shard_of == s)[0]
            local = indices[sel] - self._offsets[s]
            order = np.argsort(local, kind="stable")  # ascending reads from the memory map
            out[sel[order]] = self._shard(int(s))[local[order]]
        return out

    def steps_per_epoch(self, global_batch_size: int) -> int:
        return self.num_instances // global_batch_size  # drop_last

    def permutation(self, seed: int, epoch: int) -> np.ndarray:
        """The epoch's instance order, drawn from (seed, epoch); int32 while it fits (4 bytes an instance)."""
        dtype = np.int32 if self.num_instances < 2**31 else np.int64
        perm = np.arange(self.num_instances, dtype=dtype)
        np.random.default_rng([seed, epoch]).shuffle(perm)
        return perm

    def _special_ids(self) -> SpecialIds:
        if self._special is None:
            from bertctl.text import load_tokenizer  # the data folder holds the tokenizer it was built with

            tokens = _vocab_tokens(self.dir / "vocab.txt")
            if vocab_sha256(tokens) != self.manifest["tokenizer"]["vocab_sha256"]:
                raise BertctlError(f"{self.dir / 'vocab.txt'}: does not match the manifest's vocabulary hash")
            tok = self.manifest["tokenizer"]
            self._special = SpecialIds(cls=tok["cls_token_id"], sep=tok["sep_token_id"], mask=tok["mask_token_id"],
                                       vocab_size=len(tokens), continuation=load_tokenizer(self.dir).continues_word)
        return self._special

    def collate(self, indices: np.ndarray, *, seed: int = 0, epoch: int = 0) -> dict[str, torch.Tensor]:
        """One batch from global instance indices (masks drawn from (seed, epoch, index) when dynamic)."""
        rec = self.records(indices)
        lengths = rec["length"].astype(np.int64)
        input_ids = rec["input_ids"].astype(np.int64)
        S = self.max_seq_length
        if self.dynamic_masking:
            special = self._special_ids()
            P = self.max_predictions
            if self._masking["whole_word_mask"]:  # word structure: the per-instance procedure
                positions = np.zeros((len(rec), P), dtype=np.int64)
                labels = np.full((len(rec), P), -100, dtype=np.int64)
                for r, i in enumerate(indices):
                    n = int(lengths[r])
                    rng = random.Random(derive_seed(seed, epoch, int(i)))
                    masked, pos, lab = mask_tokens(input_ids[r, :n].tolist(), rng, special, **self._masking)
                    input_ids[r, :n] = masked
                    positions[r, : len(pos)] = pos
                    labels[r, : len(lab)] = lab
            else:  # vectorised; an instance's masks depend only on (seed, epoch, its index)
                seeds = mix64(np.uint64(derive_seed(seed, epoch)) ^ mix64(np.asarray(indices, dtype=np.uint64)))
                input_ids, positions, labels = mask_batch(input_ids, lengths, seeds, special,
                                                          masked_lm_prob=self._masking["masked_lm_prob"],
                                                          max_predictions=P)
                labels = np.where(positions > 0, labels, -100)
        else:
            positions = rec["masked_positions"].astype(np.int64)
            labels = np.where(positions > 0, rec["masked_lm_labels"].astype(np.int64), -100)
        attention_mask = (np.arange(S)[None, :] < lengths[:, None]).astype(np.int64)
        if self.pad_token_id != 0:
            input_ids[attention_mask == 0] = self.pad_token_id
        batch = {
            "input_ids": torch.from_numpy(np.ascontiguousarray(input_ids[:, :S])),
            "token_type_ids": torch.from_numpy(np.ascontiguousarray(rec["token_type_ids"][:, :S].astype(np.int64))),
            "attention_mask": torch.from_numpy(np.ascontiguousarray(attention_mask[:, :S])),
            "masked_positions": torch.from_numpy(positions),
            "masked_lm_labels": torch.from_numpy(labels),
        }
        if self.nsp:
            batch["next_sentence_label"] = torch.from_numpy(rec["next_sentence_label"].astype(np.int64))
        return batch
