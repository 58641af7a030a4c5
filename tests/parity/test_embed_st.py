"""``bertctl embed`` on sentence-transformers checkpoints against that library's own ``encode``.

The checkpoints are the real all-MiniLM-L6-v2 (Transformer, mean Pooling, Normalize, 256 tokens) and
pipelines built and saved by sentence-transformers itself on its weights: every pooling mode, Dense
layers, and the older layout (the encoder in a sub-directory, the pooling modes as booleans, a token
limit and lowercasing in sentence_bert_config.json) with a default prompt.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.sentence_transformer import modules as models
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.inference.backends import load_encoder
from bertctl.inference.embed import EmbedConfig, checkpoint_config, embed_texts, finish_features, prepare_texts
from bertctl.inference.sentence_transformers import Dense, encoder_dir, read_modules
from bertctl.tasks.common import model_dir_of
from bertctl.text import load_tokenizer

runner = CliRunner()
# Both sides compute in fp32 with different kernels (fused LayerNorm, softmax and GELU here; the
# vectors have norms of 0.1-10 before normalisation): measured differences are below 1e-6.
ATOL = 2e-5


@pytest.fixture(scope="module")
def texts(shared_data):
    lines = (shared_data / "glue" / "SST-2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:65]
    long = " ".join(f"Sentence {i} of a Long Text, Well Past the Token Limit." for i in range(60))
    return [line.split("\t")[0] for line in lines] + [long, "Upper CASE words"]


@pytest.fixture(scope="module")
def minilm_st(minilm_dir):
    return SentenceTransformer(str(minilm_dir), device="cpu")


def st_encode(directory, texts):
    return SentenceTransformer(str(directory), device="cpu").encode(texts, batch_size=32, convert_to_numpy=True)


def bertctl_embed(directory, texts, **flags):
    config, encoder_dir, _ = checkpoint_config(directory, **flags)
    model = load_encoder(encoder_dir, torch.device("cpu"))
    return embed_texts(model, load_tokenizer(encoder_dir), texts, config, progress=False)


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_all_minilm_with_no_flags_gives_its_encode_vectors(tmp_path, minilm_dir, minilm_st, texts, backend):
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    result = runner.invoke(app, ["embed", "--model", str(minilm_dir), "--backend", backend, "-o", str(out),
                                 str(tmp_path / "in.txt")])
    assert result.exit_code == 0, result.output
    assert "mean pooling, L2-normalised, 256 tokens" in result.output
    assert f"truncated 1 of the {len(texts)} texts to the 256-token limit" in " ".join(result.stderr.split())  # not 512
    reference = minilm_st.encode(texts, batch_size=32, convert_to_numpy=True)
    np.testing.assert_allclose(np.load(out), reference, atol=ATOL)


def test_flags_override_the_checkpoint(minilm_dir, minilm_st, texts):
    plain = SentenceTransformer(modules=[minilm_st[0], minilm_st[1]], device="cpu")  # without Normalize
    np.testing.assert_allclose(bertctl_embed(minilm_dir, texts, normalize=False),
                               plain.encode(texts, batch_size=32, convert_to_numpy=True), atol=ATOL)
    cls = SentenceTransformer(modules=[minilm_st[0], models.Pooling(384, pooling_mode="cls"), models.Normalize()],
                              device="cpu")
    np.testing.assert_allclose(bertctl_embed(minilm_dir, texts, pooling="cls"),
                               cls.encode(texts, batch_size=32, convert_to_numpy=True), atol=ATOL)
    # A longer limit than the checkpoint's: the long text keeps more tokens, so its vector moves.
    longer = bertctl_embed(minilm_dir, texts, max_length=512)
    assert np.abs(longer[-2] - bertctl_embed(minilm_dir, texts)[-2]).max() > 1e-3


def test_a_directory_without_modules_keeps_embeds_own_defaults(tmp_path):
    config, encoder_dir, st = checkpoint_config(tmp_path)
    assert (config.pooling, config.layers, config.normalize, config.max_length, config.dense) == \
        ("mean", "last", False, None, ())
    assert (encoder_dir, st) == (tmp_path, None)


PIPELINES = {
    "cls": dict(pooling="cls"),
    "max": dict(pooling="max"),
    "mean-sqrt-len": dict(pooling="mean_sqrt_len_tokens"),
    "weighted-mean": dict(pooling="weightedmean"),
    "last": dict(pooling="lasttoken"),
    "cls,mean + Dense tanh + Normalize": dict(pooling=("cls", "mean"), dense=[(768, 64, torch.nn.Tanh(), True)],
                                            normalize=True),
    "max + Dense GELU + Dense identity": dict(pooling="max", dense=[(384, 32, torch.nn.GELU(), True),
                                                                   (32, 16, torch.nn.Identity(), False)]),
}


@pytest.mark.parametrize("name", PIPELINES)
def test_pipelines_saved_by_sentence_transformers(tmp_path, minilm_st, texts, name):
    spec = PIPELINES[name]
    torch.manual_seed(0)
    modules = [minilm_st[0], models.Pooling(384, pooling_mode=spec["pooling"])]
    modules += [models.Dense(i, o, bias=b, activation_function=act) for i, o, act, b in spec.get("dense", [])]
    modules += [models.Normalize()] if spec.get("normalize") else []
    SentenceTransformer(modules=modules, device="cpu").save(str(tmp_path / "st"))
    st = read_modules(tmp_path / "st")
    assert st.pooling == name.split(" + ")[0] and len(st.dense) == len(spec.get("dense", []))
    np.testing.assert_allclose(bertctl_embed(tmp_path / "st", texts), st_encode(tmp_path / "st", texts), atol=ATOL)


def test_the_older_layout_with_a_prompt_limit_and_lowercasing(tmp_path, minilm_dir, texts):
    """The encoder in 0_Transformer/, boolean pooling modes, max_seq_length and do_lower_case in
    sentence_bert_config.json, and a default prompt, as sentence-transformers 2.x saved them."""
    root = tmp_path / "old"
    shutil.copytree(minilm_dir, root / "0_Transformer",
                    ignore=shutil.ignore_patterns("modules.json", "1_Pooling", "2_Normalize", "config_sentence_*"))
    (root / "0_Transformer" / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": 24, "do_lower_case": True}))
    (root / "1_Pooling").mkdir()
    (root / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 384, "pooling_mode_cls_token": False, "pooling_mode_mean_tokens": False,
         "pooling_mode_max_tokens": True, "pooling_mode_mean_sqrt_len_tokens": True}))
    (root / "modules.json").write_text(json.dumps(
        [{"idx": 0, "name": "0", "path": "0_Transformer", "type": "sentence_transformers.models.Transformer"},
         {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]))
    (root / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "Query: ", "document": ""}, "default_prompt_name": "query"}))
    st = read_modules(root)
    assert (st.encoder, st.pooling, st.max_length, st.lowercase, st.prompt, st.normalize) == \
        (root / "0_Transformer", "max,mean-sqrt-len", 24, True, "Query: ", False)
    # finetune and export find the encoder there too.
    assert encoder_dir(root) == model_dir_of(root) == root / "0_Transformer"
    assert encoder_dir(minilm_dir) == model_dir_of(minilm_dir) == minilm_dir
    config = checkpoint_config(root)[0]
    assert prepare_texts(["Upper CASE"], config) == ["query: upper case"]
    np.testing.assert_allclose(bertctl_embed(root, texts), st_encode(root, texts), atol=ATOL)
    # Another named prompt, and a prompt of one's own, as encode(prompt_name=...) and encode(prompt=...).
    st_model = SentenceTransformer(str(root), device="cpu")
    np.testing.assert_allclose(bertctl_embed(root, texts, prompt_name="document"),
                               st_model.encode(texts, prompt_name="document", batch_size=32), atol=ATOL)
    np.testing.assert_allclose(bertctl_embed(root, texts, prompt="Passage: "),
                               st_model.encode(texts, prompt="Passage: ", batch_size=32), atol=ATOL)
    with_prompt = bertctl_embed(root, texts[:4], prompt="Passage: ")
    assert not np.allclose(with_prompt, bertctl_embed(root, texts[:4]), atol=1e-3)
    (tmp_path / "in.txt").write_text("a text\n", encoding="utf-8")
    for flags, message in ((["--prompt-name", "passage"], "--prompt-name passage: no such prompt in "),
                           (["--prompt-name", "query", "--prompt", "x"], "--prompt and --prompt-name: give one")):
        result = runner.invoke(app, ["embed", "--model", str(root), "-o", str(tmp_path / "o.npy"), *flags,
                                     str(tmp_path / "in.txt")])
        assert result.exit_code == 2 and message in result.output, result.output


def _st_dir(tmp_path, minilm_dir, modules, pooling=None):
    root = tmp_path / "st"
    shutil.copytree(minilm_dir, root, ignore=shutil.ignore_patterns("model.safetensors", "modules.json"))
    (root / "model.safetensors").symlink_to(minilm_dir / "model.safetensors")
    (root / "modules.json").write_text(json.dumps(
        [{"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
         for i, (kind, path) in enumerate(modules)]))
    if pooling is not None:
        (root / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return root


@pytest.mark.parametrize("modules, pooling, message", [
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("LSTM", "2_LSTM")], None,
     "modules.json: module LSTM (2_LSTM) is not one embed computes"),
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Normalize", "2_Normalize"), ("Dense", "3_Dense")], None,
     "modules.json: a Dense module after Normalize is not supported"),
    ([("Transformer", ""), ("Normalize", "2_Normalize")], None, "modules.json: no Pooling module after the encoder"),
    ([("Transformer", ""), ("Pooling", "1_Pooling")], {"pooling_mode": "median"},
     "config.json: pooling mode 'median' is not one embed computes"),
    ([("Transformer", ""), ("Pooling", "1_Pooling"), ("Dense", "2_Dense")], None, "2_Dense/config.json: missing"),
])
def test_a_pipeline_embed_cannot_compute_is_one_line(tmp_path, minilm_dir, modules, pooling, message):
    root = _st_dir(tmp_path, minilm_dir, modules, pooling)
    (tmp_path / "in.txt").write_text("a text\n", encoding="utf-8")
    out = tmp_path / "out.npy"
    result = runner.invoke(app, ["embed", "--model", str(root), "-o", str(out), str(tmp_path / "in.txt")])
    assert result.exit_code == 2, result.output
    line = result.output.strip()
    assert "\n" not in line and message in line, line
    assert not out.exists()
    # --pooling asks for the encoder's own pooled vectors: the pipeline after it is not needed. --backend torch, the
    # reference's: auto takes onnxruntime on the CPU, and exporting each case's copy of MiniLM cost it a quarter of a
    # minute (test_all_minilm_with_no_flags_gives_its_encode_vectors runs embed on onnxruntime).
    result = runner.invoke(app, ["embed", "--model", str(root), "--pooling", "mean", "--no-normalize", "--backend",
                                 "torch", "-o", str(out), str(tmp_path / "in.txt")])
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.load(out), bertctl_embed(minilm_dir, ["a text"], normalize=False), atol=1e-6)


def test_dense_and_normalisation_by_row_chunks_match_torch():
    """finish_features works rows at a time, normalising in place: the same as torch over the whole array."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(10, 6, generator=g, dtype=torch.float64) * 3
    x[4] = 0  # a zero row (normalised alone below): divided by 1e-12, as torch.nn.functional.normalize does
    w, b = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, generator=g, dtype=torch.float64)
    config = EmbedConfig(normalize=True, dense=(Dense(w.float().numpy(), b.float().numpy(), "tanh", None),))
    got = finish_features(x.float().numpy().copy(), config, rows=3)
    want = torch.nn.functional.normalize(torch.tanh(x @ w.T + b), dim=-1)
    np.testing.assert_allclose(got, want.numpy(), atol=1e-6)
    plain = x.float().numpy().copy()
    assert finish_features(plain, EmbedConfig(normalize=True), rows=4) is plain  # in place, no copy
    np.testing.assert_allclose(plain, torch.nn.functional.normalize(x, dim=-1).numpy(), atol=1e-6)
