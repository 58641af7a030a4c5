"""SentencePiece tokenisation against sentencepiece itself on every line of every shared data file
(tests/parity/test_sentencepiece.py checks the short texts and a sample of the long ones)."""
from __future__ import annotations

import pytest

from test_sentencepiece import check_ids, check_offsets, shared_texts, train_files, trained  # noqa: F401 (fixtures)

pytestmark = pytest.mark.exhaustive


def test_every_line_of_the_shared_data(trained):  # noqa: F811
    tok, sp = trained["tok"], trained["sp"]
    for name, lines in shared_texts(full=True).items():
        check_ids(tok, sp, lines)
        check_offsets(tok, sp, lines)
