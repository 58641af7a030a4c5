"""Packed batches from the loader (``bertctl.nn.packing.layout``): the layout itself, and every model class fed
a loader-made layout against the padded model on the same weights (float64 forward and gradients, bf16), at the
edges: a batch of one, a sequence of one token, the longest sequence, segments and positions restarting at each
sequence. On a GPU: no host sync in a packed training step, and the step captured as a CUDA graph."""
from __future__ import annotations

import collections
import itertools

import numpy as np
import pytest
import torch

from bertctl.config import BertConfig
from bertctl.data import batching
from bertctl.model import (BertForMultipleChoice, BertForPreTraining, BertForQuestionAnswering,
                           BertForSequenceClassification, BertForTokenClassification, BertModel)
from bertctl.nn.packing import PACK_BELOW, Packed, bucket, granule, layout, packed_rows
from bertctl.runtime import resolve

S = 24


def config() -> BertConfig:
    return BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=S, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def make_batch(lengths, width=S, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor(lengths)
    mask = (torch.arange(width)[None] < lengths[:, None]).long()
    ids = torch.randint(5, 97, (len(lengths), width), generator=g) * mask
    # segment B starts mid-sequence, so the packed rows must carry each token's own segment
    types = (torch.arange(width)[None] >= (lengths[:, None] + 1) // 2).long() * mask
    return ids, types, mask


# Batches with enough padding to be packed: a batch of one short sequence, a one-token sequence among
# others, and the longest sequence the model takes beside short ones.
EDGES = {"one sequence": [7], "a one-token sequence": [1, 9, 3, 12], "the longest sequence": [S, 2, 5, 1, 3]}


def twins(cls, dtype=torch.float64):
    torch.manual_seed(0)
    padded = cls(config(), resolve("cpu", attn="sdpa", kernels="torch")).to(dtype)
    packed = cls(config(), resolve("cpu", attn="unpadded", kernels="torch")).to(dtype)
    packed.load_state_dict(padded.state_dict())
    return padded, packed


# ----------------------------------------------------------------------------------------- the layout


def test_buckets_are_few_and_never_waste_more_than_a_sixteenth():
    sizes = {bucket(t) for t in range(1000, 2000)}
    assert len(sizes) <= 17
    for t in [1, 7, 8, 63, 100, 1023, 1024, 5000, 11_264, 32_767]:
        b = bucket(t)
        assert t < b <= t + granule(t + 1)
        assert b - t <= max(8, t / 16 + 1)
        assert b - t <= granule(b)  # the bound Packed.from_layout gives the dummy sequence


def test_layout_packs_the_real_tokens_and_one_dummy_sequence():
    _, _, mask = make_batch([5, 1, 12, 3])
    lay = layout(mask)
    R, real = 4, 21
    T = bucket(real)
    assert lay.shape == (R + 2 + 2 * T,)
    cu, pack_index, unpack_index = lay.split([R + 2, T, T])
    assert cu.tolist() == [0, 5, 6, 18, 21, T]
    flat = mask.flatten().nonzero().squeeze(1)
    assert torch.equal(pack_index[:real], flat) and torch.equal(unpack_index[:real], flat)
    assert not pack_index[real:].any() and (unpack_index[real:] == R * S).all()  # the dummy rows go nowhere


def test_a_nearly_full_batch_is_not_packed():
    _, _, mask = make_batch([S, S, S, S - 1])
    assert layout(mask).numel() == 0
    assert packed_rows(int(mask.sum()), mask.numel()) == 0
    assert packed_rows(int(PACK_BELOW * 100) - 1, 100) == bucket(int(PACK_BELOW * 100) - 1)


def test_from_layout_equals_from_mask_on_the_real_rows():
    _, _, mask = make_batch([5, 1, 12, 3])
    a, b = Packed.from_layout(layout(mask), mask.bool()), Packed.from_mask(mask.bool())
    x = torch.randn(4, S, 6)
    real = mask.bool()
    torch.testing.assert_close(a.unpack(a.pack(x))[real], x[real], rtol=0, atol=0)
    assert not a.unpack(a.pack(x))[~real].any() and torch.equal(a.unpack(a.pack(x)), b.unpack(b.pack(x)))
    assert a.positions[:21].tolist() == [*range(5), 0, *range(12), *range(3)]
    assert a.max_seqlen >= max(12, a.pack_index.numel() - 21)


# ----------------------------------------------------------------------------------------- the models


def run(model, ids, types, mask, packing, **kw):
    return model(ids, types, mask, packing=packing, **kw)


@pytest.mark.parametrize("edge", EDGES)
def test_encoder_forward_and_gradients_match_the_padded_model_float64(edge):
    padded, packed = twins(BertModel)
    ids, types, mask = make_batch(EDGES[edge])
    lay = layout(mask)
    assert lay.numel(), "the case must be packed"
    w = torch.randn(*ids.shape, 32, dtype=torch.float64)
    real = mask.bool()
    results = []
    for model, packing in ((padded, None), (packed, lay)):
        out = run(model, ids, types, mask, packing, output_hidden_states=True)
        loss = (out.last_hidden_state * w * mask[..., None]).sum() + out.pooler_output.square().sum()
        loss.backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = results
    torch.testing.assert_close(b.last_hidden_state[real], a.last_hidden_state[real], rtol=1e-10, atol=1e-10)
    assert not b.last_hidden_state[~real].any()
    torch.testing.assert_close(b.pooler_output, a.pooler_output, rtol=1e-10, atol=1e-10)
    for ha, hb in zip(a.hidden_states, b.hidden_states):  # the embeddings first: positions and segments per sequence
        torch.testing.assert_close(hb[real], ha[real], rtol=1e-10, atol=1e-10)
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-9, atol=1e-11, msg=name)


def test_positions_and_segments_restart_at_each_sequence():
    """Each packed sequence embeds as it would alone: its own positions from 0 and its own segments."""
    padded, packed = twins(BertModel)
    ids, types, mask = make_batch([6, 11, 4])
    together = run(packed, ids, types, mask, layout(mask)).last_hidden_state
    for i, n in enumerate([6, 11, 4]):
        alone = padded(ids[i:i + 1, :n], types[i:i + 1, :n], mask[i:i + 1, :n]).last_hidden_state[0]
        torch.testing.assert_close(together[i, :n], alone, rtol=1e-10, atol=1e-10)


def head_inputs(cls, ids, types, mask):
    B = ids.shape[0]
    g = torch.Generator().manual_seed(3)
    lengths = mask.sum(1)
    if cls is BertForSequenceClassification:
        return dict(labels=torch.randint(0, 2, (B,), generator=g))
    if cls is BertForTokenClassification:
        return dict(labels=torch.where(mask.bool(), torch.randint(0, 2, ids.shape, generator=g), -100))
    if cls is BertForQuestionAnswering:
        start = (lengths - 1) // 2
        return dict(start_positions=start, end_positions=lengths - 1)
    if cls is BertForPreTraining:
        pos = torch.stack([torch.tensor([0, int(n) - 1]) for n in lengths])
        return dict(masked_positions=pos, masked_lm_labels=torch.randint(5, 97, pos.shape, generator=g),
                    next_sentence_label=torch.randint(0, 2, (B,), generator=g))
    raise AssertionError(cls)


@pytest.mark.parametrize("cls", [BertForSequenceClassification, BertForTokenClassification, BertForQuestionAnswering,
                                 BertForPreTraining])
@pytest.mark.parametrize("edge", EDGES)
def test_every_head_matches_the_padded_model_float64(cls, edge):
    padded, packed = twins(cls)
    ids, types, mask = make_batch(EDGES[edge])
    extra = head_inputs(cls, ids, types, mask)
    outs, grads = [], []
    for model, packing in ((padded, None), (packed, layout(mask))):
        out = run(model, ids, types, mask, packing, **extra)
        out.loss.backward()
        outs.append(out)
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    a, b = outs
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-10, atol=1e-10)
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], rtol=1e-9, atol=1e-11, msg=name)


