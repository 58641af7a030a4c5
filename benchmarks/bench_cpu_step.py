"""The CPU pretraining step with and without three CPU-side choices: PyTorch's dropout against
bertctl's (a hashed mask, ``bertctl.ops.dropout``), the ``foreach`` AdamW against the fused one, and
each sub-layer's output as separate ops (the Linear, dropout, LayerNorm+residual) against the matmul
then ``bertctl.ops.bias_dropout_add_layer_norm``.

    python benchmarks/bench_cpu_step.py --output benchmarks/results/cpu-step.json

``BertForPreTraining`` of each ``--sizes`` preset (size:batch), sequences of 128 with 20 masked
positions (random tokens), forward, backward and optimizer step; the variants alternate in
``--rounds`` rounds and each round reports the mean step time over ``--steps`` steps after 5
warm-up ones. Writes a JSON with the CPU, threads, versions, commit and load average.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import bertctl.model as M  # noqa: E402
from bertctl.config import BertConfig  # noqa: E402
from bertctl.train.optim import build_optimizer  # noqa: E402
from bertctl.train.pretrain import pretraining_sums  # noqa: E402

VARIANTS = {  # name: (bertctl's dropout, fused AdamW, fused bias+dropout+residual+LayerNorm)
    "torch dropout, foreach AdamW": (False, False, False),
    "torch dropout, fused AdamW": (False, True, False),
    "bertctl dropout, fused AdamW": (True, True, False),
    "bertctl dropout, fused AdamW, fused bias+dropout+add+LN": (True, True, True),
}
BERTCTL_DROPOUT, FUSED_OUTPUT = M.dropout, M.dense_dropout_add_norm


def separate_output(dense, drop, ln, h, residual, fused):
    """A sub-layer's output as separate ops: the Linear (its bias in the matmul), M.dropout, LN(x + residual)."""
    return M.layer_norm(ln, M.dropout(drop, dense(h), fused), residual, fused)


def random_batch(vocab: int, batch: int, g: torch.Generator, seq: int = 128, masked: int = 20) -> dict:
    """A pretraining batch of random tokens: sequences of ``seq``, ``masked`` masked positions each."""
    return {"input_ids": torch.randint(5, vocab, (batch, seq), generator=g),
            "token_type_ids": torch.zeros(batch, seq, dtype=torch.long),
            "attention_mask": torch.ones(batch, seq, dtype=torch.long),
            "masked_positions": torch.randint(1, seq, (batch, masked), generator=g),
            "masked_lm_labels": torch.randint(5, vocab, (batch, masked), generator=g),
            "next_sentence_label": torch.randint(0, 2, (batch,), generator=g)}


def step_ms(size: str, batch: int, steps: int, ours: bool, fused: bool, fused_output: bool) -> float:
    M.dropout = BERTCTL_DROPOUT if ours else (lambda module, x, fused_kernels: module(x))
    M.dense_dropout_add_norm = FUSED_OUTPUT if fused_output else separate_output
    try:
        cfg = BertConfig.preset(size, vocab_size=4000 if size == "tiny" else 30522)
        g = torch.Generator().manual_seed(0)
        torch.manual_seed(0)
        model = M.BertForPreTraining(cfg)
        opt = build_optimizer(model, "adamw", lr=1e-4, fused=fused)
        mb = random_batch(cfg.vocab_size, batch, g)

        def step():
            s = pretraining_sums(model, mb)
            (s["mlm_sum"] / mb["masked_lm_labels"].numel() + s["nsp_sum"] / batch).backward()
            opt.step()
            opt.zero_grad()

        for _ in range(5):
            step()
        t = time.perf_counter()
        for _ in range(steps):
            step()
        return (time.perf_counter() - t) / steps * 1e3
    finally:
        M.dropout, M.dense_dropout_add_norm = BERTCTL_DROPOUT, FUSED_OUTPUT


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny:8,mini:32", help="preset:batch, comma-separated")
    ap.add_argument("--steps", type=int, default=0, help="timed steps a round (0: 40 for tiny, 8 otherwise)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    load_before = os.getloadavg()
    rows = []
    for item in a.sizes.split(","):
        size, batch = item.split(":")
        steps = a.steps or (40 if size == "tiny" else 8)
        times = {name: [] for name in VARIANTS}
        for _ in range(a.rounds):
            for name, (ours, fused, fused_output) in VARIANTS.items():
                times[name].append(round(step_ms(size, int(batch), steps, ours, fused, fused_output), 2))
        rows.append({"size": size, "batch": int(batch), "seq": 128, "steps_per_round": steps, "ms_per_step": times})
        print(json.dumps(rows[-1]), flush=True)
    out = {"what": __doc__.split("\n\n")[0].replace("\n", " "), "commit": commit, "machine": platform.machine(),
           "processor": platform.processor(), "cpus": os.cpu_count(), "threads": a.threads,
           "torch": torch.__version__, "python": platform.python_version(),
           "load_average_before": load_before, "load_average_after": os.getloadavg(), "rows": rows}
    a.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
