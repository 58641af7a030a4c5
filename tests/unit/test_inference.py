"""The pieces every embedding backend shares (bertctl/inference): the tokenised texts' padded and
packed views, ``PoolingSpec``, the pooling arithmetic on numpy and on torch against loops written
out by hand, and ``run_padded``'s order and copies. The backends themselves are tested against
transformers and sentence-transformers in tests/parity and on a GPU in test_native.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from bertctl.errors import BertctlError
from bertctl.inference.backends.native import NativeEncoder
from bertctl.inference.backends.onnx import OnnxEncoder
from bertctl.inference.backends.torch import TorchEncoder
from bertctl.inference.embed import EmbedConfig
from bertctl.inference.encoder import Tokens, run_padded
from bertctl.inference.pooling import POOLING_CHOICES, PoolingSpec, normalize_rows, pool

TEXTS = [[101, 7, 8, 102], [101, 102], [101, 5, 6, 9, 4, 102], [101, 3, 102]]


def tokens() -> Tokens:
    return Tokens(np.array([i for t in TEXTS for i in t], np.int64), np.array([len(t) for t in TEXTS], np.int64))


def test_packed_and_padded_views_of_the_texts():
    t = tokens()
    index = np.array([2, 0, 3])
    assert t.packed(index).tolist() == TEXTS[2] + TEXTS[0] + TEXTS[3]
    ids, mask = t.padded(index, pad_id=0)
    assert ids.dtype == mask.dtype == np.int64 and ids.shape == mask.shape == (3, 6)
    for row, i in enumerate(index):
        n = len(TEXTS[i])
        assert ids[row].tolist() == TEXTS[i] + [0] * (6 - n) and mask[row].tolist() == [1] * n + [0] * (6 - n)
    assert t.padded(np.array([1]), pad_id=9)[0].tolist() == [[101, 102]]  # as wide as its longest text


def test_spec_refuses_unknown_choices_by_flag_name():
    with pytest.raises(BertctlError, match="--layers must be one of"):
        PoolingSpec("middle", "mean")
    with pytest.raises(BertctlError, match=r"--pooling must be one of .* \(or several joined by ','\), not 'mean,sum'"):
        PoolingSpec("last", "mean,sum")
    with pytest.raises(BertctlError, match="--pooling"):  # EmbedConfig checks through its spec
        EmbedConfig(pooling="median")
    assert EmbedConfig(layers="concat-last-4", pooling="cls,max").spec == PoolingSpec("concat-last-4", "cls,max")
    assert PoolingSpec("concat-last-4", "cls,max").width(384, 6) == 2 * 4 * 384
    assert PoolingSpec("sum-last-4", "mean").width(384, 6) == 384


def by_hand(x: np.ndarray, lengths: list[int], mode: str) -> np.ndarray:
    """One text at a time over its real tokens only, as sentence-transformers' Pooling defines each mode."""
    rows = []
    for b, n in enumerate(lengths):
        real = x[b, :n].astype(np.float64)
        if mode == "cls":
            rows.append(real[0])
        elif mode == "last":
            rows.append(real[-1])
        elif mode == "max":
            rows.append(real.max(0))
        elif mode == "mean":
            rows.append(real.sum(0) / n)
        elif mode == "mean-sqrt-len":
            rows.append(real.sum(0) / np.sqrt(n))
        elif mode == "weighted-mean":
            w = np.arange(1, n + 1, dtype=np.float64)[:, None]
            rows.append((real * w).sum(0) / w.sum())
    return np.stack(rows)


@pytest.mark.parametrize("mode", [*POOLING_CHOICES, "cls,max,mean"])
def test_pooling_modes_on_numpy_and_torch_match_loops_by_hand(mode):
    rng = np.random.default_rng(0)
    lengths = [5, 1, 3, 7]
    x = rng.standard_normal((4, 7, 6)).astype(np.float32)
    x[np.arange(7)[None, :] >= np.array(lengths)[:, None]] = 1e4  # padding that must never count
    mask = (np.arange(7)[None, :] < np.array(lengths)[:, None]).astype(np.int64)
    want = np.concatenate([by_hand(x, lengths, m) for m in mode.split(",")], axis=-1)
    got_np = pool(x, mask, mode)
    got_torch = pool(torch.from_numpy(x), torch.from_numpy(mask), mode).numpy()
    np.testing.assert_allclose(got_np, want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(got_torch, want, rtol=1e-6, atol=1e-6)


def test_normalize_rows_in_place_as_torch():
    x = np.random.default_rng(1).standard_normal((10, 5)).astype(np.float32)
    x[3] = 0  # a zero row stays zero (its norm counts as 1e-12)
    want = torch.nn.functional.normalize(torch.from_numpy(x.copy()), dim=-1).numpy()
    assert normalize_rows(x, rows=4) is x
    np.testing.assert_allclose(x, want, atol=1e-7)


def test_run_padded_returns_rows_in_text_order_and_copies_in_groups():
    """Batches in any order come back as row i for text i; device-side features are copied to the
    host ``copy_every`` batches at a time (one wait for several batches), the rest at the end."""
    t = tokens()
    events = []

    class OnDevice:  # stands in for a torch tensor left on a GPU
        def __init__(self, a):
            self.a, self.shape = a, a.shape

        def cpu(self):
            events.append(("copy", len(self.a)))
            return self

        def numpy(self):
            return self.a

    def forward(ids, mask):  # two features a text: its last word piece and its length
        events.append(("forward", len(ids)))
        lengths = mask.sum(1)
        return OnDevice(np.stack([ids[np.arange(len(ids)), lengths - 2], lengths], 1))

    seen = []
    out = run_padded(t, [np.array([2, 3]), np.array([0]), np.array([1])], 0, forward, advance=seen.append,
                     copy_every=2)
    assert out.dtype == np.float32 and out.shape == (4, 2)
    assert out.tolist() == [[x[-2], len(x)] for x in TEXTS]
    assert seen == [2, 1, 1]
    assert events == [("forward", 2), ("forward", 1), ("copy", 2), ("copy", 1), ("forward", 1), ("copy", 1)]


def test_every_backend_implements_the_interface():
    for cls in (TorchEncoder, OnnxEncoder, NativeEncoder):
        assert isinstance(cls.name, str) and callable(cls.features), cls
    assert {TorchEncoder.name, OnnxEncoder.name, NativeEncoder.name} == {"torch", "onnxruntime", "native"}
