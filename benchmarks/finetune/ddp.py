"""Fine-tuning on several GPUs of one host against one: ``bertctl finetune glue`` as a user starts it,
``python -m bertctl`` for one GPU and ``torchrun --nproc-per-node N -m bertctl`` for N, the same data,
model, recipe and seeds; the global batch per configuration (``--configs 1x32,2x32,2x64``: GPUs x
global batch, so ``2x64`` keeps 32 examples per GPU, as a per-device batch size does).

Per run: wall time from process start to exit, the command's own ``train_examples_per_second`` (its
training steps, CUDA-graph captures included), the captures' host time from ``metrics.jsonl``, and
the task metric. The summary holds, per configuration, the mean and spread over seeds and the
examples/s ratio against the first configuration (issue 13's target: 2 GPUs at >= 1.8x one, with the
metric within seed noise).

    python benchmarks/finetune/ddp.py --data ../shared/data/glue/SST-2 --model MODEL \\
        --configs 1x32,2x32,2x64 --seeds 42,43 --epochs 3 --out benchmarks/results/finetune-ddp-graphs.json
    python benchmarks/finetune/ddp.py --task squad --data ../shared/data/squad --model MODEL \\
        --configs 1x32,2x32 --seeds 42 --epochs 1 --out benchmarks/results/finetune-ddp-squad.json
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.append(str(Path(__file__).resolve().parent))

from vs_hf import _stats, commit  # noqa: E402  (beside this script)


def parse_configs(text: str) -> list[tuple[int, int]]:
    """``"1x32,2x64"`` -> [(1, 32), (2, 64)]: GPUs and global batch."""
    out = []
    for item in text.split(","):
        gpus, _, batch = item.strip().partition("x")
        if not (gpus.isdigit() and batch.isdigit() and int(gpus) > 0 and int(batch) >= int(gpus)):
            raise SystemExit(f"--configs: {item!r} is not GPUSxBATCH (e.g. 2x64, the batch at least the GPUs)")
        out.append((int(gpus), int(batch)))
    return out


def task_args(a) -> list[str]:
    """The task's own flags: a GLUE folder, or the SQuAD v1.1 article split (``dev-v1.1.json`` and
    ``split.json`` in ``--data``: train on its ``train`` articles, score its ``eval`` ones)."""
    if a.task == "squad":
        data, split = a.data / "dev-v1.1.json", a.data / "split.json"
        return ["squad", "--train", str(data), "--dev", str(data), "--train-articles", f"{split}:train",
                "--dev-articles", f"{split}:eval"]
    return ["glue", "--task", a.task, "--data-dir", str(a.data)]


def command(gpus: int, batch: int, seed: int, out: Path, a) -> list[str]:
    launch = [sys.executable, "-m"] if gpus == 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(gpus), "-m"]
    return [*launch, "bertctl", "finetune", *task_args(a), "--model", str(a.model), "--output", str(out),
            "--epochs", f"{a.epochs:g}", "--batch-size", str(batch), "--seed", str(seed), "--no-progress",
            "--no-tensorboard", *a.extra]


def one_run(gpus: int, batch: int, seed: int, work: Path, a) -> dict:
    out = work / f"g{gpus}-b{batch}-s{seed}"
    cmd = command(gpus, batch, seed, out, a)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    run = {"gpus": gpus, "batch_size": batch, "seed": seed, "rc": proc.returncode, "wall_seconds": round(wall, 2),
           "command": " ".join(cmd)}
    if proc.returncode != 0:
        run["stderr_tail"] = proc.stderr[-2000:]
        return run
    run.update(read_run(out, a.metric))
    return run


def read_run(out: Path, metric: str) -> dict:
    """What one finished run folder reports: the metric, examples/s, its CUDA-graph account, and its logged
    windows of training steps: the first (which holds the process's one-time GPU set-up and the first
    capture) apart from the median of the later ones."""
    metrics = json.loads((out / "metrics.json").read_text())
    events = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    graphs = [e for e in events if e.get("event") == "cuda_graphs"]
    windows = [e["seq_per_s"] for e in events if e.get("event") == "train"]
    return {"metric": metrics[metric], "train_examples_per_second": metrics["train_examples_per_second"],
            "world_size": metrics.get("device", {}).get("world_size"), "seconds": metrics.get("seconds"),
            "first_window_seq_per_s": round(windows[0], 1) if windows else None,
            "later_windows_median_seq_per_s": round(statistics.median(windows[1:]), 1) if len(windows) > 1 else None,
            "cuda_graphs": {k: graphs[-1][k] for k in ("graphs", "capture_seconds", "warmup_seconds", "record_seconds",
                                                      "instantiate_seconds", "eager_steps", "rare_shape_steps")
                            if k in graphs[-1]} if graphs else None}


def summarise(runs: list[dict], configs: list[tuple[int, int]], metric: str) -> list[dict]:
    """Per configuration: the metric and examples/s over seeds, and examples/s against the first."""
    rows = []
    for gpus, batch in configs:
        ok = [r for r in runs if (r["gpus"], r["batch_size"]) == (gpus, batch) and r["rc"] == 0]
        if not ok:
            rows.append({"gpus": gpus, "batch_size": batch, "runs": 0})
            continue
        row = {"gpus": gpus, "batch_size": batch, "runs": len(ok), metric: _stats([r["metric"] for r in ok]),
               "train_examples_per_second": _stats([r["train_examples_per_second"] for r in ok]),
               "wall_seconds": _stats([r["wall_seconds"] for r in ok])}
        later = [r["later_windows_median_seq_per_s"] for r in ok if r.get("later_windows_median_seq_per_s")]
        if len(later) == len(ok):
            row["later_windows_median_seq_per_s"] = _stats(later)
        rows.append(row)
    for key, ratio in (("train_examples_per_second", "examples_per_second_vs_first"),
                       ("later_windows_median_seq_per_s", "later_windows_vs_first")):
        base = rows[0].get(key, {}).get("mean")
        for row in rows:
            if base and key in row:
                row[ratio] = round(row[key]["mean"] / base, 3)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, required=True,
                   help="the task's data folder: a GLUE task's (train.tsv, dev.tsv), or for squad dev-v1.1.json "
                        "and split.json")
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--task", default="sst2", help="a GLUE task, or squad (the article split)")
    p.add_argument("--metric", default=None, help="the key of metrics.json to report (default: accuracy; squad f1)")
    p.add_argument("--configs", type=parse_configs, default=parse_configs("1x32,2x32,2x64"))
    p.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[42, 43])
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--work", type=Path, default=None, help="run folders (default: a temporary folder)")
    p.add_argument("--out", type=Path, required=True, help="the result JSON")
    p.add_argument("--rescore", action="store_true",
                   help="run nothing: re-read the run folders under --work (brought back from the GPU machine) "
                        "and rewrite --out's runs and summary")
    p.add_argument("extra", nargs="*", help="more bertctl finetune flags, after --")
    a = p.parse_args(argv)
    a.metric = a.metric or ("f1" if a.task == "squad" else "accuracy")
    if a.rescore:
        return rescore(a)
    import torch

    from bertctl.bench import harness

    work = a.work or Path(tempfile.mkdtemp(prefix="finetune-ddp-"))
    runs = []
    for seed in a.seeds:  # configurations alternate within a seed: a busy spell lands on all of them
        for gpus, batch in a.configs:
            runs.append(one_run(gpus, batch, seed, work, a))
            print(json.dumps(runs[-1]), file=sys.stderr, flush=True)
    task = "squad (the article split)" if a.task == "squad" else f"glue --task {a.task}"
    result = {"what": f"bertctl finetune {task}, {a.epochs:g} epochs, GPUs x global batch "
                      f"{','.join(f'{g}x{b}' for g, b in a.configs)}, seeds {a.seeds}",
              "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
              "gpus_on_host": torch.cuda.device_count(), "torch": torch.__version__, "commit": commit(),
              "environment": harness.environment("cuda" if torch.cuda.is_available() else "cpu"),
              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "extra_flags": a.extra,
              "summary": summarise(runs, a.configs, a.metric), "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(a.out)
    print(json.dumps(result["summary"], indent=1))
    return 0 if all(r["rc"] == 0 for r in runs) else 1


def rescore(a) -> int:
    if a.work is None:
        raise SystemExit("--rescore needs --work, the folder holding the runs' g<GPUS>-b<BATCH>-s<SEED> folders")
    result = json.loads(a.out.read_text())
    for run in result["runs"]:
        if run["rc"] == 0:
            run.update(read_run(a.work / f"g{run['gpus']}-b{run['batch_size']}-s{run['seed']}", a.metric))
    configs = list(dict.fromkeys((r["gpus"], r["batch_size"]) for r in result["runs"]))
    result["summary"] = summarise(result["runs"], configs, a.metric)
    tmp = a.out.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(a.out)
    print(json.dumps(result["summary"], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
