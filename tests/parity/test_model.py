"""The model against the reference implementation (transformers) on the same weights."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from bertctl.checkpoints.hf import load_pretrained, load_state
from bertctl.config import PRESETS, RUNTIME_FIELDS, BertConfig
from bertctl.model import (
    BertForMultipleChoice,
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
    PAD_LOGIT,
)
from bertctl.runtime import resolve

TOL = 1e-5  # fp32, same math in a different order


def padded_batch(vocab_size: int, generator: torch.Generator, B: int = 3, S: int = 19):
    ids = torch.randint(1000 % vocab_size, vocab_size, (B, S), generator=generator)
    mask = torch.ones(B, S, dtype=torch.long)
    mask[1, 11:] = 0  # right padding, two different lengths
    mask[B - 1, 4:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    types = torch.zeros(B, S, dtype=torch.long)
    types[:, 7:] = 1
    types = types * mask
    return ids, types, mask


@pytest.fixture(scope="module")
def minilm_pair(minilm_dir):
    ours = load_pretrained(BertModel, minilm_dir).eval()
    ref = transformers.BertModel.from_pretrained(str(minilm_dir), attn_implementation="eager").eval()
    return ours, ref


@pytest.mark.parametrize("attn", ["sdpa", "explicit"])
@pytest.mark.parametrize("kernels", ["torch", "fused"])
def test_minilm_every_layer_matches_transformers(minilm_pair, attn, kernels):
    ours, ref = minilm_pair
    ours.set_runtime(resolve("cpu", attn=attn, kernels=kernels))
    ids, types, mask = padded_batch(ours.config.vocab_size, torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = ours(ids, types, mask, output_hidden_states=True)
        b = ref(input_ids=ids, token_type_ids=types, attention_mask=mask, output_hidden_states=True)
    assert len(a.hidden_states) == len(b.hidden_states) == ours.config.num_hidden_layers + 1
    for layer, (x, y) in enumerate(zip(a.hidden_states, b.hidden_states)):
        diff = (x - y).abs().max().item()
        assert diff <= TOL, f"layer {layer}: max abs diff {diff:.3g}"
    assert (a.pooler_output - b.pooler_output).abs().max().item() <= TOL
    ours.set_runtime(None)


def test_presets_follow_the_papers():
    assert PRESETS["base"] == (12, 768, 12) and PRESETS["large"] == (24, 1024, 16)
    c = BertConfig.preset("mini")
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size) == (4, 256, 4, 1024)
    assert c.layer_norm_eps == 1e-12


def test_config_json_round_trip(tmp_path):
    c = BertConfig.preset("tiny", vocab_size=1000, id2label={0: "neg", 1: "pos"})
    c.to_json_file(tmp_path / "config.json")
    back = BertConfig.from_json_file(tmp_path / "config.json")
    assert back.to_dict() == c.to_dict()
    assert not set(RUNTIME_FIELDS) & set(back.to_dict())  # runtime choices are not architecture: not saved
    # A config.json that carries runtime choices (written while the config held them) loads without them.
    old = BertConfig.from_dict({**c.to_dict(), "attn_implementation": "unpadded", "kernels": "torch",
                                "dropout_masks": "torch"})
    assert old.to_dict() == c.to_dict()
    hf = transformers.BertConfig.from_json_file(str(tmp_path / "config.json"))
    assert hf.hidden_size == 128 and hf.id2label == {0: "neg", 1: "pos"}


def _tiny_hf_config(**kw) -> transformers.BertConfig:
    return transformers.BertConfig(
        vocab_size=211, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, **kw,
    )


def _ours_from(hf_model, cls):
    config = BertConfig.from_dict(hf_model.config.to_dict())
    return load_state(cls(config), hf_model.state_dict(), source="test").eval()


@pytest.mark.parametrize("attn", ["sdpa", "explicit"])
def test_pretraining_heads_and_loss_match(attn):
    torch.manual_seed(0)
    ref = transformers.BertForPreTraining(_tiny_hf_config()).eval()
    ours = _ours_from(ref, BertForPreTraining)
    ours.set_runtime(resolve("cpu", attn=attn))
    g = torch.Generator().manual_seed(1)
    ids, types, mask = padded_batch(211, g, B=4, S=20)
    positions = torch.tensor([[1, 3, 5], [2, 4, 6], [1, 2, 3], [5, 6, 7]])
    labels = torch.randint(0, 211, (4, 3), generator=g)
    labels[2, 2] = -100  # an unused slot
    full_labels = torch.full_like(ids, -100).scatter(1, positions, labels)
    nsp = torch.tensor([0, 1, 1, 0])
    with torch.no_grad():
        a = ours(ids, types, mask, masked_positions=positions, masked_lm_labels=labels, next_sentence_label=nsp)
        b = ref(input_ids=ids, token_type_ids=types, attention_mask=mask, labels=full_labels, next_sentence_label=nsp)
    gathered = b.prediction_logits.gather(1, positions[..., None].expand(-1, -1, 211))
    assert (a.prediction_logits - gathered).abs().max() <= TOL
    assert (a.seq_relationship_logits - b.seq_relationship_logits).abs().max() <= TOL
    assert abs(a.loss.item() - b.loss.item()) <= TOL
    # Without positions the MLM head runs on every token, as the reference does.
    with torch.no_grad():
        c = ours(ids, types, mask)
    assert (c.prediction_logits - b.prediction_logits).abs().max() <= TOL


@pytest.mark.parametrize(
    "ours_cls,ref_cls,kw",
    [
        (BertForSequenceClassification, transformers.BertForSequenceClassification, {"num_labels": 3}),
        (BertForSequenceClassification, transformers.BertForSequenceClassification, {"num_labels": 1}),
        (BertForTokenClassification, transformers.BertForTokenClassification, {"num_labels": 5}),
        (BertForQuestionAnswering, transformers.BertForQuestionAnswering, {}),
        (BertForMultipleChoice, transformers.BertForMultipleChoice, {}),
    ],
)
def test_task_heads_logits_and_loss_match(ours_cls, ref_cls, kw):
    torch.manual_seed(0)
    ref = ref_cls(_tiny_hf_config(**kw)).eval()
    ours = _ours_from(ref, ours_cls)
    assert set(ours.state_dict()) == set(ref.state_dict()), "parameter names differ from transformers"
    g = torch.Generator().manual_seed(2)
    ids, types, mask = padded_batch(211, g, B=4, S=16)
    inputs = dict(input_ids=ids, token_type_ids=types, attention_mask=mask)
    if ours_cls is BertForMultipleChoice:
        inputs = {k: v.view(2, 2, 16) for k, v in inputs.items()}
        labels = {"labels": torch.tensor([1, 0])}
    elif ours_cls is BertForQuestionAnswering:
        labels = {"start_positions": torch.tensor([1, 2, 3, 40]), "end_positions": torch.tensor([2, 5, 3, 41])}
    elif ours_cls is BertForTokenClassification:
        lab = torch.randint(0, 5, (4, 16), generator=g).masked_fill(mask == 0, -100)
        labels = {"labels": lab}
    elif kw.get("num_labels") == 1:
        labels = {"labels": torch.rand(4, generator=g) * 5}
    else:
        labels = {"labels": torch.tensor([0, 2, 1, 2])}
    with torch.no_grad():
        a = ours(**inputs, **labels)
        b = ref(**inputs, **labels)
    if ours_cls is BertForQuestionAnswering:
        # The same logits at the real tokens; bertctl takes the padding out of the span softmax, which
        # transformers leaves in: its loss is recomputed with the padding masked the same way.
        real = mask.bool()
        for x, y in ((a.start_logits, b.start_logits), (a.end_logits, b.end_logits)):
            assert (x - y)[real].abs().max() <= TOL
            assert (x[~real] == PAD_LOGIT).all()
        span = lambda logits, pos: torch.nn.functional.cross_entropy(  # noqa: E731
            logits.masked_fill(~real, PAD_LOGIT), pos.clamp(0, 16), ignore_index=16)
        ref_loss = (span(b.start_logits, labels["start_positions"]) + span(b.end_logits, labels["end_positions"])) / 2
        assert abs(a.loss.item() - ref_loss.item()) <= TOL
        assert not mask.all(), "the batch must hold padding for this to test anything"
        return
    assert (a.logits - b.logits).abs().max() <= TOL
    assert abs(a.loss.item() - b.loss.item()) <= TOL


def test_gradients_flow_through_both_backends():
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=300, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0))
    ids, types, mask = padded_batch(300, torch.Generator().manual_seed(3), B=2, S=12)
    grads = {}
    for attn in ("sdpa", "explicit"):
        model.zero_grad()
        model.set_runtime(resolve("cpu", attn=attn))
        out = model(ids, types, mask, masked_positions=torch.tensor([[1, 2], [3, 1]]),
                    masked_lm_labels=torch.tensor([[5, 6], [7, -100]]), next_sentence_label=torch.tensor([0, 1]))
        out.loss.backward()
        grads[attn] = model.bert.encoder.layer[0].attention.self.query.weight.grad.clone()
    assert grads["sdpa"].abs().sum() > 0
    torch.testing.assert_close(grads["sdpa"], grads["explicit"], atol=1e-6, rtol=1e-4)
    # The decoder is tied to the word embeddings (§3.1 uses the input embedding matrix for the output).
    assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight


def test_the_pretraining_model_compiles_whole_and_trains_as_eagerly():
    """torch.compile(fullgraph=True) of the model's training forward (the fused ops, InputProjection's
    residual hand-over, the masked-position MLM head) traces without a graph break, and its loss and every
    gradient equal the eager model's (float64, to rounding). A break at each layer's projection once made
    the compiled step 36% slower than the eager one on an H200."""
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=300, hidden_dropout_prob=0.0,
                                                 attention_probs_dropout_prob=0.0)).double()
    ids, types, mask = padded_batch(300, torch.Generator().manual_seed(4), B=3, S=12)
    batch = dict(masked_positions=torch.tensor([[1, 2], [3, 1], [2, 4]]),
                 masked_lm_labels=torch.tensor([[5, 6], [7, -100], [8, 9]]), next_sentence_label=torch.tensor([0, 1, 1]))

    def loss_and_grads(fwd):
        model.zero_grad(set_to_none=True)
        loss = fwd(ids, types, mask, **batch).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    want_loss, want = loss_and_grads(model)
    torch._dynamo.reset()
    got_loss, got = loss_and_grads(torch.compile(model, fullgraph=True))
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-12, atol=1e-12)
    assert got.keys() == want.keys() and len(want) > 20
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("widths", [(8, 8, 8), (24,)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_input_projection_is_a_linear_layer_and_its_residual(widths, with_bias):
    """InputProjection gives F.linear's column blocks and x, and the gradients autograd gives for a linear layer
    whose input is also used as a residual (float64, to rounding): with the residual's gradient accumulated in
    place or (expanded, absent) out of place, a block without a gradient, the blocks' gradients in
    (B, S, nh, hs) memory as the GPU attention kernels return them, an input of another dtype than the
    weight, and under torch.compile(fullgraph=True). The caller's gradients are left as they were."""
    from bertctl.nn.projections import InputProjection

    torch.manual_seed(0)
    B, S, H = 3, 5, 16
    N = sum(widths)
    x0 = torch.randn(B, S, H, dtype=torch.float64)
    w0, b0 = torch.randn(N, H, dtype=torch.float64), torch.randn(N, dtype=torch.float64)

    def leaves(x_dtype=torch.float64):
        return (x0.to(x_dtype).requires_grad_(), w0.clone().requires_grad_(),
                b0.clone().requires_grad_() if with_bias else None)

    def ours(x, w, b, owned=False):
        return InputProjection.apply(x, w, b, widths, owned, None)

    def plain(x, w, b):
        y = torch.nn.functional.linear(x, w, b)
        return (*y.split(widths, dim=-1), x)

    def inputs(x, w, b):
        return [t for t in (x, w, b) if t is not None]

    for a, e in zip(ours(*leaves()), plain(*leaves())):
        assert torch.equal(a, e)
    block_grads = [torch.randn(B, S, n, dtype=torch.float64) for n in widths]
    heads = [g.view(B, S, 2, n // 2).transpose(1, 2).contiguous().transpose(1, 2).reshape(B, S, n)
             for g, n in zip(block_grads, widths)]  # the same values through (B, nh, S, hs) views
    residual_grads = {"contiguous": torch.randn(B, S, H, dtype=torch.float64),
                      "expanded": torch.randn(1, 1, H, dtype=torch.float64).expand(B, S, H), "absent": None}
    for name, g_r in residual_grads.items():
        for used in ([0, 1, 2][:len(widths)], [0, 2] if len(widths) == 3 else [0]):
            given = [block_grads[i] for i in used] + ([] if g_r is None else [g_r])
            kept = [g.clone() for g in given]
            pick = lambda outs: [outs[i] for i in used] + ([] if g_r is None else [outs[-1]])  # noqa: E731
            xs, xp = leaves(), leaves()
            got = torch.autograd.grad(pick(ours(*xs)), inputs(*xs), given)
            want = torch.autograd.grad(pick(plain(*xp)), inputs(*xp), given)
            for a, e in zip(got, want):
                torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
            assert all(torch.equal(g, k) for g, k in zip(given, kept)), name
    xs, xp = leaves(), leaves()
    got = torch.autograd.grad(ours(*xs)[:-1], inputs(*xs), heads)
    want = torch.autograd.grad(plain(*xp)[:-1], inputs(*xp), block_grads)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    # The residual into a LayerNorm, as the model uses it: its gradient accumulated into in place.
    ln = torch.nn.LayerNorm(H, dtype=torch.float64)
    out_proj = torch.randn(widths[0], H, dtype=torch.float64)  # the sub-layer's output matmul, before its LayerNorm
    for sub in ("the residual alone", "the sub-layer's output"):
        xs, xp = leaves(), leaves()
        outs = [ours(*xs, owned=True), plain(*xp)]
        losses = [((ln(o[-1] + (o[0] @ out_proj if sub == "the sub-layer's output" else 0))
                    * residual_grads["contiguous"]).sum()
                   + sum((t * g).sum() for t, g in zip(o[:-1], block_grads))) for o in outs]
        got, want = (torch.autograd.grad(loss, inputs(*v)) for loss, v in zip(losses, (xs, xp)))
        for a, e in zip(got, want):
            torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
    # x in float32, the weight in float64: the residual and dx keep x's dtype
    xs, xp = leaves(torch.float32), leaves(torch.float32)
    outs = ours(*xs)
    assert outs[-1].dtype == torch.float32 and outs[0].dtype == torch.float64
    g_r = torch.randn(B, S, H)
    dx = torch.autograd.grad([*outs[:1], outs[-1]], xs[0], [block_grads[0], g_r])[0]
    want = g_r.double() + block_grads[0] @ w0[:widths[0]]
    assert dx.dtype == torch.float32
    torch.testing.assert_close(dx.double(), want, rtol=1e-6, atol=1e-6)
    # first and second derivatives by finite differences (float64): the backward is differentiable, and with
    # into_residual_grad it accumulates out of place while a graph is being built
    small = (torch.randn(2, 3, H, dtype=torch.float64, requires_grad=True), w0.clone().requires_grad_(),
             b0.clone().requires_grad_() if with_bias else None)
    f = lambda x, w, b=None: InputProjection.apply(x, w, b, widths, False, None)  # noqa: E731
    assert torch.autograd.gradcheck(f, inputs(*small)) and torch.autograd.gradgradcheck(f, inputs(*small))
    f = lambda x, w, b=None: InputProjection.apply(x, w, b, widths, True, None)  # noqa: E731
    assert torch.autograd.gradgradcheck(f, inputs(*small))
    # compiled
    xs, xp = leaves(), leaves()
    f = torch.compile(lambda *t: sum((o * g).sum() for o, g in zip(ours(*t), [*block_grads, g_r.double()])),
                      fullgraph=True)
    want = torch.autograd.grad(sum((o * g).sum() for o, g in zip(plain(*xp), [*block_grads, g_r.double()])),
                               inputs(*xp))
    for a, e in zip(torch.autograd.grad(f(*xs), inputs(*xs)), want):
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_projections_under_autocast_cast_inside_and_return_fp32_weight_gradients(device):
    """Under bf16 autocast, ``input_projection`` and ``linear`` compute autocast's F.linear values, and
    give the fp32 weights (and bias) fp32 gradients: on the CPU the widened bf16 product, exactly as
    autocast's cast node gives it; on CUDA the GEMM's fp32 result, the float64 product of the same
    bf16 operands to fp32 accumulation error, and never further from it than autocast's."""
    from bertctl.nn.projections import input_projection, linear

    gen = torch.Generator().manual_seed(11)
    B, S, H, widths = 4, 9, 64, (64, 64, 64)
    x0 = torch.randn(B, S, H, generator=gen).to(device)
    w0, b0 = torch.randn(sum(widths), H, generator=gen).to(device), torch.randn(sum(widths), generator=gen).to(device)
    gy = [torch.randn(B, S, n, generator=gen).to(device, torch.bfloat16) for n in widths]
    g_out = torch.randn(B, S, sum(widths), generator=gen).to(device, torch.bfloat16)

    def run(project):
        x, w, b = x0.clone().requires_grad_(), w0.clone().requires_grad_(), b0.clone().requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            outs = project(x, w, b)
        grads = torch.autograd.grad(outs, (x, w, b), gy[:len(outs)] if len(outs) > 1 else [g_out],
                                    allow_unused=True)
        return outs, grads

    def autocast_projection(x, w, b):
        return F.linear(x, w, b).split(widths, dim=-1)

    for ours, theirs in ((lambda x, w, b: input_projection(x, w, b, widths)[:-1], autocast_projection),
                         (lambda x, w, b: (linear(x, w),), lambda x, w, b: (F.linear(x, w),))):
        (o_ours, g_ours), (o_ref, g_ref) = run(ours), run(theirs)
        for a, e in zip(o_ours, o_ref):
            assert a.dtype == torch.bfloat16 and torch.equal(a, e)
        dw_ours, dw_ref = g_ours[1], g_ref[1]
        assert dw_ours.dtype == dw_ref.dtype == torch.float32
        torch.testing.assert_close(g_ours[0], g_ref[0], rtol=0, atol=0)  # dx: the same bf16 GEMM
        if g_ref[2] is not None:
            assert g_ours[2].dtype == torch.float32
            torch.testing.assert_close(g_ours[2], g_ref[2], rtol=1e-2, atol=1e-2)  # column sums, bf16 rounding
        if device == "cpu":
            assert torch.equal(dw_ours, dw_ref)
            continue
        g = (torch.cat(gy, -1) if len(o_ours) > 1 else g_out).double().reshape(-1, sum(widths))
        exact = g.t() @ x0.to(torch.bfloat16).double().reshape(-1, H)
        err_ours, err_ref = (dw_ours.double() - exact).abs().max(), (dw_ref.double() - exact).abs().max()
        assert err_ours <= 1e-4 * exact.abs().max() and err_ours <= err_ref, (err_ours, err_ref)


@pytest.mark.parametrize("V", [30522, 96, 13])
@pytest.mark.parametrize("loss", ["fused", "reference"])
def test_vocab_projection_padded_gives_the_same_loss_argmax_and_gradients(V, loss):
    """The padded V-way projection (as on CUDA): its first V columns are the unpadded logits, the rest
    -inf, and the cross-entropy over the padded rows gives the unpadded rows' loss, argmax and
    gradients of h, W and b (float64, to rounding), the extra columns' gradient exactly 0; V a
    multiple of the alignment is left alone."""
    from bertctl import ops
    from bertctl.nn.projections import VOCAB_ALIGN, vocab_projection

    gen = torch.Generator().manual_seed(V)
    h = torch.randn(2, 5, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.randn(V, 16, dtype=torch.float64, generator=gen, requires_grad=True)
    b = torch.randn(V, dtype=torch.float64, generator=gen, requires_grad=True)
    labels = torch.randint(0, V, (10,), generator=gen)
    labels[::3] = -100
    g = torch.randn(10, dtype=torch.float64, generator=gen)
    cross_entropy = ops.cross_entropy if loss == "fused" else ops.reference.cross_entropy
    plain = vocab_projection(h, w, b)
    padded = vocab_projection(h, w, b, pad_to=VOCAB_ALIGN)
    Vp = V + (-V % VOCAB_ALIGN)
    assert plain.shape == (2, 5, V) and padded.shape == (2, 5, Vp)
    torch.testing.assert_close(padded[..., :V], plain, rtol=1e-12, atol=1e-12)
    assert bool((padded[..., V:] == float("-inf")).all())
    (l_plain, a_plain), (l_padded, a_padded) = (cross_entropy(x.flatten(0, 1), labels) for x in (plain, padded))
    torch.testing.assert_close(l_padded, l_plain, rtol=1e-12, atol=1e-12)
    assert torch.equal(a_padded, a_plain)
    grad_padded_logits, *padded_grads = torch.autograd.grad((l_padded * g).sum(), (padded, h, w, b))
    assert bool((grad_padded_logits[..., V:] == 0).all())
    for a, e in zip(padded_grads, torch.autograd.grad((l_plain * g).sum(), (h, w, b))):
        assert a.shape == e.shape
        torch.testing.assert_close(a, e, rtol=1e-12, atol=1e-12)
