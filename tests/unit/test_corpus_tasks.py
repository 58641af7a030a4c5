"""The rule-built fine-tuning tasks of benchmarks/finetune/corpus_tasks.py, built from the shared corpus: sizes, labels,
the train/dev paragraph split, that the similarity scores order the kinds of pair as the rules say, and that a
build is a pure function of its seed."""
from __future__ import annotations

import csv
import statistics
import sys
from collections import defaultdict
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks" / "finetune"))
import corpus_tasks  # noqa: E402


def rows(path: Path) -> list[dict]:
    with open(path, encoding="utf-8", newline="") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


@pytest.fixture(scope="module")
def built(shared_data, tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("corpus-tasks")
    stats = corpus_tasks.build(shared_data / "corpus", shared_data / "squad" / "dev-v1.1.json", out)
    return out, stats


def test_sizes_and_labels(built):
    out, stats = built
    for task, (n_train, n_dev) in corpus_tasks.SIZES.items():
        for split, n in (("train", n_train), ("dev", n_dev)):
            table = rows(out / task / f"{split}.tsv")
            assert len(table) == n == stats[f"{task}/{split}"]["rows"]
            if task == "similarity":
                scores = [float(r["label"]) for r in table]
                assert min(scores) >= 0 and max(scores) <= 5
                assert all(abs(s * 5 - round(s * 5)) < 1e-9 for s in scores)  # steps of 0.2
                assert all(r["sentence1"] and r["sentence2"] for r in table)
            else:
                assert {r["label"] for r in table} == {"0", "1"}


def test_similarity_scores_order_the_kinds_of_pair(built):
    out, _ = built
    by_kind = defaultdict(list)
    for r in rows(out / "similarity" / "train.tsv"):
        by_kind[r["op"].split(":")[0]].append(float(r["label"]))
    means = {k: statistics.mean(v) for k, v in by_kind.items()}
    order = ["same", "one_change", "two_changes", "related", "unrelated"]
    assert sorted(means) == sorted(order)
    assert [means[k] for k in order] == sorted(means.values(), reverse=True), means
    shares = {k: len(v) / 5749 for k, v in by_kind.items()}
    for kind, share, _ in corpus_tasks.SIMILARITY_KINDS:
        assert shares[kind] == pytest.approx(share, abs=0.002)
    same = [r for r in rows(out / "similarity" / "train.tsv") if r["op"].startswith("same:")]
    assert all(r["sentence1"] != r["sentence2"] for r in same)  # a rewrite, never the sentence itself


def test_dev_sentences_come_from_other_paragraphs(built):
    out, _ = built
    train = {r["sentence1"] for r in rows(out / "similarity" / "train.tsv")} | {
        r["sentence2"] for r in rows(out / "similarity" / "train.tsv")}
    dev = rows(out / "similarity" / "dev.tsv")
    unchanged = [r for r in dev if r["op"].startswith(("related", "unrelated"))]  # whole corpus sentences
    assert unchanged and not any(r["sentence1"] in train or r["sentence2"] in train for r in unchanged)


def test_a_build_depends_only_on_its_seed(shared_data, built, tmp_path):
    out, _ = built
    again = tmp_path / "again"
    corpus_tasks.build(shared_data / "corpus", shared_data / "squad" / "dev-v1.1.json", again, tasks=("similarity",))
    assert (again / "similarity" / "dev.tsv").read_bytes() == (out / "similarity" / "dev.tsv").read_bytes()
    other = tmp_path / "other"
    corpus_tasks.build(shared_data / "corpus", shared_data / "squad" / "dev-v1.1.json", other, seed=14,
                       tasks=("similarity",))
    assert (other / "similarity" / "dev.tsv").read_bytes() != (out / "similarity" / "dev.tsv").read_bytes()
