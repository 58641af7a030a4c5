"""Fine-tuning on the one engine: batching, dynamic padding, accumulation, processes, exact resume, the schedule."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bertctl.checkpoints import training
from bertctl.errors import BertctlError
from bertctl.config import FinetuneConfig
from bertctl.runtime import resolve
from bertctl.tasks import trainer as T
from bertctl.data import batching as L
from test_finetune_support import make_tiny_model_dir


def test_epoch_batches_cover_everything_once_and_group_lengths():
    lengths = np.random.default_rng(0).integers(5, 120, size=1000)
    for group in (False, True):
        batches = L.epoch_batches(lengths, 32, seed=3, epoch=1, group_by_length=group)
        flat = np.concatenate(batches)
        assert sorted(flat) == list(range(1000))
        assert batches[0].tolist() == L.epoch_batches(lengths, 32, 3, 1, group)[0].tolist()  # pure in (seed, epoch)
    assert L.epoch_batches(lengths, 32, 3, 1, True)[0].tolist() != L.epoch_batches(lengths, 32, 3, 2, True)[0].tolist()
    # Grouping cuts padding: tokens in padded batches vs the random order.
    def padded(bs):
        return sum(len(b) * lengths[b].max() for b in bs)
    assert padded(L.epoch_batches(lengths, 32, 3, 1, True)) < 0.7 * padded(L.epoch_batches(lengths, 32, 3, 1, False))


def test_collate_pads_to_multiple_of_8_with_masks():
    feats = [{"input_ids": np.array([101, 5, 102]), "token_type_ids": np.array([0, 0, 0]), "labels": 1},
             {"input_ids": np.array([101, 5, 6, 7, 8, 9, 10, 11, 12, 102]), "token_type_ids": np.zeros(10), "labels": 0}]
    b = L.collate(feats)
    assert b["input_ids"].shape == (2, 16)
    assert b["attention_mask"].sum(1).tolist() == [3, 10]
    assert b["input_ids"][0, 3:].eq(0).all() and b["labels"].tolist() == [1, 0]
    tok = [{"input_ids": np.array([1, 2]), "token_type_ids": np.zeros(2), "labels": np.array([-100, 3])}]
    assert L.collate(tok)["labels"].tolist() == [[-100, 3] + [-100] * 6]


def test_a_last_batch_smaller_than_the_world_joins_the_one_before():
    lengths = np.ones(65)
    assert [len(b) for b in L.epoch_batches(lengths, 32, 0, 0, world_size=1)] == [32, 32, 1]
    assert [len(b) for b in L.epoch_batches(lengths, 32, 0, 0, world_size=2)] == [32, 33]
    assert L.steps_per_epoch(65, 32, 1) == 3 and L.steps_per_epoch(65, 32, 2) == 2


@pytest.mark.parametrize("tokens", [False, True], ids=["sequence", "token"])
def test_every_rank_knows_the_global_batchs_loss_normaliser_and_ids(tokens):
    """Several processes: each rank's step carries the loss normaliser of the whole global batch (the
    sum of every rank's own) and every rank's input ids (the embedding rows the gradients' sum
    touches), so the step needs no collective to learn them; one process carries neither."""
    rng = np.random.default_rng(1)
    feats = []
    for n in rng.integers(3, 30, 23):
        labels = np.where(rng.random(n + 2) < 0.3, -100, rng.integers(0, 3, n + 2)) if tokens else 1
        feats.append({"input_ids": np.arange(n + 2), "token_type_ids": np.zeros(n + 2, dtype=np.int8), "labels": labels})
    idx = rng.permutation(23)
    for world in (2, 3):
        steps = [L.task_step(feats, idx, rank=r, world_size=world, micro_batch_size=4) for r in range(world)]
        total = sum(sb.counts["loss"] for sb in steps)
        assert total == (sum(int((f["labels"] != -100).sum()) for f in feats) if tokens else 23)
        assert all(sb.global_counts == {"loss": total} for sb in steps)
        every = torch.cat([m["input_ids"].reshape(-1) for sb in steps for m in sb.micro])
        assert all(torch.equal(sb.every_ids, every) for sb in steps)
    one = L.task_step(feats, idx, rank=0, world_size=1, micro_batch_size=None)
    assert one.global_counts is None and one.every_ids is None


def _setup(tmp_path, dropout: float | None = None, tokens: bool = False, masks: str = "fused"):
    from bertctl.checkpoints.hf import load_pretrained
    from bertctl.model import BertForSequenceClassification, BertForTokenClassification

    d = make_tiny_model_dir(tmp_path / "tiny")
    rng = np.random.default_rng(0)
    feats = [{"input_ids": np.concatenate([[101], rng.integers(1000, 2000, n), [102]]),
              "token_type_ids": np.zeros(n + 2, dtype=np.int8), "labels": int(i % 2)}
             for i, n in enumerate(rng.integers(3, 30, 40))]
    if tokens:  # per-token labels, some ignored: the loss is normalised by labelled tokens
        for f in feats:
            n = len(f["input_ids"])
            f["labels"] = np.where(rng.random(n) < 0.3, -100, rng.integers(0, 3, n))
    over = {} if dropout is None else {"hidden_dropout_prob": dropout, "attention_probs_dropout_prob": dropout}
    cls = BertForTokenClassification if tokens else BertForSequenceClassification

    def build():  # the seed fixes the fresh head's initialisation
        torch.manual_seed(0)
        return load_pretrained(cls, d, fresh_heads=True, num_labels=3 if tokens else 2,
                               runtime=resolve("cpu", attn="sdpa", dropout_masks=masks), **over)
    return build, feats


@pytest.mark.parametrize("tokens", [False, True], ids=["sequence", "token"])
def test_predict_batches_by_token_budget_with_the_one_at_a_time_outputs(tmp_path, tokens):
    """Evaluation batches hold at most ``batch_tokens`` padded tokens (one example always fits) and
    ``batch_size`` examples, longest first; every output equals the example run alone (fp32)."""
    build, feats = _setup(tmp_path, dropout=0.0, tokens=tokens)
    model = build().eval()
    rows = []
    model.register_forward_pre_hook(lambda m, args, kwargs: rows.append(kwargs["input_ids"].shape), with_kwargs=True)
    alone = T.predict(model, feats, batch_size=1, per_token=tokens, device=torch.device("cpu"))
    rows.clear()
    budget = 96
    out = T.predict(model, feats, batch_size=8, batch_tokens=budget, per_token=tokens, device=torch.device("cpu"))
    lengths = sorted((len(f["input_ids"]) for f in feats), reverse=True)
    expected, start = [], 0
    while start < len(lengths):  # the budget, counted against the longest (first) example of each batch
        n = max(1, min(8, budget // lengths[start], len(lengths) - start))
        expected.append(n)
        start += n
    assert [r[0] for r in rows] == expected and any(n < 8 for n in expected) and max(expected) == 8
    for a, b in zip(alone, out):
        np.testing.assert_allclose(b[0], a[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [False, True], ids=["sequence", "token"])
def test_accumulation_gives_the_large_batch_result(tmp_path, tokens):
    """Batch 16 in micro-batches of 4 (and of 5: uneven) = batch 16 at once: same loss, same weights."""
    build, feats = _setup(tmp_path, dropout=0.0, tokens=tokens)
    base = dict(epochs=2, lr=1e-3, batch_size=16, device="cpu", show_progress=False)
    whole = T.fine_tune(build(), feats, FinetuneConfig.of(**base))
    for micro in (4, 5):
        acc = T.fine_tune(build(), feats, FinetuneConfig.of(**base, micro_batch_size=micro))
        for (k, a), b in zip(whole.model.state_dict().items(), acc.model.state_dict().values()):
            # the same sums in another order: float32 rounding only
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=k)
    # Against a plain reference loop: mean loss over the batch, one optimizer step per batch.
    ref = build()
    from bertctl.train.optim import build_optimizer, build_scheduler

    opt = build_optimizer(ref, "adamw", lr=1e-3, weight_decay=0.01, eps=1e-6, fused=False)
    steps = 2 * L.steps_per_epoch(len(feats), 16)
    sched = build_scheduler(opt, int(np.ceil(0.1 * steps)), steps)
    lengths = np.asarray([L.feature_length(f) for f in feats])
    for epoch in range(2):
        for idx in L.epoch_batches(lengths, 16, 42, epoch):
            out = ref(**L.collate([feats[i] for i in idx]))
            out.loss.backward()
            torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
    for (k, a), b in zip(whole.model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6, msg=k)


def test_the_seed_reaches_data_order_dropout_and_head(tmp_path):
    build, feats = _setup(tmp_path, dropout=0.1)
    runs = [T.fine_tune(build(), feats, FinetuneConfig.of(epochs=1, lr=1e-3, batch_size=8, device="cpu", show_progress=False,
                                                      seed=seed)) for seed in (42, 42, 43)]
    w = [r.model.classifier.weight for r in runs]
    assert torch.equal(w[0], w[1]) and not torch.allclose(w[0], w[2])
    # Same head and data order, other dropout: the step seed is drawn from the run seed.
    build2, _ = _setup(tmp_path / "b", dropout=0.1)
    a = L.epoch_batches(np.arange(40), 8, 42, 0)
    b = L.epoch_batches(np.arange(40), 8, 43, 0)
    assert [x.tolist() for x in a] != [x.tolist() for x in b]
    from bertctl.train.engine import step_seed

    assert step_seed(42, 0, 0) != step_seed(43, 0, 0)


@pytest.mark.parametrize("masks", ["torch", "fused"])
def test_resume_mid_epoch_gives_the_same_weights(tmp_path, masks):
    """Dropout 0.1 from either kind of mask (torch's, fine-tuning's, or the fused op's own)."""
    build, feats = _setup(tmp_path, masks=masks)
    cfg = FinetuneConfig.of(epochs=2, lr=1e-3, batch_size=8, device="cpu", show_progress=False, save_every=3)
    calls = []

    def evaluate(model, shards):
        calls.append(1)
        return {"score": float(len(calls))}

    straight = T.fine_tune(build(), feats, cfg, evaluate=evaluate, main_metric="score", output_dir=tmp_path / "a")

    class Crash(Exception):
        pass

    def crash(model, shards):  # dies at the end of epoch 1, after the step-3 checkpoint (5 steps per epoch)
        raise Crash

    with pytest.raises(Crash):
        T.fine_tune(build(), feats, cfg, evaluate=crash, main_metric="score", output_dir=tmp_path / "b")
    latest = training.latest_checkpoint(tmp_path / "b")
    assert latest.step == 3 and training.load_checkpoint(latest.path)["history"] == []
    calls.clear()
    resumed = T.fine_tune(build(), feats, cfg, evaluate=evaluate, main_metric="score", output_dir=tmp_path / "b",
                          resume=True)
    for (k, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    assert [h["epoch"] for h in resumed.history] == [1, 2]
    assert training.latest_checkpoint(tmp_path / "b") is None  # a complete run leaves no checkpoint behind


def test_select_best_restores_the_best_epoch(tmp_path):
    build, feats = _setup(tmp_path)
    cfg = FinetuneConfig.of(epochs=3, lr=1e-3, batch_size=8, device="cpu", show_progress=False, select_best=True)
    snapshots = []

    def evaluate(model, shards):
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        return {"score": [0.2, 0.9, 0.5][len(snapshots) - 1]}

    result = T.fine_tune(build(), feats, cfg, evaluate=evaluate, main_metric="score", output_dir=tmp_path / "c")
    assert result.best["epoch"] == 2
    for k, v in result.model.state_dict().items():
        torch.testing.assert_close(v, snapshots[1][k], rtol=0, atol=0)


def test_warmup_and_linear_decay_schedule(tmp_path):
    build, feats = _setup(tmp_path)
    cfg = FinetuneConfig.of(epochs=2, lr=1e-3, batch_size=8, device="cpu", show_progress=False, log_every=1)
    from bertctl.progress import MetricsLog
    import json

    with MetricsLog(tmp_path / "log.jsonl") as log:
        T.fine_tune(build(), feats, cfg, log=log)
    lrs = [r["lr"] for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines()) if r["event"] == "train"]
    total, warmup = 10, 1  # 40 rows / 8 = 5 steps x 2 epochs; 10% warm-up
    # lr after step s (LambdaLR has stepped s times): warm-up to the peak, then linear to 0.
    want = [1e-3 * (s / warmup if s < warmup else (total - s) / (total - warmup)) for s in range(1, total + 1)]
    np.testing.assert_allclose(lrs, want, rtol=1e-9, atol=1e-12)


@pytest.mark.cuda
def test_bf16_fine_tuning_on_gpu_learns(tmp_path):
    build, feats = _setup(tmp_path)
    cfg = FinetuneConfig.of(epochs=12, lr=1e-3, batch_size=8, device="cuda", show_progress=False, log_every=5)
    from bertctl.progress import MetricsLog
    import json

    with MetricsLog(tmp_path / "log.jsonl") as log:
        result = T.fine_tune(build(), feats, cfg, log=log)
    losses = [r["loss"] for r in map(json.loads, (tmp_path / "log.jsonl").read_text().splitlines())
              if r["event"] == "train"]
    assert all(np.isfinite(losses)) and np.mean(losses[-2:]) < losses[0] - 0.02, losses
    assert next(result.model.parameters()).dtype == torch.float32  # bf16 autocast, fp32 master weights
    out = T.predict(result.model, feats, device=torch.device("cuda"))
    acc = np.mean([o[0].argmax() == f["labels"] for o, f in zip(out, feats)])
    assert acc > 0.8  # 40 rows memorised


@pytest.mark.cuda
def test_a_step_across_processes_never_waits_for_the_gpu(tmp_path, monkeypatch):
    """With several processes the loss normalisers are summed on the GPU. Nothing in a step may make
    the host wait for the GPU (a pageable host-to-device copy does): each step would wait for the
    last, and two GPUs ran slower than one. The step runs under CUDA's sync check, as rank 0 of 2
    (the all-reduce itself stubbed: it is asynchronous in NCCL)."""
    from bertctl.train import distributed
    from bertctl.config import TrainConfig
    from bertctl.runtime import resolve
    from bertctl.data.batching import StepBatch
    from bertctl.train.engine import Engine

    build, feats = _setup(tmp_path)
    engine = Engine(TrainConfig(batch_size=8, warmup_steps=0), resolve("cuda", "bf16"), build(), T.TaskObjective(),
                    dist=distributed.Dist(device=torch.device("cuda", torch.cuda.current_device())), max_steps=10)
    engine.dist = distributed.Dist(rank=0, world_size=2, device=engine.device)
    monkeypatch.setattr(distributed, "all_reduce_sum", lambda t, d: t)
    batch = L.collate(feats[:8])
    sb = StepBatch([{k: v.pin_memory() for k, v in batch.items()}], {"loss": 8.0, "sequences": 8.0})
    stats = torch.zeros(1, device=engine.device)
    engine.train_step(sb, stats)  # warm-up: the first step allocates
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            loss = engine.train_step(sb, stats)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss)


