"""The model with kernels="fused" against kernels="torch": same outputs, same gradients, same loss curve.

Both runs use the explicit attention path (the one the fused softmax serves) and the same
weights; the torch run is plain PyTorch (add + nn.LayerNorm, Linear + F.gelu, scale + mask +
softmax), so it is an independent reference for the fused wiring.
"""
from __future__ import annotations

import pytest
import torch

import bertctl.model as M
from bertctl import ops
from bertctl.config import BertConfig
from bertctl.model import BertForPreTraining
from bertctl.nn.fused import dropout, layer_norm
from helpers import runtime, synthetic_batch, tiny_config

pytestmark = pytest.mark.usefixtures("fused_kernels")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pair(device, **kw) -> tuple[BertForPreTraining, BertForPreTraining]:
    torch.manual_seed(0)
    fused = BertForPreTraining(tiny_config(**kw), runtime("fused")).to(device)
    plain = BertForPreTraining(tiny_config(**kw), runtime("torch")).to(device)
    plain.load_state_dict(fused.state_dict())
    return fused, plain


def adamw_steps(model, opt, gen: torch.Generator, device, steps: int) -> tuple[list[float], list[dict]]:
    """``steps`` AdamW steps on synthetic batches: each step's loss, and its gradients (on the CPU)."""
    losses, grads = [], []
    for _ in range(steps):
        loss = model(**synthetic_batch(gen, device=device)).loss
        opt.zero_grad()
        loss.backward()
        grads.append({n: p.grad.detach().cpu().clone() for n, p in model.named_parameters()})
        opt.step()
        losses.append(float(loss.detach()))
    return losses, grads


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new"])
def test_fused_model_matches_torch(device, hidden_act, monkeypatch):
    calls = {"softmax": 0, "layer_norm": 0, "bias_gelu": 0, "bias_dropout_add_layer_norm": 0}
    for name in calls:  # count that the fused model really goes through bertctl.ops
        original = getattr(ops, name)

        def counted(*a, _name=name, _original=original, **k):
            calls[_name] += 1
            return _original(*a, **k)
        monkeypatch.setattr(ops, name, counted)
    fused, plain = pair(device, hidden_act=hidden_act)
    batch = synthetic_batch(torch.Generator().manual_seed(1), device=device)
    out_f, out_p = fused(**batch), plain(**batch)
    layers = fused.config.num_hidden_layers
    # per layer: 1 softmax, 2 bias+dropout+residual+LayerNorms (the sub-layers' outputs), 1 bias+GELU; plus the
    # embedding and MLM-head LayerNorms / GELU
    outputs = 2 * layers
    assert calls == {"softmax": layers, "layer_norm": 2 * layers + 2 - outputs, "bias_gelu": layers + 1,
                     "bias_dropout_add_layer_norm": outputs}
    torch.testing.assert_close(out_f.prediction_logits, out_p.prediction_logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out_f.loss, out_p.loss, atol=1e-5, rtol=1e-5)
    out_f.loss.backward()
    out_p.loss.backward()
    grads_p = dict(plain.named_parameters())
    for name, p in fused.named_parameters():
        torch.testing.assert_close(p.grad, grads_p[name].grad, atol=1e-5, rtol=1e-3, msg=lambda m: f"{name}: {m}")


def separate_output(dense, drop, ln, h, residual, fused, own=True):
    """A sub-layer's output as the model ran it before bias_dropout_add_layer_norm: the Linear (its bias in the
    matmul), bertctl's dropout, then LayerNorm(+residual)."""
    return layer_norm(ln, dropout(drop, dense(h), fused and own), residual, fused)


