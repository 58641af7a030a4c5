"""bertctl fine-tuning against the Hugging Face example scripts: quality over seeds, and whole runs.

Both sides are separate processes started the way a user starts them: ``python -m bertctl
finetune glue|ner|squad ...`` (the ``bertctl`` entry point runs the same function) and
``python benchmarks/finetune/hf_finetune.py glue|ner|squad ...`` (run_glue.py / run_ner.py / run_qa.py
logic on ``transformers.Trainer``). They get the same pretrained directory, data files, recipe and
seed, and their prediction files are scored here by the same code (``bertctl.tasks.metrics``).

Recipe, both sides (recorded in every result): batch 32, lr 5e-5, 3 epochs, linear warm-up over
10% of the steps then linear decay to 0, AdamW betas (0.9, 0.999), eps 1e-6, weight decay 0.01
(not on biases and LayerNorm weights, on both sides), gradient clipping at norm 1.0, bf16 autocast
on GPU, dropout 0.1 (the checkpoint's), max sequence length 128 (SQuAD 384, stride 128).
bertctl has no flag for Adam's eps: its built-in 1e-6 is recorded (``--adam-eps`` is passed if
its ``--help`` lists one). Batch order: bertctl's default; the Trainer's default random order in
quality runs, and ``group_by_length`` in speed runs when bertctl groups by length by default
(read from ``bertctl finetune glue --help``; ``--hf-group-by-length`` overrides).

Tasks (``--tasks``):
- sst2: GLUE SST-2, the full train set (67,349), dev accuracy.
- conll: CoNLL-2003, epoch chosen on valid entity F1 (both sides), test F1.
- squad: SQuAD v1.1 dev split by article (split.json): train on ``train`` articles, F1/EM on
  ``eval`` articles; ``--squad-epochs`` (default 3, the recipe's).
- paraphrase: MRPC-like pairs built from the corpus (``corpus_tasks.py``), accuracy and F1.
- acceptability: CoLA-like sentences built from the corpus, Matthews correlation.
- similarity: STS-B-like pairs built from the corpus, scored 0-5 (``--regression`` on both sides:
  one output, MSE loss), Pearson and Spearman correlation.
- rte_size: the first 2,490 training pairs of paraphrase (RTE's train size), its dev set: whole-run
  speed, and quality where data is small (234 steps in 3 epochs, a warm-up of 24).
The three built tasks are generated at run time into ``--work`` (never committed).

Modes:
- ``--mode quality``: runs per task, seed and side; ``finetune-<task>.json`` holds per-seed
  metrics of both sides, mean, std (sample), the mean difference (bertctl - HF) with the std of
  the per-seed differences and the standard error of their mean, and whether it meets issue 13's
  target (difference >= -0.3 points).
  ``--jobs N`` runs N processes at once on the one GPU (quality only; their times are not used).
- ``--mode speed``: one process at a time, after a throwaway process that warms the file cache
  and the driver; wall time from process start to ``metrics.json``
  (its modification time) and to exit; ``finetune-speed-<task>.json`` holds both sides, the
  ratio bertctl/HF and whether it meets the target (<= 0.7).
Metrics are in points: accuracy, F1 and EM in percent, Matthews correlation x 100.

Resumable: every run writes ``<out>/finetune-runs/<mode>-<task>-<side>-seed<N>.json``; a run whose
file exists (rc 0, same commit and settings) is skipped unless ``--force``, so a cut-off chunk is
repeated by running the same command again. The summaries are rebuilt from all run files after
each call and by ``--merge`` alone. SIGTERM stops the children and keeps finished runs.

    python benchmarks/finetune/vs_hf.py --model MODEL --data ../shared/data --out benchmarks/results \\
        --tasks paraphrase,acceptability --seeds 42,43,44,45,46 --jobs 4
    python benchmarks/finetune/vs_hf.py --mode speed --tasks rte_size,squad --seeds 42,43,44 ...
    python benchmarks/finetune/vs_hf.py --merge --out benchmarks/results
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
sys.path.append(str(ROOT))  # after PYTHONPATH, so a pinned copy of the package can be benchmarked
sys.path.append(str(HERE))

import corpus_tasks  # noqa: E402
from bertctl.tasks.metrics import (accuracy, binary_f1, conlleval, matthews_corrcoef, pearson,  # noqa: E402
                                   spearman, squad_v1_evaluate)

SIDES = ("bertctl", "hf")
QUALITY_TASKS = ("sst2", "conll", "squad", "paraphrase", "acceptability", "similarity", "rte_size")
SPEED_TASKS = ("rte_size", "sst2", "squad")
PARITY_POINTS = -0.3  # issue 13: bertctl's mean >= the Trainer's minus 0.3 points
SPEED_TARGET = 0.7  # issue 13: whole runs take at most 0.7x the HF script's time
RTE_TRAIN = 2490  # RTE's training set size


@dataclass(frozen=True)
class Task:
    kind: str  # glue, ner or squad
    metrics: tuple[str, ...]  # the first is the main one
    text: tuple[str, ...] = ()  # glue: text column(s)
    regression: bool = False  # glue: the label is a number


TASKS = {
    "sst2": Task("glue", ("accuracy",), ("sentence",)),
    "paraphrase": Task("glue", ("accuracy", "f1"), ("sentence1", "sentence2")),
    "rte_size": Task("glue", ("accuracy", "f1"), ("sentence1", "sentence2")),
    "acceptability": Task("glue", ("matthews_corrcoef", "accuracy"), ("sentence",)),
    "similarity": Task("glue", ("pearson", "spearmanr"), ("sentence1", "sentence2"), regression=True),
    "conll": Task("ner", ("test_f1", "valid_f1")),
    "squad": Task("squad", ("f1", "exact_match")),
}


# ------------------------------------------------------------------------------ inputs


def _write_once(path: Path, text: str) -> None:
    """Write ``path`` unless it exists (atomically: a running child may be reading it)."""
    if path.exists():
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)


def _slice_lines(src: Path, dst: Path, n: int) -> None:
    lines = src.read_text(encoding="utf-8").splitlines(keepends=True)
    _write_once(dst, "".join(lines[: n + 1]))  # header + n rows


def _slice_conll(src: Path, dst: Path, n: int) -> None:
    blocks = [b for b in src.read_text(encoding="utf-8").split("\n\n") if b.strip()]
    _write_once(dst, "\n\n".join(blocks[:n]) + "\n\n")


def _digest(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()[:16]


def model_digest(model: Path) -> str:
    """The checkpoint's weights as both sides load them: sha256 of each tensor's name, dtype, shape and bytes in
    name order (the same for one set of weights however the file orders or pads them), 16 hex digits."""
    import torch
    from safetensors import safe_open

    h = hashlib.sha256()
    with safe_open(str(model / "model.safetensors"), framework="pt") as f:
        for name in sorted(f.keys()):
            t = f.get_tensor(name).contiguous()
            h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()[:16]


def _weights_warning(runs: list[dict]) -> str | None:
    """Why the runs may not share one checkpoint's weights, or None: run files record the weights' digest since
    the field existed (a checkpoint carried as fp16 and widened back is not the original fp32)."""
    digests = {r.get("model_sha256") for r in runs}
    if None in digests:
        n = sum(1 for r in runs if r.get("model_sha256") is None)
        return f"{n} of {len(runs)} runs predate the weights' digest (model_sha256): one checkpoint is not checked"
    if len(digests) > 1:
        return f"runs from different weights: model_sha256 {sorted(digests)}"
    return None


def prepare_inputs(task: str, a) -> dict:
    """The files of one task for both sides (sliced copies with ``--limit``). Files are written
    once into folders named by what they depend on, and never rewritten while runs read them."""
    base = a.work / "inputs" / (task if not a.limit else f"{task}-limit{a.limit}")
    data = a.data
    if task == "sst2":
        src = data / "glue" / "SST-2" if (data / "glue" / "SST-2").exists() else data / "SST-2"
        if a.limit:
            _slice_lines(src / "train.tsv", base / "train.tsv", a.limit)
            _slice_lines(src / "dev.tsv", base / "dev.tsv", max(a.limit // 4, 8))
            src = base
        return {"dir": src, "train": src / "train.tsv", "dev": src / "dev.tsv"}
    if task in ("paraphrase", "acceptability", "similarity", "rte_size"):
        version = f"seed{a.data_seed}-{_digest(Path(corpus_tasks.__file__))}"  # the rules' version
        built = a.work / "inputs" / f"corpus-tasks-{version}"
        if not (built / "stats.json").exists():
            tmp = built.with_name(f"{built.name}.{os.getpid()}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            stats = corpus_tasks.build(data / "corpus", data / "squad" / "dev-v1.1.json", tmp, seed=a.data_seed)
            (tmp / "stats.json").write_text(json.dumps(stats, indent=1) + "\n")
            shutil.rmtree(built, ignore_errors=True)
            tmp.rename(built)
        name = "paraphrase" if task == "rte_size" else task
        train, dev = built / name / "train.tsv", built / name / "dev.tsv"
        n_train = a.limit or (RTE_TRAIN if task == "rte_size" else 0)
        if n_train:
            base = base.with_name(f"{base.name}-{version}")
            _slice_lines(train, base / "train.tsv", n_train)
            train = base / "train.tsv"
            if a.limit:
                _slice_lines(dev, base / "dev.tsv", max(a.limit // 4, 8))
                dev = base / "dev.tsv"
        return {"train": train, "dev": dev}
    if task == "conll":
        src = data / "conll2003"
        if a.limit:
            for name in ("train", "valid", "test"):
                _slice_conll(src / f"{name}.txt", base / f"{name}.txt", a.limit if name == "train" else a.limit // 4)
            src = base
        return {"dir": src, "test": src / "test.txt"}
    if task == "squad":
        src, split = data / "squad" / "dev-v1.1.json", data / "squad" / "split.json"
        if a.limit:  # the first questions of each side of the split, as a smaller file and split
            full = json.loads(src.read_text(encoding="utf-8"))
            titles = json.loads(split.read_text(encoding="utf-8"))
            keep: dict[str, int] = {"train": a.limit, "eval": max(a.limit // 4, 8)}
            side_of = {t: k for k in ("train", "eval") for t in titles[k]}
            articles = []
            for art in full["data"]:
                k = side_of.get(art["title"])
                if k is None or keep[k] <= 0:
                    continue
                paragraphs = []
                for p in art["paragraphs"]:
                    qas = p["qas"][: keep[k]]
                    keep[k] -= len(qas)
                    if qas:
                        paragraphs.append({**p, "qas": qas})
                if paragraphs:
                    articles.append({**art, "paragraphs": paragraphs})
            _write_once(base / "dev-v1.1.json", json.dumps({"version": "1.1", "data": articles}))
            _write_once(base / "split.json", json.dumps(
                {k: [t for t in titles[k] if t in {x["title"] for x in articles}] for k in ("train", "eval")}))
            src, split = base / "dev-v1.1.json", base / "split.json"
        return {"json": src, "split": split}
    raise SystemExit(f"unknown task {task!r}; one of {', '.join(TASKS)}")


# ------------------------------------------------------------------------------ commands


def bertctl_help(a) -> str:
    """``bertctl finetune glue --help`` as one line of words (box drawing and wrapping removed)."""
    env = {**os.environ, "COLUMNS": "400", "PYTHONPATH": _pythonpath()}
    # cwd: the work folder, as for the runs (``python -m`` puts the cwd first on sys.path)
    out = subprocess.run(a.bertctl + ["finetune", "glue", "--help"], capture_output=True, text=True, env=env,
                         cwd=a.work)
    return " ".join(out.stdout.replace("│", " ").split())


def bertctl_groups_by_length(help_text: str) -> bool | None:
    """Whether bertctl's fine-tuning groups batches by length by default, as its --help says."""
    if "[default: group-by-length]" in help_text:
        return True
    if "[default: no-group-by-length]" in help_text:
        return False
    if "--no-group-by-length" in help_text and "default: length-grouped" in help_text:
        return True
    return None


