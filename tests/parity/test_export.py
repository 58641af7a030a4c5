"""``bertctl export onnx`` and ``embed --backend onnxruntime``: the exported graphs under onnxruntime
against transformers on the same weights (tiny random models of every head, and the real MiniLM)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import transformers
from typer.testing import CliRunner

from bertctl.checkpoints.hf import save_pretrained
from bertctl.cli.app import app
from bertctl.config import BertConfig
from bertctl.errors import BertctlError
from bertctl.inference import onnx_export
from bertctl.inference.backends import load_encoder, resolve_backend
from bertctl.inference.backends import onnx as onnx_backend
from bertctl.inference.backends.onnx import cached_encoder, cached_encoder_path, optimized_path
from bertctl.inference.backends.torch import TorchEncoder
from bertctl.inference.embed import EmbedConfig
from bertctl.inference.onnx_export import HEADS, export_onnx, fuse_attention
from bertctl.model import MODEL_CLASSES, PAD_LOGIT

runner = CliRunner()


def tiny_dir(directory, architecture: str, **config):
    torch.manual_seed(0)
    labels = 2 if architecture == "BertForQuestionAnswering" else 3  # transformers' QA head has num_labels outputs
    cfg = BertConfig(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                     max_position_embeddings=40, num_labels=labels, **config)
    save_pretrained(MODEL_CLASSES[architecture](cfg), directory)
    return directory


def inputs(shape, vocab: int, seed: int) -> dict[str, np.ndarray]:
    """Random ids, a second segment, and every row after the first padded to a shorter length."""
    g = np.random.default_rng(seed)
    ids = g.integers(0, vocab, shape, dtype=np.int64)
    types = np.zeros(shape, np.int64)
    types[..., shape[-1] // 2:] = 1
    mask = np.ones(shape, np.int64)
    rows = mask.reshape(-1, shape[-1])
    for r in range(1, rows.shape[0]):
        rows[r, max(1, shape[-1] - 2 * r):] = 0
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}


def transformers_outputs(directory, architecture: str, feeds: dict[str, np.ndarray]):
    model = getattr(transformers, architecture).from_pretrained(str(directory), attn_implementation="eager").eval()
    with torch.no_grad():
        return model(**{k: torch.from_numpy(v) for k, v in feeds.items()})


@pytest.mark.parametrize("architecture", list(HEADS))
def test_every_head_exports_and_matches_transformers(tmp_path, architecture):
    model_dir = tiny_dir(tmp_path / "model", architecture)
    out = tmp_path / "out" / "model.onnx"
    result = runner.invoke(app, ["export", "onnx", "--model", str(model_dir), "--output", str(out)])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["architecture"] == architecture and report["outputs"] == list(HEADS[architecture].outputs)
    assert 0 <= max(report["check"]["max_abs_diff"].values()) <= 1e-4
    assert sorted(p.name for p in out.parent.iterdir()) == ["model.onnx"]  # no temporary left beside it

    proto = onnx.load(str(out))
    onnx.checker.check_model(proto)
    assert max(o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")) >= 17
    assert not {o.domain for o in proto.opset_import} & {"bertctl"}  # no custom ops
    axes = list(HEADS[architecture].axes)
    for i in proto.graph.input:
        assert [d.dim_param for d in i.type.tensor_type.shape.dim] == axes, i.name

    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    # Shapes unlike the trace's (batch 2, sequence 8): one row of one token, and four at the position limit.
    for n, (b, s) in enumerate([(1, 1), (4, 40)]):
        shape = (b, 3, s) if architecture == "BertForMultipleChoice" else (b, s)
        feeds = inputs(shape, 99, n)
        want = transformers_outputs(model_dir, architecture, feeds)
        for name, got in zip(names, session.run(None, feeds)):
            ref = getattr(want, name).numpy()
            if name in ("start_logits", "end_logits"):  # bertctl takes the padding out of the span softmax
                ref = np.where(feeds["attention_mask"] == 0, PAD_LOGIT, ref)
            np.testing.assert_allclose(got, ref, rtol=0, atol=1e-4, err_msg=f"{name} at {shape}")


def test_explicit_attention_and_hidden_states(tmp_path):
    model_dir = tiny_dir(tmp_path / "model", "BertModel")
    report = export_onnx(model_dir, tmp_path / "m.onnx", hidden_states=True, attn_implementation="explicit")
    assert report["outputs"] == ["last_hidden_state", "pooler_output", "hidden_states"]
    session = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    feeds = inputs((3, 17), 99, 7)
    states = session.run(["hidden_states"], feeds)[0]
    model = transformers.BertModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}, output_hidden_states=True).hidden_states
    assert states.shape == (3, 3, 17, 32)  # (L+1, B, S, H)
    np.testing.assert_allclose(states, torch.stack(want).numpy(), rtol=0, atol=1e-4)


def test_a_mismatch_writes_nothing(tmp_path, monkeypatch):
    model_dir = tiny_dir(tmp_path / "model", "BertForSequenceClassification")
    monkeypatch.setattr(onnx_export, "compare", lambda *a: {"logits": 0.5})
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(BertctlError, match=r"differs from PyTorch under onnxruntime by 0\.5.*nothing written"):
        export_onnx(model_dir, out / "m.onnx")
    assert list(out.iterdir()) == []


def test_architecture_choice(tmp_path):
    qa = tiny_dir(tmp_path / "qa", "BertForQuestionAnswering")
    assert onnx_export.resolve_architecture(qa, None) == "BertForQuestionAnswering"
    # A token-classification or QA checkpoint has no pooler: its encoder exports without pooler_output.
    report = export_onnx(qa, tmp_path / "enc.onnx", architecture="BertModel")
    assert report["outputs"] == ["last_hidden_state"]
    config = json.loads((qa / "config.json").read_text())
    config["architectures"] = ["BertForMaskedLM"]  # no bertctl head: the encoder
    (qa / "config.json").write_text(json.dumps(config))
    assert onnx_export.resolve_architecture(qa, None) == "BertModel"
    for args, message in [(["--architecture", "BertForNothing"], "--architecture must be one of"),
                          (["--opset", "16"], "--opset must be at least 17"),
                          (["--attn", "flash"], "--attn must be one of"),
                          (["--architecture", "BertForQuestionAnswering", "--hidden-states"], "encoder")]:
        result = runner.invoke(app, ["export", "onnx", "--model", str(qa), "-o", str(tmp_path / "x.onnx"), *args])
        assert result.exit_code == 2 and message in result.output, result.output
    assert not (tmp_path / "x.onnx").exists()


# ----------------------------------------------------------------------------- the real MiniLM


@pytest.fixture(scope="module")
def sst2_dev(shared_data):
    lines = (shared_data / "glue" / "SST-2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]
    return [line.split("\t")[0] for line in lines]


@pytest.fixture(scope="module")
def minilm_onnx(minilm_dir):
    """embed's cached export of MiniLM (made here once per test session)."""
    return cached_encoder(minilm_dir)


