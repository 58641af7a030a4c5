"""``bertctl embed`` against the same computation done with transformers on the same weights."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.inference.backends import load_encoder
from bertctl.inference.backends.torch import TorchEncoder
from bertctl.inference.embed import EmbedConfig, checkpoint_config, embed_texts
from bertctl.errors import BertctlError
from bertctl.text.wordpiece import BertTokenizer

runner = CliRunner()


@pytest.fixture(scope="module")
def sst2_dev(shared_data):
    lines = (shared_data / "glue" / "SST-2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:]
    return [line.split("\t")[0] for line in lines]


@pytest.fixture(scope="module")
def reference(minilm_dir):
    tok = transformers.AutoTokenizer.from_pretrained(str(minilm_dir))
    model = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    return tok, model


def reference_features(reference, texts, layers="last", pooling="mean", normalize=True):
    """transformers' hidden states pooled here, in batches of 128 texts of similar length (less padding to
    compute; the rows come back in the texts' order)."""
    tok, model = reference
    order = sorted(range(len(texts)), key=lambda i: len(texts[i]))
    rows = []
    with torch.no_grad():
        for i in range(0, len(texts), 128):
            enc = tok([texts[k] for k in order[i : i + 128]], padding=True, truncation=True, max_length=512,
                      return_tensors="pt")
            hs = model(**enc, output_hidden_states=True).hidden_states
            x = {"last": hs[-1], "second-to-last": hs[-2], "embeddings": hs[0],
                 "sum-last-4": hs[-1] + hs[-2] + hs[-3] + hs[-4],
                 "concat-last-4": torch.cat([hs[-4], hs[-3], hs[-2], hs[-1]], -1)}[layers]
            m = enc["attention_mask"].unsqueeze(-1).float()
            if pooling == "mean":
                f = (x * m).sum(1) / m.sum(1)
            elif pooling == "max":
                f = torch.where(m.bool(), x, torch.tensor(float("-inf"))).max(1).values
            else:
                f = x[:, 0]
            rows.append(torch.nn.functional.normalize(f, dim=-1) if normalize else f)
    features = torch.empty_like(torch.cat(rows))
    features[order] = torch.cat(rows)
    return features.numpy().astype(np.float64)


def cosine(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))


def test_sst2_dev_mean_normalised_matches_transformers(tmp_path, minilm_dir, sst2_dev, reference):
    (tmp_path / "dev.txt").write_text("\n".join(sst2_dev) + "\n", encoding="utf-8")
    result = runner.invoke(app, ["embed", "--model", str(minilm_dir), "--pooling", "mean", "--layers", "last",
                                 "--normalize", "--output", str(tmp_path / "out.npy"), str(tmp_path / "dev.txt")])
    assert result.exit_code == 0, result.output
    ours = np.load(tmp_path / "out.npy")
    assert ours.dtype == np.float32 and ours.shape == (872, 384)
    cos = cosine(ours, reference_features(reference, sst2_dev))
    assert cos.min() >= 0.99999, f"worst sentence {cos.argmin()}: cosine {cos.min():.7f}"


@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
@pytest.mark.parametrize("layers", ["second-to-last", "sum-last-4", "concat-last-4", "embeddings"])
@pytest.mark.parametrize("pooling", ["cls", "max", "mean"])
def test_layer_and_pooling_choices(minilm_dir, sst2_dev, reference, layers, pooling, backend):
    """Both backends (torch tensors and numpy arrays through the same pooling code) against transformers."""
    texts = sst2_dev[:24]
    model = load_encoder(minilm_dir, torch.device("cpu"), backend)
    tokenizer = BertTokenizer.from_pretrained(minilm_dir)
    config = EmbedConfig(layers=layers, pooling=pooling, batch_size=5, batch_tokens=64)
    ours = embed_texts(model, tokenizer, texts, config, progress=False)
    ref = reference_features(reference, texts, layers, pooling, normalize=False)
    assert ours.shape == ref.shape
    np.testing.assert_allclose(ours, ref, atol=2e-5, rtol=1e-4)


