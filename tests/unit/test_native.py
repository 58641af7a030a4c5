"""bertctl's own CUDA encoder for ``embed`` (bertctl/inference/backends/native.py, csrc/encoder).

On the CPU: the weight layout it is given, the layers and pooling it is asked for, and the command's
answers where it cannot run.  On a GPU (marker ``cuda``): its features against the PyTorch model run in
float64 on the CPU, for every layer choice and pooling mode, in fp32, fp16 and bf16, on the real MiniLM
and on random models of head sizes 64 and 128 with texts long enough to span several key tiles and
query blocks; and the whole command, which must not import torch.
"""
from __future__ import annotations

import subprocess
import sys
from contextlib import nullcontext
from pathlib import Path

import numpy as np
import pytest
import torch

from bertctl.config import BertConfig
from bertctl.errors import BertctlError
from bertctl.inference import backends
from bertctl.inference.backends import native
from bertctl.inference.backends.torch import TorchEncoder
from bertctl.inference.embed import EmbedConfig
from bertctl.inference.encoder import Tokens
from bertctl.inference.pooling import LAYER_CHOICES, POOLING_CHOICES, PoolingSpec, combine_layers, pool
from bertctl.runtime import device_index

ROOT = Path(__file__).resolve().parents[2]


def random_model(directory: Path, hidden: int, heads: int, layers: int = 4, act: str = "gelu", seed: int = 0,
                 sharpen: float = 1.0) -> Path:
    """A random BERT; ``sharpen`` scales the query and key weights, so that attention is far from the uniform
    average that BERT's initial weights give (where keys in the wrong order would not show)."""
    from bertctl.checkpoints.hf import save_pretrained
    from bertctl.model import BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=500, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                        intermediate_size=2 * hidden, max_position_embeddings=512, hidden_act=act)
    model = BertModel(config, add_pooling_layer=False)
    with torch.no_grad():  # LayerNorm parameters away from 1 and 0, so that a swapped gamma/beta shows
        for name, p in model.named_parameters():
            if "LayerNorm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            if name.endswith(("query.weight", "key.weight")):
                p.mul_(sharpen)
    save_pretrained(model, directory)
    return directory


def reference(directory: Path, ids: np.ndarray, mask: np.ndarray, layers: str, pooling: str) -> np.ndarray:
    """The PyTorch model's features in float64 on the CPU."""
    from bertctl.checkpoints.hf import load_config, load_state, read_state_dict
    from bertctl.model import BertModel
    from bertctl.runtime import resolve

    config = load_config(directory)
    model = load_state(BertModel(config, resolve("cpu", attn="explicit", kernels="torch"), add_pooling_layer=False),
                       read_state_dict(directory)).double().eval()
    with torch.no_grad():
        out = model(torch.from_numpy(ids), torch.zeros_like(torch.from_numpy(ids)), torch.from_numpy(mask),
                    output_hidden_states=True)
    return pool(combine_layers(out.hidden_states, PoolingSpec(layers, pooling)), torch.from_numpy(mask), pooling).numpy()


def native_features(encoder, ids: np.ndarray, mask: np.ndarray, layers: str, pooling: str) -> np.ndarray:
    """One padded batch (mask 1 = real token, padding on the right) through the native encoder's
    ``features``, as one forward pass."""
    real = mask.astype(bool)
    tokens = Tokens(ids[real], real.sum(1))
    return encoder.features(tokens, [np.arange(len(ids))], PoolingSpec(layers, pooling))