def op_counts(path) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in onnx.load(str(path)).graph.node:
        counts[node.op_type] = counts.get(node.op_type, 0) + 1
    return counts


def test_minilm_export_matches_transformers(minilm_dir, minilm_onnx, sst2_dev):
    """embed serves the fused copy of the export: one Attention and one BiasGelu per layer, no SkipLayerNorm."""
    assert minilm_onnx.path == optimized_path(cached_encoder_path(minilm_dir)) and minilm_onnx.has_hidden_states
    assert cached_encoder_path(minilm_dir).exists()  # the export stays beside it
    ops = op_counts(minilm_onnx.path)
    assert ops["Attention"] == ops["BiasGelu"] == 6 and "Softmax" not in ops and "Erf" not in ops, ops
    assert "SkipLayerNormalization" not in ops, ops
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_dir))
    enc = tok(sst2_dev[:48], padding=True, return_tensors="np")
    feeds = {k: enc[k].astype(np.int64) for k in ("input_ids", "attention_mask", "token_type_ids")}
    got = dict(zip(["last_hidden_state", "pooler_output"],
                   minilm_onnx.session.run(["last_hidden_state", "pooler_output"], feeds)))
    want = transformers_outputs(minilm_dir, "BertModel", feeds)
    for name, value in got.items():
        np.testing.assert_allclose(value, getattr(want, name).numpy(), rtol=0, atol=1e-4, err_msg=name)


