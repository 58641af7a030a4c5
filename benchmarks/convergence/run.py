"""The convergence benchmark: pretrain a BERT from scratch with bertctl, show it is worth fine-tuning.

Stages (each resumable: a finished step is skipped when its record exists, ``--force`` redoes it):

- ``prepare``: a WordPiece vocabulary trained on the corpus (``bertctl tokenize train``) and the
  pretraining data (``bertctl build-data``): ``data-nsp`` (MLM + NSP, ``--max-seq-length`` of the
  main run, 128 by default) and ``data-mlm`` (``--objective mlm``, the paper's "No NSP" ablation). The
  preset check runs at sequence length 128: on ``data-nsp`` when that is its length, else on its own
  ``data-nsp128``.
- ``finetune-scratch``: the from-scratch fine-tuning runs (below), which need no pretraining: run first,
  their measured stage plans the pretraining boxes.
- ``pretrain`` / ``pretrain-mlm``: ``bertctl pretrain --cuda-graphs`` on one GPU (``--compile`` with
  ``--no-cuda-graphs``), time-boxed: ``--minutes``, or
  by default the box that makes the whole benchmark fit ``--budget-minutes`` (25) with the measured data
  preparation and three fine-tuning stages as long as the measured from-scratch one:
  ``main`` on ``data-nsp``, ``mlm`` (the ablation) on ``data-mlm`` with the same GPU time. The two
  need not share a GPU or wait for each other.
- ``finetune``: SST-2 (dev accuracy), CoNLL-2003 (test F1, epoch chosen on valid) and the SQuAD v1.1
  article split (F1 on the ``eval`` articles), ``--seeds``, from (a) ``pretrained``: the main
  checkpoint, (b) ``scratch``: the same architecture from random initialisation
  (``finetune --from-scratch``), and ``mlm``: the ablation's checkpoint. The paper's recipe
  (batch 32, lr 5e-5, 3 epochs, warm-up 10%) for every init; ``--jobs`` processes share the GPU,
  the longest runs (SST-2) first.
  Scores are recomputed from the prediction files with the official metrics
  (``benchmarks/finetune/vs_hf.py``'s ``score``).
- ``race``: transformers' BertForPreTraining (``hf_pretrain.py``) for ``--race-minutes`` and
  ``bertctl pretrain`` for 0.6 times that, same shards, model, recipe and seed, one process at a
  time; wall-clock from process start. The target: bertctl's final held-out MLM accuracy at least
  HF's.
- ``presets``: every ``--preset-sizes`` preset at its default lr and warm-up (6% of the steps),
  batch 256 for ``--preset-steps`` steps and batch 2048 for half as many (``--preset-batches``), at sequence length 128: held-out MLM
  accuracy against the majority-token baseline and bertctl's collapse warning. ``--preset-lr``,
  ``--preset-warmup`` and ``--preset-optimizer`` run them with another lr, warm-up fraction or
  optimizer instead, for comparison (records named ``preset-SIZE-BATCH-lrX-warmupY-OPT``);
  ``--preset-nproc N`` runs each under torchrun on N GPUs (the same global batch).
- ``report``: ``convergence.json`` (every record, the targets, provenance of the corpus, the
  benchmark's time: ``prepare`` + both pretraining runs + the fine-tuning stage on each GPU, the
  figure a one-GPU machine would take end to end) and ``convergence-curves.png`` in ``--results``.
- ``pool``: several reports of the same recipe with different pretraining ``--seed`` s (``--reports``,
  e.g. one ``--work`` directory per seed) as one: each pretraining seed's held-out accuracy and
  fine-tuned scores, their mean and spread over the pretraining seeds, and the gaps and targets on
  the means (``convergence-seeds.json`` and ``convergence-seeds.png`` in ``--results``). One
  pretraining run is one draw: the SST-2 score of its fine-tuned model moves by about a point from
  seed to seed, as much as the target's margin.

Every record keeps the GPU it ran on (``CUDA_VISIBLE_DEVICES``), so stages may run side by side on
the GPUs of one machine, each with ``CUDA_VISIBLE_DEVICES`` set.

    python benchmarks/convergence/gather_corpus.py --out build/convergence-corpus
    python benchmarks/convergence/run.py prepare finetune-scratch pretrain pretrain-mlm finetune \
        --work /tmp/conv --data ../shared/data
    python benchmarks/convergence/run.py report --work /tmp/conv --results benchmarks/results
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks" / "finetune"))

import vs_hf as finetune_vs_hf  # noqa: E402  (scoring from prediction files, commit and environment)

BERTCTL = [sys.executable, "-m", "bertctl"]


def torchrun(nproc: int) -> list[str]:
    """``BERTCTL`` launched on ``nproc`` GPUs of this machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "-m",
            "bertctl"]
TASKS = ("sst2", "conll", "squad")
TARGET_MINUTES = 25.0  # the whole benchmark on one GPU
INITS = ("pretrained", "scratch", "mlm")
METRIC = {"sst2": "accuracy", "conll": "test_f1", "squad": "f1"}
TARGET_GAP = {"sst2": 5.0, "conll": 10.0, "squad": 10.0}  # (a) - (b), points
RACE_SHARE = 0.6
FINETUNE_DROPOUT = 0.1  # the paper's, whatever dropout pretraining ran with
PRESET_SIZES = ("tiny", "mini", "small", "medium", "base", "large")


def log_path(a, name: str) -> Path:
    (a.work / "logs").mkdir(parents=True, exist_ok=True)
    return a.work / "logs" / f"{name}.log"


