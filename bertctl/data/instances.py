"""Pretraining instances and masked-LM masking, as the paper (section 3.1, appendix A.1-A.2)
and google-research/bert's create_pretraining_data.py make them.

Everything works on token ids and takes explicit seeds (a ``random.Random``
for instance creation, per-instance 64-bit seeds for ``mask_batch``), so the
same documents and seeds give the same instances.  The draws follow the
reference's distributions, not its calls one for one: ``mask_tokens`` (used
for whole-word masking) draws its shuffle lazily, and ``mask_batch`` (plain
masking, at build time and for the loader's dynamic masks) masks a whole batch
with numpy from counter-based random numbers.

Deliberate deviations from the reference, each for a stated reason:

- The random "next sentence" comes from a ``RandomNextPool``: excerpts of
  other documents sampled uniformly from the documents read so far (see
  ``bertctl.data.build``), not from the whole corpus held in memory: documents are
  streamed, so memory stays bounded whatever the corpus size.  As in the
  reference it never comes from the document of segment A while another
  document exists.  B starts at a random sentence of the excerpt among those
  followed by enough text to fill it.  Without a pool entry of another
  document the draw falls back to the reference's draw among the documents of
  the work unit (the same document after ten failed tries); the build counts both.
- The short target length (probability ``short_seq_prob``) is drawn again for
  every instance, not once per document: the reference's comment and the
  paper intend "10% of the time", while a per-document draw makes the share
  of short instances depend on document lengths.
- Documents with fewer than two sentences are skipped (counted in the
  summary): they can only make "random next" pairs and bias the NSP labels.

The masked-LM-only objective (the paper's "No NSP" ablation, section 5.1) makes
one-segment instances instead, ``create_mlm_instances_from_document``: whole
consecutive sentences of one document packed to length, as RoBERTa's
DOC-SENTENCES; no pairs, no random next segments, and one-sentence documents
are kept.
"""
from __future__ import annotations

import bisect
import random
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np


@dataclass(frozen=True)
class SpecialIds:
    """What instance creation and masking need to know about the vocabulary."""

    cls: int
    sep: int
    mask: int
    vocab_size: int
    # continuation[i] is True when token i is a "##" word piece (whole-word masking).
    continuation: Sequence[bool] = field(repr=False, compare=False, default=())


@dataclass
class Instance:
    tokens: list[int]  # [CLS] A [SEP] B [SEP] ([CLS] A [SEP] for masked LM only), masked when masking is static
    len_a: int  # tokens in segment A (without specials)
    is_random_next: bool  # NSP label 1 (google-research convention: 1 = random B); False without NSP
    masked_positions: list[int]
    masked_labels: list[int]


@dataclass
class InstanceStats:
    """Counters summed over work units for the build summary."""

    instances: int = 0
    tokens: int = 0  # real tokens incl. specials
    candidate_tokens: int = 0  # tokens that may be masked (not [CLS]/[SEP])
    masked: int = 0
    masked_as_mask: int = 0  # replaced by [MASK] (80%)
    masked_as_random: int = 0  # replaced by a random token (10%)
    masked_as_same: int = 0  # left unchanged (10%)
    random_next: int = 0
    forced_random_next: int = 0  # a one-sentence chunk: B can only be random (as the reference)
    # Random B segments not drawn from the pool: from another document of the work unit, and from
    # A's own document (both 0 whenever the pool holds another document).
    random_next_from_unit: int = 0
    random_next_same_document: int = 0
    truncated: int = 0
    short_target: int = 0

    def add(self, other: "InstanceStats") -> None:
        for k, v in vars(other).items():
            setattr(self, k, getattr(self, k) + v)


