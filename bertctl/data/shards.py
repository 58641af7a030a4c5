"""Shard format: one ``.npy`` file per shard holding a structured array, one record per instance.

Record fields (S = max_seq_length, P = max_predictions_per_seq), little-endian:

=====================  ============================  ==========================================
field                  dtype, shape                  meaning
=====================  ============================  ==========================================
``input_ids``          uint16 (int32 if V >= 65536),  [CLS] A [SEP] B [SEP], [PAD]=0 after
                       (S,)                          ``length``; masked when masking is static
``token_type_ids``     uint8 (S,)                    0 for [CLS] A [SEP], 1 for B [SEP], 0 pad
``length``             uint16                        real tokens (attention mask = first length)
``masked_positions``   uint16 (P,)                   ascending; 0 ([CLS], never masked) = unused
``masked_lm_labels``   like input_ids (P,)           original token at each position
``next_sentence_label`` uint8                        1: B is random, 0: B is the real next
=====================  ============================  ==========================================

Shards built with dynamic masking have no ``masked_*`` fields: the loader masks.
Shards built for the masked-LM-only objective (``--objective mlm``) hold
``[CLS] A [SEP]``, one segment (``token_type_ids`` all 0), and no
``next_sentence_label`` field.
A ``.npy`` file is memory-mappable (``np.load(mmap_mode="r")``) with no extra
dependency, and one file per shard makes the "write to a temporary name,
rename when complete" rule a single rename.  ``manifest.json`` lists every
shard with its instance count, byte size and sha256.
"""
from __future__ import annotations

import hashlib
import io
import itertools
from pathlib import Path

import numpy as np

from bertctl import faults
from bertctl.io import atomic_path

from .instances import Instance

FORMAT_NAME = "bertctl-pretraining-data"
FORMAT_VERSION = 1


def id_dtype(vocab_size: int) -> np.dtype:
    return np.dtype("<u2") if vocab_size < 65536 else np.dtype("<i4")


def record_dtype(max_seq_length: int, max_predictions: int, vocab_size: int, dynamic: bool,
                 nsp: bool = True) -> np.dtype:
    ids = id_dtype(vocab_size)
    fields = [
        ("input_ids", ids, (max_seq_length,)),
        ("token_type_ids", "u1", (max_seq_length,)),
        ("length", "<u2"),
    ]
    if not dynamic:
        fields += [("masked_positions", "<u2", (max_predictions,)), ("masked_lm_labels", ids, (max_predictions,))]
    if nsp:
        fields.append(("next_sentence_label", "u1"))
    return np.dtype(fields)


def to_records(instances: list[Instance], dtype: np.dtype) -> np.ndarray:
    """Fixed-width records from instances (zero padded), filled with whole-array scatters."""
    out = np.zeros(len(instances), dtype=dtype)
    if not instances:
        return out
    S = out["input_ids"].shape[1]
    col = np.arange(S)[None, :]
    lengths = np.fromiter((len(i.tokens) for i in instances), dtype=np.int64, count=len(instances))
    len_a = np.fromiter((i.len_a for i in instances), dtype=np.int64, count=len(instances))
    real = col < lengths[:, None]
    ids = np.zeros((len(instances), S), dtype=out.dtype["input_ids"].base)
    ids[real] = np.fromiter(itertools.chain.from_iterable(i.tokens for i in instances), dtype=np.int64,
                            count=int(lengths.sum()))  # row-major order = instance by instance
    out["input_ids"] = ids
    out["token_type_ids"] = (col >= len_a[:, None] + 2) & real
    out["length"] = lengths
    if "next_sentence_label" in dtype.names:
        out["next_sentence_label"] = [i.is_random_next for i in instances]
    if "masked_positions" in dtype.names:
        for r, inst in enumerate(instances):
            k = len(inst.masked_positions)
            if k:
                out["masked_positions"][r, :k] = inst.masked_positions
                out["masked_lm_labels"][r, :k] = inst.masked_labels
    return out


def npy_bytes(array: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def write_shard(path: Path, array: np.ndarray) -> dict:
    """Write one shard atomically; returns its manifest entry."""
    data = npy_bytes(array)
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
        faults.point("write")  # written under its temporary name, not yet renamed
    return {"file": path.name, "num_instances": int(len(array)), "bytes": len(data),
            "sha256": hashlib.sha256(data).hexdigest()}


def file_sha256(path: Path, block: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
    return h.hexdigest()


def vocab_sha256(tokens: list[str]) -> str:
    """sha256 of the vocabulary as a vocab.txt: one token per line, UTF-8, '\\n' after each
    (equals ``sha256sum vocab.txt`` of a standard file)."""
    return hashlib.sha256("".join(t + "\n" for t in tokens).encode("utf-8")).hexdigest()