def padded_batch(lengths: list[int], vocab: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    width = max(lengths)
    mask = (np.arange(width)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    ids = rng.integers(5, vocab, size=mask.shape) * mask
    return ids.astype(np.int64), mask


# ----------------------------------------------------------------------------- CPU


def test_pool_codes_cover_the_pooling_modes():
    assert set(native.POOL_CODES) == set(POOLING_CHOICES)
    assert sorted(native.POOL_CODES.values()) == list(range(len(POOLING_CHOICES)))


@pytest.mark.parametrize("layers", LAYER_CHOICES)
def test_spec_hidden_states_match_combine_layers(layers):
    """The states the native encoder is told to use (``PoolingSpec.hidden_states``) are those the torch
    and ONNX backends combine, against the paper's Table 7 by hand."""
    spec = PoolingSpec(layers, "mean")
    states = [np.full((1, 1, 1), float(i)) for i in range(7)]  # 6 layers: value i is hidden state i
    keep, summed = spec.hidden_states(6)
    combined = combine_layers(states, spec).ravel()
    assert list(combined) == ([float(sum(keep))] if summed else [float(k) for k in keep])
    want = {"last": [6.0], "second-to-last": [5.0], "embeddings": [0.0], "sum-last-4": [3.0 + 4 + 5 + 6],
            "concat-last-4": [3.0, 4.0, 5.0, 6.0]}[layers]
    assert list(combined) == want
    assert spec.width(384, 6) == 384 * len(want)
    with pytest.raises(BertctlError, match="at least 4 layers") if layers.endswith("-4") else nullcontext():
        spec.hidden_states(3)


def test_encoder_weights_layout(tmp_path):
    """Views of the file as it is, in the encoder's order; a bf16 file's bits and fp16's as they are."""
    from safetensors.numpy import load_file, save_file
    from safetensors.torch import save_file as save_torch

    from bertctl.checkpoints.hf import load_config

    directory = random_model(tmp_path / "m", hidden=64, heads=2, layers=2)
    config = load_config(directory)
    state = load_file(str(directory / "model.safetensors"))
    weights = native.encoder_weights(directory, config)
    assert len(weights) == 5 + 12 * 2
    q, k, v = (state[f"encoder.layer.1.attention.self.{p}.weight"] for p in ("query", "key", "value"))
    for got, want in zip(weights["1.qkv.weight"], (q, k, v)):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(weights["type"][0], state["embeddings.token_type_embeddings.weight"][0])
    np.testing.assert_array_equal(weights["0.ffn.gamma"][0], state["encoder.layer.0.output.LayerNorm.weight"])
    assert all(a.flags.c_contiguous and not a.flags.writeable for parts in weights.values() for a in parts)
    # bf16, as torch saves it: the raw bits; fp16 and a "bert." prefix as they come.
    save_torch({n: torch.from_numpy(a).to(torch.bfloat16) for n, a in state.items()}, str(directory / "model.safetensors"))
    bits = native.encoder_weights(directory, config)["1.qkv.weight"][0]
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bits, torch.from_numpy(q).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16))
    save_file({"bert." + n: a.astype(np.float16) for n, a in state.items()}, str(directory / "model.safetensors"))
    half = native.encoder_weights(directory, config)["1.qkv.weight"][1]
    np.testing.assert_array_equal(half, k.astype(np.float16))
    (directory / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    with pytest.raises(BertctlError, match="unreadable weights"):
        native.encoder_weights(directory, config)


def test_unsupported_models():
    assert native.unsupported(BertConfig(hidden_size=384, num_attention_heads=12)) is None
    assert "heads of 48" in native.unsupported(BertConfig(hidden_size=384, num_attention_heads=8))
    assert "hidden_act 'silu'" in native.unsupported(BertConfig(hidden_act="silu"))
    assert "hidden size 2048" in native.unsupported(BertConfig(hidden_size=2048, num_attention_heads=16))
    assert "relative_key" in native.unsupported(BertConfig(extra={"position_embedding_type": "relative_key"}))


def test_device_names():
    assert [device_index(n) for n in ("auto", "cuda", "cuda:3", "cpu", "mps")] == [0, 0, 3, None, None]


def test_backend_native_where_it_cannot_run(tmp_path):
    """One line, exit 2: on the CPU, with --onnx, and (here, without the module or a GPU) on a GPU."""
    from typer.testing import CliRunner

    from bertctl.cli.app import app

    directory = random_model(tmp_path / "m", hidden=64, heads=2, layers=1)
    from bertctl.text.wordpiece import BertTokenizer

    BertTokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "a", "b"]).save_pretrained(directory)
    texts = tmp_path / "t.txt"
    texts.write_text("a b\nb\n", encoding="utf-8")
    runner = CliRunner()
    base = ["embed", "--model", str(directory), "-o", str(tmp_path / "o.npy"), str(texts), "--backend", "native"]
    r = runner.invoke(app, [*base, "--device", "cpu"])
    assert r.exit_code == 2 and "--backend native runs on a GPU, not --device cpu" in r.stderr, r.output
    r = runner.invoke(app, [*base, "--onnx", str(tmp_path / "x.onnx")])
    assert r.exit_code == 2 and "cannot go with --backend native" in r.stderr, r.output
    if not native.available()[0]:  # here: no module built, or no GPU
        r = runner.invoke(app, [*base, "--device", "cuda"])
        assert r.exit_code == 2 and ("--backend native: " in r.stderr or "did not start" in r.stderr), r.output
    assert not (tmp_path / "o.npy").exists()


