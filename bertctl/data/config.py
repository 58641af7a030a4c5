"""``DataConfig``: everything that decides what ``build_data`` writes.

It is saved in every shard manifest, so a data directory says how it was made.
Defaults follow google-research/bert's create_pretraining_data.py.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

from bertctl.errors import BertctlError

from .documents import FORMATS

#: Pretraining objectives the data is built for: the paper's masked LM + next-sentence prediction
#: (pairs of segments), or masked LM alone (its "No NSP" ablation, section 5.1: one segment of whole
#: sentences packed to length, RoBERTa's DOC-SENTENCES).
OBJECTIVES = ("mlm-nsp", "mlm")


def default_max_predictions(max_seq_length: int) -> int:
    """15% of the sequence rounded up to a multiple of 4: 20 at 128 and 80 at 512, the
    values of the paper's recipes (no instance can use more than round(0.15 * S))."""
    return 4 * math.ceil(0.15 * max_seq_length / 4)


@dataclass
class DataConfig:
    objective: str = "mlm-nsp"  # one of OBJECTIVES
    format: str = "lines"  # lines | text | jsonl | wikiextractor | parquet | arrow (see bertctl.data.documents)
    text_field: str = "text"  # jsonl, parquet, arrow: the field holding the document text
    doc_separator: str | None = None  # text: a line equal to this ends a document
    pattern: str = "*"  # file-name pattern when an input is a folder
    max_seq_length: int = 128
    max_predictions_per_seq: int | None = None  # None: default_max_predictions(max_seq_length)
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    dupe_factor: int | None = None  # None: 10 for static masking (the reference), 1 for dynamic
    whole_word_mask: bool = False
    dynamic_masking: bool = False  # masks drawn by the loader from (seed, epoch, index)
    seed: int = 12345
    shard_size: int = 65536  # instances per shard file at most
    chunk_bytes: int = 1 << 19  # raw text per work unit
    # Random next segments (NSP label 1) come from excerpts of other documents: a uniform sample of
    # up to random_next_pool documents per split is kept (one excerpt of 16 * max_seq_length
    # characters each), and random_next_per_unit of them go to each work unit (0: the unit's own
    # documents, the earlier behaviour).  Unused for the mlm objective.
    random_next_pool: int = 4096
    random_next_per_unit: int = 32
    holdout_fraction: float = 0.0  # share of documents written to the "eval" split
    max_document_bytes: int = 16 << 20  # longer documents are cut at a sentence/paragraph break

    @property
    def nsp(self) -> bool:
        """Whether instances are NSP pairs (and random next segments are needed)."""
        return self.objective == "mlm-nsp"

    def resolved(self) -> "DataConfig":
        """A copy with the ``None`` defaults filled in, validated."""
        cfg = DataConfig(**asdict(self))
        if cfg.max_predictions_per_seq is None:
            cfg.max_predictions_per_seq = default_max_predictions(cfg.max_seq_length)
        if cfg.dupe_factor is None:
            cfg.dupe_factor = 1 if cfg.dynamic_masking else 10
        cfg.validate()
        return cfg

    def validate(self) -> None:
        def bad(name: str, why: str) -> BertctlError:
            return BertctlError(f"--{name.replace('_', '-')}: {why}")

        if self.objective not in OBJECTIVES:
            raise bad("objective", f"unknown objective {self.objective!r} (choose from {', '.join(OBJECTIVES)})")
        if self.format not in FORMATS:
            raise bad("format", f"unknown format {self.format!r} (choose from {', '.join(FORMATS)})")
        if not 8 <= self.max_seq_length <= 65535:
            raise bad("max_seq_length", f"must be in [8, 65535], got {self.max_seq_length}")
        if self.max_predictions_per_seq is not None and not 1 <= self.max_predictions_per_seq <= self.max_seq_length:
            raise bad("max_predictions_per_seq", f"must be in [1, max_seq_length], got {self.max_predictions_per_seq}")
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise bad("masked_lm_prob", f"must be in (0, 1), got {self.masked_lm_prob}")
        if not 0.0 <= self.short_seq_prob <= 1.0:
            raise bad("short_seq_prob", f"must be in [0, 1], got {self.short_seq_prob}")
        if self.dupe_factor is not None and self.dupe_factor < 1:
            raise bad("dupe_factor", f"must be >= 1, got {self.dupe_factor}")
        if self.shard_size < 1:
            raise bad("shard_size", f"must be >= 1, got {self.shard_size}")
        if self.chunk_bytes < 1:
            raise bad("chunk_bytes", f"must be >= 1, got {self.chunk_bytes}")
        if self.random_next_pool < 1:
            raise bad("random_next_pool", f"must be >= 1, got {self.random_next_pool}")
        if not 0 <= self.random_next_per_unit <= self.random_next_pool:
            raise bad("random_next_per_unit", f"must be in [0, {self.random_next_pool}] (--random-next-pool), "
                                              f"got {self.random_next_per_unit}")
        if self.max_document_bytes < 1:
            raise bad("max_document_bytes", f"must be >= 1, got {self.max_document_bytes}")
        if not 0.0 <= self.holdout_fraction < 1.0:
            raise bad("holdout_fraction", f"must be in [0, 1), got {self.holdout_fraction}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "DataConfig":
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})