def test_output_formats_keep_input_order(tmp_path, minilm_dir):
    texts = ["a much longer sentence comes first in the file", "short", "", "mid length text here"]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in texts), encoding="utf-8")
    outs = {}
    for suffix in (".npy", ".jsonl", ".safetensors"):
        out = tmp_path / f"out{suffix}"
        r = runner.invoke(app, ["embed", "--model", str(minilm_dir), "--field", "body", "--batch-size", "2",
                                "--output", str(out), str(tmp_path / "in.jsonl")])
        assert r.exit_code == 0, r.output
        outs[suffix] = out
    a = np.load(outs[".npy"])
    b = np.array([json.loads(line)["embedding"] for line in outs[".jsonl"].read_text().splitlines()])
    c = load_file(str(outs[".safetensors"]))["embeddings"]
    np.testing.assert_allclose(a, b, atol=1e-6)
    np.testing.assert_array_equal(a, c)
    # Row i belongs to text i whatever the batching: compare with one-at-a-time embedding.
    model = load_encoder(minilm_dir, torch.device("cpu"))
    tok = BertTokenizer.from_pretrained(minilm_dir)
    config = checkpoint_config(minilm_dir)[0]  # the checkpoint's sentence-transformers settings, as the CLI's
    single = np.stack([embed_texts(model, tok, [t], config, progress=False)[0] for t in texts])
    np.testing.assert_allclose(a, single, atol=1e-5)


def test_tokenizing_in_workers_gives_the_same_ids(shared_data, minilm_dir, tmp_path, monkeypatch, sst2_dev):
    """Texts tokenised in worker processes (chunks in order) give the ids and lengths of one process;
    `embed --workers` (default: the usable CPUs, shown in --help) gives the same vectors as --workers 1."""
    import os

    import bertctl.inference.embed
    from bertctl.inference.embed import tokenize_texts

    lines = (shared_data / "glue" / "SST-2" / "train.tsv").read_text(encoding="utf-8").splitlines()[1:25_001]
    texts = [line.split("\t")[0] for line in lines]
    tok = BertTokenizer.from_pretrained(minilm_dir)
    one = tokenize_texts(tok, texts, 64, workers=1)
    two = tokenize_texts(tok, texts, 64, workers=2)
    expected = [tok.encode(t, max_length=64, truncation="longest_first").input_ids for t in texts[:50]]
    np.testing.assert_array_equal(one[1][:50], [len(e) for e in expected])
    np.testing.assert_array_equal(one[0][: sum(map(len, expected))], [i for e in expected for i in e])
    np.testing.assert_array_equal(one[0], two[0])
    np.testing.assert_array_equal(one[1], two[1])

    monkeypatch.setattr(bertctl.inference.embed, "PARALLEL_CHARACTERS", 10)  # the dev set goes through the workers too
    (tmp_path / "in.txt").write_text("\n".join(sst2_dev[:300]) + "\n", encoding="utf-8")
    outs = []
    for k, flag in enumerate(([], ["--workers", "1"])):
        out = tmp_path / f"o{k}.npy"
        r = runner.invoke(app, ["embed", "--model", str(minilm_dir), "--backend", "torch", "-o", str(out),
                                str(tmp_path / "in.txt"), *flag])
        assert r.exit_code == 0, r.output
        outs.append(np.load(out))
    np.testing.assert_array_equal(outs[0], outs[1])
    help_text = " ".join(runner.invoke(app, ["embed", "--help"]).output.replace("│", " ").split())
    assert f"[default: (the usable CPUs, {len(os.sched_getaffinity(0))} here)]" in help_text