def has_flag(help_text: str, name: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(name)}(?![\w-])", help_text) is not None


def bertctl_flags(help_text: str) -> dict[str, str]:
    """The recipe's flags as this bertctl spells them (the first spelling its --help lists)."""
    spellings = {"epochs": ("--epochs",), "lr": ("--lr",), "batch_size": ("--batch-size",),
                 "warmup": ("--warmup-fraction", "--warmup", "--warmup-ratio"), "weight_decay": ("--weight-decay",),
                 "seed": ("--seed",), "device": ("--device",), "max_steps": ("--max-steps",)}
    flags = {}
    for key, names in spellings.items():
        found = [n for n in names if has_flag(help_text, n)]
        if not found:
            raise SystemExit(f"bertctl finetune glue --help lists none of {', '.join(names)}")
        flags[key] = found[0]
    if has_flag(help_text, "--adam-eps"):
        flags["adam_eps"] = "--adam-eps"
    return flags


def recipe(a) -> dict:
    return {"epochs": a.epochs, "squad_epochs": a.squad_epochs, "lr": a.lr, "batch_size": a.batch_size,
            "eval_batch_size": 128, "warmup": a.warmup, "schedule": "linear warm-up, linear decay to 0",
            "weight_decay": a.weight_decay, "weight_decay_excludes": "biases and LayerNorm weights",
            "adam_betas": [0.9, 0.999], "adam_eps": a.adam_eps, "max_grad_norm": 1.0,
            "bf16": a.device == "cuda", "dropout": "the checkpoint's (0.1)", "max_seq_length": 128,
            "squad_max_seq_length": 384, "doc_stride": 128, "max_steps": a.max_steps or None,
            "limit": a.limit or None}


