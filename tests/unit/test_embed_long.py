"""``embed --long``: texts past the model's limit are truncated with a warning, or cut into overlapping
windows and pooled into one vector. The windows are checked against Hugging Face tokenizers'
overflowing windows, and the chunked vectors against ``transformers`` run on each window alone and
pooled by hand, for every pooling mode; the ONNX Runtime backend gives the torch backend's vectors."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.errors import BertctlError
from bertctl.inference.backends import load_encoder
from bertctl.inference.embed import EmbedConfig, embed, tokenize_texts, window_spans, _tokenize_chunk
from bertctl.inference.pooling import POOLING_CHOICES
from bertctl.text.wordpiece import BertTokenizer

WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "##s", "."]
SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
LIMIT = 12  # the model's positions: windows of 10 tokens beside [CLS] and [SEP]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 4-layer, 16-wide random BertModel with 12 positions, saved with its tokenizer (4 layers: every
    --layers choice runs)."""
    from bertctl.checkpoints.hf import save_pretrained
    from bertctl.config import BertConfig
    from bertctl.model import BertModel

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(SPECIALS + WORDS), hidden_size=16, num_hidden_layers=4, num_attention_heads=2,
                        intermediate_size=32, max_position_embeddings=LIMIT)
    directory = tmp_path_factory.mktemp("long") / "model"
    save_pretrained(BertModel(config), directory, tokenizer=BertTokenizer(SPECIALS + WORDS))
    return directory