def test_several_gpus_stepping_eagerly_get_a_note_naming_why():
    """Under torchrun on GPUs without CUDA graphs the run says why graphs are off and what it costs; one
    process, the CPU, or graphs on: nothing."""
    from bertctl.runtime import Runtime, graphs_unsupported

    def on_gpu(precision="bf16", compile=False):  # the runtime resolve() gives on a GPU (this machine may have none)
        return Runtime(device="cuda:0", precision=precision, compile=compile, graphs_unsupported=graphs_unsupported(
            device_type="cuda", precision=precision, compile=compile))

    compiled = on_gpu(compile=True)
    note = T.eager_ddp_note(compiled, 2, graphs_on=False)
    assert note.startswith("note: 2 processes without CUDA graphs (not with --compile)") and "0.74x" in note
    assert "(--no-cuda-graphs)" in T.eager_ddp_note(on_gpu(), 4, graphs_on=False)
    assert "(not with fp16" in T.eager_ddp_note(on_gpu(precision="fp16"), 2, graphs_on=False)
    on_cpu = Runtime(device="cpu", graphs_unsupported="they need a CUDA device")
    for args in ((compiled, 1, False), (on_cpu, 2, False), (on_gpu(), 2, True)):
        assert T.eager_ddp_note(*args) is None


