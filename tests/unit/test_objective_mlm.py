"""The masked-LM-only objective (the paper's "No NSP" ablation, section 5.1), end to end:
``build-data --objective mlm`` and pretraining on its data.

Independent references: the corpus is written here as one sentence per line (real text from
../shared/data/corpus) and read back with plain Python, each sentence tokenized with the plain
tokenizer (no word cache); every instance is then located in those documents, and every sentence
must be covered exactly ``dupe_factor`` times by whole-sentence runs of one document. The exported
model is checked against ``transformers.BertForMaskedLM`` on the same weights in float64, and the
default objective's shards against hashes recorded before the objective existed.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from bertctl.data import PretrainingData
from bertctl.data.batching import pretraining_batches
from bertctl.data.build import build_data, make_chunks
from bertctl.data.config import DataConfig
from bertctl.data.documents import ReadStats, list_inputs, read_documents
from bertctl.data.sentences import split_sentences
from bertctl.errors import BertctlError
from bertctl.text.wordpiece import BertTokenizer
from helpers import PRETRAIN_FILES, small_vocab

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MAX = 64
# A document of one sentence: NSP data must skip it, masked-LM-only data keeps it.
ONE_SENTENCE = "A single sentence makes this document, and masked language modelling can still use it."


@pytest.fixture(scope="module")
def tokenizer(minilm_vocab):
    return BertTokenizer.from_vocab_file(minilm_vocab)


def _decode(raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("cp1252", errors="replace")


@pytest.fixture(scope="module")
def lines_corpus(shared_data, tmp_path_factory) -> tuple[Path, list[list[str]]]:
    """The inaugural addresses and three State of the Union addresses, one sentence per line and a
    blank line between documents (the reference's input format), plus a one-sentence document."""
    files = sorted((shared_data / "corpus" / "inaugural").glob("*.txt"))
    files += sorted((shared_data / "corpus" / "state_union").glob("*.txt"))[:3]
    documents = []
    for f in files:
        paragraphs = re.split(r"\n\s*\n", _decode(f.read_bytes()).replace("\r\n", "\n"))
        sentences = [s.strip() for p in paragraphs for s in split_sentences(" ".join(p.split()))]
        documents.append([s for s in sentences if s])
    documents.insert(7, [ONE_SENTENCE])
    path = tmp_path_factory.mktemp("lines") / "corpus.txt"
    path.write_text("\n\n".join("\n".join(d) for d in documents) + "\n", encoding="utf-8")
    return path, documents


def _reference_documents(path: Path, tokenizer) -> list[list[list[int]]]:
    """Documents of a one-sentence-per-line file, read with plain Python: token ids per sentence."""
    docs = []
    for block in path.read_text(encoding="utf-8").split("\n\n"):
        doc = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(line)) for line in block.split("\n") if line.strip()]
        doc = [ids for ids in doc if ids]
        if doc:
            docs.append(doc)
    return docs


def _records(out: Path) -> np.ndarray:
    manifest = json.loads((out / "manifest.json").read_text())
    return np.concatenate([np.load(out / s["file"]) for split in manifest["splits"].values() for s in split["shards"]])


class Locator:
    """Where an instance's tokens come from: runs of whole consecutive sentences of one document,
    or (one sentence longer than the instance allows) a contiguous piece of one sentence."""

    def __init__(self, documents: list[list[list[int]]], max_tokens: int):
        self.documents = documents
        self.max_tokens = max_tokens
        self.by_prefix: dict[tuple, list[tuple[int, int]]] = {}
        for d, doc in enumerate(documents):
            for i, s in enumerate(doc):
                self.by_prefix.setdefault(tuple(s[:3]), []).append((d, i))
        self.long = [(d, i) for d, doc in enumerate(documents) for i, s in enumerate(doc) if len(s) > max_tokens]

    def runs(self, body: list[int]) -> list[tuple[int, int, int]]:
        """Every (document, first sentence, end sentence) whose sentences concatenate to ``body``."""
        found = []
        for k in (1, 2, 3):
            for d, i in self.by_prefix.get(tuple(body[:k]), []):
                doc, pos, j = self.documents[d], 0, i
                while j < len(doc) and body[pos:pos + len(doc[j])] == doc[j]:
                    pos += len(doc[j])
                    j += 1
                    if pos == len(body):
                        found.append((d, i, j))
                        break
        return found

    def cut(self, body: list[int]) -> list[tuple[int, int, int]]:
        """Sentences longer than ``max_tokens`` holding ``body`` as a contiguous piece."""
        found = []
        for d, i in self.long:
            s = self.documents[d][i]
            if any(s[k:k + len(body)] == body for k in range(len(s) - len(body) + 1)):
                found.append((d, i, i + 1))
        return found


