"""Named-entity recognition on CoNLL-2003 (paper §5.3): reading, label alignment, fine-tuning, eval.

File format: one token per line with whitespace-separated columns, the token first and the tag
last (CoNLL-2003: ``token POS chunk NER``); a blank line ends a sentence; ``-DOCSTART-`` lines
separate documents. Tags may be IOB1 or IOB2 (or IOBES): the model learns the file's tags as
they are, and scoring uses conlleval's chunk rules, which read them all.

Each word is split into word pieces; as in the paper, the label sits on the word's first piece
and the others are ignored (-100); a word's prediction is its first piece's argmax. Sentences
longer than the model's window are cut, and their cut words predicted ``O`` (counted).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from bertctl.config import IGNORE_INDEX
from bertctl.errors import BertctlError
from bertctl.io import atomic_open
from bertctl.progress import track
from bertctl.tasks import common
from bertctl.tasks.base import Task
from bertctl.tasks.metrics import conlleval
from bertctl.tasks.trainer import FinetuneConfig, predict


@dataclass
class Sentence:
    words: list[str]
    tags: list[str]
    line: int  # first line of the sentence in its file (1-based)


@dataclass
class NerData:
    path: str
    sentences: list[Sentence]


def read_conll(path: str | Path) -> NerData:
    """Sentences of a CoNLL file. The tag is the last column, and every row has as many columns as the file's
    first (CoNLL-2003: ``token POS chunk NER``), so a row that lost its NER column is an error naming it rather
    than its chunk tag read as an entity."""
    path = Path(path)
    if not path.exists():
        raise BertctlError(f"{path}: file not found")
    sentences: list[Sentence] = []
    words: list[str] = []
    tags: list[str] = []
    start = 1
    width = None  # the file's column count, from its first row

    def flush():
        nonlocal words, tags
        if words:
            sentences.append(Sentence(words, tags, start))
        words, tags = [], []

    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            cells = line.split()
            if cells and cells[0] == "-DOCSTART-":
                flush()
                continue
            if not cells:
                flush()
                continue
            if cells[0] == "-DOCSTART-":
                flush()
                continue
            if len(cells) < 2:
                raise BertctlError(f"{path}:{lineno}: expected 'token ... tag' columns, got {line.strip()!r}")
            width = width or len(cells)
            if len(cells) != width:
                raise BertctlError(f"{path}:{lineno}: {len(cells)} columns, but the file's rows have {width} (the tag "
                                   f"is the last column: CoNLL-2003 rows are 'token POS chunk NER')")
            tag = cells[-1]
            if tag != "O" and not (len(tag) > 2 and tag[1] == "-" and tag[0] in "BIES"):
                raise BertctlError(f"{path}:{lineno}: tag {tag!r} is not O or B-/I-/E-/S-TYPE")
            if not words:
                start = lineno
            words.append(cells[0])
            tags.append(tag)
    flush()
    if not sentences:
        raise BertctlError(f"{path}: no sentences")
    return NerData(str(path), sentences)


def check_tags(train: NerData, *others: NerData) -> None:
    """A tag the training file never has would be a class no step trains: refused, naming where it is first."""
    known = {t for s in train.sentences for t in s.tags}
    for d in others:
        for s in d.sentences:
            for i, t in enumerate(s.tags):
                if t not in known:
                    raise BertctlError(f"{d.path}: sentence at line {s.line}: tag {t!r} is not among {train.path}'s "
                                       f"tags ({', '.join(label_list(train))}): no step would train it")


def label_list(*datasets: NerData) -> list[str]:
    """Tags seen in the data, ``O`` first, then by entity type and prefix."""
    seen = {t for d in datasets for s in d.sentences for t in s.tags}
    rest = sorted(seen - {"O"}, key=lambda t: (t[2:], t[0]))
    return ["O", *rest]


@dataclass
class NerFeatures:
    features: list[dict]
    truncated_words: int = 0


def featurize(data: NerData, tokenizer, label_to_id: dict[str, int] | None, max_seq_length: int = 128,
              progress: bool = False) -> NerFeatures:
    """[CLS] pieces [SEP]; ``labels`` on each word's first piece, -100 elsewhere; ``_first``
    holds the position of each word's first piece (-1 for words cut off or with no pieces)."""
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    out = NerFeatures([])
    with track("tokenize", len(data.sentences), disable=not progress) as advance:
        for si, s in enumerate(data.sentences):
            pieces, word_index = tokenizer.tokenize_words(s.words)
            pieces, word_index = pieces[: max_seq_length - 2], word_index[: max_seq_length - 2]
            ids = [cls_id, *tokenizer.convert_tokens_to_ids(pieces), sep_id]
            first = np.full(len(s.words), -1, dtype=np.int32)
            labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
            prev = -1
            for pos, w in enumerate(word_index, start=1):
                if w != prev:
                    first[w] = pos
                    if label_to_id is not None:
                        labels[pos] = label_to_id[s.tags[w]]
                prev = w
            covered = set(word_index)
            out.truncated_words += sum(1 for w in range(len(s.words)) if w not in covered and
                                       (not word_index or w > word_index[-1]))
            f = {"input_ids": np.asarray(ids, dtype=np.int32), "token_type_ids": np.zeros(len(ids), dtype=np.int8),
                 "_first": first, "_sentence": si}
            if label_to_id is not None:
                f["labels"] = labels
            out.features.append(f)
            advance(1)
    return out