def run(cmd: list[str], a, name: str, *, cwd: Path | None = None) -> dict:
    """Run ``cmd``; stdout (a JSON summary for bertctl commands) and stderr go to the log. Raises on failure."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    t0, w0 = time.perf_counter(), time.time()
    with open(log_path(a, name), "w", encoding="utf-8") as log:
        log.write("$ " + shlex.join(cmd) + "\n")
        log.flush()
        proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=log, text=True, env=env, cwd=cwd or ROOT)
        log.write(proc.stdout)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{name}: exit {proc.returncode} after {seconds:.0f} s; see {log_path(a, name)}")
    out = proc.stdout
    summary = json.loads(out[out.index("{"):]) if "{" in out else None
    return {"command": shlex.join(cmd), "seconds": round(seconds, 2), "started": w0, "summary": summary,
            "device": device_name(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES", "0"),
            "versions": versions(), "commit": finetune_vs_hf.commit()}


def versions() -> dict:
    from importlib import metadata

    out = {"python": sys.version.split()[0]}
    for dist in ("torch", "transformers", "numpy"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    return out


def device_name() -> str:
    """The GPU's name (``nvidia-smi``), else ``cpu``: the report is written where the runs were not."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
        return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "cpu"
    except (OSError, subprocess.SubprocessError):
        return "cpu"


def record(a, name: str, make) -> dict:
    """``make()`` once: its result is kept in ``work/records/name.json``."""
    path = a.work / "records" / f"{name}.json"
    if path.is_file() and not a.force:
        return json.loads(path.read_text())
    path.parent.mkdir(parents=True, exist_ok=True)
    rec = make()
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(rec, indent=1, default=str) + "\n")
    tmp.replace(path)
    return rec


# ------------------------------------------------------------------------------ stages


def prepare(a) -> None:
    corpus = [str(a.corpus), "--format", "jsonl", "--pattern", "*.jsonl"]
    vocab = a.work / "vocab.txt"
    record(a, "vocab", lambda: run(BERTCTL + ["tokenize", "train", *corpus, "--vocab-size", str(a.vocab_size),
                                              "-o", str(vocab)], a, "vocab"))
    build_data(a, "data-nsp", ["--max-seq-length", str(a.seq), "--dupe-factor", str(a.dupe)])
    if "mlm" in a.inits:
        build_data(a, "data-mlm", ["--max-seq-length", str(a.seq), "--objective", "mlm", "--dupe-factor", str(a.dupe)])


def build_data(a, name: str, extra: list[str]) -> None:
    corpus = [str(a.corpus), "--format", "jsonl", "--pattern", "*.jsonl"]
    record(a, name, lambda: run(
        BERTCTL + ["build-data", *corpus, "--vocab", str(a.work / "vocab.txt"), "-o", str(a.work / name), *extra,
                   "--dynamic-masking", "--holdout-fraction", str(a.holdout),
                   "--workers", str(a.workers), "--no-progress"], a, name))


def pretrain_cmd(a, data: str, out: Path, *, minutes: float | None = None, max_steps: int | None = None,
                 size: str | None = None, batch: int | None = None, eval_every: int | None = None) -> list[str]:
    cmd = BERTCTL + ["pretrain", "--data", str(a.work / data), "-o", str(out), "--model-size", size or a.model_size,
                     "--batch-size", str(batch or a.batch), "--eval-every", str(eval_every or a.eval_every),
                     "--eval-batches", str(a.eval_batches), "--seed", str(a.seed), "--no-progress", "--resume",
                     "--save-minutes", "3"]
    if a.cuda_graphs:
        cmd.append("--cuda-graphs")
    elif a.compile:
        cmd.append("--compile")
    if a.pretrain_dropout is not None:
        cmd += ["--dropout", f"{a.pretrain_dropout:g}"]
    if minutes is not None:
        cmd += ["--minutes", f"{minutes:g}"]
    if max_steps is not None:
        cmd += ["--max-steps", str(max_steps)]
    return cmd


#: Seconds a pretraining process takes beyond its time box: start-up, the final evaluation and the
#: export (the ``pretrain`` records' seconds in ``benchmarks/results/convergence-h100-43ab90f.json``).
PRETRAIN_OVERHEAD_S = 25.0
#: Seconds kept back from the budget when planning the boxes: the plan rests on measured stages.
PLAN_MARGIN_S = 30.0


def plan_minutes(a) -> tuple[float, dict]:
    """Each pretraining run's time box: ``--minutes``, or planned so that the whole benchmark fits
    ``--budget-minutes`` of one GPU. The plan takes the measured data preparation and the measured
    from-scratch fine-tuning stage (``finetune-scratch``, which needs no pretraining and so runs
    first), and counts the two fine-tuning stages still to come (the pretrained model's and the
    ablation's: the same architecture, tasks, seeds and runs) as long as that one."""
    if a.minutes is not None:
        return a.minutes, {"minutes": a.minutes, "how": "--minutes"}
    stages = benchmark_time(load_records(a))
    scratch = [v for k, v in stages["finetune_stage_seconds"].items() if k.endswith("scratch")]
    if not scratch:
        raise SystemExit("pretrain: no --minutes and no measured from-scratch fine-tuning stage to plan the boxes "
                         "from; run the finetune-scratch stage first, or give --minutes")
    prep = sum(stages["prepare_seconds"].values())
    ft = max(scratch)
    box = (a.budget_minutes * 60 - prep - 3 * ft - 2 * PRETRAIN_OVERHEAD_S - PLAN_MARGIN_S) / 2
    if box < 60:
        raise SystemExit(f"pretrain: a {a.budget_minutes:g}-minute budget leaves {box:.0f} s per pretraining run "
                         f"after the data ({prep:.0f} s) and three fine-tuning stages of {ft:.0f} s")
    plan = {"minutes": round(box / 60, 2), "how": "planned from --budget-minutes", "budget_minutes": a.budget_minutes,
            "prepare_seconds": round(prep, 2), "finetune_scratch_stage_seconds": round(ft, 2),
            "finetune_stages_counted": 3, "pretrain_overhead_seconds": PRETRAIN_OVERHEAD_S,
            "margin_seconds": PLAN_MARGIN_S}
    return plan["minutes"], plan