def test_mid_run_checkpoints_are_written_while_training_goes_on(tmp_path, monkeypatch):
    """A slow disk: the step-3 checkpoint takes 0.5 s to write. Training goes on meanwhile (steps 4 and 5
    are logged before the checkpoint is), a crash at the end of the epoch still leaves that checkpoint
    complete, and it holds step 3's state: the resumed run ends with the uninterrupted run's weights."""
    import json
    import time

    from bertctl.progress import MetricsLog

    build, feats = _setup(tmp_path)
    cfg = FinetuneConfig.of(epochs=2, lr=1e-3, batch_size=8, device="cpu", show_progress=False, save_every=3, log_every=1)
    straight = T.fine_tune(build(), feats, cfg, output_dir=tmp_path / "a")
    real = training.save_checkpoint

    def slow(*args, **kwargs):
        time.sleep(0.5)
        return real(*args, **kwargs)

    monkeypatch.setattr(training, "save_checkpoint", slow)

    class Crash(Exception):
        pass

    def crash(model, shards):  # at the end of epoch 1 (5 steps), with the step-3 checkpoint still being written
        raise Crash

    with MetricsLog(tmp_path / "log.jsonl") as log, pytest.raises(Crash):
        T.fine_tune(build(), feats, cfg, evaluate=crash, main_metric="score", output_dir=tmp_path / "b", log=log)
    events = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    order = [(e["event"], e.get("step")) for e in events if e["event"] in ("train", "checkpoint")]
    assert order.index(("train", 5)) < order.index(("checkpoint", 3))
    assert training.latest_checkpoint(tmp_path / "b").step == 3
    monkeypatch.setattr(training, "save_checkpoint", real)
    resumed = T.fine_tune(build(), feats, cfg, output_dir=tmp_path / "b", resume=True)
    for (k, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(b, a, rtol=0, atol=0, msg=k)


def test_a_step_out_of_device_memory_is_one_line_naming_the_flag(tmp_path, monkeypatch):
    """Out of memory in a training step: one line naming the micro-batch that did not fit, the
    --micro-batch-size that halves it (the same training, by accumulation) and the checkpoint to resume from."""
    from bertctl.train.engine import Engine

    build, feats = _setup(tmp_path)
    cfg = FinetuneConfig.of(epochs=2, lr=1e-3, batch_size=8, device="cpu", show_progress=False, save_every=2)
    real = Engine.train_step

    def step(self, sb, stats):
        if self.step == 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, sb, stats)

    monkeypatch.setattr(Engine, "train_step", step)
    with pytest.raises(BertctlError) as e:
        T.fine_tune(build(), feats, cfg, output_dir=tmp_path / "run")
    message = str(e.value)
    assert "\n" not in message and message.startswith("out of CPU memory at step 4: 8 rows of ")
    assert "--micro-batch-size 4" in message and "same --batch-size 8" in message
    assert f"--resume continues from {tmp_path / 'run' / 'checkpoints' / 'step-00000002'}" in message


