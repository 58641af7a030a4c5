"""``build_data``: raw text -> shards of pretraining instances, streamed, parallel, resumable.

Pipeline (the main process reads, workers do the rest)::

    files --read_documents--> documents --holdout, chunking--> work units
          --workers: split sentences, tokenize, create instances, mask, write shards--> records
          --> manifest.json

Work units ("chunks") are runs of consecutive documents holding about
``chunk_bytes`` of raw text (at least two documents).  Their boundaries depend
only on the inputs and the config, and each unit draws from its own generator
seeded by ``(seed, split, unit index)``, so the output does not depend on the
number of workers or on scheduling: the same inputs and seed give
byte-identical shards with 1 or N workers.

Random next segments come from other documents, as the reference draws them
from the whole corpus, with bounded memory: the reader keeps a uniform random
sample of the documents read so far in each split (reservoir sampling, one
excerpt of ``16 * max_seq_length`` characters per document, at most
``random_next_pool`` of them), and every unit leaves with
``random_next_per_unit`` excerpts drawn from it when it is cut (the reader is
then one unit ahead, so the first unit sees the second's documents too).  The
sample is a function of the inputs and the seed alone, so it keeps the output
independent of the workers, and it is part of each unit's hash for ``resume``.
Data for the masked-LM-only objective (``objective="mlm"``) has no random next
segments: no sample is kept and units carry no excerpts.

Each unit writes its shards under temporary names, renames them, then writes a
small completion record (``.build/<unit>.json``); ``resume=True`` skips units
whose record and shards are complete, which makes an interrupted-then-resumed
build equal an uninterrupted one byte for byte.

The output folder follows the rule of :mod:`bertctl.rundir`: a folder holding an
interrupted build (``.build/``) needs ``resume``, a finished one (``manifest.json``,
written last and atomically: the build's own finished marker, so the folder holds
no file that differs between two equal builds) is refused unless ``overwrite``,
and a lock refuses a second build into the folder while the first lives.  A build
stopped by a signal or an operating-system error keeps its finished units and says
so; one that finished none, or failed on its input, removes what it wrote and puts
back a build that ``overwrite`` had moved aside.

Memory is bounded: the reader holds one document, the chunker two units and
the excerpt sample, and at most ``2 * workers`` units are in flight (see
:mod:`bertctl.data.instances` for the deviations from the reference).
"""
from __future__ import annotations

import gc
import hashlib
import json
import os
import random
import re
import shutil
import signal
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from bertctl import faults, rundir
from bertctl.errors import BertctlError
from bertctl.io import atomic_open, atomic_path, write_json
from bertctl.workers import worker_pool

from .config import DataConfig
from .documents import Document, ReadStats, known_text_bytes, list_inputs, read_documents
from .instances import (InstanceStats, RandomNextPool, SpecialIds, create_instances_from_document,
                        create_mlm_instances_from_document, mask_batch)
from .sentences import split_sentences
from .shards import FORMAT_NAME, FORMAT_VERSION, file_sha256, id_dtype, record_dtype, to_records, vocab_sha256, write_shard

__all__ = ["build_data", "DataConfig", "WordCache", "special_ids", "tokenizer_info"]

SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
BUILD_DIR = ".build"
# Excerpts for random next segments hold 16 characters per token of max_seq_length (about three
# full-length segments of English at 4-5 characters per token).
EXCERPT_CHARS_PER_TOKEN = 16


# ----------------------------------------------------------------------------- tokenizer side


def special_ids(tokenizer) -> SpecialIds:
    """Special-token ids and the word-continuation table (``##`` pieces; SentencePiece pieces without ``▁``)."""
    return SpecialIds(cls=tokenizer.cls_token_id, sep=tokenizer.sep_token_id, mask=tokenizer.mask_token_id,
                      vocab_size=len(tokenizer.ids_to_tokens), continuation=tokenizer.continues_word)


def tokenizer_info(tokenizer) -> dict:
    """Tokenizer settings stored in the manifest (the reference never stored do_lower_case)."""
    tokens = list(tokenizer.ids_to_tokens)
    info = {"vocab_size": len(tokens), "vocab_sha256": vocab_sha256(tokens)}
    for name in ("do_lower_case", "strip_accents", "tokenize_chinese_chars"):
        if hasattr(tokenizer, name):
            info[name] = getattr(tokenizer, name)
    if tokenizer.kind == "sentencepiece":  # the model file is copied beside the shards
        info.update(type=tokenizer.kind, sentencepiece_model=tokenizer.model_filename,
                    sentencepiece_sha256=tokenizer.model_sha256)
    for name in SPECIAL_TOKENS:
        key = name.strip("[]").lower() + "_token_id"
        info[key] = getattr(tokenizer, key)
    return info


