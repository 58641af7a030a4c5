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
import dataclasses
import importlib
import inspect
import io
import json
import os
import sys
import time
import warnings
from dataclasses import dataclass
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
DEFAULT_BATCH = 8
DUPE_FACTOR = 3
# Passes over the text (epochs x --dupe-factor) at most. On this corpus a tiny BERT's held-out loss
# (MLM + NSP, what curves.png plots) turns up after one to two passes: the NSP head starts to memorise
# the training pairs while masked-LM loss still falls, so the 262 passes an H200 fitted into the time box
# took it from 7 to 12. A run planned to this cap, its learning rate decaying to 0 there, ends at its lowest.
MAX_PASSES = 1.5


@dataclass(frozen=True)
class JobPlan:
    """How long the built-in job trains, and why: a pure function of the corpus and the machine's pace."""

    model_size: str
    batch_size: int
    max_steps: int
    passes: float            # over the text the plan makes: steps / steps per epoch x dupe factor
    limited_by: str          # "passes": the cap on passes over the text; "time": the time box
    max_passes: float        # the cap
    fit_to_minutes: bool     # the engine re-plans the steps from the run's pace (time-limited plans only)
    step_seconds: float
    reason: str

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def plan_job(train_instances: int, step_seconds: float, seconds: float, *, dupe_factor: int = DUPE_FACTOR,
             batch_size: int = DEFAULT_BATCH, model_size: str = "tiny", max_passes: float = MAX_PASSES) -> JobPlan:
    """Size the built-in job's training from the corpus (``train_instances`` built with ``dupe_factor``
    copies of the text) and the machine (``step_seconds`` a step, measured or declared; ``seconds`` to
    train in): as many steps as fit in the time, and no more than ``max_passes`` passes over the text,
    where held-out loss stops falling. The model stays tiny on every machine: a larger one only
    memorises so small a corpus sooner."""
    if train_instances < batch_size:
        raise BertctlError(f"the built-in job's corpus made {train_instances} training instances, fewer than one "
                           f"batch of {batch_size}")
    if step_seconds <= 0 or seconds <= 0:
        raise ValueError(f"plan_job: step_seconds and seconds must be > 0, got {step_seconds}, {seconds}")
    steps_per_epoch = train_instances // batch_size
    steps_per_pass = steps_per_epoch / dupe_factor
    cap = max(1, int(max_passes * steps_per_pass))
    # 85% of the time box: evaluations, checkpoints and the export take the rest.
    in_time = max(20, int(0.85 * seconds / step_seconds))
    if in_time >= cap:
        steps, limited_by = cap, "passes"
        reason = (f"{max_passes:g} passes over the text at most (held-out loss stops falling beyond them on "
                  f"this corpus); this machine could train {in_time:,} steps in the time box")
    else:
        steps, limited_by = in_time, "time"
        reason = f"the time box: {in_time:,} steps of {step_seconds * 1e3:.1f} ms fit in it, under the cap of {cap:,}"
    return JobPlan(model_size=model_size, batch_size=batch_size, max_steps=steps,
                   passes=round(steps / steps_per_pass, 2), limited_by=limited_by, max_passes=max_passes,
                   fit_to_minutes=limited_by == "time", step_seconds=step_seconds, reason=reason)


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