def check_whole_sentences(rec: np.ndarray, documents: list[list[list[int]]], tokenizer, dupe_factor: int) -> dict:
    """The layout of every instance, and every sentence of every document covered exactly
    ``dupe_factor`` times by whole-sentence runs (a longer-than-allowed sentence by a piece of it)."""
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    locator = Locator(documents, MAX - 2)
    coverage = [[0] * len(doc) for doc in documents]
    ambiguous, cut, not_full = [], 0, 0
    for r in rec:
        n = int(r["length"])
        ids = r["input_ids"].astype(np.int64)
        assert 3 <= n <= MAX and ids[0] == cls and ids[n - 1] == sep
        assert not np.any(ids[n:]) and not np.any(r["token_type_ids"]), "one segment: token_type_ids all 0"
        body = ids[1:n - 1].tolist()
        assert cls not in body and sep not in body, "no [SEP] in the middle"
        places = locator.runs(body)
        if not places:
            places = locator.cut(body)
            assert places and len(body) == MAX - 2, "neither whole sentences of one document nor a cut long sentence"
            cut += 1
        if len(places) == 1:
            d, i, j = places[0]
            for k in range(i, j):
                coverage[d][k] += 1
        else:
            ambiguous.append(places)  # the same text twice in the corpus (short closing sentences)
        d, i, j = places[0]
        doc = documents[d]
        not_full += j < len(doc) and j - i >= 1 and len(body) + len(doc[j]) <= MAX - 2 and places == locator.runs(body)
    for places in ambiguous:  # to the candidate still short of its coverage
        d, i, j = min(places, key=lambda p: min(coverage[p[0]][p[1]:p[2]]))
        for k in range(i, j):
            coverage[d][k] += 1
    wrong = [(d, k, c) for d, cov in enumerate(coverage) for k, c in enumerate(cov) if c != dupe_factor]
    assert not wrong, f"sentences covered other than {dupe_factor} times (document, sentence, times): {wrong[:10]}"
    return {"cut": cut, "not_full": not_full, "ambiguous": len(ambiguous)}


@pytest.fixture(scope="module")
def mlm_build(lines_corpus, tokenizer, tmp_path_factory):
    path, _ = lines_corpus
    out = tmp_path_factory.mktemp("mlm") / "data"
    cfg = DataConfig(objective="mlm", format="lines", max_seq_length=MAX, dupe_factor=2, dynamic_masking=True,
                     seed=21, chunk_bytes=150_000, holdout_fraction=0.1)
    summary = build_data([path], out, tokenizer, cfg, progress=False)
    return out, summary


def test_instances_are_whole_sentences_of_one_document(mlm_build, lines_corpus, tokenizer):
    out, summary = mlm_build
    path, documents = lines_corpus
    reference = _reference_documents(path, tokenizer)
    assert len(reference) == len(documents) == summary["documents"]  # the one-sentence document is kept
    rec = _records(out)
    assert "next_sentence_label" not in rec.dtype.names
    found = check_whole_sentences(rec, reference, tokenizer, dupe_factor=2)
    # Long sentences of the 18th and 19th century addresses are cut; and only a short target leaves
    # room for the document's next sentence (RoBERTa's packing, with BERT's 10% short sequences).
    assert found["cut"] == summary["counters"]["truncated"] > 0
    assert 0 < found["not_full"] <= summary["counters"]["short_target"]
    n = summary["instances"]
    assert abs(summary["short_seq_rate"] - 0.1) < 4 * math.sqrt(0.1 * 0.9 / n)
    assert found["ambiguous"] < n // 100