# Characters str.split() cuts at but BERT's text cleaning deletes (control characters): a text
# holding one goes through the tokenizer whole.  tests/test_data_build.py checks this set against
# every white-space character.
_SPLIT_MISMATCH = re.compile("[\x0b\x0c\x1c-\x1f\x85]")


class WordCache:
    """Token ids of a text: the tokenizer's basic tokenizer and WordPiece behind a cache from
    white-space word to ids.

    BERT's tokenization works word by word once text is split at white space, so the ids of a
    text are the concatenated ids of its words.  Word frequencies are Zipfian: each distinct word
    goes through the tokenizer once (``BertTokenizer.word_ids``: its basic tokenizer, then its
    WordPiece), and every other occurrence is one dict look-up, cheaper than the tokenizer's own
    path, which also keeps character offsets.  The cache is cleared when it reaches ``max_words``
    (memory stays bounded).
    """

    def __init__(self, tokenizer, max_words: int = 1 << 19):
        self.tokenizer = tokenizer
        self.max_words = max_words
        self.cache: dict[str, list[int]] = {}  # white-space word -> ids
        self.misses = 0  # distinct words worked out

    def _word(self, word: str) -> list[int]:
        self.misses += 1
        ids = self.tokenizer.word_ids(word)
        if len(self.cache) >= self.max_words:
            self.cache.clear()
        self.cache[word] = ids
        return ids

    def encode(self, text: str) -> list[int]:
        # Printable ASCII holds none of the characters split() and BERT disagree on (a cheap test).
        if not (text.isascii() and text.isprintable()) and _SPLIT_MISMATCH.search(text):
            return self.tokenizer.ids(text)
        out: list[int] = []
        cache = self.cache
        for word in text.split():
            ids = cache.get(word)
            if ids is None:
                ids = self._word(word)
            out += ids
        return out


# ----------------------------------------------------------------------------- work units


@dataclass
class Excerpt:
    """Consecutive pieces (sentences or paragraphs) of one document, for random next segments."""

    document: int  # the document's number in its split, in reading order
    pieces: list[str]
    presplit: bool
    # A paragraph cut by the excerpt's window: its partial first / last sentence is dropped.
    cut_head: bool = False
    cut_tail: bool = False


@dataclass
class Chunk:
    split: str  # "train" | "eval"
    index: int
    docs: list[tuple[list[str], bool]]  # (pieces, presplit)
    nbytes: int
    text_sha256: str  # of docs and excerpts: a resumed build checks that its inputs are unchanged
    first_document: int = 0  # number of docs[0] in its split (the rest follow in order)
    excerpts: list[Excerpt] = field(default_factory=list)  # of documents of the split, for random next

    @property
    def name(self) -> str:
        return f"{self.split}-{self.index:05d}"


def derive_seed(*parts) -> int:
    """A 64-bit seed from a tuple (seed, split, index, ...): independent streams per unit."""
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


def _unit_interval(*parts) -> float:
    return derive_seed(*parts) / 2.0**64


def _hash_docs(docs: list[tuple[list[str], bool]], excerpts: list[Excerpt] = ()) -> str:
    h = hashlib.sha256()
    for pieces, _ in docs:
        for piece in pieces:
            h.update(piece.encode("utf-8", "surrogatepass"))
            h.update(b"\n")
        h.update(b"\f")
    for e in excerpts:
        h.update(f"{e.document} {e.presplit:d}{e.cut_head:d}{e.cut_tail:d}\v".encode())
        for piece in e.pieces:
            h.update(piece.encode("utf-8", "surrogatepass"))
            h.update(b"\n")
    return h.hexdigest()