def _calibrate_step_seconds(model_config, batch_size: int, seq_len: int, max_pred: int, seed: int,
                            runtime=None) -> float:
    """Seconds per training step of this model under ``runtime`` (the run's device, precision, attention and
    kernels; default the CPU's): random tokens, the fastest of 3 timed steps after 3 warm-up ones (the first
    steps also fault in the heap the run will reuse). Eager steps: on a GPU the run's CUDA graphs are faster
    still, so the pace is never overestimated."""
    from bertctl.model import BertForPreTraining
    from bertctl.runtime import Runtime
    from bertctl.train.engine import autocast
    from bertctl.train.optim import build_optimizer
    from bertctl.train.pretrain import pretraining_sums

    runtime = runtime or Runtime()
    device = runtime.torch_device
    g = torch.Generator().manual_seed(seed)
    model = BertForPreTraining(model_config, runtime).to(device)
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
    mb = {k: t.to(device) for k, t in mb.items()}
    times = []
    for _ in range(6):
        t = time.perf_counter()
        with autocast(runtime.precision, device):
            s = pretraining_sums(model, mb)
        (s["mlm_sum"] / mb["masked_lm_labels"].numel() + s["nsp_sum"] / batch_size).backward()
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - t)
    return min(times[3:])


def _runtime(train_options: dict):
    """The runtime the job's training will resolve to (for the calibration), CUDA graphs aside."""
    from bertctl.runtime import resolve

    return resolve(train_options.get("device") or "auto", train_options.get("precision") or "auto",
                   attn=train_options.get("attn") or "auto", kernels=train_options.get("kernels") or "auto",
                   cuda_graphs=False, packed_data=True)


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
        # resume: a build interrupted with the job continues (the folder rule refuses it otherwise).
        build_data([corpus], data_dir, tokenizer,
                   DataConfig(format="text", max_seq_length=max_seq_length, dupe_factor=DUPE_FACTOR,
                              holdout_fraction=0.05, seed=seed), progress=show_progress, resume=True)
    return {"corpus": corpus_stats, "vocabulary": vocab_file, "tokenizer": tokenizer, "data": data_dir}


