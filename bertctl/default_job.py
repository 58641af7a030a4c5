"""The built-in default job: the whole pipeline on text that ships with Python itself.

``bertctl pretrain`` with no ``--data`` runs it: gather the language reference
(``pydoc_data.topics``) and the docstrings of the standard library into a JSONL
corpus (no download), train a small WordPiece vocabulary on it, build
pretraining shards with a held-out split, pretrain a tiny BERT for a few minutes
(time-boxed), and report held-out MLM accuracy at the start and the end beside
the majority-token baseline (always predicting the most frequent masked token).
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import io
import json
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from bertctl.errors import BertctlError
from bertctl.io import atomic_open, write_json
from bertctl.progress import stderr

# Modules whose import has side effects (opens a browser, prints, starts a GUI) or is
# platform-specific or huge; their docs are not needed for a corpus.
SKIP_MODULES = {
    "antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "ensurepip", "lib2to3", "test",
    "msvcrt", "winreg", "winsound", "nt", "_winapi", "__phello__", "pydoc_data", "xxsubtype", "xxlimited",
    "xxlimited_35", "_testcapi", "_testinternalcapi", "_testbuffer", "_testimportmultiple",
    "_testmultiphase", "_xxtestfuzz", "_ctypes_test", "_testclinic", "_testsinglephase", "sitecustomize",
    "usercustomize", "venv", "distutils",
}

DEFAULT_MINUTES = 2.0


def _module_docs(name: str) -> str | None:
    """Module docstring plus each public class / function defined in it (with their methods)."""
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()), \
                contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            mod = importlib.import_module(name)
    except BaseException:  # ImportError, SystemExit from odd modules: skip, never fail
        return None
    parts = []
    doc = inspect.getdoc(mod)
    if doc:
        parts.append(f"Module {name}\n\n{doc}")
    for attr in sorted(getattr(mod, "__all__", None) or dir(mod)):
        if attr.startswith("_"):
            continue
        obj = getattr(mod, attr, None)
        if not (inspect.isclass(obj) or inspect.isfunction(obj) or inspect.isbuiltin(obj)):
            continue
        if getattr(obj, "__module__", None) != name:
            continue
        d = inspect.getdoc(obj)
        if d:
            parts.append(f"{name}.{attr}\n\n{d}")
        if inspect.isclass(obj):
            for meth in sorted(vars(obj)):
                m = vars(obj)[meth]
                if meth.startswith("_") or not callable(m):
                    continue
                md = inspect.getdoc(m)
                if md:
                    parts.append(f"{name}.{attr}.{meth}\n\n{md}")
    return "\n\n".join(parts) if parts else None


def gather_python_docs(folder: str | Path, *, max_modules: int | None = None, max_bytes: int = 6_000_000) -> dict:
    """Write Python's bundled documentation as plain-text files, one document each.

    Documents: each language-reference topic of ``pydoc_data.topics`` and each
    standard-library module's docstrings, in sorted (deterministic) order, as
    ``NNNN-name.txt`` (paragraphs separated by blank lines: build-data's "text" format).
    """
    try:
        from pydoc_data.topics import topics
    except ImportError:  # some distributions split it off; the docstrings still make a corpus
        topics = {}

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    n_docs = n_bytes = 0

    def emit(name: str, text: str) -> None:
        nonlocal n_docs, n_bytes
        with atomic_open(folder / f"{n_docs:04d}-{name}.txt", "w", encoding="utf-8") as f:
            f.write(text.strip() + "\n")
        n_docs += 1
        n_bytes += len(text.encode())

    for key in sorted(topics):
        emit(f"topic-{key}", topics[key])
    names = sorted(n for n in sys.stdlib_module_names if not n.startswith("_") and n not in SKIP_MODULES)
    for name in names[:max_modules]:
        if n_bytes >= max_bytes:
            break
        text = _module_docs(name)
        if text:
            emit(f"module-{name}", text)
    return {"documents": n_docs, "bytes": n_bytes}


def _calibrate_step_seconds(model_config, batch_size: int, seq_len: int, max_pred: int, seed: int) -> float:
    """Seconds per training step of this model on this CPU (random tokens; the fastest of 3 timed
    steps after 3 warm-up ones: the first steps also fault in the heap the run will reuse)."""
    from bertctl.model import BertForPreTraining
    from bertctl.train.optim import build_optimizer
    from bertctl.train.pretrain import pretraining_sums

    g = torch.Generator().manual_seed(seed)
    model = BertForPreTraining(model_config)
    opt = build_optimizer(model, "adamw", lr=1e-4)
    v = model_config.vocab_size
    mb = {
        "input_ids": torch.randint(5, v, (batch_size, seq_len), generator=g),
        "token_type_ids": torch.zeros(batch_size, seq_len, dtype=torch.long),
        "attention_mask": torch.ones(batch_size, seq_len, dtype=torch.long),
        "masked_positions": torch.randint(1, seq_len, (batch_size, max_pred), generator=g),
        "masked_lm_labels": torch.randint(5, v, (batch_size, max_pred), generator=g),
        "next_sentence_label": torch.randint(0, 2, (batch_size,), generator=g),
    }
    times = []
    for _ in range(6):
        t = time.perf_counter()
        s = pretraining_sums(model, mb)
        (s["mlm_sum"] / mb["masked_lm_labels"].numel() + s["nsp_sum"] / batch_size).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t)
    return min(times[3:])


def prepare_default_data(work: str | Path, *, vocab_size: int = 4000, max_seq_length: int = 128, seed: int = 0,
                         max_modules: int | None = None, show_progress: bool = True) -> dict:
    """corpus -> vocabulary -> shards under ``work`` (each stage skipped when its output exists).

    Returns {"corpus": stats, "vocabulary": path, "tokenizer": BertTokenizer, "data": shard folder}.
    """
    from bertctl.data import DataConfig, build_data
    from bertctl.text.vocab_training import VocabConfig, train_vocab, write_vocab
    from bertctl.text.wordpiece import BertTokenizer

    work = Path(work)
    corpus = work / "python-docs"
    if not (work / "corpus.json").is_file():
        stderr.print("default job: gathering Python's bundled documentation (pydoc_data.topics + stdlib docstrings)")
        write_json(work / "corpus.json", gather_python_docs(corpus, max_modules=max_modules))
    corpus_stats = {"path": str(corpus), **json.loads((work / "corpus.json").read_text(encoding="utf-8"))}
    vocab_file = work / "vocab.txt"
    if not vocab_file.is_file():
        stderr.print(f"default job: training a {vocab_size}-token WordPiece vocabulary")
        write_vocab(train_vocab([corpus], VocabConfig(vocab_size=vocab_size, seed=seed)), vocab_file)
    tokenizer = BertTokenizer.from_vocab_file(vocab_file)
    data_dir = work / "data"
    if not (data_dir / "manifest.json").is_file():
        stderr.print("default job: building pretraining shards (5% of documents held out)")
        build_data([corpus], data_dir, tokenizer,
                   DataConfig(format="text", max_seq_length=max_seq_length, dupe_factor=3, holdout_fraction=0.05,
                              seed=seed), progress=show_progress)
    return {"corpus": corpus_stats, "vocabulary": vocab_file, "tokenizer": tokenizer, "data": data_dir}


def run_default_job(output: Path, *, batch_size: int | None = None, lr: float | None = None,
                    minutes: float | None = None, max_steps: int | None = None, model_size: str | None = None,
                    vocab_size: int = 4000, max_seq_length: int = 128, max_modules: int | None = None,
                    **train_options: Any) -> dict:
    """gather corpus -> train vocabulary -> build shards -> pretrain a tiny BERT -> summary dict.

    Each preparation stage is skipped when its output already exists in ``output/work``,
    so a rerun (or ``--resume``) goes straight to training.
    """
    from bertctl.config import BertConfig, PretrainConfig
    from bertctl.data import PretrainingData
    from bertctl.train.pretrain import claim_output, pretrain

    output = Path(output)
    minutes = DEFAULT_MINUTES if minutes is None else minutes
    batch_size = batch_size or 8
    model_size = model_size or "tiny"
    seed = train_options.pop("seed", 0)
    t0 = time.monotonic()
    rank, world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and max_steps is None:
        raise BertctlError("the default job under torchrun needs --max-steps (the time calibration is per process)")
    # The output folder rule before any work: a finished or running job is refused at once.
    with claim_output(PretrainConfig.of(output=str(output), resume=train_options.get("resume", False),
                                        overwrite=train_options.get("overwrite", False)), main=rank == 0):
        if rank != 0:  # under torchrun rank 0 prepares the data; the others wait for its manifest
            while not (output / "work" / "data" / "manifest.json").is_file():
                time.sleep(1.0)
        prepared = prepare_default_data(output / "work", vocab_size=vocab_size, max_seq_length=max_seq_length,
                                        seed=seed, max_modules=max_modules,
                                        show_progress=train_options.get("show_progress", True))
        data_dir, tokenizer = prepared["data"], prepared["tokenizer"]
        prep_seconds = time.monotonic() - t0

        model_overrides = train_options.pop("model_overrides", {}) or {}
        max_steps_given = max_steps
        if max_steps is None:
            # Fit the step count to the time box, so the lr schedule completes (warm-up, then decay to 0);
            # the engine re-plans from the measured step rate when the machine gets busier or quieter.
            ds = PretrainingData(data_dir)
            mconf = BertConfig.preset(model_size, vocab_size=ds.vocab_size, **model_overrides)
            t_step = _calibrate_step_seconds(mconf, batch_size, max_seq_length, ds.max_predictions, seed)
            budget = max(10.0, minutes * 60 - (time.monotonic() - t0) - 10.0)  # evals and export take a few s
            max_steps = int(min(20000, max(20, 0.85 * budget / t_step)))
            stderr.print(f"default job: {t_step * 1e3:.0f} ms a step on this CPU -> {max_steps} steps in ~{minutes:g} min "
                         "(re-planned from the run's own pace as it trains)")
        options = {"warmup_fraction": 0.05, "eval_batches": 8, **train_options}
        if not options.get("eval_every"):
            options["eval_every"] = max(10, max_steps // 5)  # a few points on the accuracy curve
        cfg = PretrainConfig.of(output=str(output), data=str(data_dir), model_size=model_size,
                                model_overrides=model_overrides, batch_size=batch_size, lr=lr or 1e-3, max_steps=max_steps,
                                minutes=max(0.1, minutes - (time.monotonic() - t0) / 60), seed=seed,
                                fit_to_minutes=max_steps_given is None, **options)
        summary = pretrain(cfg, tokenizer=tokenizer)
        ev0, ev1 = summary.get("eval_start") or {}, summary.get("eval_end") or {}
        summary["default_job"] = {
            "corpus": prepared["corpus"], "vocabulary": str(prepared["vocabulary"]), "data": str(data_dir),
            "prepare_seconds": round(prep_seconds, 1),
            "eval_mlm_accuracy_start": ev0.get("mlm_acc"), "eval_mlm_accuracy_end": ev1.get("mlm_acc"),
            "majority_token_baseline": ev1.get("mlm_majority_baseline", ev0.get("mlm_majority_baseline")),
        }
        if ev1:
            start = f"{ev0['mlm_acc']:.3f} -> " if ev0 else ""
            stderr.print(f"default job: held-out MLM accuracy {start}{ev1['mlm_acc']:.3f} "
                         f"(majority-token baseline {ev1['mlm_majority_baseline']:.3f}); "
                         f"NSP accuracy {ev1['nsp_acc']:.3f}; model in {summary.get('model')}")
        return summary