def commands(task: str, side: str, seed: int, inputs: dict, out: Path, a) -> list[str]:
    t = TASKS[task]
    epochs = a.squad_epochs if task == "squad" else a.epochs
    values = {"epochs": f"{epochs:g}", "lr": f"{a.lr:g}", "batch_size": str(a.batch_size), "warmup": f"{a.warmup:g}",
              "weight_decay": f"{a.weight_decay:g}", "seed": str(seed), "device": a.device,
              "adam_eps": f"{a.adam_eps:g}"}
    if a.max_steps:
        values["max_steps"] = str(a.max_steps)
    if side == "bertctl":
        cmd = a.bertctl + ["finetune", t.kind] + a.bertctl_args
        flags = a.bertctl_flags
    else:
        cmd = [sys.executable, str(HERE / "hf_finetune.py"), t.kind]
        flags = {k: "--" + k.replace("_", "-") for k in values}
    common = ["--model", str(a.model), "--output", str(out)]
    for key, value in values.items():
        if key in flags:
            common += [flags[key], value]
    if side == "hf":
        common += ["--max-grad-norm", "1.0"]
        if a.mode == "speed" and a.hf_group_by_length:
            common += ["--group-by-length"]
    if t.kind == "glue":
        if task == "sst2" and side == "bertctl":  # the canonical GLUE folder, as a user has it
            cmd += ["--task", "sst2", "--data-dir", str(inputs["dir"])]
        else:
            cmd += ["--train", str(inputs["train"]), "--dev", str(inputs["dev"]), "--text-column", t.text[0]]
            if len(t.text) > 1:
                cmd += ["--text-pair-column", t.text[1]]
            cmd += ["--label-column", "label"] + (["--regression"] if t.regression else [])
    elif t.kind == "ner":
        cmd += ["--data-dir", str(inputs["dir"])]
    else:
        split = str(inputs["split"])
        cmd += ["--train", str(inputs["json"]), "--dev", str(inputs["json"]), "--train-articles", f"{split}:train",
                "--dev-articles", f"{split}:eval"]
    return cmd + common