def make_excerpt(number: int, pieces: list[str], presplit: bool, chars: int, rng: random.Random) -> Excerpt:
    """About ``chars`` characters of a document from a random piece on (whole pieces where they fit).

    A paragraph longer than twice that is cut to a window at white space (from a random
    offset when the excerpt starts inside it); a cut paragraph's partial sentences are
    dropped after splitting (``cut_head`` / ``cut_tail``).  A presplit piece (a sentence)
    is only shortened.
    """
    start = int(rng.random() * len(pieces))
    out: list[str] = []
    size = 0
    cut_head = cut_tail = False
    for piece in pieces[start:]:
        if len(piece) > 2 * chars:
            lo = 0
            if not out and not presplit:  # the excerpt starts inside this paragraph
                lo = int(rng.random() * (len(piece) - chars))
                lo = piece.find(" ", lo) + 1 if lo else 0
            hi = lo + chars
            if hi < len(piece):
                space = piece.rfind(" ", lo, hi)
                hi = space if space > lo else hi
            else:
                hi = len(piece)
            out.append(piece[lo:hi])
            cut_head, cut_tail = lo > 0 and not presplit, hi < len(piece) and not presplit
            break
        out.append(piece)
        size += len(piece)
        if size >= chars:
            break
    return Excerpt(number, out, presplit, cut_head, cut_tail)


class ExcerptReservoir:
    """A uniform random sample of the documents of one split read so far, as excerpts.

    Reservoir sampling (Vitter's Algorithm R): document n (from 1) is kept with probability
    ``capacity / n`` in place of a random one, so at every moment each document read so far
    is in the sample with the same probability.  Memory: ``capacity`` excerpts of about
    ``chars`` characters (under three times that).
    """

    def __init__(self, capacity: int, chars: int, rng: random.Random):
        self.capacity = capacity
        self.chars = chars
        self.rng = rng
        self.items: list[Excerpt] = []
        self.seen = 0

    def offer(self, pieces: list[str], presplit: bool) -> None:
        number = self.seen
        self.seen += 1
        if len(self.items) < self.capacity:
            self.items.append(make_excerpt(number, pieces, presplit, self.chars, self.rng))
            return
        slot = int(self.rng.random() * self.seen)
        if slot < self.capacity:
            self.items[slot] = make_excerpt(number, pieces, presplit, self.chars, self.rng)

    def sample(self, k: int, rng: random.Random) -> list[Excerpt]:
        return list(self.items) if len(self.items) <= k else rng.sample(self.items, k)


def make_chunks(documents: Iterator[Document], cfg: DataConfig) -> Iterator[Chunk]:
    """Group streamed documents into work units per split (train / held-out eval).

    A unit closes once it holds ``chunk_bytes`` of raw text and two documents;
    a last unit with a single document is merged into the one before.  A
    document goes to "eval" with probability ``holdout_fraction``, decided by a
    hash of (seed, document number), so the split is fixed by the inputs and seed.
    Each unit carries ``random_next_per_unit`` excerpts drawn from its split's
    reservoir as it is emitted (the module docstring says why this is deterministic);
    none without NSP.
    """
    random_next = cfg.random_next_per_unit if cfg.nsp else 0
    splits = ("train", "eval") if cfg.holdout_fraction > 0 else ("train",)
    current = {s: [] for s in splits}
    size = {s: 0 for s in splits}
    pending: dict[str, tuple[list, int] | None] = {s: None for s in splits}
    counter = {s: 0 for s in splits}
    first = {s: 0 for s in splits}  # split number of the first document of the next unit emitted
    reservoir = {s: ExcerptReservoir(cfg.random_next_pool, EXCERPT_CHARS_PER_TOKEN * cfg.max_seq_length,
                                     random.Random(derive_seed(cfg.seed, "random-next-pool", s))) for s in splits}

    def emit(split: str, docs: list, nbytes: int) -> Chunk:
        index = counter[split]
        excerpts = []
        if random_next:
            excerpts = reservoir[split].sample(random_next,
                                               random.Random(derive_seed(cfg.seed, "random-next", split, index)))
        chunk = Chunk(split, index, docs, nbytes, _hash_docs(docs, excerpts), first[split], excerpts)
        counter[split] += 1
        first[split] += len(docs)
        return chunk

    for n, doc in enumerate(documents):
        split = "eval" if cfg.holdout_fraction > 0 and _unit_interval(cfg.seed, "holdout", n) < cfg.holdout_fraction else "train"
        current[split].append((doc.pieces, doc.presplit))
        if random_next:
            reservoir[split].offer(doc.pieces, doc.presplit)
        size[split] += doc.nbytes
        if size[split] >= cfg.chunk_bytes and len(current[split]) >= 2:
            if pending[split] is not None:
                yield emit(split, *pending[split])
            pending[split] = (current[split], size[split])
            current[split], size[split] = [], 0
    for split in splits:
        if current[split]:
            if len(current[split]) < 2 and pending[split] is not None:
                docs, nbytes = pending[split]
                pending[split] = (docs + current[split], nbytes + size[split])
            else:
                if pending[split] is not None:
                    yield emit(split, *pending[split])
                pending[split] = (current[split], size[split])
        if pending[split] is not None:
            yield emit(split, *pending[split])