def test_bad_input_gives_one_line_errors(tmp_path, minilm_dir):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "latin1.txt").write_bytes("ok line\ncaf\xe9\n".encode("latin-1"))
    (tmp_path / "ok.txt").write_text("hello\n")
    no_vocab = tmp_path / "novocab"
    shutil.copytree(minilm_dir, no_vocab)
    (no_vocab / "vocab.txt").unlink()
    (no_vocab / "tokenizer.json").unlink(missing_ok=True)
    cases = [
        (["--model", str(minilm_dir), "--output", str(tmp_path / "o.npy"), str(tmp_path / "empty.txt")], "empty input"),
        (["--model", str(minilm_dir), "--output", str(tmp_path / "o.npy"), str(tmp_path / "latin1.txt")], "latin1.txt:2: not valid UTF-8"),
        (["--model", str(minilm_dir), "--output", str(tmp_path / "o.npy"), str(tmp_path / "missing.txt")], "missing.txt: no such file"),
        (["--model", str(minilm_dir), "--output", str(tmp_path / "o.csv"), str(tmp_path / "ok.txt")], "suffix must be"),
        (["--model", str(minilm_dir), "--pooling", "sum", "--output", str(tmp_path / "o.npy"), str(tmp_path / "ok.txt")], "--pooling"),
        (["--model", str(no_vocab), "--output", str(tmp_path / "o.npy"), str(tmp_path / "ok.txt")], "vocab"),
    ]
    for args, message in cases:
        result = runner.invoke(app, ["embed", *args])
        assert result.exit_code == 2, (args, result.output)
        err = result.stderr if hasattr(result, "stderr") else result.output
        assert message in err, (message, err)
        assert "Traceback" not in err
    assert not (tmp_path / "o.npy").exists()


def test_bf16_casts_the_weights_once_and_keeps_the_vectors(tmp_path, minilm_dir, sst2_dev, reference):
    """--precision bf16: the encoder's weights are cast once at load (no autocast per batch); the vectors
    stay those of transformers in fp32, as close as through autocast on an fp32 model (32 texts: a CPU without
    bf16 instructions runs bf16 matmuls many times slower than fp32)."""
    texts = sst2_dev[:32]
    ref = reference_features(reference, texts)
    cast = load_encoder(minilm_dir, torch.device("cpu"), precision="bf16")
    assert {p.dtype for p in cast.model.parameters()} == {torch.bfloat16}
    config = EmbedConfig(pooling="mean", normalize=True, precision="bf16")
    once = embed_texts(cast, BertTokenizer.from_pretrained(minilm_dir), texts, config, progress=False)
    fp32 = load_encoder(minilm_dir, torch.device("cpu")).model
    autocast = embed_texts(TorchEncoder(fp32, "bf16"), BertTokenizer.from_pretrained(minilm_dir), texts, config,
                           progress=False)
    assert once.dtype == np.float32
    assert cosine(once, ref).min() >= 0.999 and cosine(autocast, ref).min() >= 0.999
    assert cosine(once, ref).min() < 0.99999 and cosine(autocast, ref).min() < 0.99999  # bf16 did run
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    result = runner.invoke(app, ["embed", "--model", str(minilm_dir), "--precision", "bf16", "--device", "cpu",
                                 "--backend", "torch", "--normalize", "-o", str(tmp_path / "o.npy"),
                                 str(tmp_path / "in.txt")])
    assert result.exit_code == 0, result.output
    np.testing.assert_allclose(np.load(tmp_path / "o.npy"), once, atol=1e-6)


def test_embeddings_that_are_not_finite_stop_the_run(tmp_path, minilm_dir):
    """Activations past a precision's range give inf/NaN vectors (here an inf weight stands in for an
    overflow): one line naming --precision, exit code 2, no output file."""
    broken = tmp_path / "broken"
    shutil.copytree(minilm_dir, broken)
    from safetensors.torch import load_file as load_tensors, save_file

    weights = next(broken.glob("*.safetensors"))
    state = load_tensors(str(weights))
    name = next(k for k in state if k.endswith("encoder.layer.5.output.LayerNorm.weight"))
    state[name] = torch.full_like(state[name], float("inf"))  # as an overflow leaves it: inf, then NaN
    save_file(state, str(weights), metadata={"format": "pt"})
    (tmp_path / "in.txt").write_text("hello world\nanother line\n", encoding="utf-8")
    result = runner.invoke(app, ["embed", "--model", str(broken), "--precision", "bf16", "--device", "cpu",
                                 "--backend", "torch", "-o", str(tmp_path / "o.npy"), str(tmp_path / "in.txt")])
    err = result.stderr if hasattr(result, "stderr") else result.output
    assert result.exit_code == 2, result.output
    assert "not finite" in err and "--precision" in err and "Traceback" not in err
    assert not (tmp_path / "o.npy").exists()