# ------------------------------------------------------------------------------ scoring


def score(task: str, inputs: dict, out: Path) -> dict:
    """Metrics in points from a run's prediction files (the same code for both sides), checked
    against the run's own metrics.json."""
    own = json.loads((out / "metrics.json").read_text())
    kind = TASKS[task].kind
    if kind == "glue":
        preds, gold = [], []
        files = sorted(out.glob("predictions_*.tsv"))  # bertctl: predictions_<dev name>.tsv
        if len(files) != 1:
            raise RuntimeError(f"{out}: expected one predictions_*.tsv, found {[f.name for f in files]}")
        lines = files[0].read_text(encoding="utf-8").splitlines()
        header = lines[0].split("\t")
        ip, il = header.index("prediction"), header.index("label")
        number = float if TASKS[task].regression else int
        for line in lines[1:]:
            cells = line.split("\t")
            preds.append(number(cells[ip]))
            gold.append(number(cells[il]))
        if TASKS[task].regression:
            m = {"pearson": pearson(preds, gold), "spearmanr": spearman(preds, gold)}
            _check(out, own.get("pearson"), m["pearson"], scale=10)  # the predictions are written to 6 decimals
        else:
            m = {"accuracy": accuracy(preds, gold), "f1": binary_f1(preds, gold),
                 "matthews_corrcoef": matthews_corrcoef(preds, gold)}
            _check(out, own.get("accuracy"), m["accuracy"])
        m = {k: 100 * v for k, v in m.items()}
    elif kind == "ner":
        gold, pred, gs, ps = [], [], [], []
        for line in (out / "predictions_test.txt").read_text(encoding="utf-8").splitlines():
            if not line.strip():
                if gs:
                    gold.append(gs)
                    pred.append(ps)
                    gs, ps = [], []
                continue
            cells = line.split()
            gs.append(cells[-2])
            ps.append(cells[-1])
        if gs:
            gold.append(gs)
            pred.append(ps)
        test = conlleval(gold, pred)
        _check(out, own.get("test_f1"), test["f1"])
        m = {"test_f1": 100 * test["f1"], "valid_f1": 100 * own["valid_f1"], "best_epoch": own.get("best_epoch")}
    else:
        split = json.loads(Path(inputs["split"]).read_text())
        data = [art for art in json.loads(Path(inputs["json"]).read_text())["data"] if art["title"] in set(split["eval"])]
        preds = json.loads((out / "predictions.json").read_text())
        m = squad_v1_evaluate(data, preds)
        _check(out, own.get("f1"), m["f1"], scale=100)
        m = {"f1": m["f1"], "exact_match": m["exact_match"]}
    return {"metrics": m, "own_metrics": {k: v for k, v in own.items() if isinstance(v, (int, float, str))}}


def _check(out: Path, own: float | None, ours: float, scale: float = 1.0) -> None:
    if own is not None and abs(own - ours) > 1e-6 * scale:
        raise RuntimeError(f"{out}: metrics.json says {own}, its predictions score {ours}")


# ------------------------------------------------------------------------------ runs


def _pythonpath() -> str:
    """PYTHONPATH for the children: the caller's first (a pinned copy of bertctl), then this checkout."""
    return os.pathsep.join([p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p] + [str(ROOT)])


