"""The model benchmark's pieces on CPU: synthetic batches, the FLOP count, and that bertctl's
masked-position loss equals Hugging Face's all-position loss on the same weights and batch."""
from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from bertctl.bench.model import bertctl_model, hf_model, step_loss, synthetic_batches
from bertctl.config import BertConfig
from bertctl.runtime import resolve
from bertctl.train.metrics import batch_counts, forward_flops


def test_synthetic_batches_look_like_built_data():
    (b,) = synthetic_batches(500, 64, 40, n=1, seed=3)
    lengths = b["attention_mask"].sum(1)
    assert b["input_ids"].shape[1] % 8 == 0 and b["input_ids"].shape[1] >= int(lengths.max())
    assert (lengths == 64).float().mean() > 0.6          # most sequences fill max_seq_length
    valid = b["masked_lm_labels"] != -100
    assert (valid.sum(1) >= 1).all() and valid.sum(1).max() <= 12  # 15% of 64, rounded up to 4
    pos = b["masked_positions"][valid]
    rows = torch.arange(40)[:, None].expand_as(valid)[valid]
    assert (b["input_ids"][rows, pos] == 4).all()                   # masked slots hold [MASK]
    assert (pos < lengths[rows]).all()
    # HF labels: the same predictions at the same places, -100 elsewhere.
    assert (b["hf_labels"] != -100).sum() == valid.sum()
    assert torch.equal(b["hf_labels"][rows, pos], b["masked_lm_labels"][valid])


def test_flop_count_matches_torch_flop_counter():
    """Unpadded batch: analytic FLOPs = the matmuls torch counts (embeddings / norms / softmax excluded)."""
    conf = BertConfig.preset("tiny", vocab_size=300)
    model = bertctl_model(conf, runtime=resolve("cpu", attn="explicit", kernels="torch")).eval()
    B, S, P = 3, 16, 4
    ids = torch.randint(5, 300, (B, S))
    pos = torch.stack([torch.randperm(S - 1)[:P] + 1 for _ in range(B)])
    batch = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": torch.ones_like(ids),
             "masked_positions": pos, "masked_lm_labels": torch.randint(5, 300, (B, P))}
    with FlopCounterMode(display=False) as fc, torch.no_grad():
        model(ids, batch["token_type_ids"], batch["attention_mask"], masked_positions=pos)
    tokens, pairs, masked, seqs = batch_counts(batch)
    assert (tokens, pairs, masked, seqs) == (B * S, B * S * S, B * P, B)
    assert forward_flops(conf, tokens, pairs, masked, seqs) == fc.get_total_flops()