def test_summary_and_manifest(mlm_build, lines_corpus, tokenizer):
    out, summary = mlm_build
    rec = _records(out)
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["objective"] == manifest["data_config"]["objective"] == summary["objective"] == "mlm"
    assert summary["instances"] == len(rec) and summary["tokens"] == int(rec["length"].sum())
    assert summary["padding_share"] == round(1 - rec["length"].sum() / (len(rec) * MAX), 4)
    # Packed: under half the padding of one sentence per instance.
    lengths = [min(len(x), MAX - 2) + 2 for doc in _reference_documents(lines_corpus[0], tokenizer) for x in doc]
    assert 0 < summary["padding_share"] < 0.5 * (1 - np.mean(lengths) / MAX)
    assert not [k for k in summary if k.startswith("nsp")]
    assert not [k for k in summary["counters"] if "random_next" in k]
    assert "documents_with_fewer_than_2_sentences" not in summary["skipped"]
    data = PretrainingData(out)
    assert data.objective == "mlm" and not data.nsp
    batch = next(pretraining_batches(data, 32, seed=0))
    assert "next_sentence_label" not in batch and not batch["token_type_ids"].any()
    n = batch["attention_mask"].sum(1)
    pos = batch["masked_positions"]
    assert ((pos == 0) | ((pos >= 1) & (pos < (n - 1)[:, None]))).all()  # dynamic masks inside the text


@pytest.mark.parametrize("masking", ["static", "whole-word"])
def test_static_and_whole_word_masks_on_whole_sentences(masking, lines_corpus, tokenizer, tmp_path):
    """Put the labels back: the instances are whole sentences again; masks take 15% of each."""
    path, _ = lines_corpus
    wwm = masking == "whole-word"
    cfg = DataConfig(objective="mlm", format="lines", max_seq_length=MAX, dupe_factor=1, seed=5,
                     whole_word_mask=wwm, chunk_bytes=150_000)
    summary = build_data([path], tmp_path / "d", tokenizer, cfg, progress=False)
    rec = _records(tmp_path / "d")
    restored = rec.copy()
    budgets = []
    for r in restored:
        k = int((r["masked_positions"] > 0).sum())
        pos = r["masked_positions"][:k]
        n = int(r["length"])
        assert k and (pos >= 1).all() and (pos < n - 1).all()
        budget = min(cfg.resolved().max_predictions_per_seq, max(1, round(n * 0.15)))
        assert k == budget if not wwm else k <= budget
        if wwm:  # a masked ## piece's word is masked from its start
            cont = [tokenizer.ids_to_tokens[t].startswith("##") for t in r["masked_lm_labels"][:k]]
            for p, c in zip(pos, cont):
                assert not c or p - 1 in pos or p == 1
        r["input_ids"][pos] = r["masked_lm_labels"][:k]
        budgets.append(k)
    check_whole_sentences(restored, _reference_documents(path, tokenizer), tokenizer, dupe_factor=1)
    assert summary["masked"] == sum(budgets)


def test_same_bytes_for_1_and_2_workers_and_after_resume(shared_data, tokenizer, tmp_path, monkeypatch):
    """The real pipeline on prose (text format, the sentence splitter): output independent of the
    workers and of an interruption; no random-next sample is kept for mlm."""
    from bertctl.data import build as build_module

    def no_pool(*args, **kwargs):
        raise AssertionError("the random-next sample is built for mlm data")

    monkeypatch.setattr(build_module.ExcerptReservoir, "offer", no_pool)
    inputs = [shared_data / "corpus" / "inaugural", shared_data / "corpus" / "gutenberg" / "blake-poems.txt"]
    cfg = DataConfig(objective="mlm", format="text", pattern="*.txt", dupe_factor=2, seed=3, chunk_bytes=100_000,
                     shard_size=700)
    chunks = list(make_chunks(read_documents(list_inputs(inputs, "*.txt", "text"), "text", ReadStats()),
                              cfg.resolved()))
    assert len(chunks) > 4 and not any(c.excerpts for c in chunks)
    s1 = build_data(inputs, tmp_path / "w1", tokenizer, cfg, workers=1, progress=False)
    s2 = build_data(inputs, tmp_path / "w2", tokenizer, cfg, workers=2, progress=False)
    a, b = _dir_bytes(tmp_path / "w1"), _dir_bytes(tmp_path / "w2")
    assert s1["shards"] > 4 and a.keys() == b.keys() and all(a[k] == b[k] for k in a)

    class Stop(Exception):
        pass

    done = []

    def stop_after_two(record):
        done.append(record)
        if len(done) == 2:
            raise Stop

    with pytest.raises(Stop):
        build_data(inputs, tmp_path / "cut", tokenizer, cfg, workers=2, progress=False, on_unit_done=stop_after_two)
    with pytest.raises(BertctlError, match="different data_config"):
        build_data(inputs, tmp_path / "cut", tokenizer, DataConfig(**{**cfg.to_dict(), "objective": "mlm-nsp"}),
                   resume=True, progress=False)
    resumed = build_data(inputs, tmp_path / "cut", tokenizer, cfg, workers=1, resume=True, progress=False)
    assert resumed["resumed_units"] >= 2
    c = _dir_bytes(tmp_path / "cut")
    assert c.keys() == a.keys() and all(a[k] == c[k] for k in a)