def embed(*args) -> np.ndarray:
    result = runner.invoke(app, ["embed", *map(str, args)])
    assert result.exit_code == 0, result.output
    return np.load(args[args.index("-o") + 1])


@pytest.mark.parametrize("layers", ["last", "sum-last-4"])
def test_embed_backends_give_the_same_vectors(tmp_path, minilm_dir, minilm_onnx, sst2_dev, layers):
    texts = tmp_path / "in.txt"
    texts.write_text("\n".join(sst2_dev[:120]) + "\n", encoding="utf-8")
    common = ["--model", minilm_dir, "--layers", layers, "--batch-size", "16"]
    a = embed(*common, "--backend", "torch", "-o", tmp_path / "torch.npy", texts)
    b = embed(*common, "--backend", "onnxruntime", "-o", tmp_path / "ort.npy", texts)
    c = embed(*common, "--onnx", minilm_onnx.path, "-o", tmp_path / "file.npy", texts)
    a, b = a.astype(np.float64), b.astype(np.float64)
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    assert a.shape == b.shape == (120, 384) and cosine.min() >= 0.9999, cosine.min()
    np.testing.assert_array_equal(b, c)


def test_embed_backend_choice_and_errors(tmp_path, minilm_dir, monkeypatch):
    cpu = torch.device("cpu")
    assert resolve_backend(EmbedConfig(), cpu) == "onnxruntime"  # the faster one on the CPU
    assert resolve_backend(EmbedConfig(precision="bf16"), cpu) == "torch"
    assert resolve_backend(EmbedConfig(precision="auto"), cpu) == "onnxruntime"  # auto is fp32 on the CPU
    assert resolve_backend(EmbedConfig(backend="torch"), cpu) == "torch"
    texts = tmp_path / "in.txt"
    texts.write_text("a sentence\n", encoding="utf-8")
    qa = tiny_dir(tmp_path / "qa", "BertForQuestionAnswering")
    export_onnx(qa, tmp_path / "qa.onnx")
    base = ["embed", "--model", str(minilm_dir), "-o", str(tmp_path / "o.npy"), str(texts)]
    for args, message in [(["--backend", "onnxruntime", "--precision", "bf16"], "--precision bf16 needs --backend torch"),
                          (["--dtype", "bf16"], "No such option: --dtype"),  # the old spelling is gone
                          (["--precision", "fp16", "--device", "cpu"], "--precision fp16 needs a GPU"),
                          (["--precision", "fp8"], "--precision must be one of"),
                          (["--backend", "torch", "--onnx", str(tmp_path / "qa.onnx")], "cannot go with --backend torch"),
                          (["--onnx", str(tmp_path / "qa.onnx")], "not an exported BERT encoder"),
                          (["--onnx", str(tmp_path / "none.onnx")], "no such file"),
                          (["--backend", "tensorflow"], "--backend must be one of")]:
        result = runner.invoke(app, [*base, *args])
        assert result.exit_code == 2 and message in result.output, (args, result.output)
    assert not (tmp_path / "o.npy").exists()
    # A model whose export fails: auto embeds with torch (with a note), onnxruntime stops.
    def broken(*a, **k):
        raise BertctlError("export failed")

    monkeypatch.setattr(onnx_export, "export_onnx", broken)
    tiny = tiny_dir(tmp_path / "tiny", "BertModel")
    assert isinstance(load_encoder(tiny, cpu, "onnxruntime", fallback=True), TorchEncoder)
    with pytest.raises(BertctlError, match="export failed"):
        load_encoder(tiny, cpu, "onnxruntime")
    # Without the onnx packages, auto falls back to torch and onnxruntime says what to install.
    monkeypatch.setattr(onnx_export, "onnx_missing", lambda export=True: ["onnxruntime"])
    assert resolve_backend(EmbedConfig(), cpu) == "torch"
    with pytest.raises(BertctlError, match=r"pip install 'bertctl\[onnx\]'"):
        resolve_backend(EmbedConfig(backend="onnxruntime"), cpu)