def mask_tokens(tokens: list[int], rng: random.Random, special: SpecialIds, *, masked_lm_prob: float,
                max_predictions: int, whole_word_mask: bool = False,
                stats: InstanceStats | None = None) -> tuple[list[int], list[int], list[int]]:
    """create_masked_lm_predictions: returns (masked tokens, positions ascending, labels).

    ``round(len(tokens) * masked_lm_prob)`` positions (at least 1, at most
    ``max_predictions``; the reference counts [CLS]/[SEP] in ``len``), chosen among
    the non-special tokens, whole words at a time with ``whole_word_mask``.
    Each chosen token becomes [MASK] 80% of the time, a uniformly random
    vocabulary token 10%, itself 10% (paper appendix A.1).
    """
    cls, sep = special.cls, special.sep
    if whole_word_mask:
        cont = special.continuation
        cand_indexes: list = []
        after_special = True  # a "##" piece opening a segment (cut by truncation) starts its own word
        for i, tok in enumerate(tokens):
            if tok == cls or tok == sep:
                after_special = True
                continue
            if cont[tok] and not after_special:
                cand_indexes[-1].append(i)
            else:
                cand_indexes.append([i])
            after_special = False
        n_candidates = sum(map(len, cand_indexes))
    else:
        cand_indexes = [i for i, tok in enumerate(tokens) if tok != cls and tok != sep]
        n_candidates = len(cand_indexes)
    output = list(tokens)
    num_to_predict = min(max_predictions, max(1, int(round(len(tokens) * masked_lm_prob))))
    masked: list[tuple[int, int]] = []
    n_mask = n_random = n_same = 0
    # The reference shuffles all candidates, then takes them in order until the
    # budget is spent.  A Fisher-Yates shuffle drawn lazily, one position at a
    # time, gives the same distribution and stops after ~num_to_predict draws.
    n = len(cand_indexes)
    random_ = rng.random
    for j in range(n):
        if len(masked) >= num_to_predict:
            break
        r = j + int(random_() * (n - j))
        cand_indexes[j], cand_indexes[r] = cand_indexes[r], cand_indexes[j]
        index_set = cand_indexes[j]
        if whole_word_mask:
            # A whole word that would overshoot the budget is skipped (the reference).
            if len(masked) + len(index_set) > num_to_predict:
                continue
        else:
            index_set = (index_set,)
        for index in index_set:
            if random_() < 0.8:
                replacement = special.mask
                n_mask += 1
            elif random_() < 0.5:
                replacement = tokens[index]
                n_same += 1
            else:
                replacement = int(random_() * special.vocab_size)
                n_random += 1
            output[index] = replacement
            masked.append((index, tokens[index]))
    masked.sort()
    if stats is not None:
        stats.candidate_tokens += n_candidates
        stats.masked += len(masked)
        stats.masked_as_mask += n_mask
        stats.masked_as_random += n_random
        stats.masked_as_same += n_same
    return output, [p for p, _ in masked], [t for _, t in masked]


def truncate_seq_pair(tokens_a: list[int], tokens_b: list[int], max_num_tokens: int,
                      rng: random.Random) -> bool:
    """Trim the longer segment one token at a time, each from a random end (the reference's
    way to avoid a bias towards either end), in place.  Returns whether anything was cut.

    The reference draws front-or-back per token; only the number of front cuts of each
    segment matters, a Binomial(k, 1/2), drawn here as the popcount of k random bits.
    """
    la, lb = len(tokens_a), len(tokens_b)
    if la + lb <= max_num_tokens:
        return False
    cut_a = cut_b = 0
    while la + lb > max_num_tokens:  # the reference's rule: the longer one, B on a tie
        if la > lb:
            la -= 1
            cut_a += 1
        else:
            lb -= 1
            cut_b += 1
    for tokens, k in ((tokens_a, cut_a), (tokens_b, cut_b)):
        if k:
            front = bin(rng.getrandbits(k)).count("1")
            del tokens[len(tokens) - (k - front):]
            del tokens[:front]
    return True


class RandomNextPool:
    """Runs of consecutive sentences (token ids) from several documents, for random B segments.

    Each run comes from a different document, named by ``documents[k]``; a draw for
    segment A of document ``d`` picks uniformly among the runs of the other documents.
    """

    def __init__(self, runs: list[list[list[int]]], documents: list[int]):
        self.runs = runs
        self.documents = documents
        self.position = {doc: k for k, doc in enumerate(documents)}
        if len(self.position) != len(documents):
            raise ValueError("RandomNextPool: two runs of one document")
        # Tokens from each sentence to the end of its run, negated so that they ascend (bisect).
        self.remaining = []
        for run in runs:
            left, total = [], sum(map(len, run))
            for sentence in run:
                left.append(-total)
                total -= len(sentence)
            self.remaining.append(left)

    def has_other(self, document: int) -> bool:
        return len(self.runs) > (document in self.position)

    def draw(self, document: int, target_length: int, rng: random.Random) -> list[int]:
        """Tokens of a run of another document than ``document``: from a random sentence among
        those followed by at least ``target_length`` tokens (the first if none is), whole
        sentences until ``target_length`` is reached (the reference's loop)."""
        own = self.position.get(document)
        k = int(rng.random() * (len(self.runs) - (own is not None)))
        if own is not None and k >= own:
            k += 1
        run = self.runs[k]
        starts = bisect.bisect_right(self.remaining[k], -target_length)
        tokens: list[int] = []
        for sentence in run[int(rng.random() * max(starts, 1)) :]:
            tokens.extend(sentence)
            if len(tokens) >= target_length:
                break
        return tokens