def _dir_bytes(out: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file()}


# The default objective's shards, recorded with the code before --objective existed (same inputs,
# configs and vocabulary): adding the objective must not change a byte of them.
MLM_NSP_SHA256 = {
    "static": {"train": ["bccfe5862bd58abdba84e036452290288513717ddd9637f7f95c6940d23fd140",
                         "6148ae81130babbdde73b71b965a881beeaf9cc17658a596838a0c7811f8c690"],
               "eval": ["ad51d00adf0e779e738055b50e096ef5ff359effb623c9d0df27fa148953582d"]},
    "dynamic": {"train": ["35dea8e88c62af252bbd6324631f50f95f0923434700d05534ab1dd460006a7c",
                          "e401a15b15be935fdf2c9c6fb6866e38d11ca27d4316c0a0ff57df832baef9e2"]},
    "wwm": {"train": ["230e49248e67a3b9e5da149b5929048cbc1ed194d717d2eb11ef2e234520332a",
                      "d0700130c52f334e400b41df9264e87dfeb1293199bb59e2b766934f5775cf4a"]},
}
MLM_NSP_CONFIGS = {
    "static": dict(dupe_factor=2, holdout_fraction=0.2, seed=11),
    "dynamic": dict(dynamic_masking=True, seed=12),
    "wwm": dict(whole_word_mask=True, dupe_factor=1, max_seq_length=64, seed=13),
}