def test_bertctl_loss_equals_hf_loss_on_the_same_batch():
    conf = BertConfig.preset("tiny", vocab_size=500, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ours = bertctl_model(conf).eval()
    theirs = hf_model(conf).eval()
    sd = ours.state_dict()
    sd["cls.predictions.decoder.bias"] = sd["cls.predictions.bias"]  # HF ties the two
    missing, unexpected = theirs.load_state_dict(sd, strict=False)
    assert not unexpected and all("position_ids" in k or "token_type_ids" in k for k in missing)
    (b,) = synthetic_batches(500, 32, 6, n=1, seed=1)
    b["n_masked"] = float((b["masked_lm_labels"] != -100).sum())
    with torch.no_grad():
        torch.testing.assert_close(step_loss("bertctl", ours, b), step_loss("hf", theirs, b), rtol=1e-5, atol=1e-5)


def test_bench_model_runs_end_to_end_on_cpu():
    from bertctl.bench.model import bench_model

    rows = []
    providers = ["bertctl", "bertctl/unpadded", "bertctl/explicit", "hf"]
    out = bench_model(["tiny-64"], providers, steps=2, warmup=1, device="cpu", log=lambda m: None,
                      on_row=lambda partial: rows.append(len(partial["train"])))
    assert [r["provider"] for r in out["train"]] == providers
    assert all(r["seq_per_s"] > 0 and r["mfu"] is None for r in out["train"])  # no MFU without a known peak
    assert [r["provider"] for r in out["inference"]] == providers
    assert "train tiny-64 bertctl / hf" in out["speedups"] and rows == [1, 2, 3, 4]
    assert out["device"]["type"] == "cpu" and out["precision"] == "fp32"


def test_mixed_lengths_case_has_fine_tunings_padding_and_unpadded_gives_hfs_loss():
    """base-mixed's batches: lengths log-uniform on [8, 128], about 3 padded tokens per real one; on such a
    batch the unpadded model's pretraining loss equals the padded sdpa model's and transformers'."""
    batches = synthetic_batches(500, 128, 256, n=4, seed=3, mixed=True)
    lengths = torch.cat([b["attention_mask"].sum(1) for b in batches]).double()
    assert lengths.min() >= 8 and lengths.max() <= 128
    assert 36 < lengths.mean() < 50  # (128 - 8) / ln 16 = 43
    padded_over_real = sum(b["attention_mask"].numel() for b in batches) / lengths.sum()
    assert 2.5 < padded_over_real < 3.5
    conf = BertConfig.preset("tiny", vocab_size=500, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    padded, theirs = bertctl_model(conf).eval(), hf_model(conf).eval()
    unpadded = bertctl_model(conf, runtime=resolve("cpu", attn="unpadded")).eval()
    unpadded.load_state_dict(padded.state_dict())
    explicit = bertctl_model(conf, runtime=resolve("cpu", attn="explicit")).eval()
    explicit.load_state_dict(padded.state_dict())
    sd = padded.state_dict()
    sd["cls.predictions.decoder.bias"] = sd["cls.predictions.bias"]
    theirs.load_state_dict(sd, strict=False)
    b = {k: v[:16] for k, v in batches[0].items()}
    b["n_masked"] = float((b["masked_lm_labels"] != -100).sum())
    with torch.no_grad():
        ref = step_loss("hf", theirs, b)
        torch.testing.assert_close(step_loss("bertctl", padded, b), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step_loss("bertctl/unpadded", unpadded, b), ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(step_loss("bertctl/explicit", explicit, b), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.cuda
def test_the_graphs_provider_times_pretrains_own_step():
    """``bertctl/graphs`` replays the engine's pretraining step as CUDA graphs on the loader's (pinned)
    batches: three of its steps leave the weights that three eager engine steps on the same batches
    leave (dropout off), and the benchmark times it beside the eager provider."""
    import copy

    from bertctl.bench.model import _engine_step_fn, bench_model
    from bertctl.train import distributed
    from bertctl.config import TrainConfig
    from bertctl.runtime import resolve
    from bertctl.train.engine import Engine
    from bertctl.data.batching import pretraining_step
    from bertctl.train.pretrain import PretrainingObjective

    cuda = torch.device("cuda", torch.cuda.current_device())
    conf = BertConfig.preset("tiny", vocab_size=500, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    model = bertctl_model(conf, cuda)
    twin = copy.deepcopy(model)
    cpu = synthetic_batches(500, 64, 8, n=3, seed=5)
    gpu = [{k: v.to(cuda) for k, v in b.items()} for b in cpu]
    step = _engine_step_fn(model, cpu, gpu, distributed.Dist(device=cuda), 64)
    eager = Engine(TrainConfig(batch_size=8, lr=1e-4, warmup_steps=0), resolve("cuda", "bf16"), twin,
                   PretrainingObjective(), dist=distributed.Dist(device=cuda), max_steps=1 << 40)
    stats = torch.zeros(4, device=cuda)
    keys = ("input_ids", "token_type_ids", "attention_mask", "masked_positions", "masked_lm_labels",
            "next_sentence_label")
    for c, g in zip(cpu, gpu):
        step(g)
        eager.train_step(pretraining_step({k: c[k] for k in keys}, 8), stats)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-6, msg=name)
    torch.manual_seed(0)
    fresh = bertctl_model(conf, cuda)
    assert not all(torch.equal(p, q) for p, q in zip(model.parameters(), fresh.parameters()))  # it trained
    out = bench_model(["tiny-64"], ["bertctl", "bertctl/graphs"], steps=3, warmup=2, log=lambda m: None,
                      inference=False)
    assert [r["provider"] for r in out["train"]] == ["bertctl", "bertctl/graphs"]
    assert all(r.get("seq_per_s", 0) > 0 for r in out["train"]), out["train"]