def commit() -> str:
    """The commit measured: '+dirty' only for changes to the code that runs (results written into the
    tree during a run leave it clean, so finished runs are still recognised)."""
    from bertctl.bench import harness

    return harness.git_commit(ROOT, paths=("bertctl", "csrc", "setup.py"))


def environment(a) -> dict:
    import torch

    def version(name):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return None

    gpu = torch.cuda.get_device_name(0) if a.device == "cuda" and torch.cuda.is_available() else None
    return {"device": gpu or "cpu", "host_cpus": os.cpu_count(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "transformers": version("transformers"), "accelerate": version("accelerate"),
            "python": sys.version.split()[0], "commit": commit()}


def warm_up(a) -> None:
    """One throwaway process that imports what both sides import and starts the device, so that
    the first timed run does not pay for a cold file cache or driver alone."""
    code = ("import torch, transformers, bertctl.cli.app; "
            "torch.zeros(1, device='cuda').sum().item() if torch.cuda.is_available() else None")
    t = time.time()
    subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": _pythonpath()}, cwd=a.work,
                   check=False, capture_output=True)
    print(f"warm-up process: {time.time() - t:.1f} s", flush=True)


@dataclass
class Run:
    mode: str
    task: str
    side: str
    seed: int

    @property
    def name(self) -> str:
        return f"{self.mode}-{self.task}-{self.side}-seed{self.seed}"


def run_settings(run: Run, a) -> dict:
    """What a run's result depends on besides the code: the recipe and the side's batch order."""
    if run.side == "bertctl":
        order = {"length_grouped_by_default": a.bertctl_groups,
                 "flags": " ".join(a.bertctl_args) if a.bertctl_args else "bertctl's defaults"}
    else:
        order = {"group_by_length": bool(a.mode == "speed" and a.hf_group_by_length),
                 "padding": "dynamic, multiple of 8",
                 "checkpoints": "each epoch end, one kept (NER: the best on valid too)"}
    return {"recipe": recipe(a), "side": order}


def is_done(path: Path, run: Run, a) -> bool:
    if a.force or not path.exists():
        return False
    r = json.loads(path.read_text())
    return r.get("rc") == 0 and r.get("environment", {}).get("commit") == a.env["commit"] \
        and r.get("settings") == run_settings(run, a)


class Runner:
    """Starts runs as child processes, at most ``jobs`` at a time, and records each as it ends."""

    def __init__(self, a):
        self.a = a
        self.live: dict = {}  # pid -> (run, proc, start, out, inputs, command, log files)
        self.failed = 0
        signal.signal(signal.SIGTERM, self._stop)

    def _stop(self, *_):
        for _, proc, *_rest in self.live.values():
            proc.terminate()
        for _, proc, *_rest in self.live.values():
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
        raise SystemExit("stopped (SIGTERM); finished runs are kept")

    def start(self, run: Run) -> None:
        a = self.a
        inputs = prepare_inputs(run.task, a)
        out = a.work / "runs" / run.name
        shutil.rmtree(out, ignore_errors=True)  # no stale metrics.json from an earlier run
        (a.work / "logs").mkdir(parents=True, exist_ok=True)
        cmd = commands(run.task, run.side, run.seed, inputs, out, a)
        env = {**os.environ, "PYTHONPATH": _pythonpath()}
        if a.jobs > 1:  # share the host's cores between the concurrent runs
            env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // a.jobs))
        stdout = open(a.work / "logs" / f"{run.name}.out", "w")
        stderr = open(a.work / "logs" / f"{run.name}.err", "w")
        start = time.time()
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env, cwd=a.work)
        self.live[proc.pid] = (run, proc, start, out, inputs, cmd, (stdout, stderr))
        print(f"start {run.name}", flush=True)

    def wait_one(self) -> None:
        pid, status = os.wait()
        if pid not in self.live:
            return
        end = time.time()
        run, proc, start, out, inputs, cmd, files = self.live.pop(pid)
        proc.returncode = os.waitstatus_to_exitcode(status)
        for f in files:
            f.close()
        self.record(run, proc.returncode, start, end, out, inputs, cmd)

    def record(self, run: Run, rc: int, start: float, end: float, out: Path, inputs: dict, cmd: list[str]) -> None:
        a = self.a
        files = [inputs[k] for k in ("train", "dev", "json", "split") if k in inputs] + \
            ([Path(inputs["dir"]) / f"{n}.txt" for n in ("train", "valid", "test")] if run.task == "conll" else [])
        r = {"task": run.task, "mode": run.mode, "side": run.side, "seed": run.seed, "rc": rc,
             "command": [str(c) for c in cmd], "concurrent_runs": a.jobs, "environment": a.env,
             "inputs_sha256": {Path(f).name: _digest(f) for f in files}, "model_sha256": a.model_sha256,
             "settings": run_settings(run, a), "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(start))}
        metrics_file = out / "metrics.json"
        if rc == 0 and metrics_file.exists():
            r["seconds_to_metrics"] = metrics_file.stat().st_mtime - start
            r["seconds_to_exit"] = end - start
            try:
                r.update(score(run.task, inputs, out))
            except (OSError, ValueError, KeyError, RuntimeError) as e:
                r["rc"], r["error"] = -1, f"scoring failed: {e}"
        else:
            err = (a.work / "logs" / f"{run.name}.err").read_text(errors="replace").splitlines()[-30:]
            r["error"] = "\n".join(err)
            r["rc"] = rc or -1
        path = a.out / "finetune-runs" / f"{run.name}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(r, indent=2) + "\n")
        tmp.replace(path)
        if r["rc"] == 0:
            shown = {k: round(v, 2) for k, v in r["metrics"].items() if isinstance(v, float)}
            print(f"done  {run.name}: {shown} in {r['seconds_to_metrics']:.1f} s", flush=True)
            if not a.keep_outputs:
                shutil.rmtree(out, ignore_errors=True)
        else:
            print(f"FAILED {run.name} (rc {r['rc']}):\n{r['error']}", flush=True)
        self.failed += r["rc"] != 0


# ------------------------------------------------------------------------------ summaries


def _stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "min": min(values), "max": max(values), "n": len(values)}