def test_multiple_choice_packs_every_choice():
    padded, packed = twins(BertForMultipleChoice)
    ids, types, mask = make_batch([3, 9, 1, 5, 7, 2])
    shape = lambda t: t.view(2, 3, S)  # noqa: E731
    labels = torch.tensor([2, 0])
    a = padded(shape(ids), shape(types), shape(mask), labels=labels)
    b = packed(shape(ids), shape(types), shape(mask), labels=labels, packing=layout(shape(mask)))
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-10, atol=1e-10)


def test_bf16_autocast_matches_the_padded_model():
    padded, packed = twins(BertForSequenceClassification, dtype=torch.float32)
    ids, types, mask = make_batch(EDGES["a one-token sequence"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = padded(ids, types, mask).logits.float()
        b = packed(ids, types, mask, packing=layout(mask)).logits.float()
    reference = padded(ids, types, mask).logits
    assert (b - reference).abs().max() <= 2 * (a - reference).abs().max() + 2e-2


def test_an_empty_layout_runs_the_batch_padded(monkeypatch):
    """The loader's empty layout means "not worth packing": the model must not pack it itself either."""
    padded, packed = twins(BertModel)
    ids, types, mask = make_batch([S, S, S, S - 1])

    def refuse(*_):
        raise AssertionError("packed on the device")

    monkeypatch.setattr(Packed, "from_mask", refuse)
    expected = padded(ids, types, mask).last_hidden_state
    got = packed(ids, types, mask, packing=layout(mask)).last_hidden_state
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-10)


# ----------------------------------------------------------------------------------------- the loader


def features(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [{"input_ids": rng.integers(5, 97, n), "token_type_ids": np.zeros(n, dtype=np.int64), "labels": int(i % 2)}
            for i, n in enumerate(lengths)]


def test_task_batches_pack_and_plan_their_shapes_exactly():
    """Packed steps at one fixed width: the plan (each step's count of steps sharing its shapes, what the CUDA
    graphs decide captures by) must count the shapes the steps really have."""
    rng = np.random.default_rng(1)
    feats = features(rng.integers(3, 40, 300))
    steps = 30
    got = list(itertools.islice(batching.task_batches(feats, 16, seed=0, start_step=0, steps_per_epoch=19,
                                                      group_by_length=False, max_steps=steps, pack=True,
                                                      fixed_length=True), steps))
    keys = [tuple((tuple(m["input_ids"].shape), tuple(m["packing"].shape)) for m in sb.micro) for sb in got]
    assert {k[0][0][1] for k in keys} == {40}  # one width: the longest feature, rounded up
    counts = collections.Counter(keys)
    assert [sb.shape_steps for sb in got] == [counts[k] for k in keys]
    assert len(counts) < steps / 2  # the buckets keep shapes repeating
    for sb in got:
        (m,) = sb.micro
        p = Packed.from_layout(m["packing"], m["attention_mask"].bool())
        assert int(p.cu_seqlens[-2]) == int(m["attention_mask"].sum()) == sb.counts["tokens"]


def test_several_processes_run_padded():
    feats = features([5, 9, 12, 3, 7, 8, 2, 30])
    sb = batching.task_step(feats, np.arange(8), rank=0, world_size=2, micro_batch_size=None, pack=True)
    assert sb.micro[0]["packing"].numel() == 0


# ----------------------------------------------------------------------------------------- on a GPU


@pytest.mark.cuda
def test_a_packed_training_step_never_waits_for_the_gpu():
    """Forward, backward and the optimizer step on a loader-packed batch with the sync debugger set to error."""
    torch.manual_seed(0)
    conf = BertConfig(vocab_size=97, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                      max_position_embeddings=S)
    model = BertForSequenceClassification(conf, resolve("cuda", attn="unpadded")).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    ids, types, mask = make_batch([7, 1, 20, 3])
    batch = {k: v.cuda() for k, v in dict(input_ids=ids, token_type_ids=types, attention_mask=mask,
                                          labels=torch.tensor([0, 1, 1, 0]), packing=layout(mask)).items()}
    for _ in range(2):  # the first call sets up the kernels (which may sync)
        torch.cuda.set_sync_debug_mode("error" if _ else 0)
        try:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(**batch).loss
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        finally:
            torch.cuda.set_sync_debug_mode(0)


@pytest.mark.cuda
def test_a_packed_step_replays_as_a_cuda_graph_like_the_eager_step():
    """The engine's whole-step graph over packed batches: the same losses and weights as eager steps."""
    from bertctl.config import TrainConfig
    from bertctl.tasks.trainer import TaskObjective, label_loss
    from bertctl.train import distributed
    from bertctl.train.engine import Engine

    conf = BertConfig(vocab_size=97, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                      max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    rng = np.random.default_rng(2)
    feats = features(rng.integers(2, 40, 96))
    results = []
    for graphs in (False, True):
        torch.manual_seed(0)
        model = BertForSequenceClassification(conf, resolve("cuda", attn="unpadded"))
        cfg = TrainConfig(batch_size=16, lr=1e-3, warmup_steps=0, show_progress=False, device="cuda")
        engine = Engine(cfg, resolve("cuda", "bf16", cuda_graphs=graphs), model, TaskObjective(label_loss),
                        dist=distributed.Dist(device=torch.device("cuda", torch.cuda.current_device())), max_steps=12)
        stats = torch.zeros(1, device="cuda")
        steps = batching.task_batches(feats, 16, seed=0, start_step=0, steps_per_epoch=6, group_by_length=False,
                                      max_steps=12, pack=True, fixed_length=True)
        for _, sb in zip(range(12), steps):
            sb.shape_steps = 12  # capture every shape
            engine.train_step(sb, stats)
        torch.cuda.synchronize()
        if graphs:
            assert engine.graphs is not None and len(engine.graphs.graphs) >= 1
        results.append((stats.clone(), {n: p.detach().clone() for n, p in model.named_parameters()}))
    (sa, wa), (sb_, wb) = results
    torch.testing.assert_close(sb_, sa, rtol=1e-4, atol=1e-4)
    for name in wa:
        torch.testing.assert_close(wb[name], wa[name], rtol=1e-3, atol=1e-4, msg=name)
