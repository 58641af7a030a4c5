"""The Hugging Face example scripts' fine-tuning, as one script a user would run: the baseline of
``finetune_vs_hf.py``.

Each sub-command follows its example script in ``transformers/examples/pytorch`` and feeds
``transformers.Trainer`` the way that script does, with plain Python lists instead of the
``datasets`` library (not installed on the GPU machine):

- ``glue`` (run_glue.py): a TSV with a header, named text and label columns (labels sorted as
  strings, as ``label_list.sort()``; with ``--regression`` one output and float labels, as for STS-B),
  ``tokenizer(a[, b], truncation=True, max_length=128)``,
  train, ``save_model``, predict on dev.
- ``ner`` (run_ner.py): CoNLL-2003 files, ``is_split_into_words``, the label on the first piece of
  each word only (``label_all_tokens=False``), evaluation on valid after every epoch with
  ``load_best_model_at_end`` on entity F1, then the test file.
- ``squad`` (run_qa.py + utils_qa.py): question first, ``truncation="only_second"``, 384-token
  windows with stride 128, answers outside a window labelled at [CLS], post-processing with
  n-best 20 and max answer length 30 over all windows of a question (v1.1, no null answer).

Settings that the scripts leave to the user are set as bertctl's defaults (recorded in
``metrics.json``): dynamic padding to a multiple of 8 (the scripts' ``--pad_to_max_length False``,
their faster setting), evaluation batch 128, a checkpoint at each epoch end (``save_total_limit
1``), the training recipe from the flags. Metrics use ``bertctl.tasks.metrics`` (the official
scorers' rules), the same code that scores bertctl's runs.

Writes to ``--output``: ``metrics.json`` (last, as bertctl does), the predictions
(``predictions_dev.tsv`` in bertctl's layout, ``predictions_test.txt``, ``predictions.json``) and
the model.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from pathlib import Path

PROCESS_START = time.time()
ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(ROOT))  # bertctl.tasks.metrics: plain Python and numpy

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bertctl.tasks.metrics import (accuracy, binary_f1, conlleval, matthews_corrcoef, pearson,  # noqa: E402
                                   spearman, squad_v1_evaluate)


# ------------------------------------------------------------------------------ shared


def training_args(a, out: Path, **extra):
    """TrainingArguments with the recipe of the flags, for this version of transformers
    (4.x: warmup_ratio, group_by_length; 5.x: a fractional warmup_steps, train_sampling_strategy)."""
    import inspect

    from transformers import TrainingArguments

    params = inspect.signature(TrainingArguments).parameters
    kw = dict(output_dir=str(out / "checkpoints"), per_device_train_batch_size=a.batch_size,
              per_device_eval_batch_size=a.eval_batch_size, learning_rate=a.lr, num_train_epochs=a.epochs,
              weight_decay=a.weight_decay, adam_epsilon=a.adam_eps, adam_beta1=0.9, adam_beta2=0.999,
              max_grad_norm=a.max_grad_norm, lr_scheduler_type="linear", bf16=a.bf16, seed=a.seed,
              logging_steps=50, report_to="none", save_strategy=a.save_strategy, save_total_limit=1,
              dataloader_num_workers=0, disable_tqdm=True)
    if a.max_steps:
        kw["max_steps"] = a.max_steps
    kw["warmup_ratio" if "warmup_ratio" in params else "warmup_steps"] = a.warmup
    if a.group_by_length:
        if "group_by_length" in params:
            kw["group_by_length"] = True
        else:
            kw["train_sampling_strategy"] = "group_by_length"
    kw["eval_strategy"] = "no"
    if a.device == "cpu":
        kw["use_cpu" if "use_cpu" in params else "no_cuda"] = True
    kw.update(extra)
    if "eval_strategy" not in params:  # transformers < 4.41
        kw["evaluation_strategy"] = kw.pop("eval_strategy")
    unknown = sorted(set(kw) - set(params))
    if unknown:
        raise SystemExit(f"this transformers has no TrainingArguments {unknown}")
    return TrainingArguments(**kw)


def make_trainer(model, args, train, tokenizer, collator, eval_dataset=None, compute_metrics=None):
    import inspect

    from transformers import Trainer

    kw = dict(model=model, args=args, train_dataset=train, eval_dataset=eval_dataset, data_collator=collator,
              compute_metrics=compute_metrics)
    kw["processing_class" if "processing_class" in inspect.signature(Trainer).parameters else "tokenizer"] = tokenizer
    return Trainer(**kw)


def settings(a, **task) -> dict:
    import transformers

    return {"recipe": {k: getattr(a, k) for k in ("epochs", "lr", "batch_size", "eval_batch_size", "warmup",
                                                  "weight_decay", "adam_eps", "max_grad_norm", "seed", "bf16",
                                                  "group_by_length", "max_steps")},
            "padding": "dynamic, multiple of 8", "save_strategy": a.save_strategy, **task,
            "transformers": transformers.__version__, "torch": torch.__version__,
            "device": torch.cuda.get_device_name(0) if a.device == "cuda" else "cpu"}


def write_json(path: Path, obj) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def finish(a, out: Path, metrics: dict, train_output) -> None:
    metrics.update(train_runtime=train_output.metrics.get("train_runtime"),
                   train_samples_per_second=train_output.metrics.get("train_samples_per_second"),
                   train_steps=train_output.global_step, seconds_in_process=time.time() - PROCESS_START)
    write_json(out / "metrics.json", metrics)
    print(json.dumps({k: v for k, v in metrics.items() if not isinstance(v, dict)}), flush=True)


# ------------------------------------------------------------------------------ glue (run_glue.py)


def read_tsv(path: Path, columns: list[str]) -> list[list[str]]:
    """Rows of a headed TSV, unquoted as GLUE's files are (a tab splits, quotes are text)."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE)
        header = next(reader)
        missing = [c for c in columns if c not in header]
        if missing:
            raise SystemExit(f"{path}:1: no column(s) {missing} in the header {header}")
        idx = [header.index(c) for c in columns]
        return [[row[i] for i in idx] for row in reader if any(row)]