def decode(features: Sequence[dict], logits: Sequence[np.ndarray], id2label: Sequence[str]) -> list[list[str]]:
    """Per sentence, the tag of each word from its first piece (``O`` for words without one)."""
    out = []
    for f, lg in zip(features, logits):
        best = lg.argmax(-1)
        out.append([id2label[int(best[p])] if p >= 0 else "O" for p in f["_first"]])
    return out


def score(data: NerData, predicted: list[list[str]]) -> dict:
    gold = [s.tags for s in data.sentences]
    return conlleval(gold, predicted)


def write_predictions(path: Path, data: NerData, predicted: list[list[str]]) -> None:
    """CoNLL columns ``token gold predicted``, a blank line after each sentence (conlleval's input)."""
    with atomic_open(path, "w", encoding="utf-8") as f:
        for s, p in zip(data.sentences, predicted):
            for w, g, t in zip(s.words, s.tags, p):
                f.write(f"{w} {g} {t}\n")
            f.write("\n")


def _predict_tags(model, data: NerData, tokenizer, id2label, tcfg: FinetuneConfig, max_seq_length: int,
                  progress: bool, feats: NerFeatures | None = None,
                  shards=None) -> tuple[list[list[str]], NerFeatures]:
    feats = feats or featurize(data, tokenizer, None, max_seq_length)
    logits = predict(model, feats.features, outputs=("logits",), batch_size=tcfg.eval_batch_size,
                     batch_tokens=tcfg.eval_batch_tokens, precision=tcfg.train.precision,
                     per_token=True, progress=progress, description=f"predict {Path(data.path).name}", shards=shards)
    return decode(feats.features, [o[0] for o in logits], id2label), feats


def _flat(metrics: dict, prefix: str) -> dict:
    out = {f"{prefix}_{k}": metrics[k] for k in ("precision", "recall", "f1", "accuracy")}
    out[f"{prefix}_per_type"] = {t: {k: v[k] for k in ("precision", "recall", "f1", "gold")}
                                 for t, v in metrics["per_type"].items()}
    return out


def find_files(data_dir: str | Path) -> tuple[Path, Path, Path | None]:
    d = Path(data_dir)
    if not d.is_dir():
        raise BertctlError(f"{d}: data directory not found")
    train, valid, test = d / "train.txt", d / "valid.txt", d / "test.txt"
    if not valid.exists() and (d / "dev.txt").exists():
        valid = d / "dev.txt"
    for p in (train, valid):
        if not p.exists():
            raise BertctlError(f"{p}: file not found (ner --data-dir needs train.txt, valid.txt and test.txt)")
    return train, valid, test if test.exists() else None


