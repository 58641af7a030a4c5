"""Checkpoint directories move between bertctl and transformers in both directions."""
from __future__ import annotations

import json

import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file

from bertctl.checkpoints.hf import load_pretrained, save_pretrained
from bertctl.config import BertConfig
from bertctl.errors import BertctlError
from bertctl.model import (
    BertForPreTraining,
    BertForQuestionAnswering,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)


def tiny_config(**kw) -> BertConfig:
    return BertConfig.preset("tiny", vocab_size=257, max_position_embeddings=64, **kw)


def batch():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, 257, (2, 10), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    return ids, mask


def test_ours_to_transformers_every_class(tmp_path):
    torch.manual_seed(0)
    ids, mask = batch()
    cases = [
        (BertForPreTraining(tiny_config()), transformers.BertForPreTraining, "prediction_logits"),
        (BertForSequenceClassification(tiny_config(id2label={0: "a", 1: "b", 2: "c"})),
         transformers.BertForSequenceClassification, "logits"),
        (BertForTokenClassification(tiny_config(num_labels=4)), transformers.BertForTokenClassification, "logits"),
        (BertForQuestionAnswering(tiny_config()), transformers.BertForQuestionAnswering, "start_logits"),
        (BertModel(tiny_config()), transformers.AutoModel, "last_hidden_state"),
    ]
    for ours, ref_cls, field in cases:
        ours.eval()
        path = tmp_path / type(ours).__name__
        save_pretrained(ours, path)
        ref = ref_cls.from_pretrained(str(path)).eval()
        with torch.no_grad():
            a = getattr(ours(ids, attention_mask=mask), field)
            b = getattr(ref(input_ids=ids, attention_mask=mask), field)
        real = mask.bool() if a.shape == mask.shape else slice(None)  # span logits: padding is PAD_LOGIT here
        assert (a - b)[real].abs().max() <= 1e-5, type(ours).__name__
    assert ref.config.hidden_size == 128
    assert transformers.AutoConfig.from_pretrained(str(tmp_path / "BertForSequenceClassification")).id2label[2] == "c"


def test_transformers_to_ours_with_and_without_prefix(tmp_path):
    torch.manual_seed(1)
    hf = transformers.BertForPreTraining(transformers.BertConfig(
        vocab_size=257, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
        max_position_embeddings=64)).eval()
    hf.save_pretrained(str(tmp_path / "pt"))
    ids, mask = batch()
    ours = load_pretrained(BertForPreTraining, tmp_path / "pt").eval()
    with torch.no_grad():
        assert (ours(ids, attention_mask=mask).prediction_logits
                - hf(input_ids=ids, attention_mask=mask).prediction_logits).abs().max() <= 1e-5
    # The same weights as a plain encoder: the pretraining heads are dropped, the prefix stripped.
    enc = load_pretrained(BertModel, tmp_path / "pt").eval()
    with torch.no_grad():
        assert (enc(ids, attention_mask=mask).last_hidden_state
                - hf.bert(input_ids=ids, attention_mask=mask).last_hidden_state).abs().max() <= 1e-5
    # A legacy pytorch_model.bin with TF-era LayerNorm.gamma/beta names and a position_ids buffer.
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    (legacy / "config.json").write_text((tmp_path / "pt" / "config.json").read_text())
    state = {k.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): v
             for k, v in hf.state_dict().items()}
    state["bert.embeddings.position_ids"] = torch.arange(64)[None]
    torch.save(state, legacy / "pytorch_model.bin")
    again = load_pretrained(BertForPreTraining, legacy).eval()
    with torch.no_grad():
        assert torch.equal(again(ids, attention_mask=mask).prediction_logits, ours(ids, attention_mask=mask).prediction_logits)


def test_base_model_into_task_head_needs_fresh_heads(minilm_dir):
    with pytest.raises(BertctlError, match="missing classifier.weight, classifier.bias"):
        load_pretrained(BertForSequenceClassification, minilm_dir)
    model = load_pretrained(BertForSequenceClassification, minilm_dir, fresh_heads=True, num_labels=3)
    assert model.classifier.weight.shape == (3, 384)
    # QA has no pooler (as in transformers): the checkpoint's pooler is dropped, not an error.
    load_pretrained(BertForQuestionAnswering, minilm_dir, fresh_heads=True)


def test_bad_checkpoints_give_one_clear_error(tmp_path):
    model = BertModel(tiny_config())
    save_pretrained(model, tmp_path / "ok")
    state = load_file(tmp_path / "ok" / "model.safetensors")

    def variant(name, mutate):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
        s = dict(state)
        mutate(s)
        save_file(s, str(path / "model.safetensors"))
        return path

    missing = variant("missing", lambda s: s.pop("encoder.layer.1.output.dense.weight"))
    with pytest.raises(BertctlError, match=r"missing encoder\.layer\.1\.output\.dense\.weight"):
        load_pretrained(BertModel, missing)
    shaped = variant("shaped", lambda s: s.update({"pooler.dense.bias": torch.zeros(7)}))
    with pytest.raises(BertctlError, match=r"mis-shaped pooler\.dense\.bias \(7,\) vs \(128,\)"):
        load_pretrained(BertModel, shaped)
    extra = variant("extra", lambda s: s.update({"encoder.layer.9.foo": torch.zeros(1)}))
    with pytest.raises(BertctlError, match=r"unexpected encoder\.layer\.9\.foo"):
        load_pretrained(BertModel, extra)
    with pytest.raises(BertctlError, match="model directory not found"):
        load_pretrained(BertModel, tmp_path / "nowhere")
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((tmp_path / "ok" / "config.json").read_text())
    (broken / "model.safetensors").write_bytes(b"\x00" * 20)
    with pytest.raises(BertctlError, match="unreadable weights"):
        load_pretrained(BertModel, broken)
    (broken / "config.json").write_text("{not json")
    with pytest.raises(BertctlError, match=r"config.json:1: invalid JSON"):
        load_pretrained(BertModel, broken)


