"""What TensorBoard logging costs a training loop: ``MetricsLog.log`` with and without it.

    python benchmarks/bench_metrics_log.py [--records 10000] [--out benchmarks/results/metrics-log-cpu.json]

Three measurements, each alternating the providers over several rounds (a shared machine's slow
spells land on all of them):
- the caller's time per ``log`` call for a pretraining ``train`` record (10 numeric fields), JSONL
  only against JSONL + TensorBoard, and torch's ``SummaryWriter.add_scalar`` per field for scale;
- the process CPU time per record including the background writer (``time.process_time`` over the
  logging and the final ``close``, which waits for every queued record to be written);
- a stand-in training step (a 256x1024 @ 1024x1024 fp32 matmul, a few ms on one core) that logs every
  step, the worst case (pretrain logs every ``--log-every`` steps, default 10): median step time.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bertctl.progress import MetricsLog  # noqa: E402


def record(step: int) -> dict:
    return {"event": "train", "step": step, "loss": 7.5 - step * 1e-4, "mlm_loss": 6.8, "nsp_loss": 0.69,
            "mlm_acc": 0.12, "nsp_acc": 0.55, "lr": 1e-4, "seq_per_s": 812.3, "tokens_per_s": 10398.1,
            "tflops": 0.42, "mfu": 0.01}


def time_log(tensorboard: bool, n: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        log = MetricsLog(Path(d) / "metrics.jsonl", tensorboard=tensorboard)
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(n):
            log.log(**record(i))
        caller = time.perf_counter() - t0
        log.close()
        cpu = time.process_time() - cpu0
    return {"caller_us_per_record": caller / n * 1e6, "cpu_us_per_record": cpu / n * 1e6}


def time_summary_writer(n: int) -> dict:
    from torch.utils.tensorboard import SummaryWriter

    with tempfile.TemporaryDirectory() as d:
        w = SummaryWriter(d)
        cpu0, t0 = time.process_time(), time.perf_counter()
        for i in range(n):
            for k, v in record(i).items():
                if k not in ("event", "step"):
                    w.add_scalar(f"train/{k}", v, i)
        caller = time.perf_counter() - t0
        w.close()
        cpu = time.process_time() - cpu0
    return {"caller_us_per_record": caller / n * 1e6, "cpu_us_per_record": cpu / n * 1e6}


def time_steps(tensorboard: bool, steps: int) -> float:
    a, b = torch.randn(256, 1024), torch.randn(1024, 1024)
    times = []
    with tempfile.TemporaryDirectory() as d:
        with MetricsLog(Path(d) / "metrics.jsonl", tensorboard=tensorboard) as log:
            for i in range(steps):
                t0 = time.perf_counter()
                (a @ b).sum().item()
                log.log(**record(i))
                times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "metrics-log-cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(1)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    log_runs = {"jsonl": [], "jsonl+tensorboard": [], "torch SummaryWriter.add_scalar (reference)": []}
    step_runs = {"jsonl": [], "jsonl+tensorboard": []}
    for _ in range(args.rounds):
        log_runs["jsonl"].append(time_log(False, args.records))
        log_runs["jsonl+tensorboard"].append(time_log(True, args.records))
        log_runs["torch SummaryWriter.add_scalar (reference)"].append(time_summary_writer(args.records))
        step_runs["jsonl"].append(time_steps(False, args.steps))
        step_runs["jsonl+tensorboard"].append(time_steps(True, args.steps))
    results = {
        name: {key: round(statistics.median(r[key] for r in runs), 2) for key in runs[0]}
        for name, runs in log_runs.items()
    }
    step = {name: {"median_step_ms": round(statistics.median(v), 3), "rounds": [round(x, 3) for x in v]}
            for name, v in step_runs.items()}
    # Each round times both back to back: the per-round ratio cancels the machine's slow spells.
    ratios = [b / a for a, b in zip(step_runs["jsonl"], step_runs["jsonl+tensorboard"])]
    step["tensorboard_over_jsonl_per_round"] = [round(r, 4) for r in ratios]
    step["tensorboard_over_jsonl_median"] = round(statistics.median(ratios), 4)
    import tensorboard

    report = {
        "benchmark": "MetricsLog.log per record, with and without TensorBoard",
        "record": "pretraining 'train' record, 10 numeric fields",
        "records": args.records, "rounds": args.rounds, "statistic": "median over rounds",
        "log": results,
        "training_step_logging_every_step": {"steps": args.steps, **step},
        "machine": {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "torch_threads": 1, "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "tensorboard": tensorboard.__version__},
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
