"""The fine-tuning loop: batching, dynamic padding, exact resume, the lr schedule."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bertctl.tasks import trainer as T
from test_finetune_support import make_tiny_model_dir


def test_epoch_batches_cover_everything_once_and_group_lengths():
    lengths = np.random.default_rng(0).integers(5, 120, size=1000)
    for group in (False, True):
        batches = T.epoch_batches(lengths, 32, seed=3, epoch=1, group_by_length=group)
        flat = np.concatenate(batches)
        assert sorted(flat) == list(range(1000))
        assert batches[0].tolist() == T.epoch_batches(lengths, 32, 3, 1, group)[0].tolist()  # pure in (seed, epoch)
    assert T.epoch_batches(lengths, 32, 3, 1, True)[0].tolist() != T.epoch_batches(lengths, 32, 3, 2, True)[0].tolist()
    # Grouping cuts padding: tokens in padded batches vs the random order.
    def padded(bs):
        return sum(len(b) * lengths[b].max() for b in bs)
    assert padded(T.epoch_batches(lengths, 32, 3, 1, True)) < 0.7 * padded(T.epoch_batches(lengths, 32, 3, 1, False))


def test_collate_pads_to_multiple_of_8_with_masks():
    feats = [{"input_ids": np.array([101, 5, 102]), "token_type_ids": np.array([0, 0, 0]), "labels": 1},
             {"input_ids": np.array([101, 5, 6, 7, 8, 9, 10, 11, 12, 102]), "token_type_ids": np.zeros(10), "labels": 0}]
    b = T.collate(feats)
    assert b["input_ids"].shape == (2, 16)
    assert b["attention_mask"].sum(1).tolist() == [3, 10]
    assert b["input_ids"][0, 3:].eq(0).all() and b["labels"].tolist() == [1, 0]
    tok = [{"input_ids": np.array([1, 2]), "token_type_ids": np.zeros(2), "labels": np.array([-100, 3])}]
    assert T.collate(tok)["labels"].tolist() == [[-100, 3] + [-100] * 6]


def _setup(tmp_path):
    from bertctl.checkpoint import load_pretrained
    from bertctl.model import BertForSequenceClassification

    d = make_tiny_model_dir(tmp_path / "tiny")
    rng = np.random.default_rng(0)
    feats = [{"input_ids": np.concatenate([[101], rng.integers(1000, 2000, n), [102]]),
              "token_type_ids": np.zeros(n + 2, dtype=np.int8), "labels": int(i % 2)}
             for i, n in enumerate(rng.integers(3, 30, 40))]

    def build():  # the seed fixes the fresh head's initialisation
        torch.manual_seed(0)
        return load_pretrained(BertForSequenceClassification, d, fresh_heads=True)
    return build, feats


def test_resume_mid_epoch_gives_the_same_weights(tmp_path):
    build, feats = _setup(tmp_path)
    cfg = T.TrainConfig(epochs=2, lr=1e-3, batch_size=8, device="cpu", progress=False, save_steps=3)
    calls = []

    def evaluate(model):
        calls.append(1)
        return {"score": float(len(calls))}

    straight = T.fine_tune(build(), feats, cfg, evaluate=evaluate, main_metric="score", output_dir=tmp_path / "a")

    class Crash(Exception):
        pass

    def crash(model):  # dies at the end of epoch 1, after the step-3 checkpoint (5 steps per epoch)
        raise Crash

    with pytest.raises(Crash):
        T.fine_tune(build(), feats, cfg, evaluate=crash, main_metric="score", output_dir=tmp_path / "b")
    state = torch.load(tmp_path / "b" / "checkpoint" / "last.pt", weights_only=False)
    assert state["position"] == {"epoch": 0, "step": 3, "global_step": 3}
    calls.clear()
    resumed = T.fine_tune(build(), feats, cfg, evaluate=evaluate, main_metric="score", output_dir=tmp_path / "b",
                          resume=True)
    for (k, a), b in zip(straight.model.state_dict().items(), resumed.model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=k)
    assert [h["epoch"] for h in resumed.history] == [1, 2]


def test_select_best_restores_the_best_epoch(tmp_path):
    build, feats = _setup(tmp_path)
    cfg = T.TrainConfig(epochs=3, lr=1e-3, batch_size=8, device="cpu", progress=False, select_best=True)
    snapshots = []

    def evaluate(model):
        snapshots.append({k: v.clone() for k, v in model.state_dict().items()})
        return {"score": [0.2, 0.9, 0.5][len(snapshots) - 1]}

    result = T.fine_tune(build(), feats, cfg, evaluate=evaluate, main_metric="score", output_dir=tmp_path / "c")
    assert result.best["epoch"] == 2
    for k, v in result.model.state_dict().items():
        torch.testing.assert_close(v, snapshots[1][k], rtol=0, atol=0)


def test_warmup_and_linear_decay_schedule(tmp_path):
    build, feats = _setup(tmp_path)
    cfg = T.TrainConfig(epochs=2, lr=1e-3, batch_size=8, device="cpu", progress=False, log_steps=1)
    from bertctl.progress import MetricsLog
    import json

    with MetricsLog(tmp_path / "log.jsonl") as log:
        T.fine_tune(build(), feats, cfg, log=log)
    lrs = [json.loads(l)["lr"] for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    total, warmup = 10, 1  # 40 rows / 8 = 5 steps x 2 epochs; 10% warm-up
    # lr after step s (LambdaLR has stepped s times): warm-up to the peak, then linear to 0.
    want = [1e-3 * (s / warmup if s < warmup else (total - s) / (total - warmup)) for s in range(1, total + 1)]
    np.testing.assert_allclose(lrs, want, rtol=1e-9, atol=1e-12)


@pytest.mark.cuda
def test_bf16_fine_tuning_on_gpu_learns(tmp_path):
    build, feats = _setup(tmp_path)
    cfg = T.TrainConfig(epochs=12, lr=1e-3, batch_size=8, device="cuda", progress=False, log_steps=5)
    from bertctl.progress import MetricsLog
    import json

    with MetricsLog(tmp_path / "log.jsonl") as log:
        result = T.fine_tune(build(), feats, cfg, log=log)
    losses = [json.loads(l)["loss"] for l in (tmp_path / "log.jsonl").read_text().splitlines()]
    assert all(np.isfinite(losses)) and np.mean(losses[-2:]) < losses[0] - 0.02, losses
    assert next(result.model.parameters()).dtype == torch.float32  # bf16 autocast, fp32 master weights
    out = T.predict(result.model, feats, device=torch.device("cuda"))
    acc = np.mean([o[0].argmax() == f["labels"] for o, f in zip(out, feats)])
    assert acc > 0.8  # 40 rows memorised
