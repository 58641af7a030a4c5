"""PretrainingData: integrity checks, rank split, seeking, dynamic masking."""
from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch

from bertctl.data.batching import pretraining_batches
from bertctl.data.build import build_data
from bertctl.data.config import DataConfig
from bertctl.data.dataset import PretrainingData
from bertctl.errors import BertctlError
from bertctl.text.wordpiece import BertTokenizer
from helpers import whole_word_masks


@pytest.fixture(scope="module")
def tokenizer(minilm_vocab):
    return BertTokenizer.from_vocab_file(minilm_vocab)


@pytest.fixture(scope="module")
def built(tmp_path_factory, shared_data, tokenizer):
    """The same inaugural addresses built with static and with dynamic masking."""
    root = tmp_path_factory.mktemp("loader")
    inputs = [shared_data / "corpus" / "inaugural"]
    for name, dynamic in (("static", False), ("dynamic", True)):
        cfg = DataConfig(format="text", dupe_factor=1, seed=11, chunk_bytes=200_000, shard_size=700,
                         dynamic_masking=dynamic, holdout_fraction=0.1)
        build_data(inputs, root / name, tokenizer, cfg, progress=False)
    return root


def test_open_and_contract(built, minilm_vocab, tokenizer):
    ds = PretrainingData(built / "static", vocab=minilm_vocab)
    m = json.loads((built / "static" / "manifest.json").read_text())
    assert ds.num_instances == m["splits"]["train"]["num_instances"] == len(ds) > 1000
    assert (ds.max_seq_length, ds.max_predictions, ds.vocab_size) == (128, 20, 30522)
    PretrainingData(built / "static", vocab=tokenizer)  # a tokenizer works as well as a path
    G = 24
    assert ds.steps_per_epoch(G) == ds.num_instances // G
    batch = next(pretraining_batches(ds, G, seed=0))
    assert set(batch) == {"input_ids", "token_type_ids", "attention_mask", "masked_positions", "masked_lm_labels",
                          "next_sentence_label"}
    assert all(t.dtype == torch.int64 for t in batch.values())
    S = batch["input_ids"].shape[1]
    lengths = batch["attention_mask"].sum(1)
    assert S == 128  # full width: the batch loader trims
    assert (batch["attention_mask"] == (torch.arange(S) < lengths[:, None])).all()
    assert batch["masked_positions"].shape == batch["masked_lm_labels"].shape == (G, 20)
    unused = batch["masked_positions"] == 0
    assert (batch["masked_lm_labels"][unused] == -100).all() and (batch["masked_lm_labels"][~unused] >= 0).all()
    assert set(batch["next_sentence_label"].tolist()) <= {0, 1}
    from bertctl.data.batching import trim

    trimmed = trim(batch, 8)
    T = trimmed["input_ids"].shape[1]
    assert T % 8 == 0 and T - 8 < lengths.max() <= T  # trimmed to the longest, rounded up to 8
    assert torch.equal(trimmed["input_ids"], batch["input_ids"][:, :T])
    assert torch.equal(trimmed["masked_positions"], batch["masked_positions"])


def test_wrong_vocabulary_or_split(built, tokenizer):
    other = list(tokenizer.ids_to_tokens)
    other[2000], other[2001] = other[2001], other[2000]
    with pytest.raises(BertctlError, match="different vocabulary"):
        PretrainingData(built / "static", vocab=other)
    with pytest.raises(BertctlError, match="no 'test' split"):
        PretrainingData(built / "static", split="test")
    with pytest.raises(BertctlError, match="no manifest"):
        PretrainingData(built)
    ev = PretrainingData(built / "static", split="eval")
    assert 0 < ev.num_instances < PretrainingData(built / "static").num_instances


