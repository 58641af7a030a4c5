"""Every batch iterator: what a training step, an evaluation or an embedding pass reads.

- padded batches: ``collate`` stacks a task's featurised examples (dicts of numpy arrays) into
  int64 tensors padded to the longest, rounded up to a multiple of 8 (tensor-core shapes), and
  ``trim`` cuts a full-width batch down so;
- by length: ``length_batches``, the longest texts first under a padded-token budget
  (``BATCH_TOKENS``), for inference (embedding, fine-tuning's evaluations);
- epoch order: ``epoch_batches``, one epoch of a task's global batches as a pure function of
  (seed, epoch), so a resumed run seeks instead of replaying; ``pretraining_batches`` and
  ``bucketed_batches``, pretraining's shards (``PretrainingData``) in their plain epoch order and
  in length-bucketed order;
- steps: ``task_step`` / ``task_batches`` and ``pretraining_step`` cut this rank's part of a global
  batch into micro-batches for gradient accumulation and count the work and each loss term's
  normaliser (``StepBatch``);
- prefetching: ``Prefetcher`` runs the deterministic source in a background thread (so batches and
  their order do not depend on timing) and pins the tensors; the training thread then copies with
  ``non_blocking=True``, overlapping the copy with the last step.

torch is imported where a tensor is made: ``embed`` batches by length with this module on ONNX
Runtime and the native encoder, which never load torch.
"""
from __future__ import annotations

import collections
import itertools
import queue
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Sequence

import numpy as np

from bertctl.config import IGNORE_INDEX
from bertctl.errors import BertctlError

if TYPE_CHECKING:
    import torch

PAD_MULTIPLE = 8
SEQUENCE_KEYS = ("input_ids", "token_type_ids", "attention_mask")


@dataclass
class StepBatch:
    """One optimizer step's data for this rank: micro-batches (CPU tensors) plus host counts.

    ``counts`` holds this rank's normaliser of every loss term (e.g. ``{"mlm": masked tokens,
    "nsp": sequences}``) and the work done, for throughput: ``sequences``, ``tokens`` (real tokens),
    ``attn_pairs`` (Σ length²) and ``padded_tokens`` (B·S computed). Without ``global_counts``,
    several processes sum the normalisers over ranks on the device.
    """

    micro: list[dict[str, torch.Tensor]]
    counts: dict[str, float]
    signature: tuple = ()  # several processes: the global step's shapes (every rank's), for the CUDA graphs
    shape_steps: int | None = None  # steps of the run with this step's shapes (None: not known), for the graphs
    global_counts: dict[str, float] | None = None  # several processes: each loss term's count over all ranks,
    # where the rank knows it (fine-tuning sees the global batch): the step then needs no collective for it
    every_ids: torch.Tensor | None = None  # several processes: every rank's input ids of the step, flat, where
    # the rank knows them: the word-embedding rows the gradients' sum touches (``GradientReducer``)

    @property
    def sequences(self) -> int:
        return int(self.counts.get("sequences", 0))


def round_up(n: int, multiple: int = PAD_MULTIPLE) -> int:
    return -(-n // multiple) * multiple


def trim(batch: dict[str, torch.Tensor], multiple: int = PAD_MULTIPLE) -> dict[str, torch.Tensor]:
    """Cut the sequence (last) dim to the longest sequence, rounded up to ``multiple``.

    Per-token labels (same shape as ``input_ids``) are cut with it; everything else is kept.
    """
    ids = batch["input_ids"]
    s = ids.shape[-1]
    longest = int(batch["attention_mask"].sum(dim=-1).max())
    keep = min(s, max(multiple, round_up(longest, multiple)))
    if keep == s:
        return batch
    out = dict(batch)
    for k, v in batch.items():
        if k in SEQUENCE_KEYS or (k == "labels" and v.shape == ids.shape):
            out[k] = v[..., :keep].contiguous()
    return out


class Prefetcher:
    """Iterate the ``StepBatch``es that ``make_step(batch)`` cuts, ``depth`` steps ahead in a daemon thread."""

    def __init__(self, batches: Iterable, make_step: Callable[[object], StepBatch], *, pin: bool = False,
                 depth: int = 4):
        self._q: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(iter(batches), make_step, pin), daemon=True)
        self._thread.start()

    def _work(self, it: Iterator, make_step: Callable, pin: bool) -> None:
        try:
            for batch in it:
                if self._stop.is_set():
                    return
                sb = make_step(batch)
                if pin:
                    sb.micro = [{k: v.pin_memory() for k, v in m.items()} for m in sb.micro]
                    if sb.every_ids is not None:
                        sb.every_ids = sb.every_ids.pin_memory()
                while not self._stop.is_set():
                    try:
                        self._q.put(sb, timeout=0.1)
                        break
                    except queue.Full:
                        continue
            self._q.put(None)
        except BaseException as e:  # hand the error to the consumer
            self._q.put(e)

    def __iter__(self):
        return self

    def __next__(self) -> StepBatch:
        item = self._q.get()
        if item is None:
            raise StopIteration
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self._stop.set()
        try:
            while True:
                self._q.get_nowait()
        except queue.Empty:
            pass
        self._thread.join(timeout=5)


