"""SentencePiece tokenisation end to end.

The reference is sentencepiece itself: a second ``SentencePieceProcessor`` on the same model file
gives the ids (``sp.encode``), the character offsets (``out_type="offset_mapping"``), the text of
each piece (``sp.normalize``) and decoding. The models are trained here by ``bertctl tokenize
train --algorithm unigram|bpe`` (sentencepiece's trainer) on four inaugural addresses. The default
run checks every SST-2 dev sentence, CoNLL-2003 valid sentence and SQuAD question and a sample of
the corpus lines and SQuAD contexts; tests/exhaustive checks every line of every data file.
"""
from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import sentencepiece as spm
from typer.testing import CliRunner

from bertctl.cli.app import app
from bertctl.errors import BertctlError
from bertctl.text import load_tokenizer
from bertctl.text.sentencepiece import SentencePieceTokenizer
from bertctl.text.wordpiece import BertTokenizer
from test_finetune_support import conll_slice, data_path, squad_slice

runner = CliRunner()
TRAIN_TEXTS = ("1789-Washington", "1861-Lincoln", "1933-Roosevelt", "1961-Kennedy")
# Non-ASCII text: SentencePiece aligns in UTF-8 bytes, bertctl in characters.
UNICODE_LINES = [
    "Grüße aus Köln, naïve café — 東京タワー and 🙂 emoji; ﬁne ligatures, ½ and …",
    "\u3000ideographic\u3000space, non\u00a0breaking, tab\tand  double  spaces  ",
    "ǅemal İstanbul ΣΊΣΥΦΟΣ e\u0301 combining \u200bzero-width",
    "", "   ", "[CLS] [MASK] <pad> <unk> text that names the specials",
]


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "bertctl", *args], env=env, capture_output=True, text=True,
                          timeout=300)


@pytest.fixture(scope="module")
def train_files() -> list[Path]:
    return [data_path("corpus", "inaugural", f"{name}.txt") for name in TRAIN_TEXTS]


_TRAINED: dict[str, dict] = {}


def _train(algorithm: str, train_files: list[Path], tmp_path_factory) -> dict:
    """A 1,500-piece uncased model, trained through the CLI once per algorithm, with its --save-dir."""
    if algorithm not in _TRAINED:
        d = tmp_path_factory.mktemp(f"spm-{algorithm}")
        model, save_dir = d / f"{algorithm}.model", d / "tokenizer"
        r = runner.invoke(app, ["tokenize", "train", "--algorithm", algorithm, "--vocab-size", "1500",
                                "-o", str(model), "--save-dir", str(save_dir), *map(str, train_files)])
        assert r.exit_code == 0, r.output
        summary = json.loads(r.stdout.strip().splitlines()[-1])
        assert summary == {"output": str(model), "algorithm": algorithm, "vocab_size": 1500}
        _TRAINED[algorithm] = {"algorithm": algorithm, "model": model, "dir": save_dir,
                               "sp": spm.SentencePieceProcessor(model_file=str(model)), "tok": load_tokenizer(model)}
    return _TRAINED[algorithm]


@pytest.fixture(scope="module", params=["unigram", "bpe"])
def trained(request, train_files, tmp_path_factory) -> dict:
    return _train(request.param, train_files, tmp_path_factory)


@pytest.fixture(scope="module")
def unigram(train_files, tmp_path_factory) -> dict:
    return _train("unigram", train_files, tmp_path_factory)


def _read_lines(path: Path) -> list[str]:
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:  # a few State of the Union files are ISO-8859-1
        text = raw.decode("latin-1")
    return text.splitlines()


