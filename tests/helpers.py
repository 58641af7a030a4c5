"""Helpers the tests of several tiers share (shards' text and vocabulary, killing a run at a checkpoint, the
whole-word-masking check). A module of its own, not conftest.py: a tier's own conftest.py would shadow the name
``conftest`` when tiers run in one session."""
from __future__ import annotations

import collections
import re
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED_DATA = ROOT.parent / "shared" / "data"

# Pretraining shards (tests/parity/test_pretrain.py, tests/gpu/test_pretrain_cuda.py): a tiny BERT's worth
# of real text, a few inaugural addresses, with a small WordPiece vocabulary made here from the same text.
PRETRAIN_FILES = ("1789-Washington", "1861-Lincoln", "1933-Roosevelt", "1961-Kennedy", "1801-Jefferson",
                  "1913-Wilson", "1981-Reagan", "1865-Lincoln")


def small_vocab(texts: list[str], n_words: int = 600) -> list[str]:
    """A WordPiece vocabulary: specials, every character (alone and as ##suffix), the commonest words."""
    low = " ".join(texts).lower()
    chars = sorted({c for c in low if not c.isspace()})
    words = collections.Counter(re.findall(r"[a-z]+", low))
    common = [w for w, _ in words.most_common(n_words) if len(w) > 1]
    return ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + chars + [f"##{c}" for c in chars] + common


def kill_at_checkpoint(cmd: list[str], run_dir: Path, step: int, env: dict, timeout: float = 300) -> int:
    """Start the pretraining command ``cmd``, SIGKILL it once ``run_dir`` holds a checkpoint of at
    least ``step``, and return the newest checkpoint's step (what a resume starts from)."""
    from bertctl.checkpoints import training

    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + timeout
    while training.latest_checkpoint(run_dir) is None or training.latest_checkpoint(run_dir).step < step:
        assert p.poll() is None, "the run ended before it could be killed"
        assert time.time() < deadline
        time.sleep(0.01)
    p.send_signal(signal.SIGKILL)
    p.wait()
    return training.latest_checkpoint(run_dir).step


def whole_word_masks(ids, masked, cont, tokenizer) -> int:
    """Assert each word (a start piece and its "##" pieces; [CLS] and [SEP] end one) is masked whole or not at
    all; return how many masked words had several pieces (so a test can see whole-word masking was exercised)."""
    import numpy as np

    starts = ~cont[ids]
    starts[1:] |= np.isin(ids[:-1], [tokenizer.cls_token_id, tokenizer.sep_token_id])
    word = np.cumsum(starts)
    multi_piece = 0
    for w in np.unique(word[masked]):
        assert masked[word == w].all()
        multi_piece += (word == w).sum() > 1
    return multi_piece


def read_only_folder(folder: Path, monkeypatch) -> Path:
    """``folder``, made to behave as a read-only mount: creating a temporary file in it fails with EROFS (the tests
    run as root, where permission bits would not stop a write)."""
    import errno
    import os
    import tempfile

    folder.mkdir()
    real_mkstemp = tempfile.mkstemp

    def mkstemp(*args, dir=None, **kwargs):
        if dir is not None and Path(dir).resolve().is_relative_to(folder.resolve()):
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(Path(dir) / "x.tmp"))
        return real_mkstemp(*args, dir=dir, **kwargs)

    monkeypatch.setattr(tempfile, "mkstemp", mkstemp)
    return folder


# ---------------------------------------------------------------- a toy pretraining task for tiny models
# (tests/unit/test_fused_model.py, tests/parity/test_dropout_training.py); torch and bertctl are imported in the
# functions, since tests that must not import torch import this module too.
def tiny_config(**kw) -> BertConfig:
    from bertctl.config import BertConfig

    kw = {"hidden_dropout_prob": 0.0, "attention_probs_dropout_prob": 0.0, **kw}
    return BertConfig.preset("tiny", vocab_size=96, max_position_embeddings=64, **kw)


def runtime(kernels: str, masks: str = "fused") -> Runtime:
    """Explicit attention (the fused softmax's path) on ``kernels``, drawing ``masks``' dropout masks."""
    from bertctl.runtime import resolve

    return resolve("cpu", attn="explicit", kernels=kernels, dropout_masks=masks)


def synthetic_batch(gen: torch.Generator, B: int = 8, S: int = 24, device="cpu") -> dict[str, torch.Tensor]:
    """A learnable toy task: each sequence repeats one of 10 tokens with a few random ones mixed in;
    predict 4 masked tokens (copy the dominant token) and a next-sentence label equal to its parity."""
    import torch

    token = torch.randint(5, 15, (B, 1), generator=gen)
    noise = torch.randint(5, 96, (B, S), generator=gen)
    ids = torch.where(torch.rand(B, S, generator=gen) < 0.8, token, noise)
    lengths = torch.randint(S // 2, S + 1, (B,), generator=gen)
    attention = (torch.arange(S)[None, :] < lengths[:, None]).long()
    ids = ids * attention  # [PAD] = 0 after each length
    positions = torch.stack([torch.randperm(int(n), generator=gen)[:4] for n in lengths])  # (B, 4), inside length
    labels = ids.gather(1, positions)
    masked = ids.scatter(1, positions, 4)  # 4 stands for [MASK]
    batch = dict(input_ids=masked, token_type_ids=torch.zeros_like(ids), attention_mask=attention,
                 masked_positions=positions, masked_lm_labels=labels, next_sentence_label=token[:, 0] % 2)
    return {k: v.to(device) for k, v in batch.items()}