class ChunkWorker:
    """Turns one work unit into shards and a completion record (runs in a worker process)."""

    def __init__(self, tokenizer, cfg: DataConfig, output_dir: Path):
        self.cfg = cfg
        self.output_dir = output_dir
        self.special = special_ids(tokenizer)
        # WordCache is WordPiece's per-word fast path; SentencePiece encodes whole sentences in C++.
        self.encode = WordCache(tokenizer).encode if tokenizer.kind == "wordpiece" else tokenizer.ids
        self.dtype = record_dtype(cfg.max_seq_length, cfg.max_predictions_per_seq, self.special.vocab_size,
                                  cfg.dynamic_masking, nsp=cfg.nsp)
        # Tokenized excerpts by (split, document): consecutive units share many of them.  The
        # output does not depend on what is cached, only the time does.
        self.excerpts: dict[tuple[str, int], list[list[int]]] = {}
        self.max_excerpts = 4 * cfg.random_next_per_unit

    def _excerpt(self, split: str, e: Excerpt) -> list[list[int]]:
        """Token ids of an excerpt's sentences (the partial ones of a cut paragraph dropped)."""
        hit = self.excerpts.get((split, e.document))
        if hit is not None:
            return hit
        if e.presplit:
            sentences = e.pieces
        else:
            split_pieces = [split_sentences(p) for p in e.pieces]
            if len(split_pieces) == 1 and len(split_pieces[0]) <= e.cut_head + e.cut_tail:
                sentences = split_pieces[0]  # one long sentence: keep it rather than nothing
            else:
                if e.cut_head:
                    split_pieces[0] = split_pieces[0][1:]
                if e.cut_tail:
                    split_pieces[-1] = split_pieces[-1][:-1]
                sentences = [s for p in split_pieces for s in p]
        ids = [x for x in map(self.encode, sentences) if x]
        if len(self.excerpts) >= self.max_excerpts:
            del self.excerpts[next(iter(self.excerpts))]  # the oldest
        self.excerpts[(split, e.document)] = ids
        return ids

    def __call__(self, chunk: Chunk) -> dict:
        # Nothing here makes reference cycles (lists of ids, numpy arrays), so the cyclic collector
        # would only re-scan the token caches, tens of thousands of containers, again and again.
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._build(chunk)
        finally:
            if enabled:
                gc.enable()

    def _build(self, chunk: Chunk) -> dict:
        cpu_start = time.process_time()
        cfg, special = self.cfg, self.special
        counts = {"documents_read": len(chunk.docs), "documents": 0, "sentences": 0, "short_documents": 0}
        # NSP needs two sentences (a one-sentence document only makes random-next pairs); masked LM one.
        min_sentences = 2 if cfg.nsp else 1
        documents: list[list[list[int]]] = []
        numbers: list[int] = []  # each document's number in its split (the excerpts name them so)
        for k, (pieces, presplit) in enumerate(chunk.docs):
            sentences = pieces if presplit else [s for p in pieces for s in split_sentences(p)]
            doc = [ids for ids in map(self.encode, sentences) if ids]
            if len(doc) < min_sentences:
                counts["short_documents"] += 1
                continue
            documents.append(doc)
            numbers.append(chunk.first_document + k)
            counts["documents"] += 1
            counts["sentences"] += len(doc)
        pool = None
        if chunk.excerpts:
            runs = [(e.document, self._excerpt(chunk.split, e)) for e in chunk.excerpts]
            runs = [(d, r) for d, r in runs if r]
            pool = RandomNextPool([r for _, r in runs], [d for d, _ in runs])

        rng = random.Random(derive_seed(cfg.seed, chunk.split, chunk.index))
        stats = InstanceStats()
        # Whole-word masking needs the word structure: masked per instance while it is made
        # (the reference's way).  Plain token masking runs vectorised over the unit below.
        masking = None if cfg.dynamic_masking or not cfg.whole_word_mask else dict(
            masked_lm_prob=cfg.masked_lm_prob, max_predictions=cfg.max_predictions_per_seq, whole_word_mask=True)
        instances = []
        if documents:  # the reference: dupe_factor passes over all documents, then one shuffle
            for _ in range(cfg.dupe_factor):
                for d in range(len(documents)):
                    if cfg.nsp:
                        instances.extend(create_instances_from_document(
                            documents, d, max_seq_length=cfg.max_seq_length, short_seq_prob=cfg.short_seq_prob,
                            special=special, rng=rng, stats=stats, masking=masking, pool=pool,
                            document_id=numbers[d]))
                    else:
                        instances.extend(create_mlm_instances_from_document(
                            documents[d], max_seq_length=cfg.max_seq_length, short_seq_prob=cfg.short_seq_prob,
                            special=special, rng=rng, stats=stats, masking=masking))
            rng.shuffle(instances)

        records = to_records(instances, self.dtype)
        del instances
        if not cfg.dynamic_masking and not cfg.whole_word_mask:
            seeds = np.array([rng.getrandbits(64) for _ in range(len(records))], dtype=np.uint64)
            ids, positions, labels = mask_batch(records["input_ids"], records["length"], seeds, special,
                                                masked_lm_prob=cfg.masked_lm_prob,
                                                max_predictions=cfg.max_predictions_per_seq, stats=stats)
            records["input_ids"], records["masked_positions"], records["masked_lm_labels"] = ids, positions, labels
        shards = []
        for part, start in enumerate(range(0, len(records), cfg.shard_size)):
            shards.append(write_shard(self.output_dir / f"{chunk.name}-{part:03d}.npy",
                                      records[start : start + cfg.shard_size]))
        record = {"unit": chunk.name, "split": chunk.split, "index": chunk.index, "text_sha256": chunk.text_sha256,
                  "bytes": chunk.nbytes, "shards": shards, "counts": counts, "stats": vars(stats)}
        write_json(self.output_dir / BUILD_DIR / f"{chunk.name}.json", record)
        # Timing stays out of the record file and the manifest (they must not depend on the run).
        return {**record, "cpu_seconds": time.process_time() - cpu_start, "worker_pid": os.getpid()}