def pretrain(a, name: str) -> dict:
    data = "data-nsp" if name == "main" else "data-mlm"

    def make():
        minutes, plan = plan_minutes(a)
        print(f"pretrain-{name}: a {minutes:g}-minute box ({plan['how']})", file=sys.stderr, flush=True)
        rec = run(pretrain_cmd(a, data, a.work / f"pretrain-{name}", minutes=minutes), a, f"pretrain-{name}")
        rec["box"] = plan
        return rec
    return record(a, f"pretrain-{name}", make)


def task_inputs(a) -> dict:
    d = a.data
    return {"sst2": {"dir": d / "glue" / "SST-2"}, "conll": {"dir": d / "conll2003"},
            "squad": {"json": d / "squad" / "dev-v1.1.json", "split": d / "squad" / "split.json"}}


def architecture(a) -> dict:
    """The main run's architecture for the from-scratch runs, before any pretraining: ``bertctl pretrain``
    on the same data and settings for one step, uncompiled; its exported ``model/config.json`` is all
    ``finetune --from-scratch`` reads."""
    cmd = pretrain_cmd(a, "data-nsp", a.work / "architecture", max_steps=1)
    cmd = [c for c in cmd if c not in ("--compile", "--cuda-graphs")]
    return record(a, "architecture", lambda: run(cmd, a, "architecture"))