def shared_texts(full: bool) -> dict[str, list[str]]:
    """Lines of the shared data sets: all of them with ``full``, else every short text and a sample of the long ones."""
    sst2 = [line.split("\t")[0] for line in _read_lines(data_path("glue", "SST-2", "dev.tsv"))[1:]]
    conll = []
    for split in ("valid", "train", "test") if full else ("valid",):
        words: list[str] = []
        for line in _read_lines(data_path("conll2003", f"{split}.txt")) + [""]:
            if not line.strip() or line.startswith("-DOCSTART-"):
                if words:
                    conll.append(" ".join(words))
                words = []
            else:
                words.append(line.split(" ")[0])
    squad = json.loads(data_path("squad", "dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    paragraphs = [p for a in squad for p in a["paragraphs"]]
    questions = [qa["question"] for p in paragraphs for qa in p["qas"]]
    contexts = [p["context"] for p in paragraphs]
    corpus = [line for f in sorted(data_path("corpus").rglob("*.txt")) for line in _read_lines(f)]
    if not full:
        contexts, corpus = contexts[::10], corpus[::40]
    return {"sst2": sst2, "conll": conll, "squad_questions": questions, "squad_contexts": contexts,
            "corpus": corpus, "unicode": UNICODE_LINES}


def check_ids(tok: SentencePieceTokenizer, sp, texts: list[str]) -> None:
    """Every public path to ids gives sentencepiece's ids."""
    cls, sep = tok.cls_token_id, tok.sep_token_id
    for text in texts:
        want = sp.encode(text)
        assert tok.ids(text) == want, text
        assert tok.convert_tokens_to_ids(tok.tokenize(text)) == want, text
        assert tok.encode(text).input_ids == [cls, *want, sep], text


class _Where:
    """Where an offset check failed: the text, the piece, its offsets and sentencepiece's (an assertion's message)."""

    def __init__(self, *args):
        self.args = args

    def __repr__(self) -> str:
        text, piece, a, b, a0, b0 = self.args
        return f"{text!r}: piece {piece!r} at ({a}, {b}), sentencepiece ({a0}, {b0})"


def check_offsets(tok: SentencePieceTokenizer, sp, texts: list[str]) -> int:
    """Offsets are sentencepiece's character offsets less the white space a ``▁`` stands for, and
    each piece's text is the normalised text of its slice. Returns the pieces checked."""
    n = 0
    for text in texts:
        tokens, offsets = tok.tokenize_with_offsets(text)
        ref = sp.encode(text, out_type="offset_mapping")
        assert tok.convert_tokens_to_ids(tokens) == ref["ids"], text
        prev_end = 0
        for i, piece, (a, b), (a0, b0) in zip(ref["ids"], ref["pieces"], offsets, ref["offsets"]):
            # The message is made only for a failure (a line's repr for each of its pieces was most of the time here).
            where = _Where(text, piece, a, b, a0, b0)
            assert b == b0 and a0 <= a <= b and a >= prev_end, where
            if piece.startswith("\u2581"):
                assert not text[a0:a].strip(), where  # only white space is left out
                assert a == b or not text[a].isspace() or sp.encode("a" + text[a] + "a") != sp.encode("a a"), where
            else:
                assert a == a0, where
            if a < b and not sp.is_unknown(i):
                # The slice normalises to the piece; a character that NFKC expands (… -> ..., ﬁ -> fi)
                # can feed two pieces, and the first one holds it.
                assert piece.lstrip("\u2581") in sp.normalize(text[a:b]), where
                n += 1
            prev_end = b
    return n


# ------------------------------------------------------------------------------ parity with sentencepiece


def test_ids_and_offsets_equal_sentencepiece(trained):
    tok, sp = trained["tok"], trained["sp"]
    texts = shared_texts(full=False)
    for name, lines in texts.items():
        check_ids(tok, sp, lines)
    checked = check_offsets(tok, sp, [t for name, lines in texts.items() if name != "squad_questions" for t in lines]
                            + texts["squad_questions"][::5])
    assert checked > 100_000


def test_batch_pairs_truncation_and_decode(trained):
    tok, sp = trained["tok"], trained["sp"]
    lines = shared_texts(full=False)["sst2"][:64]
    batch = tok.encode_batch(lines[:32], lines[32:], max_length=24)
    for k in range(32):
        enc = tok.encode(lines[k], lines[32 + k], max_length=24)
        n = len(enc)
        assert batch["input_ids"][k, :n].tolist() == enc.input_ids
        assert batch["token_type_ids"][k, :n].tolist() == enc.token_type_ids
        assert batch["attention_mask"][k].sum().item() == n <= 24
        a, b = sp.encode(lines[k]), sp.encode(lines[32 + k])
        if len(a) + len(b) + 3 <= 24:
            assert enc.input_ids == [2, *a, 3, *b, 3] and enc.token_type_ids == [0] * (len(a) + 2) + [1] * (len(b) + 1)
    for text in lines + UNICODE_LINES:
        ids = tok.encode(text).input_ids
        # skip_special_tokens drops <unk> too (as it drops [UNK] for WordPiece, and transformers does).
        assert tok.decode(ids) == sp.decode([i for i in sp.encode(text) if i != sp.unk_id()])
        if tok.unk_token_id not in ids:  # kept specials are written out, space-separated
            body = sp.decode(sp.encode(text))
            assert tok.decode(ids, skip_special_tokens=False) == (f"[CLS] {body} [SEP]" if body else "[CLS] [SEP]")
    with pytest.raises(BertctlError, match="outside the vocabulary"):
        tok.decode([1500])


def test_pickled_tokenizer_encodes_the_same(trained):
    tok = trained["tok"]
    copy = pickle.loads(pickle.dumps(tok))
    for text in UNICODE_LINES:
        assert copy.encode(text, return_offsets=True) == tok.encode(text, return_offsets=True)


# ------------------------------------------------------------------------------ training and the special tokens


def test_trained_model_layout_and_casing(trained, train_files, tmp_path):
    tok, sp = trained["tok"], trained["sp"]
    assert tok.model_type == trained["algorithm"] and tok.vocab_size == sp.get_piece_size() == 1500
    assert tok.ids_to_tokens[:5] == ["<pad>", "<unk>", "[CLS]", "[SEP]", "[MASK]"]
    assert (tok.pad_token_id, tok.unk_token_id, tok.cls_token_id, tok.sep_token_id, tok.mask_token_id) == (0, 1, 2, 3, 4)
    assert all(sp.is_control(i) for i in (0, 2, 3, 4)) and sp.is_unknown(1)
    # Control symbols are never produced from text: "[CLS]" typed in a text is ordinary characters.
    assert not set(tok.ids("[CLS] [SEP] [MASK] <pad>")) & {0, 2, 3, 4}
    # Uncased by default: the model case-folds (nmt_nfkc_cf); --cased keeps case.
    assert tok.ids("THE PEOPLE OF THE UNITED STATES") == tok.ids("the people of the united states")
    cased = tmp_path / "cased.model"
    r = runner.invoke(app, ["tokenize", "train", "--algorithm", trained["algorithm"], "--vocab-size", "800",
                            "--cased", "-o", str(cased), *map(str, train_files)])
    assert r.exit_code == 0, r.output
    ctok = load_tokenizer(cased)
    assert ctok.ids("The People") != ctok.ids("the people") and ctok.vocab_size == 800
    # --save-dir: the model file and a config saying what it is; the directory loads back the same.
    saved = trained["dir"]
    assert sorted(p.name for p in saved.iterdir()) == ["special_tokens_map.json", "spiece.model",
                                                       "tokenizer_config.json"]
    assert (saved / "spiece.model").read_bytes() == trained["model"].read_bytes()
    config = json.loads((saved / "tokenizer_config.json").read_text())
    assert config["tokenizer_type"] == "sentencepiece" and config["sentencepiece_model"] == "spiece.model"
    assert config.get("tokenizer_class") == ("AlbertTokenizer" if trained["algorithm"] == "unigram" else None)
    again = load_tokenizer(saved)
    assert isinstance(again, SentencePieceTokenizer)
    for text in UNICODE_LINES:
        assert again.encode(text, return_offsets=True) == tok.encode(text, return_offsets=True)


def test_train_errors(train_files, tmp_path):
    cases = [
        (["--algorithm", "bpe", "-o", str(tmp_path / "x.txt")], "must end in .model"),
        (["--algorithm", "bpe", "--min-frequency", "3", "-o", str(tmp_path / "x.model")], "--min-frequency applies"),
        (["--character-coverage", "1.0", "-o", str(tmp_path / "v.txt")], "--character-coverage applies"),
        (["--algorithm", "unigram", "--cased", "--no-strip-accents", "-o", str(tmp_path / "x.model")],
         "--no-strip-accents applies"),
        (["--algorithm", "sentencepiece", "-o", str(tmp_path / "x.model")], "--algorithm must be one of"),
        (["--algorithm", "unigram", "--vocab-size", "30522", "-o", str(tmp_path / "x.model")],
         r"Vocabulary size too high \(30522\)"),
    ]
    for args, message in cases:
        r = runner.invoke(app, ["tokenize", "train", *args, str(train_files[0])])
        error = r.stderr.strip().splitlines()[-1]  # after the progress bar
        assert r.exit_code == 2 and error.startswith("bertctl: error: ") and re.search(message, error), (args, r.stderr)
    assert not (tmp_path / "x.model").exists()


def _spm_model(tmp_path: Path, name: str, lines: list[str], **options) -> Path:
    prefix = tmp_path / name
    spm.SentencePieceTrainer.train(sentence_iterator=iter(lines), model_prefix=str(prefix), vocab_size=120,
                                   model_type="bpe", minloglevel=2, **options)
    return prefix.with_suffix(".model")


def test_special_token_rule(tmp_path):
    lines = shared_texts(full=False)["sst2"][:300]
    # sentencepiece's defaults (<unk> 0, <s> 1, </s> 2, no pad) plus <pad> and <mask> pieces:
    # [CLS] and [SEP] fall back to the model's <s> and </s>.
    model = _spm_model(tmp_path, "fairseq_like", lines, control_symbols=["<pad>", "<mask>"])
    tok = load_tokenizer(model)
    assert tok.special_tokens == {"cls_token": "<s>", "sep_token": "</s>", "pad_token": "<pad>",
                                  "mask_token": "<mask>", "unk_token": "<unk>"}
    assert (tok.unk_token_id, tok.cls_token_id, tok.sep_token_id) == (0, 1, 2)
    # A model without a mask piece cannot serve BERT: one error naming the file and what is missing.
    bare = _spm_model(tmp_path, "bare", lines, pad_id=3)
    with pytest.raises(BertctlError, match=r"bare.model: the SentencePiece model has no mask piece \(looked for \[MASK\], <mask>\)"):
        load_tokenizer(bare)
    # An ALBERT-style directory: tokenizer_config.json names the specials (AddedToken form too).
    albert = tmp_path / "albert"
    albert.mkdir()
    (albert / "spiece.model").write_bytes(
        _spm_model(tmp_path, "albert", lines, pad_id=0, unk_id=1, bos_id=-1, eos_id=-1,
                   control_symbols=["[CLS]", "[SEP]", "[MASK]", "<extra>"]).read_bytes())
    (albert / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "AlbertTokenizer", "mask_token": {"content": "<extra>", "lstrip": True}}))
    tok = load_tokenizer(albert)
    assert tok.special_tokens["mask_token"] == "<extra>" and tok.mask_token_id == 5 and tok.cls_token_id == 2
    (albert / "tokenizer_config.json").write_text(json.dumps({"cls_token": "<cls>"}))
    with pytest.raises(BertctlError, match=r"cls_token '<cls>' \(from tokenizer_config.json\) is not a piece"):
        load_tokenizer(albert)