_worker: ChunkWorker | None = None


def _init_worker(tokenizer, cfg: DataConfig, output_dir: Path) -> None:
    global _worker
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    _worker = ChunkWorker(tokenizer, cfg, output_dir)


def _run_chunk(chunk: Chunk) -> dict:
    return _worker(chunk)


# ----------------------------------------------------------------------------- orchestration


def _completed(output_dir: Path, chunk: Chunk) -> dict | None:
    """The unit's completion record if it and all its shards are intact, else None."""
    path = output_dir / BUILD_DIR / f"{chunk.name}.json"
    if not path.exists():
        return None
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None
    if record.get("text_sha256") != chunk.text_sha256:
        raise BertctlError(f"{output_dir}: --resume: the inputs changed since the interrupted build "
                           f"(work unit {chunk.name} now holds different text); start a new build")
    for shard in record["shards"]:
        f = output_dir / shard["file"]
        if not f.exists() or f.stat().st_size != shard["bytes"] or file_sha256(f) != shard["sha256"]:
            return None
    return record


# What a build writes into its folder: what --overwrite moves aside, and what a failed new build removes.
BUILD_OUTPUTS = ("manifest.json", "vocab.txt", "train-*.npy", "eval-*.npy", BUILD_DIR, "tokenizer_config.json",
                 "special_tokens_map.json", "*.model", ".*.tmp")


def unfinished_build(folder: Path) -> str | None:
    """What an interrupted build left in ``folder`` (for the output-folder rule), or None."""
    build = folder / BUILD_DIR
    if not build.is_dir():
        return None
    done = _finished_units(folder)
    return f"an interrupted build with {done} finished work unit{'s' if done != 1 else ''}"


def finished_build(folder: Path) -> bool:
    """A finished build: its manifest, which is written last (builds from before the rule included)."""
    return (folder / "manifest.json").is_file()


def _finished_units(folder: Path) -> int:
    return sum(1 for p in (folder / BUILD_DIR).glob("*.json") if p.name != "state.json")


def claim_output(output_dir: Path, resume: bool = False, overwrite: bool = False) -> rundir.Claim:
    """The output folder rule (bertctl.rundir) for a build."""
    return rundir.claim(output_dir, command="build-data", resume=resume, overwrite=overwrite,
                        started=unfinished_build, finished_before=finished_build, outputs=BUILD_OUTPUTS)