def test_cache_is_reused_and_replaced_when_the_weights_change(tmp_path, monkeypatch):
    model_dir = tiny_dir(tmp_path / "model", "BertModel")
    first = cached_encoder(model_dir).path
    export = cached_encoder_path(model_dir)
    calls, fusions = [], []
    real_export, real_optimize = onnx_export.export_onnx, onnx_export.optimize_encoder
    monkeypatch.setattr(onnx_export, "export_onnx", lambda *a, **k: calls.append(a) or real_export(*a, **k))
    monkeypatch.setattr(onnx_export, "optimize_encoder", lambda *a, **k: fusions.append(a) or real_optimize(*a, **k))
    assert cached_encoder(model_dir).path == first and calls == [] and fusions == []
    # Another onnxruntime: the fused copy is made again from the same export, the old copy removed.
    real_version = onnx_backend._version
    monkeypatch.setattr(onnx_backend, "_version", lambda p: "0.0-other" if p == "onnxruntime" else real_version(p))
    refused = cached_encoder(model_dir).path
    assert refused != first and calls == [] and len(fusions) == 1 and not first.exists() and export.exists()
    tiny_dir(model_dir, "BertModel", hidden_act="gelu_new")  # rewritten: a new key, the old export removed
    second = cached_encoder(model_dir).path
    assert second != refused and len(calls) == 1 and second.exists() and not refused.exists() and not export.exists()
    export = cached_encoder_path(model_dir)
    same_directory = export.parent.glob(export.name.rsplit("-", 1)[0] + "-*")  # the folder is the session's
    assert sorted(p.name for p in same_directory) == sorted([second.name, export.name])


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new"])
def test_fused_encoder_matches_transformers(tmp_path, hidden_act):
    """The fused copy of a tiny encoder (2 layers, 4 heads) against transformers, padded rows included."""
    model_dir = tiny_dir(tmp_path / "model", "BertModel", hidden_act=hidden_act)
    encoder = cached_encoder(model_dir)
    assert op_counts(encoder.path)["Attention"] == 2
    feeds = inputs((5, 23), 99, 3)
    model = transformers.BertModel.from_pretrained(str(model_dir), attn_implementation="eager").eval()
    with torch.no_grad():
        want = model(**{k: torch.from_numpy(v) for k, v in feeds.items()}, output_hidden_states=True).hidden_states
    got = encoder.hidden_states(feeds["input_ids"], feeds["attention_mask"], feeds["token_type_ids"], all_layers=True)
    np.testing.assert_allclose(np.stack(got), torch.stack(want).numpy(), rtol=0, atol=1e-4)


def test_fusion_leaves_a_graph_it_does_not_recognise(tmp_path):
    """Without the exporter's module scopes there is no attention block to find: nothing changes."""
    model_dir = tiny_dir(tmp_path / "model", "BertModel")
    export_onnx(model_dir, tmp_path / "m.onnx")
    proto = onnx.load(str(tmp_path / "m.onnx"))
    for node in proto.graph.node:
        del node.metadata_props[:]
    before = proto.SerializeToString()
    assert fuse_attention(proto, 4) == 0 and proto.SerializeToString() == before
