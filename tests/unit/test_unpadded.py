"""The ``unpadded`` attention: the encoder on the real tokens only, against the padded model (float64 and bf16)."""
from __future__ import annotations

import json

import pytest
import torch

from bertctl.config import BertConfig
from bertctl.model import (BertForMultipleChoice, BertForPreTraining, BertForQuestionAnswering,
                           BertForSequenceClassification, BertForTokenClassification, BertModel)
from bertctl.nn.packing import Packed
from bertctl.runtime import resolve

KERNELS = ["torch", "fused"]


def config(**kw) -> BertConfig:
    return BertConfig(vocab_size=97, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                      max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw)


def batch(B=5, S=17, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([S, 1, 9, S - 3, 4][:B])
    mask = (torch.arange(S)[None] < lengths[:, None]).long()
    ids = torch.randint(5, 97, (B, S), generator=g) * mask
    types = (torch.rand(B, S, generator=g) > 0.5).long() * mask
    return ids, types, mask


def twins(cls, kernels, dtype=torch.float64, **kw):
    """The same weights under both backends."""
    from bertctl import ops

    assert kernels != "fused" or ops.fused_available(), "the compiled module did not load"
    torch.manual_seed(0)
    padded = cls(config(**kw), resolve("cpu", attn="sdpa", kernels=kernels)).to(dtype)
    unpadded = cls(config(**kw), resolve("cpu", attn="unpadded", kernels=kernels)).to(dtype)
    unpadded.load_state_dict(padded.state_dict())
    return padded, unpadded


def test_packed_round_trip():
    _, _, mask = batch()
    p = Packed.from_mask(mask.bool())
    x = torch.randn(*mask.shape, 3)
    assert p.pack_index.numel() == int(mask.sum())
    assert p.cu_seqlens.tolist() == [0, *mask.sum(1).cumsum(0).tolist()]
    back = p.unpack(p.pack(x))
    assert torch.equal(back, x * mask[..., None])


@pytest.mark.parametrize("kernels", KERNELS)
def test_forward_and_gradients_match_the_padded_model_float64(kernels):
    padded, unpadded = twins(BertModel, kernels)
    ids, types, mask = batch()
    w = torch.randn(*ids.shape, 32, dtype=torch.float64) * mask[..., None]  # real positions only
    outs = []
    for model in (padded, unpadded):
        out = model(ids, types, mask, output_hidden_states=True)
        loss = (out.last_hidden_state * w).sum() + out.pooler_output.square().sum()
        loss.backward()
        outs.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = outs
    real = mask.bool()
    torch.testing.assert_close(b.last_hidden_state[real], a.last_hidden_state[real], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(b.pooler_output, a.pooler_output, rtol=1e-10, atol=1e-10)
    for ha, hb in zip(a.hidden_states, b.hidden_states):
        torch.testing.assert_close(hb[real], ha[real], rtol=1e-10, atol=1e-10)
        assert not hb[~real].any()  # padding stays zero
    assert ga.keys() == gb.keys()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("kernels", KERNELS)
def test_bf16_autocast_matches_the_padded_model(kernels):
    padded, unpadded = twins(BertModel, kernels, dtype=torch.float32)
    ids, types, mask = batch()
    real = mask.bool()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        a = padded(ids, types, mask).last_hidden_state.float()
        b = unpadded(ids, types, mask).last_hidden_state.float()
    torch.testing.assert_close(b[real], a[real], rtol=0.05, atol=0.05)


def test_heads_match_the_padded_model():
    ids, types, mask = batch()
    real = mask.bool()
    padded, unpadded = twins(BertForSequenceClassification, "torch", num_labels=3)
    torch.testing.assert_close(unpadded(ids, types, mask).logits, padded(ids, types, mask).logits)
    padded, unpadded = twins(BertForTokenClassification, "torch", num_labels=5)
    labels = torch.randint(0, 5, ids.shape).masked_fill(~real, -100)
    a, b = padded(ids, types, mask, labels=labels), unpadded(ids, types, mask, labels=labels)
    torch.testing.assert_close(b.logits[real], a.logits[real])
    torch.testing.assert_close(b.loss, a.loss)
    padded, unpadded = twins(BertForPreTraining, "torch")
    positions = torch.tensor([[1, 2, 3]] * 5) % mask.sum(1, keepdim=True)
    labels = torch.randint(0, 97, positions.shape)
    nsp = torch.tensor([0, 1, 0, 1, 1])
    a = padded(ids, types, mask, masked_positions=positions, masked_lm_labels=labels, next_sentence_label=nsp)
    b = unpadded(ids, types, mask, masked_positions=positions, masked_lm_labels=labels, next_sentence_label=nsp)
    torch.testing.assert_close(b.loss, a.loss)
    torch.testing.assert_close(b.prediction_logits, a.prediction_logits)


def test_span_qa_trains_the_same_model_padded_or_unpadded():
    """The span loss is a softmax over positions: padding must not enter it, or the unpadded encoder
    (zeros at the padding) and the padded one (states computed there) give different losses and
    gradients. float64, loss and every gradient."""
    ids, types, mask = batch()
    real = mask.bool()
    starts, ends = torch.tensor([0, 0, 3, 5, 2]), torch.tensor([4, 0, 8, 9, 3])
    outs = []
    for model in twins(BertForQuestionAnswering, "torch"):
        out = model(ids, types, mask, start_positions=starts, end_positions=ends)
        out.loss.backward()
        outs.append((out, {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, ga), (b, gb) = outs
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(b.start_logits[real], a.start_logits[real], rtol=1e-10, atol=1e-10)
    assert (a.start_logits[~real] < -1e3).all() and (b.end_logits[~real] < -1e3).all()
    for name in ga:
        torch.testing.assert_close(gb[name], ga[name], rtol=1e-9, atol=1e-10, msg=name)
    # and the padding's share is 0: the loss equals the softmax over the real positions alone
    ref = []
    for i in range(len(ids)):
        n = int(mask[i].sum())
        for logits, pos in ((a.start_logits, starts), (a.end_logits, ends)):
            ref.append(torch.log_softmax(logits[i, :n], -1)[pos[i]].neg())
    torch.testing.assert_close(a.loss, torch.stack(ref).view(-1, 2).sum(1).mean() / 2)  # fp32 logits


def test_multiple_choice_matches_the_padded_model():
    ids, types, mask = batch(B=4)
    padded, unpadded = twins(BertForMultipleChoice, "torch")
    shape = lambda t: t.view(2, 2, -1)  # noqa: E731  (2 questions x 2 choices)
    labels = torch.tensor([1, 0])
    a = padded(shape(ids), shape(types), shape(mask), labels=labels)
    b = unpadded(shape(ids), shape(types), shape(mask), labels=labels)
    torch.testing.assert_close(b.logits, a.logits, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(b.loss, a.loss, rtol=1e-10, atol=1e-10)


def test_finetune_runs_unpadded_and_export_refuses_it(tmp_path):
    """--attn unpadded through the CLI: a fine-tuning run; ONNX export has no static graph for it (exit 2)."""
    from typer.testing import CliRunner

    from bertctl.cli.app import app
    from test_finetune_support import data_path, head_lines, make_tiny_model_dir

    model = make_tiny_model_dir(tmp_path / "model")
    d = tmp_path / "sst2"
    d.mkdir()
    head_lines(data_path("glue", "SST-2", "train.tsv"), d / "train.tsv", 49)
    head_lines(data_path("glue", "SST-2", "dev.tsv"), d / "dev.tsv", 21)
    r = CliRunner().invoke(app, ["finetune", "glue", "--task", "sst2", "--data-dir", str(d), "--model", str(model),
                                 "-o", str(tmp_path / "out"), "--epochs", "1", "--batch-size", "16", "--attn",
                                 "unpadded", "--no-progress", "--no-tensorboard"])
    assert r.exit_code == 0, r.output
    assert 0.0 <= json.loads((tmp_path / "out" / "metrics.json").read_text())["accuracy"] <= 1.0
    r = CliRunner().invoke(app, ["export", "onnx", "--model", str(model), "-o", str(tmp_path / "m.onnx"), "--attn", "unpadded"])
    assert r.exit_code == 2 and "--attn" in r.output


def test_a_batch_with_little_padding_runs_padded(monkeypatch):
    """Packing a full batch costs more than it saves (8% on the CPU): such batches take the padded path."""
    padded, unpadded = twins(BertModel, "torch")
    ids, types, mask = batch()
    full = torch.ones_like(mask)
    expected = padded(ids, types, full).last_hidden_state

    def refuse(*_):
        raise AssertionError("a full batch was packed")

    monkeypatch.setattr(Packed, "__init__", refuse)
    torch.testing.assert_close(unpadded(ids, types, full).last_hidden_state, expected)
    with pytest.raises(AssertionError, match="was packed"):
        unpadded(ids, types, mask)


def cuda_twins(dtype):
    """BertModel at BERT's head size (64) on the GPU, sdpa and unpadded, the same float32 weights."""
    torch.manual_seed(0)
    kw = dict(vocab_size=97, hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
              max_position_embeddings=40, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    padded = BertModel(BertConfig(**kw), resolve("cuda", attn="sdpa")).cuda()
    unpadded = BertModel(BertConfig(**kw), resolve("cuda", attn="unpadded")).cuda()
    unpadded.load_state_dict(padded.state_dict())
    reference = BertModel(BertConfig(**kw), resolve("cpu", attn="sdpa", kernels="torch")).double()
    reference.load_state_dict(padded.state_dict())
    return padded, unpadded, reference


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_flash_attention_matches_float64(dtype):
    """On a GPU under autocast the unpadded encoder runs FlashAttention's varlen kernel on (T, heads, 64):
    outputs and gradients as close to the float64 padded model as the padded sdpa model is."""
    from bertctl.nn.attention import varlen_ok

    padded, unpadded, reference = cuda_twins(dtype)
    ids, types, mask = batch(B=5, S=37)
    w = torch.randn(*ids.shape, 128, dtype=torch.float64) * mask[..., None]
    real = mask.bool()

    def run(model, device, autocast):
        with torch.autocast("cuda", dtype=dtype, enabled=autocast):
            out = model(ids.to(device), types.to(device), mask.to(device)).last_hidden_state
        loss = (out.double() * w.to(device)).sum()
        loss.backward()
        grads = {n: p.grad.double().cpu() for n, p in model.named_parameters() if p.grad is not None}
        return out.double().cpu(), grads

    assert varlen_ok(torch.empty(3, 384, device="cuda", dtype=dtype), 64)
    ref, g_ref = run(reference, "cpu", False)
    (pad, g_pad), (unp, g_unp) = run(padded, "cuda", True), run(unpadded, "cuda", True)
    err_pad = (pad - ref)[real].abs().max()
    err_unp = (unp - ref)[real].abs().max()
    assert err_unp <= 2 * err_pad + 1e-3, (err_unp, err_pad)
    assert g_unp.keys() == g_ref.keys()
    for name in g_ref:
        scale = g_ref[name].abs().max() + 1e-6
        e_pad = ((g_pad[name] - g_ref[name]).abs().max() / scale).item()
        e_unp = ((g_unp[name] - g_ref[name]).abs().max() / scale).item()
        assert e_unp <= 2 * e_pad + 2e-2, (name, e_unp, e_pad)


@pytest.mark.cuda
def test_varlen_attention_dropout_backward_replays_the_forward_mask():
    """With attention dropout the backward must use the forward's mask: the directional derivative
    (L(x + e d) - L(x - e d)) / 2e, each forward drawing the same mask from the same seed, equals the
    gradient's dot product with d; and the outputs' mean over many masks approaches the no-dropout output."""
    from bertctl.nn.attention import VarlenAttention

    torch.manual_seed(0)
    lengths = torch.tensor([37, 5, 20, 64])
    cu = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32).cuda()
    T, nh, hs = int(lengths.sum()), 4, 64
    q, k, v = (torch.randn(T, nh, hs, device="cuda", dtype=torch.float16) for _ in range(3))
    w = torch.randn(T, nh, hs, device="cuda", dtype=torch.float32)

    def loss(q, k, v, seed=1234):
        torch.cuda.manual_seed(seed)
        return (VarlenAttention.apply(q, k, v, cu, 64, 0.1, hs ** -0.5).float() * w).sum()

    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    loss(qg, kg, vg).backward()
    for x, g in ((q, qg.grad), (k, kg.grad), (v, vg.grad)):
        d = torch.randn_like(x)
        eps = 0.05
        args = [q, k, v]
        i = [id(t) for t in args].index(id(x))
        plus, minus = list(args), list(args)
        plus[i], minus[i] = x + eps * d, x - eps * d
        numeric = (loss(*plus) - loss(*minus)).item() / (2 * eps)
        analytic = (g.float() * (plus[i].float() - minus[i].float())).sum().item() / (2 * eps)  # fp16 steps
        assert abs(numeric - analytic) <= 0.05 * abs(analytic) + 1.0, (numeric, analytic)
    mean = sum(VarlenAttention.apply(q, k, v, cu, 64, 0.1, hs ** -0.5).float() for _ in range(200)) / 200
    exact = VarlenAttention.apply(q, k, v, cu, 64, 0.0, hs ** -0.5).float()
    assert (mean - exact).abs().mean() < 0.1 * exact.abs().mean()


def test_auto_attention_is_unpadded_except_compiled_or_pretraining():
    from bertctl.runtime import resolve_attention

    assert resolve_attention("auto", "cpu") == resolve_attention("auto", "cuda") == "unpadded"
    assert resolve_attention("auto", "cpu", packed_data=True) == "unpadded"  # no compiled kernels
    assert resolve_attention("auto", "cpu", packed_data=True, fused_kernels=True) == "explicit"
    assert resolve_attention("auto", "cpu", compiled=True, packed_data=True, fused_kernels=True) == "sdpa"
    assert resolve_attention("auto", "cuda", packed_data=True) == "sdpa"
    assert resolve_attention("auto", "cpu", compiled=True) == resolve_attention("auto", "cuda", compiled=True) == "sdpa"
    assert resolve_attention("explicit", "cuda") == "explicit"