# --------------------------------------------------------------------------- pretraining


def pretraining_step(batch: dict[str, torch.Tensor], micro_batch_size: int, multiple: int = PAD_MULTIPLE,
                     pack: bool = False) -> StepBatch:
    """A rank batch of ``PretrainingData`` -> micro-batches and counts (``mlm`` = masked predictions,
    ``nsp`` = sequences: the two loss terms' normalisers); with ``pack``, each micro-batch with its packed
    layout (``collate``)."""
    b = batch["input_ids"].shape[0]
    micro = [trim({k: v[start:start + micro_batch_size] for k, v in batch.items()}, multiple)
             for start in range(0, b, micro_batch_size)]
    if pack:
        from bertctl.nn.packing import layout

        for m in micro:
            m["packing"] = layout(m["attention_mask"])
    lengths = batch["attention_mask"].sum(dim=1).double()
    masked = float((batch["masked_lm_labels"] != IGNORE_INDEX).sum())
    counts = {"mlm": masked, "nsp": float(b), "sequences": float(b), "tokens": float(lengths.sum()),
              "attn_pairs": float((lengths * lengths).sum()),
              "padded_tokens": float(sum(m["input_ids"].numel() for m in micro))}
    return StepBatch(micro, counts)


def pretraining_batches(data, global_batch_size: int, *, seed: int, epoch: int = 0, start_step: int = 0,
                        rank: int = 0, world_size: int = 1) -> Iterator[dict[str, torch.Tensor]]:
    """One epoch of ``PretrainingData`` from ``start_step`` on, in its plain order: the epoch's permutation
    (the data set's, from (seed, epoch)) cut into global batches, batch ``k`` being ``perm[k*G:(k+1)*G]``,
    of which rank ``r`` of ``world_size`` takes the ``r``-th contiguous slice. So N ranks together see
    exactly what one process sees, and ``start_step`` seeks to batch ``k`` without reading the ones
    before it. Tensors are CPU int64, ``max_seq_length`` wide (``trim`` cuts the padding)."""
    if global_batch_size < 1 or global_batch_size % world_size:
        raise BertctlError(f"global batch size {global_batch_size} must be a positive multiple of "
                           f"world size {world_size}")
    if not 0 <= rank < world_size:
        raise BertctlError(f"rank {rank} not in [0, {world_size})")
    steps = data.steps_per_epoch(global_batch_size)
    if steps == 0:
        raise BertctlError(f"{data.dir}: {data.num_instances} instances in split {data.split!r}, fewer than one "
                           f"global batch of {global_batch_size}")
    perm = data.permutation(seed, epoch)
    b = global_batch_size // world_size
    for k in range(start_step, steps):
        idx = perm[k * global_batch_size + rank * b : k * global_batch_size + (rank + 1) * b]
        yield data.collate(idx, seed=seed, epoch=epoch)