def test_save_is_atomic_and_replaces(tmp_path):
    a, b = BertModel(tiny_config()), BertModel(tiny_config())
    save_pretrained(a, tmp_path / "m")
    save_pretrained(b, tmp_path / "m")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # no temporary debris
    loaded = load_pretrained(BertModel, tmp_path / "m")
    assert torch.equal(loaded.pooler.dense.weight, b.pooler.dense.weight)


def test_the_background_writer_keeps_the_state_as_it_was_at_submit(tmp_path):
    """``CheckpointWriter.submit`` snapshots tensors and containers: changing them afterwards, while the
    write may still be running, does not reach the checkpoint; a failed write is raised by ``wait``."""
    from bertctl.checkpoints import training

    from collections import namedtuple

    weights, history = torch.arange(6.0), [1]
    Pair = namedtuple("Pair", "a b")
    writer = training.CheckpointWriter()
    done = []
    path = writer.submit(tmp_path, 7, {"w": weights, "history": history, "nested": {"h": history}},
                         {"step": 7, "history": history}, done=done.append)
    pair = training.host_copy(Pair(weights, 3))  # named tuples too (the checkpoints' RNG states are plain ones)
    weights.add_(100.0)
    history.append(2)
    writer.wait()
    blob = training.load_checkpoint(path)
    assert torch.equal(blob["w"], torch.arange(6.0)) and blob["history"] == [1] and blob["nested"]["h"] == [1]
    assert isinstance(pair, Pair) and torch.equal(pair.a, torch.arange(6.0)) and pair.b == 3
    assert json.loads((path / "meta.json").read_text())["history"] == [1]
    assert done == [path] and training.latest_checkpoint(tmp_path).step == 7
    (tmp_path / "file").write_text("x")
    writer.submit(tmp_path / "file", 8, {"w": weights}, {"step": 8})  # a run folder under a file: fails
    with pytest.raises(NotADirectoryError, match="file"):  # what the synchronous write raises (the CLI: one line)
        writer.wait()
    writer.wait()  # the error was handed over once


@pytest.mark.parametrize("cls", [BertForSequenceClassification, BertForTokenClassification, BertForQuestionAnswering,
                                 BertForPreTraining, BertModel])
def test_loading_builds_on_the_meta_device_and_draws_only_the_new_head(tmp_path, cls):
    """``load_pretrained`` builds the model on the meta device: every tensor the checkpoint has comes
    across bit for bit (in the model's dtype, from an fp16 file too), every new one is allocated and
    drawn as the model initialises it, the MLM decoder stays tied, and nothing is left on meta."""
    torch.manual_seed(1)
    source = BertModel(tiny_config(), add_pooling_layer=False).half()  # no pooler, no heads: all new
    save_pretrained(source, tmp_path / "m")
    torch.manual_seed(0)
    model = load_pretrained(cls, tmp_path / "m", fresh_heads=True)
    saved = load_file(tmp_path / "m" / "model.safetensors")
    own = model.state_dict()
    prefix = "" if cls is BertModel else "bert."
    for name, tensor in saved.items():
        assert own[prefix + name].dtype == torch.float32 and torch.equal(own[prefix + name], tensor.float()), name
    assert not any(t.is_meta for t in (*model.parameters(), *model.buffers()))
    assert all(p.requires_grad for p in model.parameters())
    new = {k: v for k, v in own.items() if k.removeprefix(prefix) not in saved and not k.endswith("decoder.weight")}
    assert new or cls is BertModel
    for name, t in new.items():
        if name.endswith("LayerNorm.weight"):
            assert torch.equal(t, torch.ones_like(t)), name
        elif name.endswith("bias"):
            assert torch.equal(t, torch.zeros_like(t)), name
        elif t.numel() >= 1000:  # a matrix drawn from N(0, initializer_range)
            assert abs(t.std().item() - model.config.initializer_range) < 0.1 * model.config.initializer_range, name
    if cls is BertForPreTraining:
        assert model.cls.predictions.decoder.weight is model.bert.embeddings.word_embeddings.weight
    ids, mask = batch()
    with torch.no_grad():
        model(ids, attention_mask=mask)  # it runs


def test_building_on_meta_draws_nothing_and_leaves_torch_init_as_it_found_it():
    """The meta build skips torch.nn.init (whose reference ops import torch._dynamo, over a second of
    start-up), in a fresh process, and puts the functions back even when the build fails."""
    import subprocess
    import sys

    code = ("import sys, torch\n"
            "from bertctl.checkpoints.hf import on_meta\n"
            "from bertctl.config import BertConfig\n"
            "from bertctl.model import BertModel\n"
            "m = on_meta(lambda: BertModel(BertConfig.preset('tiny')))\n"
            "assert m.embeddings.word_embeddings.weight.is_meta\n"
            "print('torch._dynamo' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

    from bertctl.checkpoints.hf import _INIT_FUNCTIONS, on_meta
    rng = torch.get_rng_state()
    on_meta(lambda: BertModel(BertConfig.preset("tiny")))
    assert torch.equal(torch.get_rng_state(), rng)  # a fresh head drawn next gets the draws it always got
    before = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}

    def failing():
        torch.nn.Linear(2, 2)
        raise RuntimeError("build failed")
    with pytest.raises(RuntimeError, match="build failed"):
        on_meta(failing)
    assert {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS} == before
    w = torch.nn.init.normal_(torch.empty(1000), 0.0, 1.0)  # real draws again
    assert 0.8 < float(w.std()) < 1.2