def test_evaluation_out_of_device_memory_names_the_token_budget(tmp_path):
    build, feats = _setup(tmp_path)
    model = build()

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model.forward = oom
    with pytest.raises(BertctlError, match=r"^out of CPU memory evaluating \d+ examples of \d+ tokens in one forward "
                                           r"pass: pass a smaller --batch-tokens \(bertctl eval\) or --eval-batch-tokens"):
        T.predict(model, feats, device=torch.device("cpu"))


def test_rare_padded_lengths_join_the_next_common_one():
    """``common_lengths``: shortest first, groups of at least ``min_steps`` steps, each padded to its
    longest; a short last group joins the one before."""
    counts = {16: 40, 24: 3, 32: 5, 40: 9, 48: 30, 56: 2, 64: 1}
    assert L.common_lengths(counts, 16) == {24: 40, 32: 40, 56: 64, 48: 64}
    assert L.common_lengths(counts, 1) == {}
    assert L.common_lengths({8: 2, 16: 3}, 16) == {8: 16}


@pytest.mark.parametrize("world,micro", [(1, None), (1, 8), (2, None)])
def test_with_graphs_rare_lengths_pad_up_and_a_resumed_run_pads_alike(world, micro):
    """``task_batches(min_shape_steps=...)``: a batch is padded to at least its own longest (rounded),
    to a length the run has anyway; far fewer steps are left with a shape too rare to capture, and a
    run resumed mid-way gets the same tensors as the whole run from that step on."""
    rng = np.random.default_rng(4)
    feats = [{"input_ids": np.arange(n), "token_type_ids": np.zeros(n, dtype=np.int8), "labels": 1}
             for n in np.minimum(rng.geometric(0.02, 700) + 4, 200)]
    spe = L.steps_per_epoch(len(feats), 32, world)

    def run(min_steps, start=0, rank=0):
        it = L.task_batches(feats, 32, seed=1, start_step=start, steps_per_epoch=spe, group_by_length=False, rank=rank,
                            world_size=world, micro_batch_size=micro, max_steps=3 * spe, min_shape_steps=min_steps)
        return [next(it) for _ in range(3 * spe - start)]

    plain, padded = run(None), run(16)
    natural = {m["input_ids"].shape[-1] for sb in plain for m in sb.micro}
    for a, b in zip(plain, padded):
        for ma, mb in zip(a.micro, b.micro):
            assert mb["input_ids"].shape[-1] >= ma["input_ids"].shape[-1]
            assert mb["input_ids"].shape[-1] in natural
            n = ma["input_ids"].shape[-1]
            for k in ma:  # the same rows, padded further
                assert torch.equal(mb[k][..., :n], ma[k]) if mb[k].dim() > 1 else torch.equal(mb[k], ma[k])
            assert not mb["attention_mask"][..., n:].any()
        assert a.counts["tokens"] == b.counts["tokens"] and a.counts["loss"] == b.counts["loss"]
    rare = [sum(sb.shape_steps < 16 for sb in steps) for steps in (plain, padded)]
    if micro:  # one process's micro-batches keep their own lengths
        assert all(a.micro[i]["input_ids"].shape == b.micro[i]["input_ids"].shape
                   for a, b in zip(plain, padded) for i in range(len(a.micro)))
    else:
        assert rare[1] <= 3 < rare[0] // 3  # at most each epoch's short last batch
    resumed = run(16, start=spe + 5)
    for a, b in zip(padded[spe + 5:], resumed):
        assert all(torch.equal(a.micro[i][k], b.micro[i][k]) for i in range(len(a.micro)) for k in a.micro[i])
    if world > 1:
        other = run(16, rank=1)
        assert [sb.signature for sb in other] == [sb.signature for sb in padded]