def bucketed_batches(data, global_batch_size: int, *, seed: int, epoch: int = 0, start_step: int = 0,
                     rank: int = 0, world_size: int = 1, window: int = 64) -> Iterator[dict[str, torch.Tensor]]:
    """One epoch of ``PretrainingData`` in length-bucketed order: less padding when lengths vary.

    The epoch's permutation (the data set's, from (seed, epoch)) is cut into windows of
    ``window`` global batches; inside a window the instances are sorted by length and cut
    into global batches, whose order is then shuffled from (seed, epoch, window start).
    Every instance is still seen once an epoch; rank r takes the r-th slice of each global
    batch, and ``start_step`` seeks exactly (a window is recomputed, never replayed).
    """
    perm = data.permutation(seed, epoch)
    steps = data.steps_per_epoch(global_batch_size)
    b = global_batch_size // world_size
    for w0 in range(start_step - start_step % window, steps, window):
        w1 = min(steps, w0 + window)
        idx = perm[w0 * global_batch_size:w1 * global_batch_size]
        lengths = np.asarray(data.records(idx)["length"])
        ordered = idx[np.argsort(lengths, kind="stable")].reshape(w1 - w0, global_batch_size)
        ordered = ordered[np.random.default_rng([seed, epoch, w0, 7]).permutation(w1 - w0)]
        for k in range(max(w0, start_step), w1):
            yield data.collate(ordered[k - w0][rank * b:(rank + 1) * b], seed=seed, epoch=epoch)


# --------------------------------------------------------------------------- by length, for inference

# Padded tokens per forward pass, by device type: on the CPU small batches stay in its caches, a GPU
# wants large ones (its host time for a batch of short texts is several times its work).
BATCH_TOKENS = {"cpu": 1024, "cuda": 65536}