def create_instances_from_document(documents: list[list[list[int]]], document_index: int, *,
                                   max_seq_length: int, short_seq_prob: float, special: SpecialIds,
                                   rng: random.Random, stats: InstanceStats, masking: dict | None,
                                   pool: RandomNextPool | None = None,
                                   document_id: int | None = None) -> list[Instance]:
    """Instances from one document (a list of sentences, each a list of token ids).

    Segment A is 1..n-1 consecutive sentences of a chunk filling the target
    length; B is the rest of the chunk (actual next, NSP label 0) or, half the
    time, sentences from a random other document (label 1), in which case the
    unused sentences of the chunk are put back.  Random B segments come from
    ``pool`` (excluding ``document_id``, this document's name there) when it holds
    another document, else from another of ``documents``.  ``masking`` holds
    ``mask_tokens`` keyword arguments for static masking, or ``None`` (masks
    are drawn at load time).
    """
    use_pool = pool is not None and pool.has_other(document_id)
    document = documents[document_index]
    max_num_tokens = max_seq_length - 3  # [CLS], [SEP], [SEP]
    random_ = rng.random

    def below(n: int) -> int:
        # Uniform on 0..n-1 as rng.randrange(n) up to n / 2**53, at a third of its cost.
        return int(random_() * n)

    def draw_target() -> tuple[int, bool]:
        if random_() < short_seq_prob:
            return 2 + below(max_num_tokens - 1), True
        return max_num_tokens, False

    target_seq_length, short = draw_target()
    instances: list[Instance] = []
    current_chunk: list[list[int]] = []
    current_length = 0
    i = 0
    while i < len(document):
        segment = document[i]
        current_chunk.append(segment)
        current_length += len(segment)
        if i == len(document) - 1 or current_length >= target_seq_length:
            if current_chunk:
                a_end = 1
                if len(current_chunk) >= 2:
                    a_end = 1 + below(len(current_chunk) - 1)
                tokens_a = [t for j in range(a_end) for t in current_chunk[j]]
                tokens_b: list[int] = []
                forced = len(current_chunk) == 1
                if forced or random_() < 0.5:
                    is_random_next = True
                    target_b_length = target_seq_length - len(tokens_a)
                    if use_pool:
                        tokens_b = pool.draw(document_id, target_b_length, rng)
                    else:
                        # The reference's draw: ten tries for another document of the unit.
                        for _ in range(10):
                            random_document_index = below(len(documents))
                            if random_document_index != document_index:
                                break
                        random_document = documents[random_document_index]
                        random_start = below(len(random_document))
                        for j in range(random_start, len(random_document)):
                            tokens_b.extend(random_document[j])
                            if len(tokens_b) >= target_b_length:
                                break
                        stats.random_next_from_unit += random_document_index != document_index
                        stats.random_next_same_document += random_document_index == document_index
                    # Put the unused sentences back: they start the next chunk.
                    i -= len(current_chunk) - a_end
                else:
                    is_random_next = False
                    tokens_b = [t for j in range(a_end, len(current_chunk)) for t in current_chunk[j]]
                truncated = truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                tokens = [special.cls, *tokens_a, special.sep, *tokens_b, special.sep]
                if masking is not None:
                    tokens, positions, labels = mask_tokens(tokens, rng, special, stats=stats, **masking)
                else:
                    positions, labels = [], []
                instances.append(Instance(tokens, len(tokens_a), is_random_next, positions, labels))
                stats.instances += 1
                stats.tokens += len(tokens)
                stats.random_next += is_random_next
                stats.forced_random_next += forced and is_random_next
                stats.truncated += truncated
                stats.short_target += short
                target_seq_length, short = draw_target()
            current_chunk = []
            current_length = 0
        i += 1
    return instances


def create_mlm_instances_from_document(document: list[list[int]], *, max_seq_length: int, short_seq_prob: float,
                                       special: SpecialIds, rng: random.Random, stats: InstanceStats,
                                       masking: dict | None) -> list[Instance]:
    """Masked-LM-only instances from one document (a list of sentences, each a list of token ids).

    Each instance is ``[CLS] sentences [SEP]``, one segment: whole consecutive sentences, in
    order, added while the total stays within the target length, ``max_seq_length - 2``
    tokens, or with probability ``short_seq_prob`` a target drawn uniformly from
    2..max_seq_length - 2 as for NSP pairs (RoBERTa's DOC-SENTENCES, with BERT's short
    sequences).  An instance holds at least one sentence, so a sentence longer than the
    target starts an instance of its own, and one longer than ``max_seq_length - 2`` is cut
    to that length from a random end (``truncate_seq_pair``'s rule); no other sentence is
    ever cut.  Instances never cross documents; the last of a document may be short.
    ``masking`` as for ``create_instances_from_document``.
    """
    max_num_tokens = max_seq_length - 2  # [CLS], [SEP]
    random_ = rng.random
    instances: list[Instance] = []
    i, n = 0, len(document)
    while i < n:
        short = random_() < short_seq_prob
        target = 2 + int(random_() * (max_num_tokens - 1)) if short else max_num_tokens
        body = list(document[i])
        i += 1
        while i < n and len(body) + len(document[i]) <= target:
            body += document[i]
            i += 1
        truncated = truncate_seq_pair(body, [], max_num_tokens, rng)
        tokens = [special.cls, *body, special.sep]
        if masking is not None:
            tokens, positions, labels = mask_tokens(tokens, rng, special, stats=stats, **masking)
        else:
            positions, labels = [], []
        instances.append(Instance(tokens, len(body), False, positions, labels))
        stats.instances += 1
        stats.tokens += len(tokens)
        stats.truncated += truncated
        stats.short_target += short
    return instances