def test_padding_further_changes_no_loss_or_gradient():
    """What ``common_lengths`` relies on: a batch padded beyond its longest gives every head the same
    loss and gradients (float64, the padded sdpa model): attention, the span softmax and the token
    labels mask the padding."""
    from bertctl.config import BertConfig
    from bertctl.model import (BertForMultipleChoice, BertForQuestionAnswering, BertForSequenceClassification,
                               BertForTokenClassification)

    rng = np.random.default_rng(2)
    conf = dict(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
                max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    lens = [5, 11, 3, 17]

    def seq(n):
        return {"input_ids": rng.integers(1, 50, n), "token_type_ids": (np.arange(n) > n // 2).astype(np.int8)}

    cases = [
        (BertForSequenceClassification, dict(num_labels=3), [{**seq(n), "labels": i % 3} for i, n in enumerate(lens)]),
        (BertForTokenClassification, dict(num_labels=4),
         [{**seq(n), "labels": np.where(rng.random(n) < 0.3, -100, rng.integers(0, 4, n))} for n in lens]),
        (BertForQuestionAnswering, {}, [{**seq(n), "start_positions": n // 3, "end_positions": n // 2} for n in lens]),
        (BertForMultipleChoice, {}, [{"input_ids": np.stack([rng.integers(1, 50, 24)] * 2),
                                      "token_type_ids": np.zeros((2, 24), dtype=np.int8), "lengths": [n, n + 2],
                                      "labels": i % 2} for i, n in enumerate(lens)]),
    ]
    for cls, kw, features in cases:
        torch.manual_seed(0)
        model = cls(BertConfig(**conf, **kw), resolve("cpu", attn="sdpa", kernels="torch")).double()
        results = []
        for extra in (0, 16):
            natural = L.collate(features)
            batch = L.collate(features, length=natural["input_ids"].shape[-1] + extra)
            model.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            results.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
        (a, ga), (b, gb) = results
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=cls.__name__)
        assert len(ga) == len(gb)
        for x, y in zip(ga, gb):
            torch.testing.assert_close(y, x, rtol=1e-10, atol=1e-12, msg=cls.__name__)


def test_seeding_a_step_is_torch_manual_seed_for_the_cpu_and_cuda():
    """``seed_step`` (the engine's per-step seeding) leaves the CPU generator, and CUDA's where there
    is a GPU, as ``torch.manual_seed`` does: dropout masks and resume stay as they were."""
    from bertctl.train.engine import seed_step, step_seed

    devices = [torch.device("cpu")] + ([torch.device("cuda")] if torch.cuda.is_available() else [])
    for device in devices:
        s = step_seed(42, 7, 1)
        torch.manual_seed(s)
        ref = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if device.type == "cuda" else [])
        torch.manual_seed(0)
        seed_step(s, device)
        got = [torch.get_rng_state()] + ([torch.cuda.get_rng_state()] if device.type == "cuda" else [])
        assert all(torch.equal(a, b) for a, b in zip(ref, got))
        assert torch.equal(torch.rand(5), (torch.manual_seed(s), torch.rand(5))[1])


def test_fine_tuning_trains_with_torchs_dropout_masks(tmp_path):
    """The fine-tuning model draws torch's dropout masks (they measured better than the fused sub-layer op's
    own); a model loaded for anything else keeps the default, the op's own."""
    from bertctl.checkpoints.hf import load_pretrained
    from bertctl.model import BertForSequenceClassification
    from bertctl.tasks import common

    d = make_tiny_model_dir(tmp_path / "tiny")
    tuned = common.load_for_finetuning(BertForSequenceClassification, d, cfg=FinetuneConfig.of(device="cpu"), num_labels=2)
    assert tuned.runtime.dropout_masks == "torch"
    other = load_pretrained(BertForSequenceClassification, d, fresh_heads=True, num_labels=2)
    assert other.runtime.dropout_masks == "fused"


def test_the_median_step_length_is_the_first_epochs_median_padded_longest():
    rng = np.random.default_rng(3)
    feats = [{"input_ids": np.ones(int(n), dtype=np.int32)} for n in rng.integers(5, 400, 101)]
    lengths = np.array([len(f["input_ids"]) for f in feats])
    for group, world in ((False, 1), (True, 2)):
        batches = L.epoch_batches(lengths, 16, 7, 0, group, world)
        want = np.median([-(-int(lengths[b].max()) // 8) * 8 for b in batches])
        assert L.median_step_length(feats, 16, seed=7, group_by_length=group, world_size=world) == int(want)


@pytest.mark.parametrize("length,head_dim,cudnn", [(300, 64, True), (300, 32, False), (120, 64, False)],
                         ids=["long-wide", "long-narrow", "short-wide"])
def test_training_keeps_cudnn_attention_only_for_long_steps_of_wide_heads(monkeypatch, length, head_dim, cudnn):
    """cuDNN's attention (a plan per shape, faster on long sequences of 64-wide heads) stays on for the training
    steps only where they are long and the heads wide; elsewhere training runs inside ``varied_shapes``."""
    import contextlib

    from bertctl.config import BertConfig
    from bertctl.model import BertForSequenceClassification
    from bertctl.nn.attention import cudnn_training_attention

    assert cudnn_training_attention(64, 256, 1000) and not cudnn_training_attention(64, 248, 1000)
    assert not cudnn_training_attention(32, 512, 1000) and not cudnn_training_attention(64, 384, 999)
    monkeypatch.setattr(T, "cudnn_training_attention", lambda h, n, steps: cudnn_training_attention(h, n, 1000))
    entered = []

    @contextlib.contextmanager
    def recording():
        entered.append(True)
        yield
    monkeypatch.setattr(T, "varied_shapes", recording)
    config = BertConfig(vocab_size=100, hidden_size=2 * head_dim, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, num_labels=2)
    torch.manual_seed(0)
    model = BertForSequenceClassification(config)
    rng = np.random.default_rng(0)
    feats = [{"input_ids": rng.integers(5, 100, int(n)), "token_type_ids": np.zeros(int(n), dtype=np.int8),
              "labels": i % 2} for i, n in enumerate(rng.integers(length - 20, length + 1, 16))]
    T.fine_tune(model, feats, FinetuneConfig.of(device="cpu", batch_size=8, max_steps=1, show_progress=False,
                                            tensorboard=False))
    assert bool(entered) == (not cudnn)