def _common_environment(runs: list[dict]) -> dict:
    """The runs' environment; a key whose runs differ holds the list of their values."""
    envs = [r["environment"] for r in runs]
    out = {}
    for key in envs[0]:
        values = []
        for e in envs:
            if e.get(key) not in values:
                values.append(e.get(key))
        out[key] = values[0] if len(values) == 1 else values
    return out


def _settings(by_side: dict, seeds: list[int]) -> dict:
    first = {s: by_side[s][seeds[0]]["settings"] for s in SIDES}
    return {"recipe": first["bertctl"]["recipe"], **{s: first[s]["side"] for s in SIDES}}


def summarise_quality(task: str, runs: list[dict]) -> dict:
    by_side = {s: {r["seed"]: r for r in runs if r["side"] == s} for s in SIDES}
    seeds = sorted(set(by_side["bertctl"]) & set(by_side["hf"]))
    names = TASKS[task].metrics
    per_seed = [{"seed": s, **{side: {m: by_side[side][s]["metrics"][m] for m in names} for side in SIDES},
                 "wall_seconds": {side: by_side[side][s]["seconds_to_metrics"] for side in SIDES}} for s in seeds]
    result = {"task": task, "mode": "quality", "metric": names[0], "metrics": list(names),
              "units": "points (percent; Matthews correlation x 100); std: sample std over seeds", "seeds": seeds,
              "environment": _common_environment(runs), "settings": _settings(by_side, seeds) if seeds else {},
              "concurrent_runs": max(r["concurrent_runs"] for r in runs), "per_seed": per_seed}
    if not seeds:
        result["incomplete"] = "no seed has both sides"
        return result
    for side in SIDES:
        result[side] = {m: _stats([p[side][m] for p in per_seed]) for m in names}
    result["difference"] = {m: _stats([p["bertctl"][m] - p["hf"][m] for p in per_seed]) for m in names}
    for d in result["difference"].values():  # of the mean difference: how far the target is, in its noise
        d["standard_error"] = d["std"] / d["n"] ** 0.5
    result["meets_target"] = {m: result["difference"][m]["mean"] >= PARITY_POINTS for m in names}
    result["target"] = f"mean(bertctl) - mean(HF) >= {PARITY_POINTS} points over >= 5 seeds"
    result["enough_seeds"] = len(seeds) >= 5
    result["only_one_side"] = sorted((set(by_side["bertctl"]) | set(by_side["hf"])) - set(seeds))
    envs = {(r["environment"]["device"], r["environment"]["commit"]) for r in runs}
    if len(envs) > 1:
        result["warning"] = f"runs from several devices or commits: {sorted(envs)}"
    if (weights := _weights_warning(runs)) is not None:
        result["weights_warning"] = weights
    return result


