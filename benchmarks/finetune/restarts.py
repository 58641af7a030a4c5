"""Random restarts side by side: the wall time of ``bertctl finetune glue --restarts N`` (its runs side by
side on the GPU) against one run alone, and each seed's dev metrics against the same seed run alone.

The target: N = 5 restarts of MiniLM on SST-2 in at most 1.5 times one run's wall time, with the same
per-seed metrics as separate runs (``--separate`` runs every seed alone; by default only the first). One run's
wall time moved by up to a fifth between runs on one lease, so ``--rounds R`` alternates the run alone and the
suite R times and reports the median of the rounds' ratios beside each round's. Where
nvidia-smi is present, the GPU's SM and memory utilisation is sampled once a second over the run alone and
over the suite, to tell a GPU the runs keep busy from one they leave waiting.

    python benchmarks/finetune/restarts.py --model MINILM --data-dir ../shared/data/glue/SST-2 --epochs 1 --rounds 3 -o OUT.json
    python benchmarks/finetune/restarts.py --model MINILM --data-dir ../shared/data/glue/SST-2 --device cpu \\
        --limit 64 --max-steps 2 --restarts 2 --rounds 2 -o /tmp/restarts.json     # a check of the script on the CPU
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


class GpuUtilisation:
    """``nvidia-smi dmon``'s once-a-second SM and memory-bandwidth utilisation over a block, to tell a GPU that
    the runs side by side keep busy from one they leave idle; ``summary()`` is None where there is no
    nvidia-smi."""

    def __init__(self, argv: tuple[str, ...] = ("nvidia-smi", "dmon", "-s", "u", "-d", "1")):
        self.argv = list(argv)
        self.proc = None
        self.text = ""

    def __enter__(self) -> "GpuUtilisation":
        try:
            self.proc = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        except OSError:
            self.proc = None
        return self

    def __exit__(self, *exc) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.text = self.proc.communicate(timeout=10)[0]

    def summary(self) -> dict | None:
        """Per GPU: the samples of SM and memory utilisation (%) and their means; None without samples."""
        columns, rows = None, {}
        for line in self.text.splitlines():
            fields = line.split()
            if line.startswith("#"):
                if columns is None and "sm" in fields:
                    columns = fields[1:]  # "# gpu sm mem ...": the names, "#" dropped
                continue
            if columns is None or len(fields) != len(columns) or not all(f.isdigit() or f == "-" for f in fields):
                continue
            row = dict(zip(columns, fields))
            gpu = rows.setdefault(row["gpu"], {"sm": [], "mem": []})
            for key in ("sm", "mem"):
                if row.get(key, "-").isdigit():
                    gpu[key].append(int(row[key]))
        if not any(g["sm"] for g in rows.values()):
            return None
        return {gpu: {"sm_percent": g["sm"], "mem_percent": g["mem"],
                      "sm_mean": round(sum(g["sm"]) / len(g["sm"]), 1) if g["sm"] else None,
                      "mem_mean": round(sum(g["mem"]) / len(g["mem"]), 1) if g["mem"] else None}
                for gpu, g in rows.items()}


def timed(argv: list[str], log: Path) -> float:
    t0 = time.perf_counter()
    with open(log, "w") as f:
        r = subprocess.run(argv, stdout=f, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        sys.exit(f"{' '.join(argv)} failed (exit {r.returncode}); see {log}")
    return time.perf_counter() - t0


def phases(run_dir: Path, wall: float | None = None) -> dict:
    """Where a run's seconds went, from its metrics.json: the process's age at the end, its training steps, its
    evaluations, the rest (start-up, featurising, saving), and the command's wall time when known."""
    seconds = json.loads((run_dir / "metrics.json").read_text()).get("seconds", {})
    age, steps, evals = (seconds.get(k) for k in ("since_process_start", "training_steps", "evaluations"))
    out = {"process": age, "training_steps": steps, "evaluations": evals,
           "rest": round(age - steps - evals, 3) if None not in (age, steps, evals) else None}
    return out | ({"command": round(wall, 3)} if wall is not None else {})