def test_cpu_fused_sublayer_output_matches_the_ops_apart(monkeypatch):
    """The CPU model with bias_dropout_add_layer_norm against the same model with the ops apart, dropout 0.1 in
    training, two steps of AdamW from one torch.manual_seed: the same masks (same seeds, drawn in the same order),
    so the same losses and gradients up to fp32 rounding; then in eval the same outputs."""
    drop = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
    results = {}
    for name in ("fused", "apart"):
        if name == "apart":
            monkeypatch.setattr(M, "dense_dropout_add_norm", separate_output)
        torch.manual_seed(0)
        model = BertForPreTraining(tiny_config(**drop), runtime("fused"))
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        gen = torch.Generator().manual_seed(4)
        torch.manual_seed(7)  # the dropout masks' generator
        losses, grads = adamw_steps(model, opt, gen, "cpu", 2)
        model.eval()
        with torch.no_grad():
            logits = model(**synthetic_batch(gen)).prediction_logits
        results[name] = (torch.tensor(losses), grads, logits)
    (loss_f, grads_f, logits_f), (loss_a, grads_a, logits_a) = results["fused"], results["apart"]
    torch.testing.assert_close(loss_f, loss_a, atol=1e-5, rtol=1e-5)
    for step, (gf, ga) in enumerate(zip(grads_f, grads_a)):
        for n in gf:
            torch.testing.assert_close(gf[n], ga[n], atol=1e-5, rtol=1e-3, msg=lambda m: f"step {step}, {n}: {m}")
    torch.testing.assert_close(logits_f, logits_a, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("device", DEVICES)
def test_with_torchs_masks_the_fused_model_trains_as_plain_pytorch(device, monkeypatch):
    """dropout_masks="torch" (fine-tuning's): in training every dropout is torch's, drawn in the plain
    model's order, so the fused model and the plain PyTorch one take the same 3 AdamW steps from one seed,
    dropout 0.1 everywhere, losses and gradients equal up to fp32 rounding; the one fused sub-layer op is not
    used there, and in eval it is, giving the default model's outputs bit for bit."""
    drop = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.1}
    calls = {"training": 0, "eval": 0}
    original = ops.bias_dropout_add_layer_norm

    def counted(*a, **k):
        calls["eval" if not torch.is_grad_enabled() else "training"] += 1
        return original(*a, **k)
    monkeypatch.setattr(ops, "bias_dropout_add_layer_norm", counted)
    results = {}
    for name, kernels, masks in (("fused", "fused", "torch"), ("plain", "torch", "fused"), ("own", "fused", "fused")):
        torch.manual_seed(0)
        model = BertForPreTraining(tiny_config(**drop), runtime(kernels, masks)).to(device)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        gen = torch.Generator().manual_seed(4)
        torch.manual_seed(7)  # the dropout masks' generator (CPU and CUDA)
        losses, grads = adamw_steps(model, opt, gen, device, 3)
        if name == "fused":
            assert calls == {"training": 0, "eval": 0}
            own_state = {k: v.clone() for k, v in model.state_dict().items()}
        model.eval()
        with torch.no_grad():
            if name == "own":
                model.load_state_dict(own_state)  # the torch-masks model's weights under the default settings
            logits = model(**synthetic_batch(torch.Generator().manual_seed(9), device=device)).prediction_logits
        results[name] = (torch.tensor(losses), grads, logits.cpu())
    assert calls["eval"] == 2 * 2 * 2  # two layers' two sub-layer outputs, in both eval passes of the fused models
    (loss_f, grads_f, logits_f), (loss_p, grads_p, _), (loss_o, _, logits_o) = (results[k] for k in ("fused", "plain", "own"))
    assert (loss_f - loss_o).abs().max() > 1e-4  # the masks differ from the fused op's own: dropout is on
    torch.testing.assert_close(loss_f, loss_p, atol=1e-5, rtol=1e-5)
    for step, (gf, gp) in enumerate(zip(grads_f, grads_p)):
        for n in gf:
            torch.testing.assert_close(gf[n], gp[n], atol=1e-5, rtol=1e-3, msg=lambda m: f"step {step}, {n}: {m}")
    assert torch.equal(logits_f, logits_o)


def test_dropout_masks_is_a_runtime_choice_and_checked():
    """Not architecture: a config.json that names it loads without it; an unknown value is one clear error."""
    from bertctl.errors import BertctlError

    assert "dropout_masks" not in BertConfig.from_dict({**tiny_config().to_dict(), "dropout_masks": "torch"}).to_dict()
    with pytest.raises(BertctlError, match="dropout_masks must be one of"):
        runtime("fused", "philox")


@pytest.mark.cuda
def test_fused_sublayer_outputs_train_alike_on_cpu_and_cuda(monkeypatch):
    """The sub-layer outputs' dropout is one hash on both devices: given the same seeds (a fixed sequence in place
    of each device's generator), the fused model in fp32 takes the same 3 AdamW steps on the CPU and on CUDA, hidden
    dropout 0.1 after every sub-layer (the embeddings' dropout and attention dropout off: on CUDA those are
    torch's), the losses and gradients equal up to rounding."""
    drop = {"hidden_dropout_prob": 0.1, "attention_probs_dropout_prob": 0.0}
    results = {}
    for device, first in (("cpu", 1000), ("cuda", 1000), ("other seeds", 5000)):
        seeds = iter(range(first, first + 1000, 7))
        device = "cuda" if device == "other seeds" else device
        monkeypatch.setattr(ops, "_seed", lambda x: torch.tensor(next(seeds), device=x.device))
        torch.manual_seed(0)
        model = BertForPreTraining(tiny_config(**drop), runtime("fused")).to(device)
        model.bert.embeddings.dropout.p = 0.0
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        gen = torch.Generator().manual_seed(4)
        losses, grads = adamw_steps(model, opt, gen, device, 3)
        results[device if first == 1000 else "other seeds"] = (losses, grads)
    (loss_c, grads_c), (loss_g, grads_g) = results["cpu"], results["cuda"]
    assert abs(results["other seeds"][0][0] - loss_g[0]) > 1e-4  # the masks matter: dropout is on
    torch.testing.assert_close(torch.tensor(loss_g), torch.tensor(loss_c), atol=1e-5, rtol=1e-5)
    for step, (gc, gg) in enumerate(zip(grads_c, grads_g)):
        for n in gc:
            torch.testing.assert_close(gg[n], gc[n], atol=1e-5, rtol=1e-3, msg=lambda m: f"step {step}, {n}: {m}")


@pytest.mark.parametrize("device", DEVICES)
def test_fused_training_converges_like_torch(device):
    """40 AdamW steps on the toy task: the fused and plain loss curves agree, and both learn."""
    fused, plain = pair(device)
    curves = {}
    for name, model in (("fused", fused), ("torch", plain)):
        gen = torch.Generator().manual_seed(2)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3)
        losses = []
        for _ in range(40):
            loss = model(**synthetic_batch(gen, device=device)).loss
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        curves[name] = torch.tensor(losses)
    torch.testing.assert_close(curves["fused"], curves["torch"], atol=2e-3, rtol=1e-3)
    assert curves["fused"][-5:].mean() < 0.7 * curves["fused"][:5].mean()


@pytest.mark.cuda
def test_fused_model_bf16_autocast_cuda():
    """Mixed precision (bf16 autocast, fp32 parameters): fused and plain agree to bf16 accuracy."""
    fused, plain = pair("cuda")
    batch = synthetic_batch(torch.Generator().manual_seed(3), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        lf, lp = fused(**batch).loss, plain(**batch).loss
    torch.testing.assert_close(lf.float(), lp.float(), atol=3e-2, rtol=2e-2)