def glue(a) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding, set_seed

    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    cols = [a.text_column] + ([a.text_pair_column] if a.text_pair_column else []) + [a.label_column]
    train_rows, dev_rows = read_tsv(Path(a.train), cols), read_tsv(Path(a.dev), cols)
    set_seed(a.seed)  # run_glue seeds before building the model (the head's initialisation)
    tokenizer = AutoTokenizer.from_pretrained(a.model, use_fast=True)
    if a.regression:  # run_glue's is_regression: one output, float labels (the model's MSE loss)
        labels = None
        model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=1)
    else:
        labels = sorted({r[-1] for r in train_rows})  # run_glue: label_list = unique(label); sort()
        label_id = {l: i for i, l in enumerate(labels)}
        model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=len(labels), label2id=label_id,
                                                                   id2label=dict(enumerate(labels)))

    def encode(rows):
        texts = ([r[0] for r in rows],) + (([r[1] for r in rows],) if a.text_pair_column else ())
        enc = tokenizer(*texts, truncation=True, max_length=a.max_seq_length)
        return [{"input_ids": i, "token_type_ids": t, "attention_mask": m,
                 "labels": float(r[-1]) if a.regression else label_id[r[-1]]}
                for i, t, m, r in zip(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"], rows)]

    train, dev = encode(train_rows), encode(dev_rows)
    trainer = make_trainer(model, training_args(a, out), train, tokenizer,
                           DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8))
    result = trainer.train()
    trainer.save_model(str(out / "model"))
    logits = trainer.predict(dev).predictions
    gold = [d["labels"] for d in dev]
    with open(out / "predictions_dev.tsv", "w", encoding="utf-8") as f:  # bertctl's layout
        f.write("index\tprediction\tlabel\tsource\n")
        if a.regression:  # run_glue: np.squeeze(predictions); written as bertctl writes scores
            preds = [float(f"{x:.6f}") for x in np.asarray(logits, dtype=np.float64)[:, 0]]
            for i, (p, r) in enumerate(zip(preds, dev_rows)):
                f.write(f"{i}\t{p:.6f}\t{float(r[-1]):g}\t{a.dev}:{i + 2}\n")
        else:
            preds = np.argmax(logits, -1)
            for i, (p, r) in enumerate(zip(preds, dev_rows)):
                f.write(f"{i}\t{labels[int(p)]}\t{r[-1]}\t{a.dev}:{i + 2}\n")
    if a.regression:
        metrics = {"task": "glue", "pearson": pearson(preds, gold), "spearmanr": spearman(preds, gold)}
    else:
        metrics = {"task": "glue", "accuracy": accuracy(preds, gold)}
        if len(labels) == 2:
            metrics.update(f1=binary_f1(preds, gold), matthews_corrcoef=matthews_corrcoef(preds, gold))
    metrics.update(train_examples=len(train), dev_examples=len(dev),
                   settings=settings(a, max_seq_length=a.max_seq_length, labels=labels))
    finish(a, out, metrics, result)


# ------------------------------------------------------------------------------ ner (run_ner.py)


def read_conll(path: Path) -> list[tuple[list[str], list[str]]]:
    """Sentences (words, tags) of a CoNLL-2003 file: the first column is the word, the last the tag;
    -DOCSTART- lines and blank lines separate sentences."""
    sentences, words, tags = [], [], []
    for line in open(path, encoding="utf-8"):
        cells = line.split()
        if not cells or cells[0] == "-DOCSTART-":
            if words:
                sentences.append((words, tags))
                words, tags = [], []
            continue
        words.append(cells[0])
        tags.append(cells[-1])
    if words:
        sentences.append((words, tags))
    return sentences


def ner(a) -> None:
    from transformers import (AutoModelForTokenClassification, AutoTokenizer, DataCollatorForTokenClassification,
                              set_seed)

    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    d = Path(a.data_dir)
    train_s, valid_s, test_s = (read_conll(d / f"{n}.txt") for n in ("train", "valid", "test"))
    labels = sorted({t for data in (train_s, valid_s, test_s) for _, tags in data for t in tags})
    label_id = {l: i for i, l in enumerate(labels)}
    set_seed(a.seed)
    tokenizer = AutoTokenizer.from_pretrained(a.model, use_fast=True)
    model = AutoModelForTokenClassification.from_pretrained(a.model, num_labels=len(labels), label2id=label_id,
                                                            id2label=dict(enumerate(labels)))

    def encode(data):
        """tokenize_and_align_labels: -100 on special tokens and on every piece after a word's first."""
        enc = tokenizer([w for w, _ in data], is_split_into_words=True, truncation=True, max_length=a.max_seq_length)
        rows, word_ids = [], []
        for k, (_, tags) in enumerate(data):
            wids = enc.word_ids(k)
            lab, prev = [], None
            for w in wids:
                lab.append(-100 if w is None or w == prev else label_id[tags[w]])
                prev = w
            rows.append({"input_ids": enc["input_ids"][k], "token_type_ids": enc["token_type_ids"][k],
                         "attention_mask": enc["attention_mask"][k], "labels": lab})
            word_ids.append(wids)
        return rows, word_ids

    train, _ = encode(train_s)
    valid, _ = encode(valid_s)
    test, test_wids = encode(test_s)

    def compute_metrics(p):
        """run_ner's: predictions where the label is not -100, scored by entity (conlleval rules)."""
        preds = np.argmax(p.predictions, axis=2)
        gold = [[labels[l] for l in row if l != -100] for row in p.label_ids]
        pred = [[labels[q] for q, l in zip(prow, row) if l != -100] for prow, row in zip(preds, p.label_ids)]
        return {"f1": conlleval(gold, pred)["f1"]}

    args = training_args(a, out, save_strategy="epoch", load_best_model_at_end=True, metric_for_best_model="f1",
                         greater_is_better=True, eval_strategy="epoch")
    trainer = make_trainer(model, args, train, tokenizer, DataCollatorForTokenClassification(tokenizer,
                                                                                             pad_to_multiple_of=8),
                           eval_dataset=valid, compute_metrics=compute_metrics)
    result = trainer.train()
    trainer.save_model(str(out / "model"))
    valid_f1 = trainer.state.best_metric
    best_epoch = next((round(h["epoch"]) for h in trainer.state.log_history if h.get("eval_f1") == valid_f1), None)
    logits = trainer.predict(test).predictions
    tags = []
    for lg, wids, (words, _) in zip(logits, test_wids, test_s):
        pred, prev = ["O"] * len(words), None  # words cut by truncation stay "O"
        for pos, w in enumerate(wids):
            if w is not None and w != prev:
                pred[w] = labels[int(np.argmax(lg[pos]))]
            prev = w
        tags.append(pred)
    with open(out / "predictions_test.txt", "w", encoding="utf-8") as f:
        for (words, gold), pred in zip(test_s, tags):
            f.write("".join(f"{w} {g} {p}\n" for w, g, p in zip(words, gold, pred)) + "\n")
    m = conlleval([g for _, g in test_s], tags)
    metrics = {"task": "ner", "test_f1": m["f1"], "test_precision": m["precision"], "test_recall": m["recall"],
               "valid_f1": valid_f1, "best_epoch": best_epoch, "train_sentences": len(train),
               "settings": settings(a, max_seq_length=a.max_seq_length, selection="best epoch on valid f1")}
    finish(a, out, metrics, result)


# ------------------------------------------------------------------------------ squad (run_qa.py)


def read_squad(path: Path, articles: str | None) -> list[dict]:
    """The articles of a SQuAD JSON, optionally those named in SPLIT.json:KEY."""
    data = json.loads(Path(path).read_text(encoding="utf-8"))["data"]
    if articles:
        split, key = articles.rsplit(":", 1)
        titles = set(json.loads(Path(split).read_text(encoding="utf-8"))[key])
        data = [art for art in data if art["title"] in titles]
    return data


def questions(data: list[dict]) -> list[dict]:
    return [{"id": q["id"], "question": q["question"], "context": p["context"], "answers": q["answers"]}
            for art in data for p in art["paragraphs"] for q in p["qas"]]


def squad(a) -> None:
    import collections

    from transformers import AutoModelForQuestionAnswering, AutoTokenizer, DataCollatorWithPadding, set_seed

    out = Path(a.output)
    out.mkdir(parents=True, exist_ok=True)
    train_q = questions(read_squad(Path(a.train), a.train_articles))
    dev_data = read_squad(Path(a.dev), a.dev_articles)
    dev_q = questions(dev_data)
    set_seed(a.seed)
    tokenizer = AutoTokenizer.from_pretrained(a.model, use_fast=True)
    model = AutoModelForQuestionAnswering.from_pretrained(a.model)

    def tokenize(qs):
        return tokenizer([q["question"].lstrip() for q in qs], [q["context"] for q in qs], truncation="only_second",
                         max_length=a.max_seq_length, stride=a.doc_stride, return_overflowing_tokens=True,
                         return_offsets_mapping=True)

    def prepare_train_features(qs):
        enc = tokenize(qs)
        rows = []
        for i, offsets in enumerate(enc["offset_mapping"]):
            ids = enc["input_ids"][i]
            cls = ids.index(tokenizer.cls_token_id)
            seq = enc.sequence_ids(i)
            answer = qs[enc["overflow_to_sample_mapping"][i]]["answers"][0]
            start_char = answer["answer_start"]
            end_char = start_char + len(answer["text"])
            ts = 0
            while seq[ts] != 1:
                ts += 1
            te = len(ids) - 1
            while seq[te] != 1:
                te -= 1
            if not (offsets[ts][0] <= start_char and offsets[te][1] >= end_char):
                start, end = cls, cls  # the answer is not in this window
            else:
                while ts < len(offsets) and offsets[ts][0] <= start_char:
                    ts += 1
                start = ts - 1
                while offsets[te][1] >= end_char:
                    te -= 1
                end = te + 1
            rows.append({"input_ids": ids, "token_type_ids": enc["token_type_ids"][i],
                         "attention_mask": enc["attention_mask"][i], "start_positions": start, "end_positions": end})
        return rows

    def prepare_validation_features(qs):
        enc = tokenize(qs)
        rows, meta = [], []
        for i in range(len(enc["input_ids"])):
            seq = enc.sequence_ids(i)
            offsets = [o if seq[k] == 1 else None for k, o in enumerate(enc["offset_mapping"][i])]
            rows.append({"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                         "attention_mask": enc["attention_mask"][i]})
            meta.append((enc["overflow_to_sample_mapping"][i], offsets))
        return rows, meta

    train = prepare_train_features(train_q)
    dev, dev_meta = prepare_validation_features(dev_q)
    trainer = make_trainer(model, training_args(a, out), train, tokenizer,
                           DataCollatorWithPadding(tokenizer, pad_to_multiple_of=8))
    result = trainer.train()
    trainer.save_model(str(out / "model"))
    start_logits, end_logits = trainer.predict(dev).predictions

    # utils_qa.postprocess_qa_predictions, v1.1: the best-scoring valid span over all windows.
    features_of = collections.defaultdict(list)
    for fi, (qi, _) in enumerate(dev_meta):
        features_of[qi].append(fi)
    n_best, max_len = a.n_best_size, a.max_answer_length
    predictions = {}
    for qi, q in enumerate(dev_q):
        cands = []
        for fi in features_of[qi]:
            sl, el, offsets = start_logits[fi], end_logits[fi], dev_meta[fi][1]
            for s in np.argsort(sl)[-1: -n_best - 1: -1].tolist():
                for e in np.argsort(el)[-1: -n_best - 1: -1].tolist():
                    if s >= len(offsets) or e >= len(offsets) or offsets[s] is None or offsets[e] is None:
                        continue
                    if e < s or e - s + 1 > max_len:
                        continue
                    cands.append((float(sl[s] + el[e]), offsets[s][0], offsets[e][1]))
        cands.sort(key=lambda c: c[0], reverse=True)
        text = q["context"][cands[0][1]: cands[0][2]] if cands else ""
        predictions[q["id"]] = text if text else "empty"
    write_json(out / "predictions.json", predictions)
    m = squad_v1_evaluate(dev_data, predictions)
    metrics = {"task": "squad-v1.1", "exact_match": m["exact_match"], "f1": m["f1"], "train_questions": len(train_q),
               "train_features": len(train), "dev_questions": len(dev_q),
               "settings": settings(a, max_seq_length=a.max_seq_length, doc_stride=a.doc_stride,
                                    n_best_size=n_best, max_answer_length=max_len)}
    finish(a, out, metrics, result)


# ------------------------------------------------------------------------------ command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--model", required=True, help="pretrained model directory")
    common.add_argument("--output", required=True, help="output directory")
    common.add_argument("--epochs", type=float, default=3.0, help="default 3")
    common.add_argument("--lr", type=float, default=5e-5, help="default 5e-5")
    common.add_argument("--batch-size", type=int, default=32, help="default 32")
    common.add_argument("--eval-batch-size", type=int, default=128, help="default 128")
    common.add_argument("--warmup", type=float, default=0.1, help="warm-up fraction of the steps (default 0.1)")
    common.add_argument("--weight-decay", type=float, default=0.01, help="default 0.01")
    common.add_argument("--adam-eps", type=float, default=1e-6, help="default 1e-6")
    common.add_argument("--max-grad-norm", type=float, default=1.0, help="default 1.0")
    common.add_argument("--seed", type=int, default=42, help="default 42")
    common.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: the epochs; default 0)")
    common.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                        help="cuda or cpu (default: cuda when present)")
    common.add_argument("--no-bf16", action="store_true", help="fp32 on GPU (default: bf16 autocast on GPU)")
    common.add_argument("--group-by-length", action="store_true", help="length-grouped batches (default: random)")
    common.add_argument("--save-strategy", default="epoch", choices=("epoch", "no"),
                        help="checkpoints (default: epoch, one kept)")
    g = sub.add_parser("glue", parents=[common], help="sentence(-pair) classification (run_glue.py)")
    g.add_argument("--train", required=True)
    g.add_argument("--dev", required=True)
    g.add_argument("--text-column", required=True)
    g.add_argument("--text-pair-column", default=None, help="default: none (single sentences)")
    g.add_argument("--label-column", required=True)
    g.add_argument("--regression", action="store_true", help="the label is a number: one output, MSE loss "
                                                              "(default: classes)")
    g.add_argument("--max-seq-length", type=int, default=128, help="default 128")
    n = sub.add_parser("ner", parents=[common], help="CoNLL-2003 NER (run_ner.py)")
    n.add_argument("--data-dir", required=True, help="folder with train.txt, valid.txt, test.txt")
    n.add_argument("--max-seq-length", type=int, default=128, help="default 128")
    q = sub.add_parser("squad", parents=[common], help="SQuAD v1.1 (run_qa.py)")
    q.add_argument("--train", required=True)
    q.add_argument("--dev", required=True)
    q.add_argument("--train-articles", default=None, help="SPLIT.json:KEY (default: all articles)")
    q.add_argument("--dev-articles", default=None, help="SPLIT.json:KEY (default: all articles)")
    q.add_argument("--max-seq-length", type=int, default=384, help="default 384")
    q.add_argument("--doc-stride", type=int, default=128, help="default 128")
    q.add_argument("--n-best-size", type=int, default=20, help="default 20")
    q.add_argument("--max-answer-length", type=int, default=30, help="default 30")
    a = p.parse_args(argv)
    a.bf16 = a.device.startswith("cuda") and not a.no_bf16
    {"glue": glue, "ner": ner, "squad": squad}[a.command](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