def beyond_runs(suite_seconds: float, since_start: dict) -> float | None:
    """The suite's own seconds: its wall time less the span from its first run's start to its last run's end
    (a run forked from the suite counts its age from the fork, so the runs' own ages cannot say this)."""
    if "first_run_started" not in since_start or "runs_done" not in since_start:
        return None
    return round(suite_seconds - (since_start["runs_done"] - since_start["first_run_started"]), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--data-dir", required=True, type=Path, help="The task's GLUE folder.")
    ap.add_argument("--task", default="sst2")
    ap.add_argument("--restarts", type=int, default=5)
    ap.add_argument("--seed", type=int, default=42)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--separate", action="store_true", help="Run every seed alone too, not only the first.")
    ap.add_argument("--limit", type=int, help="Train on the first N rows only (a quick check).")
    ap.add_argument("--max-steps", type=int, help="Passed to each run (a quick check).")
    ap.add_argument("--epochs", type=float, help="Passed to each run (default: the task's recipe).")
    ap.add_argument("--rounds", type=int, default=1,
                    help="Alternate the first seed alone and the suite this many times (default 1).")
    ap.add_argument("--work", type=Path, help="Folder for the runs (default: a temporary one).")
    ap.add_argument("-o", "--output", type=Path, required=True)
    args = ap.parse_args()

    from bertctl.bench.harness import environment
    from bertctl.tasks.glue import find_task_files, task_spec

    work = args.work or Path(tempfile.mkdtemp(prefix="restarts-"))
    work.mkdir(parents=True, exist_ok=True)
    train, devs = find_task_files(args.data_dir, task_spec(args.task))
    data = train.parent
    if args.limit:
        data = work / "data"
        data.mkdir(exist_ok=True)
        lines = train.read_text(encoding="utf-8").splitlines(keepends=True)
        (data / "train.tsv").write_text("".join(lines[:args.limit + 1]), encoding="utf-8")
        for dev in devs:
            (data / dev.name).write_bytes(dev.read_bytes())
    base = [sys.executable, "-m", "bertctl", "finetune", "glue", "--task", args.task, "--data-dir", str(data),
            "--model", str(args.model), "--device", args.device, "--no-progress"]
    if args.max_steps:
        base += ["--max-steps", str(args.max_steps)]
    if args.epochs:
        base += ["--epochs", str(args.epochs)]
    seeds = [args.seed + i for i in range(args.restarts)]
    alone, rounds = {}, []
    for round_ in range(args.rounds):
        for seed in (seeds if args.separate and round_ == 0 else seeds[:1]):
            out = work / f"alone-seed{seed}-round{round_}"
            with GpuUtilisation() as gpu:
                seconds = timed(base + ["--seed", str(seed), "--output", str(out)], work / f"alone-seed{seed}-round{round_}.log")
            if seed not in alone:
                alone[seed] = {"seconds": seconds, "metrics": json.loads((out / "metrics.json").read_text()),
                               "phases": phases(out, seconds), "gpu_utilisation": gpu.summary()}
            if seed == seeds[0]:
                one_run = seconds
            print(f"round {round_}: seed {seed} alone: {seconds:.1f} s", file=sys.stderr)
        suite_out = work / f"suite-round{round_}"
        with GpuUtilisation() as suite_gpu:
            suite_seconds = timed(base + ["--seed", str(args.seed), "--restarts", str(args.restarts), "--output",
                                          str(suite_out)], work / f"suite-round{round_}.log")
        rounds.append({"one_run_seconds": one_run, "suite_seconds": suite_seconds, "ratio": suite_seconds / one_run})
        print(f"round {round_}: {args.restarts} restarts {suite_seconds:.1f} s, one run {one_run:.1f} s: "
              f"{suite_seconds / one_run:.2f}x", file=sys.stderr)
    summary = json.loads((suite_out / "summary.json").read_text())
    task = summary["tasks"][task_spec(args.task).name]
    if not task.get("runs"):
        sys.exit(f"every run of the suite failed: see {work / f'suite-round{args.rounds - 1}.log'} and {suite_out}")
    scores = [json.loads((work / f"suite-round{r}" / "summary.json").read_text())["tasks"][task_spec(args.task).name]
              ["grid"][0]["seeds"] for r in range(args.rounds)]
    per_seed = []
    for run in task["runs"]:
        row = {"seed": run["seed"], "score": run["score"], "metrics": run["metrics"],
               "phases": phases(suite_out / task_spec(args.task).folder / "runs" / run["run"])}
        if run["seed"] in alone:
            mine = alone[run["seed"]]["metrics"]
            row["alone"] = {k: mine[k] for k in run["metrics"] if k in mine and not isinstance(mine[k], dict)}
            row["alone_phases"] = alone[run["seed"]]["phases"]
            row["alone_gpu_utilisation"] = alone[run["seed"]]["gpu_utilisation"]
            row["largest_difference"] = max((abs(v - mine[k]) for k, v in run["metrics"].items()
                                             if k in mine and isinstance(mine[k], float) and "second" not in k),
                                            default=0.0)
        per_seed.append(row)
    launched = next((line for line in (work / f"suite-round{args.rounds - 1}.log").read_text().splitlines()
                     if line.startswith("suite:")), "")
    middle = statistics.median(r["ratio"] for r in rounds)
    result = {"environment": environment(args.device if args.device != "auto" else
                                         ("cuda" if __import__("torch").cuda.is_available() else "cpu")),
              "task": args.task, "model": str(args.model), "epochs": args.epochs, "restarts": args.restarts,
              "one_run_seconds": statistics.median(r["one_run_seconds"] for r in rounds),
              "suite_seconds": statistics.median(r["suite_seconds"] for r in rounds), "ratio": middle,
              "rounds": rounds, "same_scores_every_round": all(s == scores[0] for s in scores), "target_ratio": 1.5,
              "suite_plan": launched, "suite_since_start": summary.get("since_start"),
              "suite_runs_started": summary.get("runs_started"), "suite_preload_seconds": summary.get("preload_seconds"),
              "suite_gpu_utilisation": suite_gpu.summary(),
              "suite_beyond_runs_seconds": beyond_runs(suite_seconds, summary.get("since_start") or {}),
              "per_seed": per_seed,
              "mean": task["grid"][0]["mean"], "std": task["grid"][0]["std"], "chosen": task["chosen"]["run"]}
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.restarts} restarts: {middle:.2f}x one run's wall time, the median of {args.rounds} round(s) "
          f"(target 1.5x)", file=sys.stderr)


if __name__ == "__main__":
    main()