@pytest.mark.parametrize("name", sorted(MLM_NSP_CONFIGS))
def test_mlm_nsp_shards_unchanged(name, shared_data, tokenizer, tmp_path):
    files = sorted((shared_data / "corpus" / "inaugural").glob("*.txt"))[:10]
    out = tmp_path / "d"
    summary = build_data([str(f) for f in files], out, tokenizer,
                         DataConfig(format="text", chunk_bytes=40_000, **MLM_NSP_CONFIGS[name]), progress=False)
    manifest = json.loads((out / "manifest.json").read_text())
    got = {s: [sh["sha256"] for sh in v["shards"]] for s, v in manifest["splits"].items()}
    assert got == MLM_NSP_SHA256[name]
    for shard in manifest["splits"]["train"]["shards"]:  # the manifest's hashes are the files' own
        assert hashlib.sha256((out / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]
    assert manifest["objective"] == summary["objective"] == "mlm-nsp"
    assert "nsp_random_fraction" in summary and "next_sentence_label" in np.load(out / shard["file"]).dtype.names


def test_cli_rejects_an_unknown_objective(minilm_vocab, shared_data, tmp_path):
    out = tmp_path / "x"
    proc = subprocess.run([sys.executable, "-m", "bertctl", "build-data", "--vocab", str(minilm_vocab), "--objective",
                           "nsp", "--no-progress", "-o", str(out), str(shared_data / "corpus" / "inaugural")],
                          capture_output=True, text=True, env=ENV, timeout=120)
    assert proc.returncode == 2 and proc.stdout == "" and not out.exists()
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("bertctl: error: --objective:"), proc.stderr
    assert "mlm-nsp, mlm" in proc.stderr


def test_cli_help_shows_the_default_objective():
    from typer.testing import CliRunner

    from bertctl.cli.app import app

    result = CliRunner().invoke(app, ["build-data", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--objective" in result.output and "[default: mlm-nsp]" in result.output


# ----------------------------------------------------------------------------- pretraining on mlm data


@pytest.fixture(scope="module")
def small_tokenizer(shared_data):
    files = [shared_data / "corpus" / "inaugural" / f"{n}.txt" for n in PRETRAIN_FILES]
    return BertTokenizer(small_vocab([f.read_text(encoding="utf-8", errors="replace") for f in files])), files


@pytest.fixture(scope="module")
def mlm_data(small_tokenizer, tmp_path_factory) -> Path:
    tok, files = small_tokenizer
    out = tmp_path_factory.mktemp("mlm-pretrain-data") / "data"
    build_data([str(f) for f in files], out, tok,
               DataConfig(objective="mlm", format="text", max_seq_length=64, dupe_factor=3, holdout_fraction=0.25,
                          seed=3), progress=False)
    return out


def _config(data: Path, out: Path, **kw):
    from bertctl.config import PretrainConfig

    base = dict(output=str(out), data=str(data), model_size="tiny", batch_size=16, lr=2e-3, max_steps=30,
                device="cpu", log_every=5, eval_every=10, eval_batches=4, show_progress=False, warmup_fraction=0.1,
                save_minutes=None)
    return PretrainConfig.of(**{**base, **kw})


@pytest.fixture(scope="module")
def mlm_run(mlm_data, tmp_path_factory):
    from bertctl.train.pretrain import pretrain

    out = tmp_path_factory.mktemp("mlm-run") / "run"
    return out, pretrain(_config(mlm_data, out, save_every=10))


def test_pretraining_on_mlm_data_learns_without_nsp(mlm_run):
    out, summary = mlm_run
    assert summary["objective"] == "mlm" and summary["steps"] == 30 and summary["stopped"] is None
    ev0, ev1 = summary["eval_start"], summary["eval_end"]
    assert ev1["mlm_loss"] < ev0["mlm_loss"] - 1.0 and ev1["mlm_acc"] > ev0["mlm_acc"], (ev0, ev1)
    assert ev1["perplexity"] == pytest.approx(math.exp(ev1["mlm_loss"]))
    assert summary["train"]["loss"] == summary["train"]["mlm_loss"]
    text = (out / "metrics.jsonl").read_text()
    records = [json.loads(x) for x in text.splitlines()]
    kinds = Counter(r["event"] for r in records)
    assert kinds["train"] == 6 and kinds["eval"] == 4  # steps 0, 10, 20, 30
    assert "nsp" not in text, "no NSP metric anywhere in metrics.jsonl"
    assert not [k for part in ("train", "eval_start", "eval_end") for k in summary[part] if "nsp" in k]
    config = next(r for r in records if r["event"] == "config")
    assert config["configs"]["objective"] == "mlm"
    assert (out / "curves.png").stat().st_size > 1000


def test_progress_text_has_no_nsp():
    from bertctl.train.pretrain import PretrainingObjective

    rec = {"loss": 2.0, "mlm_acc": 0.25, "lr": 1e-3, "seq_per_s": 10.0, "tokens_per_s": 1000.0}
    text = PretrainingObjective(nsp=False).info(rec)
    assert "mlm_acc 0.250" in text and "nsp" not in text
    assert "nsp_acc 0.600" in PretrainingObjective().info({**rec, "nsp_acc": 0.6})


def test_export_is_a_masked_lm_that_transformers_loads(mlm_run):
    import transformers

    from bertctl.checkpoints.hf import load_pretrained
    from bertctl.model import BertForMaskedLM
    from bertctl.runtime import resolve

    model_dir = mlm_run[0] / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["BertForMaskedLM"]
    hf, info = transformers.BertForMaskedLM.from_pretrained(model_dir, output_loading_info=True,
                                                            attn_implementation="eager")
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    hf = hf.double().eval()
    ours = load_pretrained(BertForMaskedLM, model_dir, runtime=resolve("cpu", attn="sdpa", kernels="torch")).double().eval()
    tok = transformers.BertTokenizer.from_pretrained(model_dir)
    enc = tok(["We the people hold these truths.", "Ask not what your country can do for you, ask what you can do."],
              padding=True, return_tensors="pt")
    with torch.no_grad():
        a = ours(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"]).prediction_logits
        b = hf(**enc).logits
    mask = enc["attention_mask"].bool()
    assert a.dtype == b.dtype == torch.float64
    torch.testing.assert_close(a[mask], b[mask], atol=1e-9, rtol=1e-9)


def test_export_is_accepted_by_fine_tuning_and_embedding(mlm_run):
    """Fine-tuning heads start fresh (the pooler too: masked LM trains none); the encoder is the trained one."""
    from safetensors.torch import load_file

    from bertctl.checkpoints.hf import load_pretrained
    from bertctl.inference.backends import load_encoder
    from bertctl.model import BertForSequenceClassification, BertForTokenClassification

    model_dir = mlm_run[0] / "model"
    saved = load_file(model_dir / "model.safetensors")
    assert not [k for k in saved if "pooler" in k or "seq_relationship" in k]
    for cls in (BertForSequenceClassification, BertForTokenClassification):
        model = load_pretrained(cls, model_dir, fresh_heads=True, num_labels=3)
        w = model.bert.encoder.layer[1].output.dense.weight
        assert torch.equal(w, saved["bert.encoder.layer.1.output.dense.weight"])
    with pytest.raises(BertctlError, match="missing bert.pooler"):  # without fresh_heads nothing is made up
        load_pretrained(BertForSequenceClassification, model_dir)
    encoder = load_encoder(model_dir, torch.device("cpu"))
    assert torch.equal(encoder.model.embeddings.word_embeddings.weight, saved["bert.embeddings.word_embeddings.weight"])


def test_resume_on_mlm_data_is_bit_identical(mlm_run, mlm_data, tmp_path):
    from safetensors.torch import load_file

    from bertctl import rundir
    from bertctl.checkpoints import training
    from bertctl.train.pretrain import pretrain

    out, _ = mlm_run
    cut = tmp_path / "run"
    shutil.copytree(out, cut)
    for c in training.list_checkpoints(cut):
        if c.step > 10:
            shutil.rmtree(c.path)
    shutil.rmtree(cut / "model")
    (cut / rundir.MARKER).unlink()  # as the run was at step 10: not finished
    summary = pretrain(_config(mlm_data, cut, save_every=10, resume=True))
    assert summary["start_step"] == 10 and summary["steps"] == 30 and summary["objective"] == "mlm"
    a, b = load_file(out / "model" / "model.safetensors"), load_file(cut / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_eval_data_of_another_objective_is_refused(mlm_data, data_dir, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bertctl", "pretrain", "--data", str(mlm_data), "--eval-data",
                           str(data_dir), "--output", str(tmp_path / "run"), "--model-size", "tiny", "--batch-size",
                           "16", "--device", "cpu", "--no-progress", "--max-steps", "2"],
                          capture_output=True, text=True, env=ENV, timeout=300)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("bertctl: error: --eval-data") and "--objective mlm-nsp" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_mlm_phase_from_an_mlm_nsp_run(mlm_data, data_dir, tmp_path):
    """Continued pretraining across objectives: the encoder and MLM head carry over, the NSP head is dropped;
    the optimizer state cannot carry over."""
    from safetensors.torch import load_file

    from bertctl.train.pretrain import pretrain

    first = tmp_path / "nsp"
    s1 = pretrain(_config(data_dir, first, max_steps=4, eval_every=None, eval_batches=1))
    assert s1["objective"] == "mlm-nsp" and "nsp_acc" in s1["eval_end"]
    with pytest.raises(BertctlError, match="--keep-optimizer"):
        pretrain(_config(mlm_data, tmp_path / "kept", init_from=str(first), keep_optimizer=True, max_steps=2))
    second = tmp_path / "mlm"
    s2 = pretrain(_config(mlm_data, second, init_from=str(first), max_steps=2, lr=1e-9, warmup_fraction=0.0,
                          eval_every=None, eval_batches=1))
    assert s2["objective"] == "mlm"
    a, b = load_file(first / "model" / "model.safetensors"), load_file(second / "model" / "model.safetensors")
    assert "cls.seq_relationship.weight" in a and "cls.seq_relationship.weight" not in b
    # lr 1e-9 for 2 steps: the weights are those of the first run (up to Adam's first steps of 1e-9).
    torch.testing.assert_close(b["bert.encoder.layer.0.attention.self.query.weight"],
                               a["bert.encoder.layer.0.attention.self.query.weight"], atol=1e-7, rtol=0)