def _prepare_output(output_dir: Path, state: dict, claim: rundir.Claim) -> None:
    """Start the build's state in a claimed folder, or check that a resumed one was built the same way."""
    state_path = output_dir / BUILD_DIR / "state.json"
    if claim.state == "resume" and state_path.exists():
        try:
            old_state = json.loads(state_path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            old_state = None  # torn by a kill mid-write (it is written atomically, so only by hand)
        if old_state != state:
            diff = sorted(k for k in state if (old_state or {}).get(k) != state[k])
            raise BertctlError(f"{output_dir}: --resume: the folder was built with a different "
                               f"{', '.join(diff)}; start a new build (--overwrite)")
        for tmp in [*output_dir.glob(".*.tmp"), *(output_dir / BUILD_DIR).glob(".*.tmp")]:
            tmp.unlink()  # debris of an interrupted write
        return
    (output_dir / BUILD_DIR).mkdir(parents=True, exist_ok=True)
    write_json(state_path, state)


def _remove_outputs(output_dir: Path) -> None:
    """Delete what a build writes (``BUILD_OUTPUTS``), and nothing else of the folder's."""
    for pattern in BUILD_OUTPUTS:
        for p in output_dir.glob(pattern):
            shutil.rmtree(p) if p.is_dir() else p.unlink()


def _restore_replaced(output_dir: Path, claim: rundir.Claim) -> bool:
    """Put back the build that ``--overwrite`` moved aside; True when there was one."""
    aside = claim.replaced
    if aside is None or not aside.is_dir():
        return False
    for p in sorted(aside.iterdir()):
        p.rename(output_dir / p.name)
    aside.rmdir()
    claim.replaced = None
    return True


def _after_failure(output_dir: Path, claim: rundir.Claim, error: BaseException) -> None:
    """Leave the folder so that no work is lost, and say on stderr what was kept and how to continue.

    Finished work units survive an interruption or an operating-system error (``--resume`` continues
    them); a build that failed on its input, or finished no unit, removes what it wrote, and an
    ``--overwrite`` build then puts back the build it replaced."""
    done = _finished_units(output_dir) if (output_dir / BUILD_DIR).is_dir() else 0
    stopped = not isinstance(error, BertctlError)  # a signal, a full disk: the inputs are good
    if claim.state == "resume" and not stopped:
        return  # refused on its input: the interrupted build stays as it was, for a corrected --resume
    if claim.state == "resume" or (stopped and done):
        said = (f"bertctl: build-data: kept the partial build in {output_dir} ({done} finished work units); "
                "run the same command with --resume to continue it, or delete the folder")
        if claim.replaced is not None:
            said += f"; the build it replaces stays in {claim.replaced} until this one finishes"
        _say(said)
        return
    _remove_outputs(output_dir)
    if _restore_replaced(output_dir, claim):
        _say(f"bertctl: build-data: stopped before any work unit finished; the previous build in {output_dir} "
             "is kept as it was")
    elif stopped:
        _say(f"bertctl: build-data: stopped before any work unit finished; nothing was kept in {output_dir}")


def _say(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class _Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the build is, so that it stops as it does for a Ctrl-C: finished units kept."""


def _terminate_as_interrupt():
    """Install a SIGTERM handler raising ``_Terminated`` (main thread only); returns the undo."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def stop(signum, frame):
        raise _Terminated()

    previous = signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _summarize(records: list[dict], read: ReadStats, cfg: DataConfig) -> dict:
    counts = {"documents_read": 0, "documents": 0, "sentences": 0, "short_documents": 0}
    stats = InstanceStats()
    per_split: dict[str, int] = {}
    for r in records:
        for k in counts:
            counts[k] += r["counts"][k]
        stats.add(InstanceStats(**r["stats"]))
        per_split[r["split"]] = per_split.get(r["split"], 0) + r["stats"]["instances"]
    n = max(stats.instances, 1)
    summary = {
        "objective": cfg.objective,
        "files": read.files,
        "bytes": read.bytes,
        "documents": counts["documents"],
        "documents_read": counts["documents_read"],
        "sentences": counts["sentences"],
        "instances": stats.instances,
        "instances_per_split": per_split,
        "tokens": stats.tokens,
        "mean_length": round(stats.tokens / n, 2),
        # Share of the fixed-width records' token slots that are padding.
        "padding_share": round(1 - stats.tokens / (n * cfg.max_seq_length), 4),
    }
    counters = vars(stats)
    if cfg.nsp:
        summary.update({
            "nsp_random_fraction": round(stats.random_next / n, 4),
            "nsp_forced_random": stats.forced_random_next,
            # Where random next segments came from: other documents through the excerpt pool, else
            # (no pool excerpt of another document) another document of the unit, else the same one.
            "nsp_random_next_same_document": stats.random_next_same_document,
            "nsp_random_next_from_unit": stats.random_next_from_unit,
        })
    else:  # no pairs: the NSP counters do not apply
        counters = {k: v for k, v in counters.items() if "random_next" not in k}
    # mlm-nsp: a pair cut to fit; mlm: a sentence longer than max_seq_length - 2 cut.
    summary["truncation_rate"] = round(stats.truncated / n, 4)
    summary["short_seq_rate"] = round(stats.short_target / n, 4)
    if cfg.dynamic_masking:
        summary["masking"] = "dynamic (drawn by the loader from seed, epoch and instance index)"
    else:
        m = max(stats.masked, 1)
        summary.update({
            "masked": stats.masked,
            "mask_rate": round(stats.masked / max(stats.candidate_tokens, 1), 4),
            "masked_as_mask": round(stats.masked_as_mask / m, 4),
            "masked_as_random": round(stats.masked_as_random / m, 4),
            "masked_as_same": round(stats.masked_as_same / m, 4),
        })
    summary["skipped"] = {
        "inputs": read.skipped_inputs,
        "lines": read.skipped_lines,
        ("documents_with_fewer_than_2_sentences" if cfg.nsp else "documents_without_text"): counts["short_documents"],
    }
    summary["documents_cut_at_max_bytes"] = read.cut_documents
    summary["non_utf8_files"] = read.non_utf8_files
    summary["encoding_policy"] = "utf-8 per line, else cp1252, else latin-1"
    summary["counters"] = counters
    return summary


def _as_tokenizer(tokenizer):
    """A tokenizer object, or one loaded from a vocab.txt path (uncased), a SentencePiece .model or a tokenizer folder."""
    if hasattr(tokenizer, "ids_to_tokens"):
        return tokenizer
    from bertctl.text import load_tokenizer

    return load_tokenizer(tokenizer)


def build_data(inputs: list[str | os.PathLike], output_dir: str | os.PathLike, tokenizer=None,
               config: DataConfig | None = None, workers: int = 1, resume: bool = False, progress: bool = True,
               *, overwrite: bool = False, vocab: str | os.PathLike | None = None,
               on_unit_done: Callable[[dict], None] | None = None) -> dict:
    """Build pretraining shards from raw text; returns the summary (also stored in the manifest).

    ``inputs``: files or folders; ``tokenizer``: a ``bertctl.text.wordpiece.BertTokenizer``, or
    a tokenizer folder / vocab.txt path (``vocab=`` says the same; a bare vocab.txt
    is read uncased); ``config``: a ``DataConfig`` (defaults when None);
    ``workers``: processes (the output does not depend on it); ``resume``:
    continue an interrupted build in ``output_dir``; ``overwrite``: replace a build
    there (the module docstring gives the folder rule); ``on_unit_done(record)`` is
    called in this process after each finished work unit (progress hooks, tests).
    """
    start = time.perf_counter()
    if tokenizer is None and vocab is None:
        raise BertctlError("build_data: give a tokenizer (or vocab=path)")
    tokenizer = _as_tokenizer(tokenizer if tokenizer is not None else vocab)
    cfg = (config or DataConfig()).resolved()
    if workers < 1:
        raise BertctlError(f"--workers: must be >= 1, got {workers}")
    output_dir = Path(output_dir)
    files = list_inputs(inputs, cfg.pattern, cfg.format)
    special_ids(tokenizer)  # fail early on a vocabulary without specials
    tok = tokenizer_info(tokenizer)
    state = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "data_config": cfg.to_dict(), "tokenizer": tok,
             "inputs": [str(f) for f in files]}
    claim = claim_output(output_dir, resume=resume, overwrite=overwrite)
    undo_term = _terminate_as_interrupt()
    try:
        _prepare_output(output_dir, state, claim)
        faults.point("start")
        summary = _build(files, output_dir, tokenizer, cfg, state, workers, claim.state == "resume", progress,
                         on_unit_done, start)
        shutil.rmtree(output_dir / rundir.REPLACED, ignore_errors=True)  # the new build supersedes it
        claim.replaced = None
        return summary
    except BaseException as e:
        undo_term()  # a second TERM while the folder is put in order ends the process, as TERM does
        _after_failure(output_dir, claim, e)
        raise
    finally:
        undo_term()
        claim.release()


def _build(files: list[Path], output_dir: Path, tokenizer, cfg: DataConfig, state: dict, workers: int, resume: bool,
           progress: bool, on_unit_done, start: float) -> dict:
    from bertctl.progress import track

    tok = state["tokenizer"]
    read = ReadStats()
    chunks = make_chunks(read_documents(files, cfg.format, read, text_field=cfg.text_field,
                                        doc_separator=cfg.doc_separator,
                                        max_document_bytes=cfg.max_document_bytes), cfg)
    records: list[dict] = []
    skipped_units = 0
    total_bytes = known_text_bytes(files, cfg.format)  # None: compressed or columnar input, or stdin
    pool = None
    if workers > 1:  # fork before the progress bar starts its thread
        pool = worker_pool(workers, _init_worker, (tokenizer, cfg, output_dir))
    try:
        with track("build-data (bytes)", total_bytes, disable=not progress) as advance:
            def finish(record: dict) -> None:
                records.append(record)
                advance(record["bytes"], info=f"{sum(r['stats']['instances'] for r in records)} instances")
                if on_unit_done is not None:
                    on_unit_done(record)
                faults.point("shard")  # between two units' shards: those of this one are complete

            worker = ChunkWorker(tokenizer, cfg, output_dir) if pool is None else None
            in_flight: deque = deque()
            for chunk in chunks:
                record = _completed(output_dir, chunk) if resume else None
                if record is not None:
                    skipped_units += 1
                    finish(record)
                    continue
                if pool is None:
                    finish(worker(chunk))
                    continue
                in_flight.append(pool.apply_async(_run_chunk, (chunk,)))
                while len(in_flight) >= 2 * workers:
                    finish(pool.wait(in_flight.popleft()))
            while in_flight:
                finish(pool.wait(in_flight.popleft()))
            if total_bytes is not None:
                advance(max(total_bytes - sum(r["bytes"] for r in records), 0))
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()

    summary = _summarize(records, read, cfg)
    notes = read.notes(cfg.format)
    if summary["instances"] == 0:
        need = "two or more non-empty sentences" if cfg.nsp else "text"
        why = f"; {'; '.join(notes)}" if notes else ""
        raise BertctlError(f"no instances: the inputs hold no document with {need} "
                           f"({summary['documents_read']} documents read; format {cfg.format!r}){why}")
    from bertctl.progress import stderr

    for note in notes:  # said on stderr whatever the progress setting: a skip is never silent
        stderr.print(note, markup=False, highlight=False, soft_wrap=True)
    records.sort(key=lambda r: (r["split"] != "train", r["index"]))
    splits: dict[str, dict] = {}
    for r in records:
        split = splits.setdefault(r["split"], {"num_instances": 0, "shards": []})
        for shard in r["shards"]:
            split["shards"].append(shard)
            split["num_instances"] += shard["num_instances"]
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "max_seq_length": cfg.max_seq_length,
        "max_predictions": cfg.max_predictions_per_seq,
        "dynamic_masking": cfg.dynamic_masking,
        "objective": cfg.objective,
        "input_ids_dtype": id_dtype(tok["vocab_size"]).name,
        "data_config": cfg.to_dict(),
        "tokenizer": tok,
        "splits": splits,
        "summary": summary,
        "build_state": state,
    }
    with atomic_open(output_dir / "vocab.txt", "w", encoding="utf-8", newline="\n") as f:
        f.writelines(t + "\n" for t in tokenizer.ids_to_tokens)
    # A SentencePiece folder also holds the model file, so pretraining tokenises as the data was.
    if tokenizer.kind == "sentencepiece":
        tokenizer.save_pretrained(output_dir)
    # The manifest is written last: it marks the build finished (``finished_build``).
    with atomic_path(output_dir / "manifest.json") as tmp:
        tmp.write_text(json.dumps(manifest, indent=2) + "\n", encoding="utf-8")
        faults.point("write")  # written under its temporary name, not yet renamed
    shutil.rmtree(output_dir / BUILD_DIR, ignore_errors=True)

    seconds = time.perf_counter() - start
    per_worker: dict[int, float] = {}
    for r in records:
        if "worker_pid" in r:
            per_worker[r["worker_pid"]] = per_worker.get(r["worker_pid"], 0.0) + r["cpu_seconds"]
    summary = dict(summary)
    summary["worker_cpu_seconds"] = sorted((round(v, 3) for v in per_worker.values()), reverse=True)
    summary.update(output=str(output_dir), shards=sum(len(s["shards"]) for s in splits.values()),
                   resumed_units=skipped_units, workers=workers, seconds=round(seconds, 3),
                   mb_per_second=round(read.bytes / 1e6 / max(seconds, 1e-9), 3))
    return summary
