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


# All 1,112,064 code points (surrogates aside).
@pytest.mark.parametrize("kind", ["uncased", "cased"])
def test_parity_every_code_point(kind):
    _compare_code_points(kind, _CODE_POINTS)