def test_load_tokenizer_picks_by_what_the_path_holds(trained, tmp_path, minilm_vocab):
    model = trained["model"]
    assert isinstance(load_tokenizer(model), SentencePieceTokenizer)
    assert isinstance(load_tokenizer(minilm_vocab), BertTokenizer)
    # XLM-R's file name, beside a vocab.txt: the SentencePiece model wins.
    d = tmp_path / "xlmr_named"
    d.mkdir()
    (d / "sentencepiece.bpe.model").write_bytes(model.read_bytes())
    (d / "vocab.txt").write_text(minilm_vocab.read_text())
    tok = load_tokenizer(d)
    assert isinstance(tok, SentencePieceTokenizer) and tok.model_filename == "sentencepiece.bpe.model"
    assert tok.ids("hello world") == trained["sp"].encode("hello world")
    bad = tmp_path / "bad.model"
    bad.write_bytes(b"\x00not a protobuf")
    with pytest.raises(BertctlError, match="bad.model: not a SentencePiece model"):
        load_tokenizer(bad)
    with pytest.raises(BertctlError, match="no such file or directory"):
        load_tokenizer(tmp_path / "absent")


def test_transformers_loads_a_saved_unigram_tokenizer(unigram):
    """transformers' AlbertTokenizer on the saved directory: the same ids, except that it rewrites
    `` and '' to " before SentencePiece (ALBERT's preprocessing, which bertctl does not do).
    (transformers has no class for a BPE SentencePiece model without fairseq's id offset.)"""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(unigram["dir"]))
    tok = unigram["tok"]
    lines = [t for t in shared_texts(full=False)["sst2"] if "``" not in t and "''" not in t]
    assert len(lines) > 800
    sp = unigram["sp"]
    ties = 0
    for text in lines:
        theirs, ours = hf(text)["input_ids"], tok.encode(text).input_ids
        if theirs != ours:
            # tokenizers' Viterbi breaks ties between equally likely segmentations otherwise: the
            # same text and the same total log-probability, or it is a real difference.
            assert tok.decode(theirs) == tok.decode(ours), text
            assert sum(map(sp.get_score, theirs[1:-1])) == pytest.approx(sum(map(sp.get_score, ours[1:-1])), abs=1e-4)
            ties += 1
    assert ties <= len(lines) // 100, ties