def summarise_speed(task: str, runs: list[dict]) -> dict:
    by_side = {s: {r["seed"]: r for r in runs if r["side"] == s} for s in SIDES}
    seeds = sorted(set(by_side["bertctl"]) & set(by_side["hf"]))
    result = {"task": task, "mode": "speed", "seeds": seeds, "environment": _common_environment(runs),
              "measure": "seconds from process start to metrics.json (and to exit), one process at a time",
              "settings": _settings(by_side, seeds) if seeds else {},
              "per_seed": [{"seed": s, **{side: {k: by_side[side][s][k] for k in ("seconds_to_metrics",
                                                                                 "seconds_to_exit")}
                                          for side in SIDES},
                            "metric": {side: by_side[side][s]["metrics"][TASKS[task].metrics[0]] for side in SIDES}}
                           for s in seeds]}
    if not seeds:
        result["incomplete"] = "no seed has both sides"
        return result
    for side in SIDES:
        result[side] = {k: _stats([p[side][k] for p in result["per_seed"]]) for k in ("seconds_to_metrics",
                                                                                      "seconds_to_exit")}
    # Training throughput as each side reports it: bertctl's examples/s over its training steps (evaluation
    # excluded), the Trainer's train_samples_per_second (examples x epochs / train() time).
    own = {"bertctl": "train_examples_per_second", "hf": "train_samples_per_second"}
    rates = {side: [by_side[side][s].get("own_metrics", {}).get(own[side]) for s in seeds] for side in SIDES}
    if all(v for side in SIDES for v in rates[side]):
        result["train_examples_per_second"] = {side: _stats(rates[side]) for side in SIDES}
        result["train_examples_per_second"]["ratio"] = (result["train_examples_per_second"]["bertctl"]["mean"]
                                                        / result["train_examples_per_second"]["hf"]["mean"])
    b, h = result["bertctl"]["seconds_to_metrics"]["mean"], result["hf"]["seconds_to_metrics"]["mean"]
    result["ratio"] = b / h
    result["meets_target"] = b / h <= SPEED_TARGET
    result["target"] = f"bertctl / HF <= {SPEED_TARGET}"
    if len({r["environment"]["device"] for r in runs}) > 1 or any(r["concurrent_runs"] != 1 for r in runs):
        result["warning"] = "runs from several devices or run concurrently: not comparable"
    if (weights := _weights_warning(runs)) is not None:
        result["weights_warning"] = weights
    return result


def merge(out: Path) -> list[dict]:
    """Rebuild finetune-<task>.json and finetune-speed-<task>.json from out/finetune-runs/."""
    runs = [json.loads(p.read_text()) for p in sorted((out / "finetune-runs").glob("*.json"))]
    runs = [r for r in runs if r.get("rc") == 0]
    rows = []
    for mode, summarise, prefix in (("quality", summarise_quality, "finetune-"),
                                    ("speed", summarise_speed, "finetune-speed-")):
        for task in TASKS:
            mine = [r for r in runs if r["mode"] == mode and r["task"] == task]
            if not mine:
                continue
            row = summarise(task, mine)
            path = out / f"{prefix}{task}.json"
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text(json.dumps(row, indent=2) + "\n")
            tmp.replace(path)
            rows.append(row)
    return rows


def table(rows: list[dict]) -> None:
    for r in rows:
        if "incomplete" in r:
            print(f"{r['mode']:<8} {r['task']:<14} incomplete: {r['incomplete']}")
        elif r["mode"] == "quality":
            for m in r["metrics"]:
                b, h, d = r["bertctl"][m], r["hf"][m], r["difference"][m]
                print(f"quality  {r['task']:<14} {m:<18} seeds {len(r['seeds'])}  bertctl {b['mean']:6.2f} ± "
                      f"{b['std']:4.2f}  HF {h['mean']:6.2f} ± {h['std']:4.2f}  diff {d['mean']:+6.2f} ± {d['std']:4.2f}"
                      f" (se {d['standard_error']:4.2f})"
                      f"  {'ok' if r['meets_target'][m] else 'BELOW'}")
        else:
            b, h = r["bertctl"]["seconds_to_metrics"], r["hf"]["seconds_to_metrics"]
            print(f"speed    {r['task']:<14} seeds {len(r['seeds'])}  bertctl {b['mean']:7.1f} s ± {b['std']:4.1f}  "
                  f"HF {h['mean']:7.1f} s ± {h['std']:4.1f}  ratio {r['ratio']:.3f}  "
                  f"{'ok' if r['meets_target'] else 'ABOVE'} {SPEED_TARGET}")