def test_corrupted_shard_is_detected(built, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(built / "static", bad)
    shard = sorted(bad.glob("train-*.npy"))[1]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    shard.write_bytes(bytes(data))
    with pytest.raises(BertctlError, match=shard.name):
        PretrainingData(bad)
    lazy = PretrainingData(bad, verify="lazy")  # big data sets: checked on first touch, before use
    with pytest.raises(BertctlError, match=f"{shard.name}.*corrupted"):
        for _ in pretraining_batches(lazy, 64, seed=0):
            pass
    shard.write_bytes(bytes(data[:-10]))
    with pytest.raises(BertctlError, match=f"{shard.name}.*size"):
        PretrainingData(bad, verify="lazy")


def test_ranks_together_see_one_process(built):
    ds = PretrainingData(built / "static")
    G, W = 32, 4
    single = list(pretraining_batches(ds, G, seed=3, epoch=1))
    per_rank = [list(pretraining_batches(ds, G, seed=3, epoch=1, rank=r, world_size=W)) for r in range(W)]
    assert all(len(p) == len(single) == ds.steps_per_epoch(G) for p in per_rank)
    for k, batch in enumerate(single):
        for key, value in batch.items():
            assert torch.equal(torch.cat([per_rank[r][k][key] for r in range(W)]), value), (k, key)
    with pytest.raises(BertctlError, match="multiple"):
        next(pretraining_batches(ds, 30, seed=0, world_size=4))


def test_epoch_order_and_seek(built):
    ds = PretrainingData(built / "static")
    G = 64
    first = [b["input_ids"] for b in pretraining_batches(ds, G, seed=5)]
    again = [b["input_ids"] for b in pretraining_batches(ds, G, seed=5)]
    other = [b["input_ids"] for b in pretraining_batches(ds, G, seed=5, epoch=1)]
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert not torch.equal(first[0], other[0])
    # one epoch is a permutation: every instance once (rows compared as bytes)
    rows = {r.numpy().tobytes() for b in first for r in b}
    everything = {r.numpy().tobytes() for b in pretraining_batches(ds, ds.num_instances, seed=0)
                  for r in b["input_ids"]}
    assert len(rows) == ds.steps_per_epoch(G) * G and rows <= everything and len(everything) == ds.num_instances

    reads = []
    original = ds.records
    ds.records = lambda idx: reads.append(len(idx)) or original(idx)
    k = ds.steps_per_epoch(G) - 2
    sought = list(pretraining_batches(ds, G, seed=5, start_step=k))
    assert len(sought) == 2 and reads == [G, G]  # no replay of the k batches before
    assert torch.equal(sought[0]["input_ids"], first[k])


def test_dynamic_masking(built, tokenizer):
    ds = PretrainingData(built / "dynamic")
    raw = np.concatenate([np.load(built / "dynamic" / s["file"])
                          for s in ds.manifest["splits"]["train"]["shards"]])
    assert "masked_positions" not in raw.dtype.names  # stored unmasked
    idx = np.arange(0, 600)
    e0, e0b, e1 = (ds.collate(idx, seed=9, epoch=e) for e in (0, 0, 1))
    assert all(torch.equal(e0[k], e0b[k]) for k in e0)  # deterministic from (seed, epoch, index)
    assert (e0["masked_positions"] != e1["masked_positions"]).any(1).float().mean() > 0.95  # new masks every epoch
    assert not torch.equal(ds.collate(idx, seed=10, epoch=0)["masked_positions"], e0["masked_positions"])

    counts = {"mask": 0, "same": 0, "random": 0}
    total = 0
    for batch in (e0, e1):
        pos, labels = batch["masked_positions"], batch["masked_lm_labels"]
        used = pos > 0
        lengths = torch.from_numpy(raw["length"][idx].astype(np.int64))
        expected = torch.clamp(torch.round(lengths * 0.15), 1, 20)  # the budget rule (no .5 ties below 128)
        assert torch.equal(used.sum(1), expected.long())
        rows = torch.arange(len(idx))[:, None].expand_as(pos)[used]
        original = torch.from_numpy(raw["input_ids"][idx].astype(np.int64))
        assert torch.equal(labels[used], original[rows, pos[used]])  # labels are the stored tokens
        shown = batch["input_ids"][rows, pos[used]]
        counts["mask"] += int((shown == tokenizer.mask_token_id).sum())
        counts["same"] += int((shown == labels[used]).sum())
        total += int(used.sum())
        # everything not masked is the stored token
        untouched = batch["input_ids"].clone()
        untouched[rows, pos[used]] = original[rows, pos[used]]
        assert torch.equal(untouched, original)
    counts["random"] = total - counts["mask"] - counts["same"]
    for key, p in (("mask", 0.8), ("same", 0.1), ("random", 0.1)):
        assert abs(counts[key] / total - p) < 4 * math.sqrt(p * (1 - p) / total), (key, counts, total)


def test_dynamic_whole_word_masking(tmp_path, shared_data, tokenizer):
    inputs = [shared_data / "corpus" / "state_union" / n for n in ("1970-Nixon.txt", "1971-Nixon.txt")]
    cfg = DataConfig(format="text", dupe_factor=1, dynamic_masking=True, whole_word_mask=True, seed=2)
    build_data(inputs, tmp_path / "d", tokenizer, cfg, progress=False)
    ds = PretrainingData(tmp_path / "d")
    idx = np.arange(ds.num_instances)
    raw = ds.records(idx)
    cont = np.array([t.startswith("##") for t in tokenizer.ids_to_tokens])
    e0, e1 = ds.collate(idx, seed=1, epoch=0), ds.collate(idx, seed=1, epoch=1)
    assert not torch.equal(e0["masked_positions"], e1["masked_positions"])
    multi_piece = 0
    for r in range(len(idx)):
        n = int(raw["length"][r])
        ids = raw["input_ids"][r, :n].astype(np.int64)
        pos = e0["masked_positions"][r]
        pos = pos[pos > 0].numpy()
        assert torch.equal(e0["masked_lm_labels"][r, : len(pos)], torch.from_numpy(ids[pos]))
        masked = np.zeros(n, bool)
        masked[pos] = True
        multi_piece += whole_word_masks(ids, masked, cont, tokenizer)
    assert multi_piece > 10