# ------------------------------------------------------------------------------ the command line


def test_tokenize_encode_decode_inspect(trained, tmp_path):
    sp, model = trained["sp"], trained["model"]
    lines = shared_texts(full=False)["sst2"][:50] + ["Grüße, 東京 🙂 ﬁne"]
    src = tmp_path / "in.txt"
    src.write_text("\n".join(lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    r = runner.invoke(app, ["tokenize", "encode", "--spm-model", str(model), "--offsets", "-o", str(out), str(src)])
    assert r.exit_code == 0, r.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(rows) == len(lines)
    for row, text in zip(rows, lines):
        assert row["input_ids"] == [2, *sp.encode(text), 3]
        assert all(text[a:b] == "" or not text[a:b][0].isspace() for a, b in row["offsets"])
    r = runner.invoke(app, ["tokenize", "decode", "--model", str(trained["dir"]), str(out)])
    assert r.exit_code == 0, r.output
    assert r.stdout.splitlines() == [sp.decode([i for i in sp.encode(t) if i != sp.unk_id()]) for t in lines]
    r = runner.invoke(app, ["tokenize", "inspect", "--spm-model", str(model), "Unaffable tokenizers!"])
    assert r.exit_code == 0, r.output
    tsv = [x.split("\t") for x in r.stdout.strip().splitlines()[-(len(sp.encode("Unaffable tokenizers!")) + 2):]]
    assert [int(x[1]) for x in tsv] == [2, *sp.encode("Unaffable tokenizers!"), 3]
    for args, message in ((["--spm-model", str(model), "--vocab", str(model)], "give exactly one of"),
                          (["--spm-model", str(model), "--cased"], "--cased applies to --vocab"),
                          (["--spm-model", str(tmp_path / "none.model")], "none.model: --spm-model: no such file")):
        r = runner.invoke(app, ["tokenize", "inspect", *args, "text"])
        err = r.stderr.strip()
        assert r.exit_code == 2 and err.startswith("bertctl: error: ") and message in err and "\n" not in err, r.stderr


# ------------------------------------------------------------------------------ build-data: whole words at ▁


def _words(tokens: list[int], continues, specials) -> list[list[int]]:
    """Positions grouped into words: a piece without ▁ joins the word before it (not across [CLS]/[SEP])."""
    words: list[list[int]] = []
    after_special = True
    for p, t in enumerate(tokens):
        if t in specials:
            after_special = True
            continue
        if continues[t] and not after_special:
            words[-1].append(p)
        else:
            words.append([p])
        after_special = False
    return words


def _check_whole_words(rows, continues) -> tuple[int, int]:
    """Each (ids, length, masked positions, labels) row masks whole words only; returns the masked
    words and those of several pieces."""
    masked_words = multi = 0
    for ids, n, positions, labels in rows:
        positions = [int(p) for p in positions if p]
        original = np.asarray(ids[:n], dtype=np.int64).copy()
        original[positions] = labels[: len(positions)]
        assert original[0] == 2 and original[n - 1] == 3
        masked = set(positions)
        for word in _words(original.tolist(), continues, {2, 3}):
            k = len(masked.intersection(word))
            assert k in (0, len(word)), (word, positions)  # a word is masked whole or not at all
            masked_words += k > 0
            multi += k > 1
    return masked_words, multi


def test_build_data_whole_word_masking_on_word_starts(trained, train_files, tmp_path):
    tok = trained["tok"]
    out = tmp_path / "data"
    args = ["build-data", "--spm-model", str(trained["model"]), "--format", "text", "--max-seq-length", "64",
            "--dupe-factor", "2", "--whole-word-mask", "--seed", "7", "--no-progress"]
    r = runner.invoke(app, [*args, "-o", str(out), *map(str, train_files[:2])])
    assert r.exit_code == 0, r.output
    manifest = json.loads((out / "manifest.json").read_text())
    info = manifest["tokenizer"]
    assert info["type"] == "sentencepiece" and info["sentencepiece_sha256"] == tok.model_sha256
    assert (info["pad_token_id"], info["cls_token_id"], info["mask_token_id"]) == (0, 2, 4)
    # The folder is a tokenizer directory: pretraining tokenises as the data was.
    assert (out / "spiece.model").read_bytes() == trained["model"].read_bytes()
    assert isinstance(load_tokenizer(out), SentencePieceTokenizer)
    continues = [not p.startswith("\u2581") and not trained["sp"].is_control(i) for i, p in enumerate(tok.ids_to_tokens)]
    assert list(tok.continues_word) == continues and 0 < sum(continues) < len(continues)
    records = np.concatenate([np.load(out / s["file"]) for s in manifest["splits"]["train"]["shards"]])
    masked_words, multi = _check_whole_words(
        [(rec["input_ids"], int(rec["length"]), rec["masked_positions"], rec["masked_lm_labels"]) for rec in records],
        continues)
    assert masked_words > 500 and multi > 50  # words of several pieces were masked together
    # --dynamic-masking: the loader masks whole words at every epoch, from the folder's own model file.
    from bertctl.data import PretrainingData

    dyn = tmp_path / "dynamic"
    r = runner.invoke(app, [*args, "--dynamic-masking", "-o", str(dyn), *map(str, train_files[:2])])
    assert r.exit_code == 0, r.output
    data = PretrainingData(dyn)
    batch = data.collate(np.arange(min(data.num_instances, 256)), seed=3, epoch=1)
    rows = [(ids, int(mask.sum()), pos, lab) for ids, mask, pos, lab in
            zip(batch["input_ids"].numpy(), batch["attention_mask"].numpy(), batch["masked_positions"].numpy(),
                batch["masked_lm_labels"].numpy())]
    masked_words, multi = _check_whole_words(rows, continues)
    assert masked_words > 200 and multi > 20
    # Two workers give the same bytes (the tokenizer travels to worker processes by pickling).
    r = runner.invoke(app, [*args, "--workers", "2", "--unit-mb", "0.05", "-o", str(tmp_path / "w2"),
                            *map(str, train_files[:2])])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, [*args, "--unit-mb", "0.05", "-o", str(tmp_path / "w1"), *map(str, train_files[:2])])
    assert r.exit_code == 0, r.output
    files = sorted(p.name for p in (tmp_path / "w1").iterdir())
    assert files == sorted(p.name for p in (tmp_path / "w2").iterdir())
    for name in files:
        if name.endswith(".npy"):
            assert (tmp_path / "w1" / name).read_bytes() == (tmp_path / "w2" / name).read_bytes(), name


# ------------------------------------------------------------------------------ offsets for SQuAD and NER


def test_squad_answers_and_ner_words_through_offsets(trained):
    from bertctl.tasks import ner, squad

    tok = trained["tok"]
    data = json.loads(data_path("squad", "dev-v1.1.json").read_text(encoding="utf-8"))["data"]
    found = 0
    for p in (p for a in data[:8] for p in a["paragraphs"]):
        tokens, offsets = tok.tokenize_with_offsets(p["context"])
        for qa in p["qas"]:
            for ans in qa["answers"]:
                start, text = ans["answer_start"], ans["text"]
                first, last = squad.char_to_token_span(offsets, start, start + len(text))
                span = p["context"][offsets[first][0] : offsets[last][1]]
                # The token span covers the answer and starts and ends inside its first and last words.
                assert text in span and len(span) < len(text) + 40, (text, span)
                found += 1
    assert found > 1000
    sentences = ner.read_conll(data_path("conll2003", "valid.txt")).sentences[:500]
    for s in sentences:
        pieces, word_index = tok.tokenize_words(s.words)
        assert sorted(set(word_index)) == [k for k, w in enumerate(s.words) if tok.ids(w)]
        starts = [k for k in range(len(pieces)) if k == 0 or word_index[k] != word_index[k - 1]]
        assert all(pieces[k].startswith("\u2581") for k in starts)  # every word opens with its ▁ piece
        assert tok.convert_tokens_to_ids(pieces) == [i for w in s.words for i in trained["sp"].encode(w)]


# ------------------------------------------------------------------------------ pretrain -> fine-tune


def test_pretrain_then_finetune_round_trip(unigram, train_files, tmp_path):
    """build-data --spm-model -> pretrain (tiny, a few steps) -> fine-tune SST-2, NER and SQuAD, and
    embed: every saved model directory carries the SentencePiece model and tokenises as the data."""
    trained = unigram
    tok = trained["tok"]
    data = tmp_path / "data"
    r = runner.invoke(app, ["build-data", "--spm-model", str(trained["model"]), "--format", "text",
                            "--max-seq-length", "64", "--dupe-factor", "1", "--holdout-fraction", "0.2",
                            "--no-progress", "-o", str(data), *map(str, train_files)])
    assert r.exit_code == 0, r.output
    run = tmp_path / "run"
    r = _cli("pretrain", "--data", str(data), "--output", str(run), "--model-size", "tiny", "--batch-size", "8",
             "--max-steps", "3", "--device", "cpu", "--no-progress", "--eval-batches", "1")
    assert r.returncode == 0, r.stderr[-3000:]
    model_dir = run / "model"

    def same_tokenizer(directory: Path) -> None:
        assert (directory / "spiece.model").read_bytes() == trained["model"].read_bytes()
        again = load_tokenizer(directory)
        assert isinstance(again, SentencePieceTokenizer)
        for text in UNICODE_LINES:
            assert again.encode(text, return_offsets=True) == tok.encode(text, return_offsets=True)

    same_tokenizer(model_dir)
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == tok.vocab_size

    sst2 = tmp_path / "sst2"
    sst2.mkdir()
    for name, n in (("train.tsv", 33), ("dev.tsv", 17)):
        (sst2 / name).write_text("\n".join(_read_lines(data_path("glue", "SST-2", name))[:n]) + "\n", encoding="utf-8")
    conll = tmp_path / "conll"
    conll.mkdir()
    for name in ("train", "valid", "test"):  # valid and test from train's sentences: a tag train lacks is refused
        conll_slice(data_path("conll2003", "train.txt"), conll / f"{name}.txt", 24 if name == "train" else 12)
    squad_file = squad_slice(data_path("squad", "dev-v1.1.json"), tmp_path / "squad.json", articles=1, paragraphs=2)
    runs = {
        "glue": ["glue", "--task", "sst2", "--data-dir", str(sst2)],
        "ner": ["ner", "--data-dir", str(conll)],
        "squad": ["squad", "--train", str(squad_file), "--dev", str(squad_file), "--max-seq-length", "128",
                  "--doc-stride", "64"],
    }
    for task, args in runs.items():
        out = tmp_path / f"ft-{task}"
        r = runner.invoke(app, ["finetune", *args, "--model", str(model_dir), "--output", str(out),
                                "--max-steps", "2", "--batch-size", "8", "--no-progress"])
        assert r.exit_code == 0, (task, r.output)
        same_tokenizer(out / "model")
        assert (out / "metrics.json").is_file()
    preds = json.loads((tmp_path / "ft-squad" / "predictions.json").read_text())
    contexts = " ".join(p["context"] for a in json.loads(squad_file.read_text())["data"] for p in a["paragraphs"])
    assert preds and all(v in contexts for v in preds.values())  # answers are spans cut by the offsets
    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(UNICODE_LINES[:3]) + "\n", encoding="utf-8")
    r = runner.invoke(app, ["embed", "--model", str(tmp_path / "ft-glue" / "model"), "-o", str(tmp_path / "e.npy"), str(texts)])
    assert r.exit_code == 0, r.output
    assert np.load(tmp_path / "e.npy").shape[0] == 3
