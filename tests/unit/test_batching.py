"""bertctl.data.batching's inference batches, against the limits they promise (the training iterators'
tests sit with what drives them: test_data_loader.py, test_finetune_trainer.py, test_pretrain.py)."""
from __future__ import annotations

import numpy as np

from bertctl.data.batching import length_batches


def test_length_batches():
    """Longest first, every text once, at most batch_size texts and batch_tokens padded tokens a batch,
    a text longer than the budget alone."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(2, 60, 500)
    lengths[7] = 300
    batches = length_batches(lengths, 16, 256)
    flat = np.concatenate(batches)
    assert sorted(flat) == list(range(500))
    assert (np.diff(lengths[flat]) <= 0).all()  # longest first, so each batch's first is its longest
    assert all(len(b) <= 16 and (len(b) * lengths[b].max() <= 256 or len(b) == 1) for b in batches)
    assert batches[0].tolist() == [7]
    # Greedy: each batch takes as many texts as fit (the next one would break a limit).
    assert all(len(b) == 16 or (len(b) + 1) * lengths[b[0]] > 256 for b in batches[:-1])
    # No limit on texts (embed's default): the token budget alone cuts the batches.
    unlimited = length_batches(lengths, None, 256)
    assert sorted(np.concatenate(unlimited)) == list(range(500))
    assert all((len(b) + 1) * lengths[b[0]] > 256 for b in unlimited[:-1])
    assert max(map(len, unlimited)) > 16