class Ner(Task):
    """CoNLL NER as a ``Task``: fine-tuning on ``data_dir``'s train.txt, the epoch (and lr) chosen on
    valid.txt, valid and test reported; or (``data_path``) evaluating on one CoNLL file."""

    main_metric = "valid_f1"
    select_best = True
    reuse_last = False  # the final report predicts test too (``final_outputs`` reuses valid's)

    def __init__(self, *, data_dir: str | Path | None = None, data_path: str | Path | None = None,
                 max_seq_length: int = 128):
        self.name, self.max_seq_length = "ner", max_seq_length
        self.train_features: list[dict] = []
        self.train = self.valid = self.test = self.train_feats = self.valid_feats = None
        if data_dir is not None:
            train_path, valid_path, test_path = find_files(data_dir)
            self.train, self.valid = read_conll(train_path), read_conll(valid_path)
            self.test = read_conll(test_path) if test_path else None
            check_tags(self.train, self.valid, *([self.test] if self.test else []))
            self.labels = label_list(self.train)
            self.sets = [("valid", self.valid), ("test", self.test)]
        else:
            self.sets = [(None, read_conll(data_path))]

    @property
    def model_class(self):
        from bertctl.model import BertForTokenClassification

        return BertForTokenClassification

    def configure(self, cfg: FinetuneConfig) -> FinetuneConfig:
        return _select_best(cfg)

    def head(self) -> dict:
        return dict(id2label=dict(enumerate(self.labels)), label2id={l: i for i, l in enumerate(self.labels)})

    def adopt(self, model, model_dir) -> None:
        self.labels = common.head_labels(model)
        data = self.sets[0][1]
        unknown = sorted({t for s in data.sentences for t in s.tags} - set(self.labels))
        if unknown:
            raise BertctlError(f"{data.path}: tags {', '.join(unknown)} are not among the model's labels "
                               f"({', '.join(self.labels)})")

    def featurize(self, tokenizer, progress: bool) -> None:
        self.tokenizer = tokenizer
        if self.train is not None:
            label_to_id = {l: i for i, l in enumerate(self.labels)}
            self.train_feats = featurize(self.train, tokenizer, label_to_id, self.max_seq_length, progress=progress)
            self.train_features = self.train_feats.features
            self.valid_feats = featurize(self.valid, tokenizer, None, self.max_seq_length)

    def predict(self, model, cfg: FinetuneConfig, *, progress=False, shards=None, final=False):
        if not final:  # an epoch end: valid only
            return _predict_tags(model, self.valid, self.tokenizer, self.labels, cfg, self.max_seq_length, False,
                                 self.valid_feats, shards)[0]
        feats = {"valid": self.valid_feats}
        return {name: _predict_tags(model, d, self.tokenizer, self.labels, cfg, self.max_seq_length, progress,
                                    feats.get(name)) for name, d in self.sets if d is not None}

    def final_outputs(self, model, cfg: FinetuneConfig, *, progress=False, last=None):
        if last is None:
            return super().final_outputs(model, cfg, progress=progress)
        # The last evaluation's valid tags are those of this model: predicting valid again would repeat them.
        return {name: (last, self.valid_feats) if name == "valid" else
                _predict_tags(model, d, self.tokenizer, self.labels, cfg, self.max_seq_length, progress)
                for name, d in self.sets if d is not None}

    def score(self, outputs, *, final=False) -> dict:
        if not final:
            m = score(self.valid, outputs)
            return {"valid_f1": m["f1"], "valid_precision": m["precision"], "valid_recall": m["recall"]}
        if self.train is None:  # evaluating one file
            (tags, feats), = outputs.values()
            m = score(self.sets[0][1], tags)
            result = {**{k: m[k] for k in ("precision", "recall", "f1", "accuracy")},
                      "per_type": {t: {k: v[k] for k in ("precision", "recall", "f1", "gold")}
                                   for t, v in m["per_type"].items()}}
            if feats.truncated_words:
                result["truncated_words"] = feats.truncated_words
            return result
        result = {"labels": self.labels}
        for name, d in self.sets:
            if d is None:
                continue
            tags, feats = outputs[name]
            result.update(_flat(score(d, tags), name))
            if feats.truncated_words:
                result[f"{name}_truncated_words"] = feats.truncated_words
        return result

    def write_predictions(self, output: Path, outputs) -> None:
        for name, d in self.sets:
            if d is not None:
                write_predictions(output / (f"predictions_{name}.txt" if name else "predictions.txt"), d,
                                  outputs[name][0])

    def facts(self) -> dict:
        if self.train is None:
            return {"sentences": len(self.sets[0][1].sentences)}
        return {"train_sentences": len(self.train.sentences)}

    def notes(self) -> dict:
        if self.train is None:
            return {}
        return {"train_truncated_words": self.train_feats.truncated_words} if self.train_feats.truncated_words else {}


def _select_best(tcfg: FinetuneConfig) -> FinetuneConfig:
    """The recipe's epoch choice on valid: an evaluation after every epoch, the best one kept."""
    import dataclasses

    if not tcfg.epoch_evals:
        raise BertctlError("--no-epoch-evals: NER keeps the epoch with the best validation F1, which needs an "
                           "evaluation after every epoch")
    return dataclasses.replace(tcfg, select_best=True)