def test_auto_on_a_gpu_takes_the_backend_predicted_faster(tmp_path, monkeypatch, capsys):
    """``auto`` on a GPU: the native encoder where the cost model predicts it faster (short sentences and
    ~180-token passages on a MiniLM-sized model both), torch where it predicts torch faster, and torch,
    saying why, where the native encoder cannot run the model or does not start; an explicit ``native``
    keeps it. The GPU is stood in for: the decision is the CPU's."""
    from bertctl.inference import costs

    class Started:
        name = "native"

        def __init__(self, directory, device, precision):
            self.device, self.precision = device, precision

    directory = random_model(tmp_path / "m", hidden=384, heads=12, layers=6)
    monkeypatch.setattr(backends, "native_device", lambda config, onnx=None: "cuda:0")
    monkeypatch.setattr(native, "NativeEncoder", Started)
    monkeypatch.setattr(backends, "resolve_device", lambda name: "cpu")
    rng = np.random.default_rng(0)
    short, passages = (lambda: rng.integers(4, 30, 5000)), (lambda: rng.integers(150, 210, 2000))
    for lengths in (short, passages):
        assert isinstance(backends.open_encoder(directory, EmbedConfig(precision="fp16"), lengths=lengths), Started)
        assert "--backend auto: native (predicted" in capsys.readouterr().err
    table = {"cuda": {"native": dict.fromkeys(costs.TERMS, 1.0), "torch": dict.fromkeys(costs.TERMS, 0.0)}}
    with monkeypatch.context() as m:
        m.setattr(costs, "_table", lambda: table)
        assert isinstance(backends.open_encoder(directory, EmbedConfig(precision="bf16"), lengths=short), TorchEncoder)
        assert "--backend auto: torch (predicted" in capsys.readouterr().err

    def fails(*a, **k):
        raise BertctlError("cuda:0: the native encoder did not start (no device)")

    with monkeypatch.context() as m:
        m.setattr(native, "NativeEncoder", fails)
        assert isinstance(backends.open_encoder(directory, EmbedConfig(precision="bf16"), lengths=short), TorchEncoder)
        err = " ".join(capsys.readouterr().err.split())
        assert "--backend auto: torch (the only backend that runs here; not onnxruntime: it runs on the CPU; " \
               "native: cuda:0: the native encoder did not start" in err, err
    assert isinstance(backends.open_encoder(directory, EmbedConfig(backend="native"), lengths=passages), Started)
    odd = random_model(tmp_path / "odd", hidden=96, heads=2, layers=1)  # heads of 48: not the native encoder's
    assert isinstance(backends.open_encoder(odd, EmbedConfig(precision="bf16"), lengths=short), TorchEncoder)
    assert "not native: attention heads of 48" in " ".join(capsys.readouterr().err.split())