def texts_of(rng: np.random.Generator, lengths) -> list[str]:
    return [" ".join(rng.choice(["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "dogs", "."], n))
            for n in lengths]


@pytest.mark.parametrize("n, width, stride", [(1, 10, 2), (10, 10, 2), (11, 10, 2), (25, 10, 0), (26, 10, 9),
                                             (100, 10, 3), (7, 1, 0), (40, 6, 5)])
def test_window_spans_cover_the_text_in_steps_of_width_less_stride(n, width, stride):
    spans = window_spans(n, width, stride)
    assert spans[0][0] == 0 and spans[-1][1] == n
    assert all(b - a == width for a, b in spans[:-1]) and 0 < spans[-1][1] - spans[-1][0] <= width
    assert all(b[0] - a[0] == width - stride for a, b in zip(spans, spans[1:]))
    assert len(spans) == 1 or spans[-2][1] < n  # no window after one that reached the end


@pytest.mark.parametrize("stride", [0, 1, 4, 9])
def test_windows_are_hugging_faces_overflowing_windows(model_dir, stride):
    """Each window is [CLS] window [SEP], as a Hugging Face tokenizer cuts with return_overflowing_tokens."""
    hf = transformers.BertTokenizerFast.from_pretrained(str(model_dir))
    texts = texts_of(np.random.default_rng(stride), [1, 9, 10, 11, 23, 57])
    ours = _tokenize_chunk(BertTokenizer.from_pretrained(model_dir), texts, LIMIT, "chunk", stride)
    want = []
    for t in texts:
        want += hf(t, max_length=LIMIT, truncation=True, stride=stride, return_overflowing_tokens=True)["input_ids"]
    assert ours.lengths.tolist() == [len(w) for w in want]
    assert ours.ids.tolist() == [i for w in want for i in w]
    assert ours.windows.sum() == len(want)
    assert ours.full.tolist() == [len(hf(t)["input_ids"]) for t in texts]
    # truncate keeps each text's first window: what tokenize_texts (and embed by default) gives
    first = [hf(t, max_length=LIMIT, truncation=True)["input_ids"] for t in texts]
    ids, lengths = tokenize_texts(BertTokenizer.from_pretrained(model_dir), texts, LIMIT)
    assert ids.tolist() == [i for w in first for i in w] and lengths.tolist() == [len(w) for w in first]


def pooled_by_hand(states: np.ndarray, mode: str) -> np.ndarray:
    """One window's (S, H) float64 hidden states pooled as sentence-transformers' Pooling defines each mode."""
    out = []
    for m in mode.split(","):
        n = len(states)
        w = np.arange(1, n + 1, dtype=np.float64)[:, None]
        out.append({"cls": states[0], "last": states[-1], "max": states.max(0), "mean": states.mean(0),
                    "mean-sqrt-len": states.sum(0) / np.sqrt(n), "weighted-mean": (states * w).sum(0) / w.sum()}[m])
    return np.concatenate(out)


@functools.lru_cache(maxsize=1)
def reference(model_dir: Path):
    """The Hugging Face tokenizer and transformers' BertModel (in float64) of ``model_dir``."""
    return (transformers.BertTokenizerFast.from_pretrained(str(model_dir)),
            transformers.BertModel.from_pretrained(str(model_dir), add_pooling_layer=False).eval().double())


def by_hand(model_dir: Path, texts: list[str], stride: int, layers: str, mode: str, normalize: bool,
            first_only: bool = False) -> np.ndarray:
    """Each text's windows from the Hugging Face tokenizer (``first_only``: the first alone), each run alone
    through transformers' BertModel, pooled, their vectors averaged weighted by their tokens, then
    L2-normalised if asked."""
    hf, ref = reference(model_dir)
    rows = []
    for t in texts:
        windows = hf(t, max_length=LIMIT, truncation=True, stride=stride, return_overflowing_tokens=True)["input_ids"]
        windows = windows[:1] if first_only else windows
        vectors, weights = [], []
        for ids in windows:
            with torch.no_grad():
                hs = ref(torch.tensor([ids]), output_hidden_states=True).hidden_states
            x = {"last": hs[-1], "second-to-last": hs[-2], "sum-last-4": sum(hs[-4:]),
                 "concat-last-4": torch.cat(hs[-4:], -1)}[layers][0].numpy()
            v = pooled_by_hand(x, mode)
            vectors.append(v / np.linalg.norm(v) if normalize else v)
            weights.append(len(ids))
        v = np.average(np.stack(vectors), axis=0, weights=weights)
        rows.append(v / np.linalg.norm(v) if normalize else v)
    return np.stack(rows)


@pytest.mark.parametrize("mode", [*POOLING_CHOICES, "cls,max,mean"])
def test_chunked_vectors_are_the_windows_embedded_one_by_one_and_pooled_by_hand(model_dir, mode):
    texts = texts_of(np.random.default_rng(1), [3, 10, 11, 27, 64, 5])
    encoder = load_encoder(model_dir, "cpu", "torch")
    tokenizer = BertTokenizer.from_pretrained(model_dir)
    counts = [len(tokenizer.ids(t)) for t in texts]
    for layers, normalize in (("last", False), ("sum-last-4", True), ("concat-last-4", False)):
        config = EmbedConfig(pooling=mode, layers=layers, normalize=normalize, long="chunk", stride=3, batch_tokens=40)
        got = embed(encoder, tokenizer, texts, config, progress=False)
        want = by_hand(model_dir, texts, 3, layers, mode, normalize)
        np.testing.assert_allclose(got.vectors, want, rtol=1e-4, atol=1e-5, err_msg=f"{mode} {layers}")
        assert got.summary["chunked"] == sum(n > LIMIT - 2 for n in counts) >= 3 and got.summary["truncated"] == 0
        assert got.summary["windows"] == sum(len(window_spans(n, LIMIT - 2, 3)) for n in counts)


def test_chunk_keeps_short_texts_bit_for_bit_and_truncate_keeps_the_first_window(model_dir):
    """A text within the limit gets the same vector under chunk as under truncate; under truncate a long
    text's vector is its first window's alone."""
    texts = texts_of(np.random.default_rng(2), [4, 30, 9])
    encoder = load_encoder(model_dir, "cpu", "torch")
    tokenizer = BertTokenizer.from_pretrained(model_dir)
    chunked = embed(encoder, tokenizer, texts, EmbedConfig(long="chunk"), progress=False).vectors
    cut = embed(encoder, tokenizer, texts, EmbedConfig(), progress=False)
    np.testing.assert_array_equal(chunked[[0, 2]], cut.vectors[[0, 2]])
    first = by_hand(model_dir, [texts[1]], 0, "last", "mean", False, first_only=True)
    np.testing.assert_allclose(cut.vectors[1], first[0], rtol=1e-4, atol=1e-5)
    assert cut.summary["truncated"] == 1 and cut.summary["chunked"] == 0 and cut.summary["windows"] == 3


@pytest.mark.parametrize("pooling", ["mean", "cls,max"])
def test_onnxruntime_chunks_as_torch_does(model_dir, pooling):
    texts = texts_of(np.random.default_rng(3), [40, 2, 17])
    tokenizer = BertTokenizer.from_pretrained(model_dir)
    config = EmbedConfig(pooling=pooling, normalize=True, long="chunk", stride=2)
    torch_out = embed(load_encoder(model_dir, "cpu", "torch"), tokenizer, texts, config, progress=False)
    onnx_out = embed(load_encoder(model_dir, "cpu", "onnxruntime"), tokenizer, texts, config, progress=False)
    assert onnx_out.summary["backend"] == "onnxruntime"
    np.testing.assert_allclose(onnx_out.vectors, torch_out.vectors, atol=2e-6)


def test_stride_checks_name_the_flag():
    with pytest.raises(BertctlError, match="--stride .* needs --long chunk"):
        EmbedConfig(stride=4)
    with pytest.raises(BertctlError, match="--stride must be 0 or more"):
        EmbedConfig(long="chunk", stride=-1)
    with pytest.raises(BertctlError, match="--long must be one of truncate, chunk"):
        EmbedConfig(long="split")


def invoke(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_command_warns_of_truncation_with_line_numbers_and_counts_in_the_summary(model_dir, tmp_path):
    """truncate (the default) says on stderr how many texts it cut and where (JSONL: the file's own line
    numbers, blank lines counted) and points to --long chunk; the JSON summary counts them; chunk counts
    the chunked texts instead and warns of nothing."""
    rng = np.random.default_rng(4)
    src = tmp_path / "in.jsonl"
    lines = [json.dumps({"text": t}) for t in texts_of(rng, [3, 30, 4])] + [""] + \
            [json.dumps({"text": t}) for t in texts_of(rng, [12, 2] + [40] * 6)]
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    r = invoke("embed", "--model", model_dir, "--backend", "torch", "--no-progress", "-o", tmp_path / "a.npy", src)
    assert r.exit_code == 0, r.output
    squeezed = "".join(r.stderr.split())  # the console wraps long lines, inside a path too
    want = f"truncated 8 of the 11 texts to the {LIMIT}-token limit ({src}:2, {src}:5, {src}:7, {src}:8, {src}:9 and 3 more)"
    assert "".join(want.split()) in squeezed and "--longchunk" in squeezed, r.stderr
    summary = json.loads(r.stdout)
    assert summary["truncated"] == 8 and summary["chunked"] == 0 and summary["output"] == str(tmp_path / "a.npy")
    ages = summary["since_process_start"]  # this process's age (the test runner's): only their order is known
    assert 0 < ages["encoder_ready"] <= ages["embedded"] <= ages["written"], ages
    r = invoke("embed", "--model", model_dir, "--backend", "torch", "--no-progress", "--long", "chunk", "--stride", "5",
               "-o", tmp_path / "b.npy", src)
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout)
    assert summary["chunked"] == 8 and summary["truncated"] == 0 and summary["stride"] == 5
    assert "truncated" not in r.stderr
    assert np.load(tmp_path / "b.npy").shape == (11, 16)


@pytest.mark.parametrize("args, message", [
    (("--stride", "3"), "--stride is the overlap of --long chunk's windows"),
    (("--long", "chunk", "--stride", "10"), "--stride 10 must be less than the window's 10 tokens"),
    (("--long", "chunk", "--max-seq-length", "2"), "--long chunk needs windows of at least one token"),
    (("--long", "all"), "--long must be one of truncate, chunk"),
])
def test_bad_long_flags_are_one_line_before_any_work(model_dir, tmp_path, args, message):
    src = tmp_path / "in.txt"
    src.write_text("the cat\n", encoding="utf-8")
    r = invoke("embed", "--model", model_dir, *args, "-o", tmp_path / "o.npy", src)
    assert r.exit_code == 2 and message in r.stderr and "Traceback" not in r.output, r.output
    assert not (tmp_path / "o.npy").exists()


def test_workers_tokenise_by_the_texts_characters_not_their_count(model_dir, monkeypatch):
    """A few long texts go to the workers as many short ones do (10,000 long documents were tokenised in the
    process, before the model could load); either way the result is the same ids, in order."""
    import bertctl.inference.embed as embed_module

    tokenizer = BertTokenizer.from_pretrained(model_dir)
    monkeypatch.setattr(embed_module, "PARALLEL_CHARACTERS", 2000)
    rng = np.random.default_rng(5)
    few_long, many_short = texts_of(rng, [400] * 4), texts_of(rng, [1] * 300)
    assert sum(map(len, few_long)) >= 2000 > sum(map(len, many_short))
    for texts, in_workers in ((few_long, True), (many_short, False)):
        with embed_module.Tokenizing(tokenizer, texts, LIMIT, workers=2, long="chunk", stride=3) as tokenizing:
            assert (tokenizing._pool is not None) == in_workers
            got = tokenizing.result()
        want = _tokenize_chunk(tokenizer, texts, LIMIT, "chunk", 3)
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b)