# ----------------------------------------------------------------------------- vectorised masking
#
# The same masked-LM procedure for a whole batch at once with numpy, for the
# common case without whole-word masking: a uniformly random subset of
# min(max_predictions, max(1, round(len * p))) non-special positions, each
# [MASK] 80%, itself 10%, a random token 10%.  Random numbers are counter-based
# (splitmix64 of the instance seed and the position), so an instance's masks
# depend only on its own seed, never on which batch or worker it is in.

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def mix64(x) -> np.ndarray:
    """splitmix64's finaliser on uint64 arrays: a bijective, well-mixed hash."""
    with np.errstate(over="ignore"):  # multiplication modulo 2**64 is the point
        x = np.asarray(x, dtype=np.uint64) + _GOLDEN
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def _uniform(seeds: np.ndarray, positions: np.ndarray, stream: int) -> np.ndarray:
    """Uniforms in [0, 1), one per (seed, position) pair (broadcast); independent streams 0..3."""
    counters = mix64(np.asarray(positions, dtype=np.uint64) * np.uint64(4) + np.uint64(stream))
    z = mix64(mix64(seeds) ^ counters)
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def mask_batch(input_ids: np.ndarray, lengths: np.ndarray, seeds: np.ndarray, special: SpecialIds, *,
               masked_lm_prob: float, max_predictions: int,
               stats: InstanceStats | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Mask a batch: ``input_ids`` (B, S), ``lengths`` (B,), ``seeds`` (B,) uint64.

    Returns (masked ids (B, S), positions (B, P) ascending with 0 in unused slots,
    labels (B, P) with 0 in unused slots), P = ``max_predictions``.
    """
    input_ids = np.asarray(input_ids)
    B, S = input_ids.shape
    P = max_predictions
    lengths = np.asarray(lengths, dtype=np.int64)
    col = np.arange(S)
    candidate = ((col[None, :] >= 1) & (col[None, :] < lengths[:, None] - 1)
                 & (input_ids != special.cls) & (input_ids != special.sep))
    n_candidates = candidate.sum(1)
    # np.round rounds half to even, as Python's round in the reference.
    budget = np.minimum(np.clip(np.round(lengths * masked_lm_prob), 1, P).astype(np.int64), n_candidates)
    seeds = np.asarray(seeds, dtype=np.uint64)
    keys = np.where(candidate, _uniform(seeds[:, None], col[None, :], 0), 2.0)
    # The P smallest keys, in key order: the first P of a uniformly random order of the candidates.
    order = np.argpartition(keys, P - 1, axis=1)[:, :P] if P < S else np.arange(S)[None, :].repeat(B, 0)
    order = np.take_along_axis(order, np.argsort(np.take_along_axis(keys, order, 1), axis=1, kind="stable"), 1)
    chosen = np.arange(P)[None, :] < budget[:, None]
    positions = np.sort(np.where(chosen, order, S), axis=1)
    used = positions < S
    positions = np.where(used, positions, 0)
    rows = np.nonzero(used)[0]
    cols = positions[used]
    labels = np.zeros((B, P), dtype=input_ids.dtype)
    labels[used] = input_ids[rows, cols]
    kind = _uniform(seeds[rows], cols, 1)
    random_ids = (_uniform(seeds[rows], cols, 2) * special.vocab_size).astype(np.int64)
    as_mask, as_same = kind < 0.8, (kind >= 0.8) & (kind < 0.9)
    replacement = np.where(as_mask, special.mask, np.where(as_same, labels[used], random_ids))
    masked = input_ids.copy()
    masked[rows, cols] = replacement
    if stats is not None:
        stats.candidate_tokens += int(n_candidates.sum())
        stats.masked += len(rows)
        stats.masked_as_mask += int(as_mask.sum())
        stats.masked_as_same += int(as_same.sum())
        stats.masked_as_random += int(len(rows) - as_mask.sum() - as_same.sum())
    return masked, positions, labels