def test_no_progress_hides_the_bar_and_keeps_the_summary(tmp_path, minilm_dir):
    """--no-progress as in every command: no bar on stderr; the closing line (texts, tokens, speed) stays."""
    (tmp_path / "in.txt").write_text("one text\nanother text here\n", encoding="utf-8")
    runs = {}
    for args in ((), ("--no-progress",)):
        result = runner.invoke(app, ["embed", "--model", str(minilm_dir), "-o", str(tmp_path / f"o{len(args)}.npy"),
                                     *args, str(tmp_path / "in.txt")])
        assert result.exit_code == 0, result.output
        runs[args] = result.stderr
    assert "embedded 2 texts" in runs[()] and "embedded 2 texts" in runs[("--no-progress",)]
    assert "━" in runs[()] and "━" not in runs[("--no-progress",)]


def test_tokenizing_workers_stop_when_the_model_fails_to_load(tmp_path, minilm_dir, monkeypatch, sst2_dev):
    """The command starts tokenising before it loads the model; a model that fails to load gives one
    line and exit code 2, and leaves no worker process behind."""
    import multiprocessing

    import bertctl.inference.embed

    monkeypatch.setattr(bertctl.inference.embed, "PARALLEL_CHARACTERS", 10)
    broken = tmp_path / "broken"
    shutil.copytree(minilm_dir, broken)
    for weights in broken.glob("*.safetensors"):
        weights.write_bytes(b"not a safetensors file")
    (tmp_path / "in.txt").write_text("\n".join(sst2_dev[:300]) + "\n", encoding="utf-8")
    r = runner.invoke(app, ["embed", "--model", str(broken), "--backend", "torch", "--workers", "2", "-o",
                            str(tmp_path / "o.npy"), str(tmp_path / "in.txt")])
    assert r.exit_code == 2, r.output
    assert "Traceback" not in r.output and not (tmp_path / "o.npy").exists()
    assert multiprocessing.active_children() == []


def test_a_forward_pass_out_of_device_memory_names_the_token_budget(tmp_path, minilm_dir, monkeypatch):
    """Out of memory in a forward pass: one line naming the batch and --batch-tokens, exit code 2, no output."""
    from bertctl.model import BertModel

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(BertModel, "forward", oom)
    (tmp_path / "in.txt").write_text("hello world\nanother line\n", encoding="utf-8")
    result = runner.invoke(app, ["embed", "--model", str(minilm_dir), "--device", "cpu", "--backend", "torch",
                                 "-o", str(tmp_path / "o.npy"), str(tmp_path / "in.txt")])
    err = result.stderr if hasattr(result, "stderr") else result.output
    assert result.exit_code == 2, result.output
    assert "out of CPU memory embedding 2 texts" in err and "--batch-tokens" in err and "Traceback" not in err
    assert not (tmp_path / "o.npy").exists()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(["a", "é", "\n", "\r", "\r\n", " ", "日本", "\t", ""]), max_size=30))
def test_read_lines_is_iter_lines_at_once(tmp_path_factory, parts):
    """``embed``'s fast read gives ``iter_lines``' lines: the same splits, \\r\\n endings, final newline."""
    from bertctl.text.files import iter_lines, read_lines

    path = tmp_path_factory.mktemp("lines") / "t.txt"
    path.write_bytes("".join(parts).encode("utf-8"))
    assert read_lines(path) == [line for _, line, _ in iter_lines(path)]


def test_read_lines_names_the_bad_line(tmp_path):
    from bertctl.text.files import read_lines

    path = tmp_path / "t.txt"
    path.write_bytes(b"fine\nalso fine\nbad \xff byte\n")
    with pytest.raises(BertctlError, match=r"t\.txt:3: not valid UTF-8 \(byte 0xff at column 5\)"):
        read_lines(path)
    with pytest.raises(BertctlError, match="no such file"):
        read_lines(tmp_path / "missing.txt")
