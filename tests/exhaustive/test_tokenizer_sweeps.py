"""BertTokenizer against Hugging Face's BertTokenizerFast on every line of every shared data file and on
every Unicode code point (tests/parity/test_tokenizer.py checks fixed samples of both)."""
from __future__ import annotations

import pytest

from test_tokenizer import _CODE_POINTS, _compare_code_points, _hf, _tok, compare
from tokenizer_data import data_texts

pytestmark = pytest.mark.exhaustive


# 267,787 texts, 16 MB.
@pytest.mark.usefixtures("shared_data")
@pytest.mark.parametrize("kind", ["uncased", "cased"])
def test_parity_every_line_of_every_data_file(kind):
    ours, hf = _tok(kind), _hf(kind)
    for name, texts in data_texts().items():
        for k in range(0, len(texts), 20000):
            compare(ours, hf, texts[k : k + 20000], name)


# All 1,112,064 code points (surrogates aside), in four quarters per tokenizer: eight tests of about the same
# length, so that the workers of pytest -n 2 end together rather than one waiting on the longest sweep.
QUARTERS = 4


@pytest.mark.parametrize("quarter", range(QUARTERS), ids=lambda q: f"quarter{q + 1}")
@pytest.mark.parametrize("kind", ["uncased", "cased"])
def test_parity_every_code_point(kind, quarter):
    n = -(-len(_CODE_POINTS) // QUARTERS)
    _compare_code_points(kind, _CODE_POINTS[quarter * n : (quarter + 1) * n])


def test_the_quarters_cover_every_code_point():
    n = -(-len(_CODE_POINTS) // QUARTERS)
    assert [cp for q in range(QUARTERS) for cp in _CODE_POINTS[q * n : (q + 1) * n]] == _CODE_POINTS
    assert len(_CODE_POINTS) == 0x110000 - 0x800
