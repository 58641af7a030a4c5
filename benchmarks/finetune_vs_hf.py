"""bertctl fine-tuning against Hugging Face's Trainer, same weights, data, recipe and GPU.

For each task both sides start from the same pretrained directory (all-MiniLM-L6-v2 by
default), use the same hyper-parameters (batch 32, lr, 10% linear warm-up then linear decay,
AdamW with weight decay 0.01 and eps 1e-6, grad-norm clip 1.0, bf16 autocast, seed) and the
same metric code (bertctl.tasks.metrics, which re-implements the official scorers), so the
difference left is the implementation: bertctl's loop (length-grouped dynamic padding, no host
sync per step) against ``transformers.Trainer`` fed as the example scripts feed it
(run_glue.py / run_ner.py / run_qa.py logic, with dynamic padding, its faster setting).

- sst2: full SST-2 train set, 1 epoch; dev accuracy.
- conll: CoNLL-2003, 3 epochs, epoch chosen on valid F1; test entity F1 (conlleval rules).
- squad: SQuAD v1.1 dev split by article (split.json): train on `train` articles 2 epochs,
  F1/EM on `eval` articles.

Throughput is training examples (windows for SQuAD) per second over the training steps only
(evaluation excluded on both sides), and each side's train-loop wall time is reported.
Writes ``finetune-<task>-seed<N>.json`` per task and seed to ``--out``, and
``finetune-<task>.json`` (mean over the seeds found there, per-seed runs inside); ``--merge``
rebuilds the latter from per-seed files gathered from several runs on the same kind of card.
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH, so a pinned copy of the package can be benchmarked

from bertctl.tasks import glue, ner, squad  # noqa: E402
from bertctl.tasks.metrics import accuracy, conlleval, squad_v1_evaluate  # noqa: E402
from bertctl.tasks.trainer import TrainConfig, device_info  # noqa: E402


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return os.environ.get("BERTCTL_COMMIT", "unknown")


# ------------------------------------------------------------------------------ HF side helpers


def hf_args(out: Path, a, epochs: float, lr: float, **extra):
    """TrainingArguments with the shared recipe, built from whatever this transformers accepts."""
    import inspect

    from transformers import TrainingArguments

    params = inspect.signature(TrainingArguments).parameters
    kw = dict(output_dir=str(out), per_device_train_batch_size=a.batch_size, per_device_eval_batch_size=128,
              learning_rate=lr, num_train_epochs=epochs, weight_decay=0.01, adam_epsilon=1e-6, max_grad_norm=1.0,
              lr_scheduler_type="linear", bf16=a.device == "cuda", seed=a.seed, logging_steps=50,
              report_to="none", save_strategy="no", disable_tqdm=True, dataloader_num_workers=0)
    if "warmup_ratio" in params:
        kw["warmup_ratio"] = 0.1
    else:  # transformers >= 5: a float warmup_steps in [0, 1) is a ratio
        kw["warmup_steps"] = 0.1
    if "eval_strategy" in params:
        kw["eval_strategy"] = "no"
    if a.device == "cpu" and "use_cpu" in params:
        kw["use_cpu"] = True
    kw.update(extra)
    return TrainingArguments(**{k: v for k, v in kw.items() if k in params})


class EpochTimer:
    """Trainer callback timing the training steps of each epoch (syncs the GPU at the edges)."""

    def __new__(cls):
        from transformers import TrainerCallback

        class _Timer(TrainerCallback):
            def __init__(self):
                self.seconds = 0.0
                self._t0 = None

            def on_epoch_begin(self, args, state, control, **kw):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self._t0 = time.perf_counter()

            def on_epoch_end(self, args, state, control, **kw):
                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.seconds += time.perf_counter() - self._t0

        return _Timer()


def hf_tokenizer(model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir, use_fast=True)


def list_dataset(rows):
    """A plain list works as a torch Dataset for Trainer (no `datasets` needed)."""
    return rows


def _trainer(model, args, train, tok, collator, callbacks=(), eval_dataset=None, compute_metrics=None):
    import inspect

    from transformers import Trainer

    kw = dict(model=model, args=args, train_dataset=train, data_collator=collator, callbacks=list(callbacks),
              eval_dataset=eval_dataset, compute_metrics=compute_metrics)
    params = inspect.signature(Trainer).parameters
    kw["processing_class" if "processing_class" in params else "tokenizer"] = tok
    return Trainer(**kw)


# ------------------------------------------------------------------------------ SST-2


def sst2(a, out: Path) -> dict:
    data = glue.load_data(task="sst2", data_dir=a.data / "SST-2")
    if a.limit:
        data.train = data.train[: a.limit]
        data.devs = [(n, p, ex[: a.limit // 4]) for n, p, ex in data.devs]
    dev = data.devs[0][2]
    epochs, lr = a.sst2_epochs, a.lr
    cfg = TrainConfig(epochs=epochs, lr=lr, batch_size=a.batch_size, seed=a.seed, device=a.device, progress=False,
                      kernels=a.kernels)
    t = time.perf_counter()
    ours = glue.run_finetune(data, a.model, out / "bertctl-sst2", cfg)
    ours_wall = time.perf_counter() - t

    # Hugging Face: run_glue.py logic (tokenize sentence, truncation at 128, dynamic padding).
    from transformers import AutoModelForSequenceClassification, DataCollatorWithPadding, set_seed

    set_seed(a.seed)
    tok = hf_tokenizer(a.model)
    t = time.perf_counter()
    label = {"0": 0, "1": 1}

    def enc(examples):
        batch = tok([e.text_a for e in examples], truncation=True, max_length=128)
        return [{"input_ids": i, "token_type_ids": tt, "attention_mask": m, "labels": label[e.label]}
                for i, tt, m, e in zip(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"], examples)]

    train, dev_rows = enc(data.train), enc(dev)
    model = AutoModelForSequenceClassification.from_pretrained(a.model, num_labels=2)
    timer = EpochTimer()
    trainer = _trainer(model, hf_args(out / "hf-sst2", a, epochs, lr), train, tok,
                       DataCollatorWithPadding(tok, pad_to_multiple_of=8), [timer])
    trainer.train()
    logits = trainer.predict(dev_rows).predictions
    hf_acc = accuracy(np.argmax(logits, -1), [label[e.label] for e in dev])
    hf_wall = time.perf_counter() - t
    n = len(train) * epochs
    return {"metric": "accuracy", "bertctl": {"accuracy": ours["accuracy"],
                                              "train_examples_per_second": ours["train_examples_per_second"],
                                              "wall_seconds": ours_wall},
            "hf": {"accuracy": hf_acc, "train_examples_per_second": n / timer.seconds, "train_seconds": timer.seconds,
                   "wall_seconds": hf_wall},
            "settings": {"epochs": epochs, "lr": lr, "train_examples": len(train), "dev_examples": len(dev)}}


# ------------------------------------------------------------------------------ CoNLL-2003


def conll(a, out: Path) -> dict:
    d = a.data / "conll2003"
    epochs, lr = a.conll_epochs, a.lr_conll
    cfg = TrainConfig(epochs=epochs, lr=lr, batch_size=a.batch_size, seed=a.seed, device=a.device, progress=False,
                      kernels=a.kernels)
    data_dir = d
    if a.limit:  # a slice for CPU smoke runs
        data_dir = out / "conll-slice"
        data_dir.mkdir(parents=True, exist_ok=True)
        for name in ("train", "valid", "test"):
            src = ner.read_conll(d / f"{name}.txt")
            k = a.limit if name == "train" else a.limit // 4
            with open(data_dir / f"{name}.txt", "w") as f:
                for s in src.sentences[:k]:
                    f.write("".join(f"{w} X X {t}\n" for w, t in zip(s.words, s.tags)) + "\n")
    t = time.perf_counter()
    ours = ner.run_finetune(data_dir, a.model, out / "bertctl-conll", cfg)
    ours_wall = time.perf_counter() - t

    # Hugging Face: run_ner.py logic (is_split_into_words, label on the first sub-token only,
    # DataCollatorForTokenClassification), best epoch on valid F1, scored on test.
    from transformers import AutoModelForTokenClassification, DataCollatorForTokenClassification, set_seed

    set_seed(a.seed)
    tok = hf_tokenizer(a.model)
    t = time.perf_counter()
    train_d, valid_d, test_d = (ner.read_conll(data_dir / f"{n}.txt") for n in ("train", "valid", "test"))
    labels = ner.label_list(train_d, valid_d, test_d)
    l2i = {l: i for i, l in enumerate(labels)}

    def enc(data):
        rows = []
        words = [s.words for s in data.sentences]
        batch = tok(words, is_split_into_words=True, truncation=True, max_length=128)
        for k, s in enumerate(data.sentences):
            word_ids = batch.word_ids(k)
            lab, prev = [], None
            for w in word_ids:
                lab.append(-100 if w is None or w == prev else l2i[s.tags[w]])
                prev = w
            rows.append({"input_ids": batch["input_ids"][k], "token_type_ids": batch["token_type_ids"][k],
                         "attention_mask": batch["attention_mask"][k], "labels": lab})
        return rows, [batch.word_ids(k) for k in range(len(data.sentences))]

    train, _ = enc(train_d)
    valid, valid_wids = enc(valid_d)
    test, test_wids = enc(test_d)

    def tags_of(logits, wids, data):
        out_tags = []
        for lg, w_ids, s in zip(logits, wids, data.sentences):
            pred = ["O"] * len(s.words)
            prev = None
            for pos, w in enumerate(w_ids):
                if w is not None and w != prev:
                    pred[w] = labels[int(np.argmax(lg[pos]))]
                prev = w
            out_tags.append(pred)
        return out_tags

    model = AutoModelForTokenClassification.from_pretrained(a.model, num_labels=len(labels),
                                                            id2label=dict(enumerate(labels)), label2id=l2i)
    timer = EpochTimer()
    from transformers import TrainerCallback

    best = {"f1": -1.0, "state": None, "epoch": None}

    class SelectOnValid(TrainerCallback):
        """Evaluate on valid after each epoch (outside the timed region) and keep the best weights,
        as run_ner.py does with load_best_model_at_end and metric_for_best_model=f1."""

        def on_epoch_end(self, args, state, control, model=None, **kw):
            lg = trainer.predict(valid).predictions
            f1 = conlleval([s.tags for s in valid_d.sentences], tags_of(lg, valid_wids, valid_d))["f1"]
            if f1 > best["f1"]:
                best.update(f1=f1, epoch=round(state.epoch), state={k: v.detach().clone() for k, v in
                                                                     model.state_dict().items()})

    trainer = _trainer(model, hf_args(out / "hf-conll", a, epochs, lr), train, tok,
                       DataCollatorForTokenClassification(tok, pad_to_multiple_of=8), [timer, SelectOnValid()])
    trainer.train()
    model.load_state_dict(best["state"])
    lg = trainer.predict(test).predictions
    hf_test = conlleval([s.tags for s in test_d.sentences], tags_of(lg, test_wids, test_d))
    hf_wall = time.perf_counter() - t
    # Valid evaluation runs inside on_epoch_end after the timer callback has stopped its clock.
    n = len(train) * epochs
    return {"metric": "test_f1", "bertctl": {"test_f1": ours["test_f1"], "valid_f1": ours["valid_f1"],
                                             "best_epoch": ours["best_epoch"],
                                             "train_examples_per_second": ours["train_examples_per_second"],
                                             "wall_seconds": ours_wall},
            "hf": {"test_f1": hf_test["f1"], "valid_f1": best["f1"], "best_epoch": best["epoch"],
                   "train_examples_per_second": n / timer.seconds, "train_seconds": timer.seconds,
                   "wall_seconds": hf_wall},
            "settings": {"epochs": epochs, "lr": lr, "train_sentences": len(train)}}


# ------------------------------------------------------------------------------ SQuAD


def squad_task(a, out: Path) -> dict:
    sq = a.data / "squad"
    split = sq / "split.json"
    epochs, lr = a.squad_epochs, a.lr_squad
    cfg = TrainConfig(epochs=epochs, lr=lr, batch_size=a.batch_size, seed=a.seed, device=a.device, progress=False,
                      kernels=a.kernels)
    scfg = squad.SquadConfig()
    train = squad.read_squad(sq / "dev-v1.1.json", articles=f"{split}:train", training=True)
    dev = squad.read_squad(sq / "dev-v1.1.json", articles=f"{split}:eval")
    if a.limit:
        train.examples = train.examples[: a.limit]
        dev.examples = dev.examples[: a.limit // 4]
        keep = {e.qid for e in dev.examples}
        dev.dataset = [{**art, "paragraphs": [{**p, "qas": [q for q in p["qas"] if q["id"] in keep]}
                                              for p in art["paragraphs"]]} for art in dev.dataset]
    t = time.perf_counter()
    ours = squad.run_finetune(train, dev, a.model, out / "bertctl-squad", cfg, scfg)
    ours_wall = time.perf_counter() - t

    # Hugging Face: run_qa.py logic (question first, truncation="only_second", max_length 384,
    # stride 128 overlap, offsets; answers outside a window label [CLS]; post-processing with
    # n-best 20 and max_answer_length 30 over all windows).
    from transformers import AutoModelForQuestionAnswering, DataCollatorWithPadding, set_seed

    set_seed(a.seed)
    tok = hf_tokenizer(a.model)
    t = time.perf_counter()

    def prepare_train(examples):
        enc = tok([e.question.lstrip() for e in examples], [e.context for e in examples], truncation="only_second",
                  max_length=384, stride=128, return_overflowing_tokens=True, return_offsets_mapping=True)
        rows = []
        for i, offsets in enumerate(enc["offset_mapping"]):
            ex = examples[enc["overflow_to_sample_mapping"][i]]
            seq = enc.sequence_ids(i)
            text, start = ex.answers[0]
            s_char, e_char = start, start + len(text)
            ts = 0
            while seq[ts] != 1:
                ts += 1
            te = len(enc["input_ids"][i]) - 1
            while seq[te] != 1:
                te -= 1
            if not (offsets[ts][0] <= s_char and offsets[te][1] >= e_char):
                sp = ep = 0
            else:
                while ts < len(offsets) and offsets[ts][0] <= s_char:
                    ts += 1
                sp = ts - 1
                while offsets[te][1] >= e_char:
                    te -= 1
                ep = te + 1
            rows.append({"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                         "attention_mask": enc["attention_mask"][i], "start_positions": sp, "end_positions": ep})
        return rows

    def prepare_eval(examples):
        enc = tok([e.question.lstrip() for e in examples], [e.context for e in examples], truncation="only_second",
                  max_length=384, stride=128, return_overflowing_tokens=True, return_offsets_mapping=True)
        rows, meta = [], []
        for i in range(len(enc["input_ids"])):
            seq = enc.sequence_ids(i)
            offs = [o if seq[k] == 1 else None for k, o in enumerate(enc["offset_mapping"][i])]
            rows.append({"input_ids": enc["input_ids"][i], "token_type_ids": enc["token_type_ids"][i],
                         "attention_mask": enc["attention_mask"][i]})
            meta.append((enc["overflow_to_sample_mapping"][i], offs))
        return rows, meta

    train_rows = prepare_train(train.examples)
    dev_rows, dev_meta = prepare_eval(dev.examples)
    model = AutoModelForQuestionAnswering.from_pretrained(a.model)
    timer = EpochTimer()
    trainer = _trainer(model, hf_args(out / "hf-squad", a, epochs, lr), train_rows, tok,
                       DataCollatorWithPadding(tok, pad_to_multiple_of=8), [timer])
    trainer.train()
    start_logits, end_logits = trainer.predict(dev_rows).predictions
    # postprocess_qa_predictions (utils_qa.py): n-best over all windows of each question.
    by_ex = collections.defaultdict(list)
    for fi, (ei, _) in enumerate(dev_meta):
        by_ex[ei].append(fi)
    preds = {}
    for ei, ex in enumerate(dev.examples):
        cands = []
        for fi in by_ex[ei]:
            offs = dev_meta[fi][1]
            sl, el = start_logits[fi], end_logits[fi]
            n = len(offs)
            for s in np.argsort(sl[:n])[-1:-21:-1]:
                for e in np.argsort(el[:n])[-1:-21:-1]:
                    if offs[s] is None or offs[e] is None or e < s or e - s + 1 > 30:
                        continue
                    cands.append((float(sl[s] + el[e]), offs[s][0], offs[e][1]))
        best = max(cands, default=(0.0, 0, 0))
        preds[ex.qid] = ex.context[best[1]:best[2]]
    hf_metrics = squad_v1_evaluate(dev.dataset, preds)
    hf_wall = time.perf_counter() - t
    n = len(train_rows) * epochs
    return {"metric": "f1", "bertctl": {"f1": ours["f1"], "exact_match": ours["exact_match"],
                                        "train_features": ours["train_features"],
                                        "train_examples_per_second": ours["train_examples_per_second"],
                                        "train_questions_per_second": ours["train_examples_per_second"]
                                        * ours["train_questions"] / ours["train_features"],
                                        "wall_seconds": ours_wall},
            "hf": {"f1": hf_metrics["f1"], "exact_match": hf_metrics["exact_match"], "train_features": len(train_rows),
                   "train_examples_per_second": n / timer.seconds,
                   "train_questions_per_second": len(train.examples) * epochs / timer.seconds,
                   "train_seconds": timer.seconds, "wall_seconds": hf_wall},
            "settings": {"epochs": epochs, "lr": lr, "train_questions": len(train.examples),
                         "eval_questions": len(dev.examples), "max_seq_length": 384, "doc_stride": 128}}


TASKS = {"sst2": sst2, "conll": conll, "squad": squad_task}


def summarise(task: str, runs: list[dict]) -> dict:
    """One result per task from its per-seed runs: the metric and throughput averaged over seeds."""
    m = runs[0]["metric"]
    mean = {side: {k: float(np.mean([r[side][k] for r in runs])) for k in (m, "train_examples_per_second")}
            for side in ("bertctl", "hf")}
    return {"task": task, "metric": m, "seeds": [r["seed"] for r in runs], "bertctl": mean["bertctl"],
            "hf": mean["hf"], "delta": mean["bertctl"][m] - mean["hf"][m],
            "speedup": mean["bertctl"]["train_examples_per_second"] / mean["hf"]["train_examples_per_second"],
            "settings": runs[0]["settings"], "device": runs[-1]["device"], "runs": runs}


def merge(folder: Path) -> list[dict]:
    """Rebuild finetune-<task>.json in ``folder`` from every finetune-<task>-seed<N>.json there."""
    rows = []
    for task in TASKS:
        runs = [json.loads(p.read_text()) for p in sorted(folder.glob(f"finetune-{task}-seed*.json"))]
        if not runs:
            continue
        devices = {r["device"]["device"] for r in runs}
        if len(devices) > 1:  # timings are only comparable on one kind of card
            raise SystemExit(f"{task}: runs from different devices {devices}; merge them separately")
        row = summarise(task, runs)
        (folder / f"finetune-{task}.json").write_text(json.dumps(row, indent=2) + "\n")
        rows.append(row)
    return rows


def table(rows: list[dict]) -> None:
    print(f"\n{'task':<6} {'metric':<9} {'seeds':<8} {'bertctl':>9} {'HF':>9} {'delta':>7} {'ex/s ours':>10} "
          f"{'ex/s HF':>9} {'speedup':>7}")
    for r in rows:
        m = r["metric"]
        scale = 1.0 if m == "f1" else 100.0
        seeds = ",".join(map(str, r["seeds"]))
        print(f"{r['task']:<6} {m:<9} {seeds:<8} {scale * r['bertctl'][m]:9.2f} {scale * r['hf'][m]:9.2f} "
              f"{scale * r['delta']:7.2f} {r['bertctl']['train_examples_per_second']:10.1f} "
              f"{r['hf']['train_examples_per_second']:9.1f} {r['speedup']:7.2f}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="pretrained model directory (HF layout)")
    p.add_argument("--data", type=Path, help="folder with SST-2/, conll2003/, squad/")
    p.add_argument("--out", type=Path, required=True, help="where the finetune-<task>.json results go")
    p.add_argument("--work", type=Path, default=None, help="fine-tuned models and predictions (default: --out)")
    p.add_argument("--merge", action="store_true", help="only rebuild the per-task summaries in --out from the "
                                                         "per-seed files there (runs from several calls)")
    p.add_argument("--no-merge", action="store_true", help="write the per-seed files only")
    p.add_argument("--tasks", default="sst2,conll,squad")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seeds", default="42", help="comma-separated; both sides run once per seed")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--kernels", default="auto", help="bertctl model ops: auto, fused or torch")
    p.add_argument("--lr", type=float, default=5e-5, help="SST-2 lr")
    p.add_argument("--lr-conll", type=float, default=1e-4)
    p.add_argument("--lr-squad", type=float, default=1e-4)
    p.add_argument("--sst2-epochs", type=float, default=1.0)
    p.add_argument("--conll-epochs", type=float, default=3.0)
    p.add_argument("--squad-epochs", type=float, default=2.0)
    p.add_argument("--limit", type=int, default=0, help="slice the data (CPU smoke runs)")
    a = p.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.merge:
        table(merge(a.out))
        return 0
    if a.model is None or a.data is None:
        p.error("--model and --data are required (except with --merge)")
    work = a.work or a.out
    work.mkdir(parents=True, exist_ok=True)
    for seed in (int(x) for x in a.seeds.split(",")):  # seeds outer: a cut-off run still has whole seeds
        for name in a.tasks.split(","):
            a.seed = seed
            t = time.perf_counter()
            r = TASKS[name](a, work / f"seed{seed}")
            m = r["metric"]
            r = {"task": name, "seed": seed, **r, "delta": r["bertctl"][m] - r["hf"][m],
                 "speedup": r["bertctl"]["train_examples_per_second"] / r["hf"]["train_examples_per_second"],
                 "device": {**device_info(), "commit": commit(),
                            "transformers": __import__("transformers").__version__},
                 "seconds": time.perf_counter() - t}
            (a.out / f"finetune-{name}-seed{seed}.json").write_text(json.dumps(r, indent=2) + "\n")
            print(json.dumps({k: r[k] for k in ("task", "seed", "bertctl", "hf", "delta", "speedup", "seconds")}),
                  flush=True)
    if not a.no_merge:
        table(merge(a.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