def test_native_module_imports_no_torch():
    code = ("import sys; import bertctl.inference.backends.native as native, bertctl.inference.embed; "
            "native.available(); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)


# ----------------------------------------------------------------------------- GPU

cuda = pytest.mark.cuda


@pytest.fixture(scope="module")
def gpu_native():
    ok, why = native.available()
    if not ok:
        pytest.fail(f"the native encoder does not run on this GPU machine: {why}")


# The largest error, relative to the largest feature, against float64. fp32: single-precision sums in
# cuBLAS's order and the kernels' (2^-24 a rounding). fp16 (10-bit mantissa, 2^-11 a rounding) and bf16
# (7 bits, 2^-8): the weights and each layer's activations are rounded once a step over six layers; the
# bounds are a few roundings.
TOLERANCE = {"fp32": 2e-5, "fp16": 2e-3, "bf16": 1.5e-2}


def check_features(directory: Path, lengths: list[int], precision: str, layers: str, pooling: str) -> None:
    from bertctl.checkpoints.hf import load_config

    vocab = load_config(directory).vocab_size
    ids, mask = padded_batch(lengths, vocab)
    encoder = native.NativeEncoder(directory, "cuda:0", precision)
    got = native_features(encoder, ids, mask, layers, pooling)
    want = reference(directory, ids, mask, layers, pooling)
    assert got.shape == want.shape and got.dtype == np.float32
    error = np.abs(got - want).max() / np.abs(want).max()
    assert error < TOLERANCE[precision], (precision, layers, pooling, error)
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert cos.min() > {"fp32": 1 - 1e-6, "fp16": 0.99999, "bf16": 0.9995}[precision], cos.min()


@cuda
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("layers", LAYER_CHOICES)
def test_minilm_features_every_layer_choice(gpu_native, minilm_dir, precision, layers):
    check_features(minilm_dir, [2, 7, 13, 40, 3, 66, 9], precision, layers, "mean")


@cuda
@pytest.mark.parametrize("pooling", [*POOLING_CHOICES, "cls,max,mean"])
def test_minilm_features_every_pooling(gpu_native, minilm_dir, pooling):
    check_features(minilm_dir, [5, 3, 30, 17], "fp32", "sum-last-4", pooling)
    check_features(minilm_dir, [5, 3, 30, 17], "fp16", "concat-last-4", pooling)


@cuda
@pytest.mark.parametrize("hidden,heads,act", [(128, 2, "gelu"), (256, 2, "gelu_new"), (128, 4, "relu")])
@pytest.mark.parametrize("precision", ["fp32", "fp16", "bf16"])
def test_random_models_long_texts(gpu_native, tmp_path, hidden, heads, act, precision):
    """Head sizes 64 and 32 over several query blocks and key tiles, and 128; in fp16 and bf16 the tensor-core
    kernel, whose tiles of 64 queries and 64 keys the lengths straddle (one token, 33, 63 to 65, 512)."""
    directory = random_model(tmp_path / "m", hidden=hidden, heads=heads, layers=2, act=act, sharpen=4.0)
    check_features(directory, [300, 129, 2, 64, 255, 1, 33, 63, 65, 512], precision, "last", "mean,cls")


@cuda
def test_batches_reuse_buffers(gpu_native, minilm_dir):
    """A large batch, then a small one, then a large one: the buffers grow once and stale rows never leak."""
    encoder = native.NativeEncoder(minilm_dir, "cuda:0", "fp32")
    big, small = padded_batch([50] * 64 + [3] * 10, 30522, seed=1), padded_batch([4, 9], 30522, seed=2)
    first = native_features(encoder, *big, "last", "mean")
    np.testing.assert_allclose(native_features(encoder, *small, "last", "mean"),
                               reference(minilm_dir, *small, "last", "mean"), atol=2e-5, rtol=0)
    np.testing.assert_array_equal(native_features(encoder, *big, "last", "mean"), first)


@cuda
def test_command_runs_native_without_torch(gpu_native, minilm_dir, tmp_path, shared_data):
    """The whole command on SST-2 sentences: the torch backend's vectors, and torch never imported."""
    texts = tmp_path / "t.txt"
    lines = (shared_data / "glue" / "SST-2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:400]
    texts.write_text("\n".join(line.split("\t")[0] for line in lines) + "\n", encoding="utf-8")
    code = ("import sys\nfrom bertctl.cli.app import main\nsys.argv = ['bertctl', *sys.argv[1:]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    args = ["embed", "--model", str(minilm_dir), str(texts), "--precision", "fp32", "--normalize"]
    subprocess.run([sys.executable, "-c", code, *args, "-o", str(tmp_path / "n.npy")], check=True, cwd=ROOT)
    subprocess.run([sys.executable, "-m", "bertctl", *args, "--backend", "torch", "-o", str(tmp_path / "t.npy")],
                   check=True, cwd=ROOT)
    got, want = np.load(tmp_path / "n.npy"), np.load(tmp_path / "t.npy")
    assert got.shape == want.shape == (399, 384)
    assert (got * want).sum(1).min() > 1 - 1e-6


@cuda
def test_embed_config_auto_picks_native(gpu_native, minilm_dir):
    from bertctl.inference.backends import native_device

    assert native_device(EmbedConfig()) == "cuda:0"
    assert native_device(EmbedConfig(backend="torch")) is None
    assert native_device(EmbedConfig(device="cpu")) is None
    with pytest.raises(BertctlError, match="did not start .*invalid device ordinal"):
        native.NativeEncoder(minilm_dir, f"cuda:{native.device_count()}", "fp32")


@cuda
@pytest.mark.parametrize("normalize", [False, True])
def test_many_batches_and_chunks_match_torch(gpu_native, minilm_dir, shared_data, monkeypatch, normalize):
    """embed_texts on the native encoder, its batches queued in several chunks (each a wait and a scatter
    into the output), against the torch backend's batches one by one."""
    from bertctl.inference.backends import load_encoder
    from bertctl.inference.embed import embed_texts
    from bertctl.text import load_tokenizer

    lines = (shared_data / "glue" / "SST-2" / "dev.tsv").read_text(encoding="utf-8").splitlines()[1:700]
    texts = [line.split("\t")[0] for line in lines]
    tokenizer = load_tokenizer(minilm_dir)
    config = EmbedConfig(pooling="mean,max", layers="concat-last-4", normalize=normalize, batch_tokens=2048)
    want = embed_texts(load_encoder(minilm_dir, torch.device("cuda")), tokenizer, texts, config, progress=False)
    encoder = native.NativeEncoder(minilm_dir, "cuda:0", "fp32")
    monkeypatch.setattr(native, "CHUNK_VALUES", 200 * config.spec.width(384, 6))
    got = embed_texts(encoder, tokenizer, texts, config, progress=False)
    assert got.shape == want.shape == (len(texts), 2 * 4 * 384)
    np.testing.assert_allclose(got, want, atol=3e-5 * np.abs(want).max(), rtol=0)


@cuda
@pytest.mark.parametrize("pooling", ["mean", "cls,max"])
def test_long_texts_chunk_as_on_torch(gpu_native, minilm_dir, shared_data, pooling):
    """--long chunk on the native encoder: the windows' vectors pooled into one a text, as the torch
    backend pools them (tests/unit/test_embed_long.py checks torch's against windows embedded by hand)."""
    from bertctl.inference.backends import load_encoder
    from bertctl.inference.embed import embed
    from bertctl.text import load_tokenizer

    words = (shared_data / "corpus" / "gutenberg" / "austen-emma.txt").read_text(encoding="utf-8").split()
    texts = [" ".join(words[i:i + n]) for i, n in zip(range(0, 40_000, 2_000), [5, 300, 900, 40, 2_000] * 4)]
    tokenizer = load_tokenizer(minilm_dir)
    config = EmbedConfig(pooling=pooling, normalize=True, max_length=128, long="chunk", stride=32)
    want = embed(load_encoder(minilm_dir, torch.device("cuda")), tokenizer, texts, config, progress=False)
    got = embed(native.NativeEncoder(minilm_dir, "cuda:0", "fp32"), tokenizer, texts, config, progress=False)
    assert got.summary["chunked"] == want.summary["chunked"] >= 12 and got.summary["backend"] == "native"
    np.testing.assert_allclose(got.vectors, want.vectors, atol=2e-5)