def finetune_cmd(a, task: str, init: str, seed: int, out: Path) -> list[str]:
    run_dir = {"mlm": "pretrain-mlm", "pretrained": "pretrain-main", "scratch": "architecture"}[init]
    model = a.work / run_dir / "model"
    inputs = task_inputs(a)[task]
    if task == "sst2":
        cmd = BERTCTL + ["finetune", "glue", "--task", "sst2", "--data-dir", str(inputs["dir"])]
    elif task == "conll":
        cmd = BERTCTL + ["finetune", "ner", "--data-dir", str(inputs["dir"])]
    else:  # windows as long as the pretraining sequences: positions beyond were never trained
        split = str(inputs["split"])
        cmd = BERTCTL + ["finetune", "squad", "--train", str(inputs["json"]), "--dev", str(inputs["json"]),
                         "--train-articles", f"{split}:train", "--dev-articles", f"{split}:eval",
                         "--max-seq-length", str(a.seq), "--doc-stride", str(a.seq // 2)]
    cmd += ["--model", str(model), "-o", str(out), "--seed", str(seed), "--no-progress", "--no-tensorboard"]
    if a.pretrain_dropout is not None:  # the exported config carries pretraining's dropout: fine-tune at the paper's
        cmd += ["--dropout", f"{FINETUNE_DROPOUT:g}"]
    return cmd + (["--from-scratch"] if init == "scratch" else [])


def finetune(a, inits: list[str] | None = None) -> list[dict]:
    """Fine-tune every (task, init, seed), ``--jobs`` at a time; each record names its stage (the inits
    fine-tuned together), whose span on its GPU is what the benchmark's time counts."""
    inits = inits or a.inits
    stage = "+".join(inits)
    if "scratch" in inits:
        architecture(a)
    jobs = [(task, init, seed) for task in a.tasks for init in inits for seed in a.seeds]  # SST-2, the longest, first

    def one(job):
        task, init, seed = job
        name = f"ft-{init}-{task}-{seed}"
        out = a.work / "finetune" / name

        def make():
            rec = run(finetune_cmd(a, task, init, seed, out), a, name)
            rec.update(task=task, init=init, seed=seed, stage=stage,
                       **finetune_vs_hf.score(task, task_inputs(a)[task], out))
            return rec
        try:
            return record(a, name, make)
        except Exception as e:  # one failed run must not stop the others; it is reported
            print(f"{name}: {e}", file=sys.stderr)
            return {"task": task, "init": init, "seed": seed, "error": str(e)}

    with ThreadPoolExecutor(a.jobs) as pool:
        return list(pool.map(one, jobs))


def race(a) -> dict:
    hf = record(a, "race-hf", lambda: run(
        [sys.executable, str(ROOT / "benchmarks" / "convergence" / "hf_pretrain.py"), "--data",
         str(a.work / "data-nsp"), "-o", str(a.work / "race-hf"), "--model-size", a.model_size, "--batch-size",
         str(a.batch), "--minutes", f"{a.race_minutes:g}", "--eval-every", str(a.race_eval_every), "--eval-batches",
         str(a.eval_batches), "--seed", str(a.seed)], a, "race-hf"))
    ours = record(a, "race-bertctl", lambda: run(
        pretrain_cmd(a, "data-nsp", a.work / "race-bertctl", minutes=RACE_SHARE * a.race_minutes,
                     eval_every=a.race_eval_every), a, "race-bertctl"))
    return {"hf": hf, "bertctl": ours}


def presets(a) -> list[dict]:
    # Built here, not by ``prepare``: the main benchmark's time leaves it out. The preset check draws at
    # most 1M sequences: 5 passes (1.1M instances at 128) are enough.
    data = "data-nsp" if a.seq == 128 and a.dupe == 5 else "data-nsp128"
    if data == "data-nsp128":
        build_data(a, data, ["--max-seq-length", "128", "--dupe-factor", "5"])
    out = []
    for size in a.preset_sizes:
        for batch in a.preset_batches:
            name = (f"preset-{size}-{batch}" + (f"-lr{a.preset_lr:g}" if a.preset_lr else "")
                    + (f"-warmup{a.preset_warmup:g}" if a.preset_warmup else "")
                    + (f"-{a.preset_optimizer}" if a.preset_optimizer else ""))
            steps = a.preset_steps if batch == 256 else a.preset_steps // 2  # 2048: 4x the sequences all the same
            cmd = pretrain_cmd(a, data, a.work / name, max_steps=steps, size=size, batch=batch,
                               eval_every=max(1, steps // 8))
            if a.preset_lr:  # another lr than the preset's default, to compare
                cmd += ["--lr", f"{a.preset_lr:g}"]
            if a.preset_warmup:
                cmd += ["--warmup-fraction", f"{a.preset_warmup:g}"]
            if a.preset_optimizer:
                cmd += ["--optimizer", a.preset_optimizer]
            cmd = [c for c in cmd if c not in ("--compile", "--cuda-graphs")]
            if a.preset_micro_batch and batch > a.preset_micro_batch:  # accumulation: the same maths, less memory
                cmd += ["--micro-batch-size", str(a.preset_micro_batch)]
            if a.preset_nproc > 1:  # data-parallel over the GPUs; --batch-size stays the global batch
                cmd = torchrun(a.preset_nproc) + cmd[len(BERTCTL):]
            try:
                out.append(record(a, name, lambda cmd=cmd, name=name: {**run(cmd, a, name), "size": size,
                                                                        "batch": batch, "dir": name}))
            except Exception as e:
                print(f"{name}: {e}", file=sys.stderr)
                out.append({"size": size, "batch": batch, "error": str(e)})
    return out


# ------------------------------------------------------------------------------ report


def events(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def curve(run_dir: Path, started: float) -> list[dict]:
    """Held-out evaluations of a run: step, seconds since its process started, MLM/NSP accuracy."""
    return [{"step": e["step"], "wall_seconds": round(e["time"] - started, 2), "mlm_acc": e["mlm_acc"],
             "nsp_acc": e.get("nsp_acc"), "mlm_loss": e["mlm_loss"], "perplexity": e.get("perplexity")}
            for e in events(run_dir / "metrics.jsonl") if e["event"] == "eval"]


def stats(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def load_records(a) -> dict[str, dict]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((a.work / "records").glob("*.json"))}


def report(a) -> dict:
    recs = load_records(a)
    # The recipe; each record keeps the exact command it ran.
    keep = ("vocab_size", "seq", "dupe", "holdout", "model_size", "batch", "minutes", "eval_every", "eval_batches",
            "seed", "compile", "cuda_graphs", "pretrain_dropout", "tasks", "seeds")
    res: dict = {"benchmark": "convergence", "commit": finetune_vs_hf.commit(),
                 "settings": {k: getattr(a, k) for k in keep}}
    box = (recs.get("pretrain-main") or {}).get("box")
    if box:  # the time box each pretraining run had, and how it was planned
        res["settings"]["minutes"] = box["minutes"]
        res["settings"]["box"] = box
    if a.note:
        res["note"] = a.note
    # where the runs ran (the report may be written elsewhere)
    res["devices"] = sorted({r.get("device", "?") for r in recs.values()})
    res["run_versions"] = sorted({json.dumps(r.get("versions"), sort_keys=True) for r in recs.values()})
    res["run_commits"] = sorted({str(r.get("commit")) for r in recs.values()})
    prov = a.corpus / "provenance.json"
    if prov.is_file():
        res["corpus"] = json.loads(prov.read_text())
    res["prepare"] = {k: {"seconds": v["seconds"], "summary": v["summary"]} for k, v in recs.items()
                      if k == "vocab" or k.startswith("data-")}
    for name in ("main", "mlm"):
        r = recs.get(f"pretrain-{name}")
        if r:
            s = r["summary"]
            res[f"pretrain_{name}"] = {"command": r["command"], "seconds": r["seconds"], "steps": s.get("steps"),
                                       "eval_start": s.get("eval_start"), "eval_end": s.get("eval_end"),
                                       "summary": s, "curve": curve(a.work / f"pretrain-{name}", r["started"])}
    runs = [r for k, r in recs.items() if k.startswith("ft-")]
    table: dict = {}
    for task in TASKS:
        for init in INITS:
            vals = [r["metrics"][METRIC[task]] for r in runs if r["task"] == task and r["init"] == init]
            if vals:
                table.setdefault(task, {})[init] = stats(vals)
        t = table.get(task, {})
        if "pretrained" in t and "scratch" in t:
            gap = t["pretrained"]["mean"] - t["scratch"]["mean"]
            t["gap_pretrained_minus_scratch"] = gap
            t["target_gap"] = TARGET_GAP[task]
            t["meets_target"] = gap >= TARGET_GAP[task]
        if "pretrained" in t and "mlm" in t:
            t["gap_nsp_minus_mlm_only"] = t["pretrained"]["mean"] - t["mlm"]["mean"]
    res["finetune"] = {"metrics": {t: METRIC[t] for t in TASKS}, "table": table,
                       "runs": [{k: r.get(k) for k in ("task", "init", "seed", "metrics", "seconds", "command")}
                                for r in runs]}
    res["benchmark_time"] = benchmark_time(recs)
    end = (res.get("pretrain_main") or {}).get("eval_end") or {}
    if end:
        res["pretrain_targets"] = {"heldout_nsp_acc": end.get("nsp_acc"), "nsp_target": 0.85,
                                   "nsp_meets_target": (end.get("nsp_acc") or 0) >= 0.85,
                                   "heldout_mlm_acc": end.get("mlm_acc"), "heldout_perplexity": end.get("perplexity")}
    if "race-hf" in recs and "race-bertctl" in recs:
        hf, ours = recs["race-hf"], recs["race-bertctl"]
        hf_curve, our_curve = curve(a.work / "race-hf", hf["started"]), curve(a.work / "race-bertctl", ours["started"])
        target = hf_curve[-1]["mlm_acc"]
        reached = next((p for p in our_curve if p["mlm_acc"] >= target), None)
        res["race"] = {
            "hf": {"command": hf["command"], "wall_seconds": hf["seconds"], "summary": hf["summary"], "curve": hf_curve},
            "bertctl": {"command": ours["command"], "wall_seconds": ours["seconds"], "summary": ours["summary"],
                        "curve": our_curve},
            "hf_final_mlm_acc": target, "bertctl_final_mlm_acc": our_curve[-1]["mlm_acc"],
            "bertctl_reaches_hf_final_at_seconds": reached and reached["wall_seconds"],
            "time_ratio": reached and reached["wall_seconds"] / hf["seconds"],
            "target_ratio": RACE_SHARE,
            "meets_target": bool(reached) and reached["wall_seconds"] <= RACE_SHARE * hf["seconds"]}
    elif (a.work / "race-hf" / "metrics.jsonl").is_file() and "pretrain-main" in recs:
        res["race_incomplete"] = partial_race(a, recs["pretrain-main"])
    pre = [r for k, r in recs.items() if k.startswith("preset-")]
    if pre:
        res["presets"] = []
        for r in pre:
            s = r.get("summary") or {}
            end = s.get("eval_end") or {}
            base = end.get("mlm_majority_baseline")
            from bertctl.train.pretrain import PRESET_LR

            run_dir = a.work / r.get("dir", f"preset-{r.get('size')}-{r.get('batch')}")
            given = _flag(r.get("command", ""), "--lr")
            training = _run_training(run_dir)
            lr = training.get("lr") or (float(given) if given else PRESET_LR.get(r.get("size")))
            warmup = training.get("warmup_fraction", 0.06)
            res["presets"].append({"size": r.get("size"), "batch": r.get("batch"), "lr": lr,
                                   "lr_given": given is not None, "lr_is_todays_default": lr == PRESET_LR.get(r.get("size")),
                                   "collapse_warning": _collapse(run_dir, lr, r.get("batch"), warmup),
                                   "warmup_fraction": warmup, "optimizer": training.get("optimizer", "adamw"),
                                   "steps": s.get("steps"),
                                   "mlm_acc": end.get("mlm_acc"), "majority_baseline": base,
                                   "nsp_acc": end.get("nsp_acc"), "collapsed": bool(s.get("collapsed")),
                                   "learns": bool(base is not None and end.get("mlm_acc", 0) > 1.5 * base),
                                   "mlm_loss": end.get("mlm_loss"), "unigram_entropy": end.get("mlm_unigram_entropy"),
                                   "micro_batch": _flag(r.get("command", ""), "--micro-batch-size"),
                                   "curve": _preset_curve(run_dir),
                                   "seconds": r.get("seconds"), "error": r.get("error")})
    return write_result(a, res, "convergence.json", plot, "convergence-curves.png")


def write_result(a, res: dict, name: str, draw, picture: str) -> dict:
    """``res`` as ``--results``/``name`` (written whole, then renamed) and its picture beside it."""
    a.results.mkdir(parents=True, exist_ok=True)
    path = a.results / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str) + "\n")
    tmp.replace(path)
    draw(res, a.results / picture)
    return res


def pool(a) -> dict:
    """The reports of several pretraining seeds (``--reports``) as one: per seed, and the mean and spread
    over seeds. Fine-tuning from random weights does not depend on the pretraining seed, so its runs
    are pooled from the reports that have them; each gap is the pretrained mean over pretraining seeds
    minus that. The reports must share the recipe (every setting but ``seed``)."""
    reports = [json.loads(Path(p).read_text()) for p in a.reports]

    def recipe(r: dict) -> dict:
        return {k: v for k, v in r["settings"].items() if k != "seed"}

    for path, r in zip(a.reports, reports):
        if "pretrain_main" not in r:
            raise SystemExit(f"pool: {path} has no main pretraining run")
        if recipe(r) != recipe(reports[0]):
            differ = sorted(k for k in recipe(r).keys() | recipe(reports[0]).keys()
                            if recipe(r).get(k) != recipe(reports[0]).get(k))
            raise SystemExit(f"pool: {path} differs from {a.reports[0]} beyond the seed: {', '.join(differ)}")
    seeds = [r["settings"]["seed"] for r in reports]
    if len(set(seeds)) != len(seeds):
        raise SystemExit(f"pool: a pretraining seed appears twice among the reports: {seeds}")
    per_seed = []
    for path, r in zip(a.reports, reports):
        end = r["pretrain_main"]["eval_end"]
        table = r["finetune"]["table"]
        per_seed.append({"seed": r["settings"]["seed"], "report": Path(path).name, "commits": r["run_commits"],
                         "steps": r["pretrain_main"]["steps"], "heldout_mlm_acc": end["mlm_acc"],
                         "heldout_nsp_acc": end["nsp_acc"], "heldout_perplexity": end.get("perplexity"),
                         "pretrained": {t: table[t]["pretrained"] for t in TASKS if "pretrained" in table.get(t, {})},
                         "curve": r["pretrain_main"]["curve"]})
    pretraining = {k: stats([p[k] for p in per_seed]) for k in ("steps", "heldout_mlm_acc", "heldout_nsp_acc")}
    nsp = pretraining["heldout_nsp_acc"]
    pretraining.update(nsp_target=0.85, nsp_meets_target=nsp["mean"] >= 0.85,
                       seeds_meeting_nsp_target=sum(v >= 0.85 for v in nsp["values"]))
    finetune: dict = {}
    for task in TASKS:
        means = [p["pretrained"][task]["mean"] for p in per_seed if task in p["pretrained"]]
        scratch = [v for r in reports
                   for v in (r["finetune"]["table"].get(task, {}).get("scratch") or {}).get("values", [])]
        if not means:
            continue
        t = finetune[task] = {"metric": METRIC[task], "pretrained_over_pretraining_seeds": stats(means)}
        if scratch:
            base = statistics.fmean(scratch)
            t["scratch"] = stats(scratch)
            t["gap_pretrained_minus_scratch"] = statistics.fmean(means) - base
            t["gap_per_pretraining_seed"] = [m - base for m in means]
            t["target_gap"] = TARGET_GAP[task]
            t["meets_target"] = t["gap_pretrained_minus_scratch"] >= TARGET_GAP[task]
            t["seeds_meeting_target"] = sum(m - base >= TARGET_GAP[task] for m in means)
    res = {"benchmark": "convergence, several pretraining seeds", "commit": finetune_vs_hf.commit(),
           "settings": recipe(reports[0]), "pretraining_seeds": seeds,
           "devices": sorted({d for r in reports for d in r.get("devices", [])}),
           "run_commits": sorted({c for r in reports for c in r.get("run_commits", [])}),
           "pretraining": pretraining, "finetune": finetune, "per_seed": per_seed}
    if a.note:
        res["note"] = a.note
    return write_result(a, res, "convergence-seeds.json", plot_seeds, "convergence-seeds.png")


def plot_seeds(res: dict, path: Path) -> None:
    """Each pretraining seed's held-out curves, and each task's fine-tuned score per pretraining seed
    against the from-scratch runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11.4, 4.8))
    for p in res["per_seed"]:
        line, = left.plot([x["step"] for x in p["curve"]], [x["mlm_acc"] for x in p["curve"]],
                          label=f"seed {p['seed']}: MLM")
        left.plot([x["step"] for x in p["curve"]], [x["nsp_acc"] for x in p["curve"]], ":", color=line.get_color(),
                  label=f"seed {p['seed']}: NSP")
    left.axhline(res["pretraining"]["nsp_target"], color="grey", lw=0.8, ls="--")
    left.set_xlabel("step")
    left.set_ylabel("held-out accuracy")
    left.set_title("bertctl pretraining, one run per seed (held out)")
    left.legend(fontsize=8)
    tasks = list(res["finetune"])
    for i, task in enumerate(tasks):
        t = res["finetune"][task]
        right.scatter([i - 0.12] * len(t["pretrained_over_pretraining_seeds"]["values"]),
                      t["pretrained_over_pretraining_seeds"]["values"], color="C0",
                      label="(a) pretrained, one point per pretraining seed" if i == 0 else None)
        if "scratch" in t:
            right.scatter([i + 0.12] * len(t["scratch"]["values"]), t["scratch"]["values"], color="C1",
                          label="(b) random init, one point per run" if i == 0 else None)
    right.set_xticks(range(len(tasks)))
    right.set_xticklabels([f"{k}\n{METRIC[k]}" for k in tasks])
    right.set_title("fine-tuned (each pretrained point: mean over fine-tuning seeds)")
    right.legend(fontsize=8)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def _flag(command: str, flag: str) -> str | None:
    words = shlex.split(command)
    return words[words.index(flag) + 1] if flag in words else None


def _collapse(run_dir: Path, lr: float | None, batch: int | None, warmup_fraction: float = 0.06) -> str | None:
    """The collapse warning today's rule gives on a run's evaluations (a run made before the rule
    changed carries the old verdict in its summary)."""
    from bertctl.train.engine import warmup_steps
    from bertctl.train.pretrain import collapse_warning

    path = run_dir / "metrics.jsonl"
    if not path.is_file() or lr is None or not batch:
        return None
    evs = [e for e in events(path) if e["event"] == "eval" and e["step"] > 0]
    steps = max((e["step"] for e in evs), default=0)
    warmup = warmup_steps(steps, None, warmup_fraction)
    for prev, ev in zip(evs, evs[1:]):
        warning = collapse_warning(prev, ev, ev["step"], warmup, steps, lr, batch)
        if warning:
            return warning
    return None


def _run_training(run_dir: Path) -> dict:
    """The training settings a run used (lr, warm-up, optimizer), from its config event: what the
    code of its day chose."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return {}
    config = next((e for e in events(path) if e["event"] == "config"), {})
    return (config.get("configs") or {}).get("training") or {}


def _preset_curve(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [{"step": e["step"], "mlm_acc": round(e["mlm_acc"], 4), "mlm_loss": round(e["mlm_loss"], 4)}
            for e in events(path) if e["event"] == "eval"]


def benchmark_time(recs: dict[str, dict]) -> dict:
    """What the benchmark costs on one GPU machine: the data (vocabulary and both builds), both
    pretraining runs and each fine-tuning stage on each GPU it used (runs sharing a GPU overlap, so
    a stage counts from its first start to its last finish; a stage is the inits fine-tuned
    together, e.g. ``scratch`` before pretraining). The race and the presets are apart."""
    prep = {k: recs[k]["seconds"] for k in ("vocab", "data-nsp", "data-mlm", "architecture") if k in recs}
    pre = {k: recs[k]["seconds"] for k in ("pretrain-main", "pretrain-mlm") if k in recs}
    spans: dict[str, list[float]] = {}
    for k, r in recs.items():
        if k.startswith("ft-") and "started" in r:
            key = f"gpu {r.get('gpu', '0')}" + (f", {r['stage']}" if r.get("stage") else "")
            lo, hi = spans.setdefault(key, [float("inf"), 0.0])
            spans[key] = [min(lo, r["started"]), max(hi, r["started"] + r["seconds"])]
    ft = {g: round(hi - lo, 2) for g, (lo, hi) in sorted(spans.items())}
    total = sum(prep.values()) + sum(pre.values()) + sum(ft.values())
    return {"prepare_seconds": prep, "pretrain_seconds": pre, "finetune_stage_seconds": ft,
            "total_minutes": round(total / 60, 2), "target_minutes": TARGET_MINUTES,
            "meets_target": total <= TARGET_MINUTES * 60}


def partial_race(a, main: dict) -> dict:
    """An HF race run that did not finish: its evaluations so far against the main bertctl run's, both timed
    from their config event (imports and data loading excluded on both sides, compilation included for
    bertctl). The schedules differ (the main run's warm-up and decay span its own, longer time box), so
    this compares progress, not final models."""
    ev = events(a.work / "race-hf" / "metrics.jsonl")
    t_hf = next(e for e in ev if e["event"] == "config")["time"]
    plan = next((e for e in ev if e["event"] == "plan"), {})
    hf = [{"step": e["step"], "seconds": round(e["time"] - t_hf, 2), "mlm_acc": e["mlm_acc"], "nsp_acc": e.get("nsp_acc")}
          for e in ev if e["event"] == "eval"]
    ours_ev = events(a.work / "pretrain-main" / "metrics.jsonl")
    t_b = next(e for e in ours_ev if e["event"] == "config")["time"]
    ours = [{"step": e["step"], "seconds": round(e["time"] - t_b, 2), "mlm_acc": e["mlm_acc"], "nsp_acc": e.get("nsp_acc")}
            for e in ours_ev if e["event"] == "eval"]
    points = []
    for h in hf[1:]:
        hit = next((o for o in ours if o["mlm_acc"] >= h["mlm_acc"]), None)
        points.append({"hf_step": h["step"], "hf_seconds": h["seconds"], "hf_mlm_acc": h["mlm_acc"],
                       "bertctl_step": hit and hit["step"], "bertctl_seconds": hit and hit["seconds"],
                       "time_ratio": hit and round(hit["seconds"] / h["seconds"], 3)})
    return {"complete": False, "hf_planned_steps": plan.get("max_steps"), "hf_seconds_per_step": plan.get("seconds_per_step"),
            "hf_curve": hf, "bertctl_main_curve": ours, "bertctl_reaches_hf_accuracy": points,
            "note": "the HF run stopped before its planned end (the GPU machine was lost); bertctl's curve is the "
                    "main run's (a longer schedule), so this compares progress at equal accuracy, not final models"}


def plot(res: dict, path: Path) -> None:
    """The run's curves, one panel per part it has: pretraining (main run and ablation), the race or
    the preset checks, and the fine-tuning table."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [draw for draw, has in ((_pretraining_panel, _pretraining_panel(res, None)),
                                     (_middle_panel, _middle_panel(res, None)),
                                     (_finetune_panel, _finetune_panel(res, None))) if has]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.7 * len(panels), 4.8), squeeze=False)
    for draw, ax in zip(panels, axes[0]):
        draw(res, ax)
    fig.tight_layout()
    tmp = path.with_name(path.stem + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(path)


def _pretraining_panel(res: dict, ax) -> bool:
    """Held-out accuracy of the main run and the ablation; with ``ax`` None, whether there is any."""
    runs = [(name, style, res[f"pretrain_{name}"]["curve"]) for name, style in (("main", "-"), ("mlm", "--"))
            if (res.get(f"pretrain_{name}") or {}).get("curve")]
    if ax is None or not runs:
        return bool(runs)
    for name, style, c in runs:
        ax.plot([x["step"] for x in c], [x["mlm_acc"] for x in c], style, label=f"{name}: MLM accuracy")
        if name == "main":
            ax.plot([x["step"] for x in c], [x["nsp_acc"] for x in c], ":", label="main: NSP accuracy")
    ax.set_xlabel("step")
    ax.set_ylabel("held-out accuracy")
    ax.set_title("bertctl pretraining (held out)")
    ax.legend()
    return True


def _middle_panel(res: dict, ax) -> bool:
    """The race against transformers (finished, or stopped early), else the preset checks."""
    r, partial, presets = res.get("race"), res.get("race_incomplete"), res.get("presets")
    if ax is None:
        return bool(r or partial or presets)
    if partial and not r:
        for key, label in (("hf_curve", "transformers BertForPreTraining (stopped early)"),
                           ("bertctl_main_curve", "bertctl pretrain (main run)")):
            c = [x for x in partial[key] if x["seconds"] <= 1.3 * partial["hf_curve"][-1]["seconds"]]
            ax.plot([x["seconds"] / 60 for x in c], [x["mlm_acc"] for x in c], "o-", ms=3, label=label)
        ax.set_xlabel("wall-clock minutes from the config event (same GPU model)")
        ax.set_ylabel("held-out MLM accuracy")
        ax.set_title("same shards, model, batch and seed")
        ax.legend()
    if r:
        for side in ("hf", "bertctl"):
            c = r[side]["curve"]
            ax.plot([x["wall_seconds"] / 60 for x in c], [x["mlm_acc"] for x in c], "o-", ms=3,
                    label="transformers BertForPreTraining" if side == "hf" else "bertctl pretrain")
        ax.axhline(r["hf_final_mlm_acc"], color="grey", lw=0.8)
        ax.set_xlabel("wall-clock minutes from process start (same GPU)")
        ax.set_ylabel("held-out MLM accuracy")
        ax.set_title("same shards, model and recipe")
        ax.legend()
    if not r and not partial and presets:  # no race in this run: the preset checks instead
        for pr in presets:
            c = pr.get("curve") or []
            ax.plot([x["step"] for x in c], [x["mlm_acc"] for x in c], "o-", ms=3,
                    label=f"{pr['size']}, batch {pr['batch']}, lr {pr['lr']:.2g}"
                          + (f", warm-up {pr['warmup_fraction']:g}" if pr.get("warmup_fraction", 0.06) != 0.06 else "")
                          + (f", {pr['optimizer']}" if pr.get("optimizer", "adamw") != "adamw" else ""))
        base = next((pr["majority_baseline"] for pr in presets if pr.get("majority_baseline")), None)
        if base:
            ax.axhline(base, color="grey", lw=0.8, ls="--", label="majority-token baseline")
        ax.set_xlabel("step")
        ax.set_ylabel("held-out MLM accuracy")
        ax.set_title("presets at sequence length 128")
        ax.legend(fontsize=8)
    return True


def _finetune_panel(res: dict, ax) -> bool:
    """Each task's metric per initialisation, mean and spread over seeds."""
    t = (res.get("finetune") or {}).get("table") or {}
    labels = [k for k in TASKS if k in t]
    if ax is None or not labels:
        return bool(labels)
    width = 0.27
    for j, init in enumerate(INITS):
        if not any(init in t[k] for k in labels):
            continue
        ys = [t[k][init]["mean"] if init in t[k] else 0 for k in labels]
        es = [t[k][init]["std"] if init in t[k] else 0 for k in labels]
        ax.bar([i + (j - 1) * width for i in range(len(labels))], ys, width, yerr=es,
               label={"pretrained": "(a) pretrained", "scratch": "(b) random init", "mlm": "MLM only (no NSP)"}[init])
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels([f"{k}\n{METRIC[k]}" for k in labels])
    ax.set_title("fine-tuned, mean ± std over seeds")
    ax.legend()
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stages", nargs="+", choices=("prepare", "finetune-scratch", "pretrain", "pretrain-mlm",
                                                  "finetune", "race", "presets", "report", "pool"))
    p.add_argument("--work", type=Path, default=ROOT / "build" / "conv")
    p.add_argument("--corpus", type=Path, default=ROOT / "build" / "convergence-corpus")
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data", help="shared task data")
    p.add_argument("--results", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--vocab-size", type=int, default=30522)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--dupe", type=int, default=5,
                   help="build-data --dupe-factor of the main and ablation data (20 scored no better: convergence-h100-bd90980.json)")
    p.add_argument("--holdout", type=float, default=0.02)
    p.add_argument("--workers", type=int, default=os.cpu_count())
    p.add_argument("--model-size", default="medium")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--minutes", type=float, default=None,
                   help="each pretraining run's time box (default: planned from --budget-minutes, the measured data "
                        "preparation and the measured finetune-scratch stage, which must then have run)")
    p.add_argument("--budget-minutes", type=float, default=TARGET_MINUTES,
                   help="the whole benchmark's GPU time that the planned boxes fill (default 25)")
    p.add_argument("--pretrain-dropout", type=float, default=None,
                   help="hidden and attention dropout while pretraining (default: the preset's, 0.1); fine-tuning then "
                        f"runs at {FINETUNE_DROPOUT:g} for every init")
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="pretrain with each step one CUDA graph (the eager fused kernels); --no-cuda-graphs: "
                        "--compile instead")
    p.add_argument("--no-compile", dest="compile", action="store_false", help="with --no-cuda-graphs: eager steps")
    p.add_argument("--tasks", type=lambda s: s.split(","), default=list(TASKS))
    p.add_argument("--inits", type=lambda s: s.split(","), default=list(INITS))
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[42, 43, 44])
    p.add_argument("--jobs", type=int, default=9)
    p.add_argument("--race-minutes", type=float, default=4.0)
    p.add_argument("--race-eval-every", type=int, default=500)
    p.add_argument("--preset-sizes", type=lambda s: s.split(","), default=list(PRESET_SIZES))
    p.add_argument("--preset-steps", type=int, default=1000, help="at batch 256; half as many at 2048")
    p.add_argument("--preset-batches", type=lambda s: [int(x) for x in s.split(",")], default=[256, 2048])
    p.add_argument("--preset-lr", type=float, default=None,
                   help="an lr for the preset runs instead of each preset's default (a comparison)")
    p.add_argument("--preset-warmup", type=float, default=None,
                   help="another --warmup-fraction than the preset's default, to compare")
    p.add_argument("--preset-optimizer", choices=("adamw", "lamb"), default=None,
                   help="another --optimizer than the default (adamw), to compare")
    p.add_argument("--preset-nproc", type=int, default=1,
                   help="GPUs per preset run, under torchrun (the same global batch and maths, sooner)")
    p.add_argument("--preset-micro-batch", type=int, default=0,
                   help="sequences per forward in the preset runs, accumulated to the batch (default 0: the whole batch)")
    p.add_argument("--force", action="store_true", help="redo finished steps")
    p.add_argument("--note", default="", help="a note kept in the report (what differs from the defaults, say)")
    p.add_argument("--reports", type=Path, nargs="+", default=[],
                   help="pool: the convergence.json of each pretraining seed (the same recipe)")
    a = p.parse_args(argv)
    a.work.mkdir(parents=True, exist_ok=True)
    for stage in a.stages:
        t0 = time.perf_counter()
        if stage == "prepare":
            prepare(a)
        elif stage == "pretrain":
            pretrain(a, "main")
        elif stage == "pretrain-mlm":
            pretrain(a, "mlm")
        elif stage == "finetune-scratch":
            finetune(a, ["scratch"])
        elif stage == "finetune":
            finetune(a, [i for i in a.inits if i != "scratch"] if "finetune-scratch" in a.stages else None)
        elif stage == "race":
            race(a)
        elif stage == "presets":
            presets(a)
        elif stage == "pool":
            if len(a.reports) < 2:
                raise SystemExit("pool: give --reports, the convergence.json of two or more pretraining seeds")
            pool(a)
        else:
            report(a)
        print(f"[{stage}] {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