# ------------------------------------------------------------------------------ main


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, help="pretrained model directory (HF layout)")
    p.add_argument("--data", type=Path, help="folder with glue/SST-2/ (or SST-2/), conll2003/, squad/, corpus/")
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results",
                   help="results: finetune-runs/ and the summaries (default benchmarks/results)")
    p.add_argument("--work", type=Path, default=Path("/tmp/bertctl-finetune-vs-hf"),
                   help="generated data, run outputs, logs (default /tmp/bertctl-finetune-vs-hf)")
    p.add_argument("--merge", action="store_true", help="only rebuild the summaries from --out/finetune-runs/")
    p.add_argument("--mode", choices=("quality", "speed"), default="quality", help="default quality")
    p.add_argument("--tasks", default=None, help=f"comma-separated (default quality: {','.join(QUALITY_TASKS)}; "
                                                 f"speed: {','.join(SPEED_TASKS)})")
    p.add_argument("--seeds", default="42,43,44,45,46", help="comma-separated (default 42,43,44,45,46)")
    p.add_argument("--sides", default="bertctl,hf", help="default bertctl,hf")
    p.add_argument("--jobs", type=int, default=1, help="runs at once on the one device, quality mode (default 1)")
    p.add_argument("--force", action="store_true", help="rerun runs that already have a result file")
    p.add_argument("--keep-outputs", action="store_true", help="keep each run's output folder (models)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when present)")
    p.add_argument("--bertctl", default=None, help="the command that starts bertctl (default: python -m bertctl)")
    p.add_argument("--bertctl-args", default="", help="more flags for every bertctl run, e.g. '--attn unpadded' "
                   "(recorded in each run's settings; put such runs in their own --out; default none)")
    p.add_argument("--epochs", type=float, default=3.0, help="default 3")
    p.add_argument("--squad-epochs", type=float, default=3.0, help="default 3")
    p.add_argument("--lr", type=float, default=5e-5, help="default 5e-5")
    p.add_argument("--batch-size", type=int, default=32, help="default 32")
    p.add_argument("--warmup", type=float, default=0.1, help="default 0.1")
    p.add_argument("--weight-decay", type=float, default=0.01, help="default 0.01")
    p.add_argument("--adam-eps", type=float, default=1e-6, help="HF side, and bertctl if it has the flag "
                                                                "(default 1e-6, bertctl's built-in)")
    p.add_argument("--hf-group-by-length", choices=("match", "yes", "no"), default="match",
                   help="speed mode: the Trainer's group_by_length (default match: as bertctl's default)")
    p.add_argument("--max-steps", type=int, default=0, help="stop each run after N steps (smoke tests; default 0)")
    p.add_argument("--limit", type=int, default=0, help="train on the first N examples, dev N/4 (default 0: all)")
    p.add_argument("--data-seed", type=int, default=13, help="seed of the built tasks (default 13)")
    a = p.parse_args(argv)
    a.out = a.out.resolve()
    if a.merge:
        table(merge(a.out))
        return 0
    if a.model is None or a.data is None:
        p.error("--model and --data are required (except with --merge)")
    a.model, a.data, a.work = a.model.resolve(), a.data.resolve(), a.work.resolve()
    a.model_sha256 = model_digest(a.model)
    import torch

    a.device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    a.bertctl = shlex.split(a.bertctl) if a.bertctl else [sys.executable, "-m", "bertctl"]
    a.bertctl_args = shlex.split(a.bertctl_args)
    a.work.mkdir(parents=True, exist_ok=True)
    help_text = bertctl_help(a)
    if "--epochs" not in help_text:
        raise SystemExit(f"{' '.join(a.bertctl)} finetune glue --help did not run: is bertctl importable?")
    a.bertctl_flags = bertctl_flags(help_text)
    a.bertctl_groups = bertctl_groups_by_length(help_text)
    if a.hf_group_by_length == "match":
        if a.mode == "speed" and a.bertctl_groups is None:
            raise SystemExit("cannot tell from bertctl's --help whether it groups by length by default: "
                             "pass --hf-group-by-length yes|no")
        a.hf_group_by_length = bool(a.bertctl_groups)
    else:
        a.hf_group_by_length = a.hf_group_by_length == "yes"
    if a.mode == "speed" and a.jobs != 1:
        raise SystemExit("--mode speed times one process at a time: --jobs 1")
    a.env = environment(a)
    tasks = (a.tasks or ",".join(QUALITY_TASKS if a.mode == "quality" else SPEED_TASKS)).split(",")
    for t in tasks:
        if t not in TASKS:
            raise SystemExit(f"unknown task {t!r}; one of {', '.join(TASKS)}")
    sides = a.sides.split(",")
    if set(sides) - set(SIDES):
        raise SystemExit(f"--sides: one or both of {', '.join(SIDES)}")
    seeds = [int(s) for s in a.seeds.split(",")]
    print(json.dumps({"environment": a.env, "bertctl_groups_by_length": a.bertctl_groups,
                      "hf_group_by_length_in_speed_runs": a.hf_group_by_length}), flush=True)

    # Seeds outer, so a cut-off call still leaves whole seeds; sides alternate within a seed.
    todo = [Run(a.mode, t, s, seed) for seed in seeds for t in tasks for s in sides]
    todo = [r for r in todo if not is_done(a.out / "finetune-runs" / f"{r.name}.json", r, a)]
    if a.mode == "speed" and todo:
        warm_up(a)
    runner = Runner(a)
    t0 = time.time()
    for run in todo:
        while len(runner.live) >= a.jobs:
            runner.wait_one()
        runner.start(run)
    while runner.live:
        runner.wait_one()
    print(f"{len(todo)} runs in {time.time() - t0:.0f} s", flush=True)
    table(merge(a.out))
    return 1 if runner.failed else 0


if __name__ == "__main__":
    sys.exit(main())