def run_default_job(output: Path, *, batch_size: int | None = None, lr: float | None = None,
                    minutes: float | None = None, max_steps: int | None = None, model_size: str | None = None,
                    vocab_size: int = 4000, max_seq_length: int = 128, max_modules: int | None = None,
                    **train_options: Any) -> dict:
    """gather corpus -> train vocabulary -> build shards -> plan -> pretrain a tiny BERT -> summary dict.

    Each preparation stage is skipped when its output already exists in ``output/work``,
    so a rerun (or ``--resume``) goes straight to training; the plan (``plan_job``: steps from the
    corpus and this machine's measured pace) is kept in ``output/work/plan.json`` for ``--resume``.
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
        ds = PretrainingData(data_dir)
        dupe = (ds.manifest.get("data_config") or {}).get("dupe_factor") or DUPE_FACTOR
        plan = None
        plan_file = output / "work" / "plan.json"
        if max_steps is None and train_options.get("resume") and plan_file.is_file():
            plan = JobPlan(**json.loads(plan_file.read_text(encoding="utf-8")))  # a resumed job keeps its plan
            max_steps = plan.max_steps
        elif max_steps is None:
            # Size the run from the corpus and this machine's pace: the time box, capped in passes over the text.
            mconf = BertConfig.preset(model_size, vocab_size=ds.vocab_size, **model_overrides)
            runtime = _runtime(train_options)
            device = runtime.device
            t_step = _calibrate_step_seconds(mconf, batch_size, max_seq_length, ds.max_predictions, seed, runtime)
            budget = max(10.0, minutes * 60 - (time.monotonic() - t0) - 10.0)  # evals and export take a few s
            plan = plan_job(ds.num_instances, t_step, budget, dupe_factor=dupe, batch_size=batch_size,
                            model_size=model_size, max_passes=MAX_PASSES)
            max_steps = plan.max_steps
            if rank == 0:
                write_json(plan_file, plan.to_dict())
            stderr.print(f"default job: {t_step * 1e3:.1f} ms a step on {device} -> {max_steps:,} steps, "
                         f"{plan.passes:g} passes over the text; limited by {plan.reason}")
        options = {"warmup_fraction": 0.05, "eval_batches": 8, **train_options}
        if not options.get("eval_every"):
            options["eval_every"] = max(10, max_steps // 5)  # a few points on the accuracy curve
        cfg = PretrainConfig.of(output=str(output), data=str(data_dir), model_size=model_size,
                                model_overrides=model_overrides, batch_size=batch_size, lr=lr or 1e-3, max_steps=max_steps,
                                minutes=max(0.1, minutes - (time.monotonic() - t0) / 60), seed=seed,
                                fit_to_minutes=plan is not None and plan.fit_to_minutes, **options)
        summary = pretrain(cfg, tokenizer=tokenizer)
        ev0, ev1 = summary.get("eval_start") or {}, summary.get("eval_end") or {}
        stopped = stop_reason(summary, plan)
        summary["default_job"] = {
            "corpus": prepared["corpus"], "vocabulary": str(prepared["vocabulary"]), "data": str(data_dir),
            "prepare_seconds": round(prep_seconds, 1),
            "plan": plan.to_dict() if plan else {"max_steps": max_steps, "reason": "--max-steps"},
            "steps": summary.get("steps"), "passes_over_text": summary.get("passes_over_text"), "stopped_by": stopped,
            "eval_mlm_accuracy_start": ev0.get("mlm_acc"), "eval_mlm_accuracy_end": ev1.get("mlm_acc"),
            "majority_token_baseline": ev1.get("mlm_majority_baseline", ev0.get("mlm_majority_baseline")),
        }
        said = (f"default job: {summary.get('steps'):,} steps, {summary.get('passes_over_text'):g} passes over the "
                f"text; stopped by {stopped}")
        if rank == 0:
            _record(output, summary, said)
        stderr.print(said)
        if ev1:
            start = f"{ev0['mlm_acc']:.3f} -> " if ev0 else ""
            nsp = f"; NSP accuracy {ev1['nsp_acc']:.3f}" if "nsp_acc" in ev1 else ""
            stderr.print(f"default job: held-out MLM accuracy {start}{ev1['mlm_acc']:.3f} "
                         f"(majority-token baseline {ev1['mlm_majority_baseline']:.3f}){nsp}; "
                         f"model in {summary.get('model')}")
        return summary


def stop_reason(summary: dict, plan: JobPlan | None) -> str:
    """Why the job stopped, in words: its plan's limit, the time box, or a signal."""
    stopped = summary.get("stopped")
    if stopped == "time limit":
        return "the time box, before the planned steps (the machine ran slower than it measured)"
    if stopped:
        return f"{stopped} (an interrupted run: --resume continues it)"
    if plan is None:
        return f"--max-steps {summary.get('max_steps')}"
    if plan.limited_by == "passes":
        return f"the cap of {plan.max_passes:g} passes over the text, where held-out loss stops falling"
    return "the time box, with the learning-rate schedule fitted to end in it"


def _record(output: Path, summary: dict, said: str) -> None:
    """What the job did, in its metrics log and on its curves (a picture must never cost a run)."""
    metrics = output / "metrics.jsonl"
    if metrics.is_file():
        with open(metrics, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": "note", "kind": "default-job", "step": summary.get("steps"),
                                "time": time.time(), **summary["default_job"]["plan"], "message": said},
                               default=str) + "\n")
    png = summary.get("curves")
    if png and Path(png).is_file():
        try:
            caption_curves(Path(png), said.removeprefix("default job: "))
        except Exception as e:
            stderr.print(f"[yellow]could not caption the curves: {e}")


def caption_curves(png: Path, text: str) -> None:
    """Redraw ``png`` with ``text`` as a title strip above it (Agg, no display)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.image import imread

    from bertctl.io import atomic_path

    image = imread(png)
    height, width = image.shape[:2]
    strip = 40
    fig = Figure(figsize=(width / 100, (height + strip) / 100), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, height / (height + strip)))
    ax.imshow(image)
    ax.axis("off")
    fig.text(0.5, 1 - strip / 2 / (height + strip), text, ha="center", va="center", fontsize=11)
    with atomic_path(png) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
