"""Texts of the shared real data sets, as the tokenizer tests and benchmark read them.

Every line of every text file under ``../shared/data``: SST-2 sentences, CoNLL-2003 sentences
(tokens joined with spaces), SQuAD v1.1 dev contexts, questions and answers, the BERT ensemble's
SQuAD predictions, SWAG sentences and endings,
and every line of every corpus file (UTF-8, or ISO-8859-1 where a file is not valid UTF-8).
"""
from __future__ import annotations

import functools
import json
from pathlib import Path

DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


def read_text(path: Path) -> str:
    """A file's text: UTF-8, or latin-1 where it is not valid UTF-8 (some corpus files are)."""
    raw = path.read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def corpus_files() -> list[Path]:
    return sorted(p for p in (DATA / "corpus").rglob("*") if p.is_file())


@functools.lru_cache(maxsize=1)
def data_texts() -> dict[str, list[str]]:
    """{source name: texts}; one entry per file (the SQuAD file gives contexts and questions)."""
    out: dict[str, list[str]] = {}
    for split in ("train", "dev"):
        lines = read_text(DATA / "glue" / "SST-2" / f"{split}.tsv").split("\n")[1:]
        out[f"sst2-{split}"] = [line.split("\t")[0] for line in lines]
    for split in ("train", "valid", "test"):
        sentences, words = [], []
        for line in read_text(DATA / "conll2003" / f"{split}.txt").splitlines():
            if not line.strip() or line.startswith("-DOCSTART-"):
                if words:
                    sentences.append(" ".join(words))
                    words = []
                continue
            words.append(line.split(" ")[0])
        if words:
            sentences.append(" ".join(words))
        out[f"conll-{split}"] = sentences
    squad = json.loads(read_text(DATA / "squad" / "dev-v1.1.json"))
    contexts, questions, answers = [], [], []
    for article in squad["data"]:
        for para in article["paragraphs"]:
            contexts.append(para["context"])
            questions.extend(q["question"] for q in para["qas"])
            answers.extend(a["text"] for q in para["qas"] for a in q["answers"])
    out["squad-contexts"] = contexts
    out["squad-questions"] = questions
    out["squad-answers"] = answers
    predictions = json.loads(read_text(DATA / "squad" / "predictions-v1.1-bert-ensemble.json"))
    out["squad-predictions"] = list(predictions.values())
    swag = []
    for line in read_text(DATA / "swag" / "sample.jsonl").splitlines():
        row = json.loads(line)
        swag += [row["sent1"], row["sent2"]] + [row[f"ending{k}"] for k in range(4)]
    out["swag"] = swag
    for path in corpus_files():
        out[str(path.relative_to(DATA))] = read_text(path).split("\n")
    return out