def length_batches(lengths: np.ndarray, batch_size: int | None, batch_tokens: int) -> list[np.ndarray]:
    """Indices into ``lengths``, longest first, cut into batches of at most ``batch_size`` texts (None:
    no limit) whose padded size (texts x longest) is at most ``batch_tokens``; a text longer than that
    goes alone."""
    order = np.argsort(-lengths, kind="stable")
    batch_size = batch_size or len(lengths)
    batches, start = [], 0
    while start < len(order):
        fit = max(1, min(batch_size, batch_tokens // int(lengths[order[start]])))  # the first is the longest
        batches.append(order[start:start + fit])
        start += fit
    return batches


# --------------------------------------------------------------------------- fine-tuning


def feature_length(feature: dict) -> int:
    return int(feature["input_ids"].shape[-1])


def loss_count(feature: dict) -> int:
    """What one feature adds to the loss's normaliser: its labelled tokens (token labels, -100 for
    none), else 1 (one example)."""
    labels = feature.get("labels")
    if isinstance(labels, np.ndarray) and labels.ndim == 1:
        return int((labels != IGNORE_INDEX).sum())
    return 1


def collate(features: Sequence[dict], pad_id: int = 0, multiple: int = PAD_MULTIPLE,
            length: int | None = None, pack: bool = False) -> dict[str, torch.Tensor]:
    """Stack task features into padded int64 tensors (padded to the longest, rounded up to ``multiple``,
    or to ``length``); with ``pack``, plus the batch's packed layout (``packing``, ``bertctl.nn.packing``)
    for a model whose attention is ``unpadded``.

    ``input_ids`` / ``token_type_ids`` are (S,) or (C, S) arrays (C choices); ``attention_mask``
    is derived from their lengths (``lengths`` per choice for multiple choice). ``labels`` may be a
    scalar (class / float score) or an (S,) array (token labels, padded with -100);
    ``start_positions`` / ``end_positions`` are ints. Keys starting with ``_`` stay out.
    """
    import torch

    first = features[0]
    length = length or round_up(max(feature_length(f) for f in features), multiple)
    ids = padded_ids(features, length, pad_id)
    types, mask = np.zeros_like(ids), np.zeros_like(ids)
    B = len(features)
    for i, f in enumerate(features):
        n = f["input_ids"].shape[-1]
        types[i, ..., :n] = f["token_type_ids"]
        if "lengths" in f:  # multiple choice: each choice has its own length
            for c, m in enumerate(f["lengths"]):
                mask[i, c, :m] = 1
        else:
            mask[i, :n] = 1
    batch = {"input_ids": ids, "token_type_ids": types, "attention_mask": mask}
    for key in ("labels", "start_positions", "end_positions"):
        if key not in first:
            continue
        value = first[key]
        if isinstance(value, np.ndarray) and value.ndim == 1:
            arr = np.full((B, length), IGNORE_INDEX, dtype=np.int64)
            for i, f in enumerate(features):
                arr[i, : len(f[key])] = f[key]
            batch[key] = arr
        else:
            dtype = np.float32 if isinstance(value, (float, np.floating)) else np.int64
            batch[key] = np.asarray([f[key] for f in features], dtype=dtype)
    out = {k: torch.from_numpy(v) for k, v in batch.items()}
    if pack:
        from bertctl.nn.packing import layout

        out["packing"] = layout(out["attention_mask"])
    return out


def padded_ids(features: Sequence[dict], length: int, pad_id: int = 0) -> np.ndarray:
    """The features' ``input_ids`` in one int64 array, each padded with ``pad_id`` to ``length``."""
    ids = np.full((len(features), *features[0]["input_ids"].shape[:-1], length), pad_id, dtype=np.int64)
    for i, f in enumerate(features):
        ids[i, ..., :f["input_ids"].shape[-1]] = f["input_ids"]
    return ids


def epoch_batches(lengths: np.ndarray, batch_size: int, seed: int, epoch: int, group_by_length: bool = False,
                  world_size: int = 1) -> list[np.ndarray]:
    """The global batches (index arrays) of one epoch: a pure function of (seed, epoch), so resume can seek.

    Plain: a random permutation cut into batches (the last may be smaller), as Hugging Face's
    Trainer does by default. ``group_by_length``: Hugging Face's ``LengthGroupedSampler`` scheme,
    the permutation cut into mega-batches of 50 batches, each sorted by length (longest first) and
    cut into batches, and the batch order shuffled again: less padding, batches of similar length.
    A last batch with fewer examples than processes joins the one before it (every rank needs one).
    """
    rng = np.random.default_rng([seed, epoch])
    perm = rng.permutation(len(lengths))
    if group_by_length:
        mega = batch_size * 50
        chunks = [perm[i: i + mega] for i in range(0, len(perm), mega)]
        perm = np.concatenate([c[np.argsort(-lengths[c], kind="stable")] for c in chunks])
    batches = [perm[i: i + batch_size] for i in range(0, len(perm), batch_size)]
    if len(batches) > 1 and len(batches[-1]) < world_size:
        batches[-2:] = [np.concatenate(batches[-2:])]
    if group_by_length:
        order = rng.permutation(len(batches))
        batches = [batches[i] for i in order]
    return batches


def median_step_length(features: Sequence[dict], batch_size: int, *, seed: int, group_by_length: bool,
                       world_size: int = 1) -> int:
    """The padded length (the global batch's longest, rounded up) of the median step of the first epoch."""
    lengths = np.asarray([feature_length(f) for f in features])
    return int(np.median([_padded(lengths[idx], None)
                          for idx in epoch_batches(lengths, batch_size, seed, 0, group_by_length, world_size)]))


def real_tokens(feature: dict) -> int:
    """A feature's tokens that are not padding (a multiple-choice feature's over all its choices)."""
    return int(sum(feature["lengths"])) if "lengths" in feature else feature_length(feature)


def task_step(features: Sequence[dict], idx: np.ndarray, *, rank: int, world_size: int, micro_batch_size: int | None,
              pad_id: int = 0, pad_to: dict[int, int] | None = None, pack: bool = False,
              pack_length: int | None = None) -> StepBatch:
    """One global batch ``idx`` of task features -> this rank's micro-batches and counts.

    Rank r takes the r-th of ``world_size`` near-equal contiguous slices. The loss term ``loss`` is
    normalised by examples, or by labelled tokens for per-token labels (NER), over the global batch.
    Several processes pad every micro-batch to the global batch's longest example, so that all ranks
    share one sequence length per step; the step's ``signature`` (that length and every rank's rows)
    is then the same on every rank, which the CUDA graphs of all ranks must agree on, and a task has
    as many signatures as one process has shapes. Every rank also knows the global batch's loss
    normaliser (``global_counts``) and input ids (``every_ids``), so the step needs no collective to
    learn them. ``pad_to`` (from ``common_lengths``) pads a padded length further, to a longer one
    that more steps share.

    ``pack``: each micro-batch carries its packed layout (``collate``), padded to ``pack_length`` when
    given (the padding then costs no work, and one length keeps the CUDA graphs to one per packed size).
    Several processes run padded (an empty layout), since every rank's graphs must take the same shapes.
    """
    import torch

    parts = np.array_split(idx, world_size)
    mine = parts[rank]
    micro_size = micro_batch_size or len(mine)
    length, signature = None, ()
    if world_size > 1:
        length = _padded(lengths_of(features, idx), pad_to)
        signature = (length, tuple(len(part) for part in parts), micro_batch_size)
    micro, counts = [], {"loss": float(sum(loss_count(features[i]) for i in mine)), "sequences": float(len(mine)),
                         "tokens": 0.0, "attn_pairs": 0.0, "padded_tokens": 0.0}
    totals = {"loss": float(sum(loss_count(features[i]) for i in idx))} if world_size > 1 else None
    for start in range(0, len(mine), micro_size):
        part = mine[start:start + micro_size]
        own = pack_length if pack and world_size == 1 and pack_length else _padded(lengths_of(features, part), pad_to)
        mb = collate([features[i] for i in part], pad_id, length=length or own, pack=pack and world_size == 1)
        if pack and world_size > 1:
            mb["packing"] = torch.empty(0, dtype=torch.int64)
        lengths = mb["attention_mask"].sum(dim=-1).double()
        counts["tokens"] += float(lengths.sum())
        counts["attn_pairs"] += float((lengths * lengths).sum())
        counts["padded_tokens"] += float(mb["input_ids"].numel())
        micro.append(mb)
    every = torch.from_numpy(padded_ids([features[i] for i in idx], length, pad_id)).reshape(-1) if world_size > 1 else None
    return StepBatch(micro, counts, signature, global_counts=totals, every_ids=every)


def lengths_of(features: Sequence[dict], idx: np.ndarray) -> np.ndarray:
    return np.asarray([feature_length(features[i]) for i in idx])


def _padded(lengths: np.ndarray, pad_to: dict[int, int] | None) -> int:
    """The length a batch of ``lengths`` is padded to: its longest, rounded up, then ``pad_to``'s."""
    n = round_up(int(lengths.max()))
    return pad_to.get(n, n) if pad_to else n


def shape_class(lengths: np.ndarray, idx: np.ndarray, world_size: int, micro_batch_size: int | None,
                pad_to: dict[int, int] | None = None, real: np.ndarray | None = None,
                pack_length: int | None = None, choices: int = 1) -> tuple:
    """What fixes the tensor shapes of the step ``task_step`` cuts from global batch ``idx``: several
    processes, the signature (the global longest, every rank's rows, the micro-batch size); one, each
    micro-batch's rows and its own padded length, and packed (``real``: each feature's real tokens), its
    packed row count. The same on every rank."""
    from bertctl.nn.packing import packed_rows

    if world_size > 1:
        return (_padded(lengths[idx], pad_to), tuple(len(p) for p in np.array_split(idx, world_size)), micro_batch_size)
    size = micro_batch_size or len(idx)
    shapes = []
    for s in range(0, len(idx), size):
        part = idx[s:s + size]
        if real is None:
            shapes.append((len(part), _padded(lengths[part], pad_to)))
        else:
            S = pack_length or _padded(lengths[part], pad_to)
            shapes.append((len(part), S, packed_rows(int(real[part].sum()), len(part) * choices * S)))
    return tuple(shapes)


def common_lengths(counts: collections.Counter, min_steps: int) -> dict[int, int]:
    """Padded length -> a longer one to pad to, so that as few steps as possible have a length that
    fewer than ``min_steps`` steps share (``counts``: steps per padded length, over the whole run).

    The lengths, shortest first, are gathered into groups of at least ``min_steps`` steps, each padded
    to its longest; a last group short of it joins the one before. CUDA graphs capture only lengths a
    run has enough steps of, and run the rest eagerly, which bounds a step by the host; padded this way,
    few steps are left eager for little more padding
    (``benchmarks/results/finetune-graph-min-steps-h200-9b4adab.json``).
    Attention, the losses and the counts mask the padding; only the dropout masks differ, drawn over
    a longer tensor.
    """
    groups: list[list[int]] = []
    group, steps = [], 0
    for n in sorted(counts):
        group.append(n)
        steps += counts[n]
        if steps >= min_steps:
            groups.append(group)
            group, steps = [], 0
    if group:
        if groups:
            groups[-1] += group
        else:
            groups.append(group)
    return {n: max(g) for g in groups for n in g if n != max(g)}


def _global_batches(start_step: int, lengths: np.ndarray, batch_size: int, seed: int, steps_per_epoch: int,
                    group_by_length: bool, world_size: int) -> Iterator[np.ndarray]:
    """The global batches from step ``start_step`` on, epoch after epoch (seeking, never replaying)."""
    epoch, k = divmod(start_step, steps_per_epoch)
    while True:
        yield from epoch_batches(lengths, batch_size, seed, epoch, group_by_length, world_size)[k:]
        epoch, k = epoch + 1, 0


def task_batches(features: Sequence[dict], batch_size: int, *, seed: int, start_step: int, steps_per_epoch: int,
                 group_by_length: bool, rank: int = 0, world_size: int = 1, micro_batch_size: int | None = None,
                 max_steps: int | None = None, min_shape_steps: int | None = None, pack: bool = False,
                 fixed_length: bool = False) -> Iterator[StepBatch]:
    """Global step ``start_step`` onwards, epoch after epoch (seeking, never replaying). With ``max_steps``
    each step's ``shape_steps`` counts the steps from ``start_step`` to ``max_steps`` that share its
    shapes (``shape_class``), which tells the CUDA graphs which shapes are worth a capture; with
    ``min_shape_steps`` too, a padded length that fewer steps of the whole run share is padded further,
    to the next common one (``common_lengths``; decided from step 0, so a resumed run pads alike). Not
    with one process's micro-batches: each is padded to its own longest, and the step's shape is then
    a combination of lengths that few steps share however the lengths are merged.

    ``pack`` (``task_step``): packed layouts, with ``fixed_length`` every micro-batch padded to the
    task's longest feature, so that a step's shapes vary only with its packed row count (for the CUDA
    graphs; the padding costs no work)."""
    lengths = np.asarray([feature_length(f) for f in features])
    args = (lengths, batch_size, seed, steps_per_epoch, group_by_length, world_size)
    plan = pad_to = None
    packing = pack and world_size == 1
    pack_length = round_up(int(lengths.max())) if packing and fixed_length else None
    real = np.asarray([real_tokens(f) for f in features]) if packing else None
    choices = int(features[0]["input_ids"].shape[0]) if features[0]["input_ids"].ndim == 2 else 1
    if max_steps is not None:
        if not packing and min_shape_steps and min_shape_steps > 1 and (world_size > 1 or not micro_batch_size):
            pad_to = common_lengths(collections.Counter(  # one padded length a step: the global batch's
                _padded(lengths[idx], None) for idx in itertools.islice(_global_batches(0, *args), max_steps)),
                min_shape_steps)
        plan = collections.Counter(shape_class(lengths, idx, world_size, micro_batch_size, pad_to, real, pack_length,
                                               choices)
                                   for idx in itertools.islice(_global_batches(start_step, *args),
                                                               max(0, max_steps - start_step)))
    for idx in _global_batches(start_step, *args):
        sb = task_step(features, idx, rank=rank, world_size=world_size, micro_batch_size=micro_batch_size, pad_to=pad_to,
                       pack=pack, pack_length=pack_length)
        if plan is not None:
            sb.shape_steps = plan[shape_class(lengths, idx, world_size, micro_batch_size, pad_to, real, pack_length,
                                              choices)]
        yield sb


def steps_per_epoch(num_examples: int, batch_size: int, world_size: int = 1) -> int:
    """Optimizer steps in one epoch of ``epoch_batches`` (it merges a last batch smaller than the world)."""
    steps = -(-num_examples // batch_size)
    if steps > 1 and num_examples - (steps - 1) * batch_size < world_size:
        steps -= 1
    return steps
