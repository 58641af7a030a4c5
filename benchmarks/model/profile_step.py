"""Where a BERT-Base pretraining step spends its GPU time: torch.profiler over a few steps.

    python benchmarks/model/profile_step.py [--case base-128] [--attn sdpa] [--kernels fused]

The step is ``bench model``'s (``bertctl`` provider: bf16 autocast, fused AdamW, clipping). Prints
the device row, the step's wall time (CUDA events over 20 steps back to back, unprofiled), its kernel time by kind (matmuls, attention,
bertctl's fused ops, copies and casts, the optimizer, the rest), the gap between the two (the GPU
idle between kernels), and the kernels by total time.  bertctl's kernels are launched with
programmatic dependent launch, so each one's profiled duration includes its wait for the kernel
before: run with BERTCTL_PDL=0 for each kernel's own time.
"""
from __future__ import annotations

import argparse
import json

import torch
from torch.profiler import ProfilerActivity, profile

from bertctl.bench import harness
from bertctl.bench.model import CASES, MIXED_CASES, _train_step_fn, bertctl_model, synthetic_batches
from bertctl.nn.packing import layout
from bertctl.config import BertConfig
from bertctl.runtime import resolve
from bertctl.train.optim import build_optimizer


def kind(name: str) -> str:
    """A kernel's kind, from its name."""
    low = name.lower()
    # attention first: FlashAttention's kernels name cutlass types, which the matmul test would take
    if any(t in low for t in ("sdpa", "flash", "fmha", "attention", "cudnn")):
        return "attention"
    if any(t in low for t in ("gemm", "cutlass", "sm90_xmma", "nvjet", "cublas")):
        return "matmuls"
    if "bertctl::" in name:
        return "fused ops"
    if any(t in low for t in ("copy", "cat", "fill", "memset", "memcpy")):
        return "copies, casts, fills"
    if any(t in low for t in ("multi_tensor", "fusedopti", "foreach")):
        return "optimizer, clipping"
    return "other"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="base-128", choices=sorted(CASES))
    ap.add_argument("--attn", default="sdpa")
    ap.add_argument("--kernels", default="auto")
    ap.add_argument("--rows", type=int, default=30)
    args = ap.parse_args()
    print(json.dumps(harness.environment("cuda")))
    size, seq, batch = CASES[args.case]
    config = BertConfig.preset(size)
    model = bertctl_model(config, "cuda", resolve("cuda", attn=args.attn, kernels=args.kernels))
    opt = build_optimizer(model, "adamw", lr=1e-4, fused=True)
    batches = synthetic_batches(config.vocab_size, seq, batch, 4, mixed=args.case in MIXED_CASES)
    dev = []
    for b in batches:
        if args.attn == "unpadded":  # packed on the host, as the loader packs them
            b["packing"] = layout(b["attention_mask"])
        d = {k: v.cuda() for k, v in b.items() if k != "hf_labels"}
        d["n_masked"] = float((b["masked_lm_labels"] != -100).sum())
        dev.append(d)
    step = _train_step_fn("bertctl", model, opt)
    for i in range(5):
        step(dev[i % 4])
    torch.cuda.synchronize()
    # Back to back, not the harness's per-call timing (which queues each call ahead behind a device-side
    # sleep): the gap between this and the kernels' time is the GPU idle between them.
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(20):
        step(dev[i % 4])
    end.record()
    torch.cuda.synchronize()
    wall = start.elapsed_time(end) / 20
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for i in range(5):
            step(dev[i % 4])
        torch.cuda.synchronize()
    events = prof.key_averages()
    total = sum(e.self_device_time_total for e in events)
    gemm = sum(e.self_device_time_total for e in events if kind(e.key) == "matmuls")
    print(f"GPU time per step {total / 5 / 1e3:.2f} ms; matmul kernels {100 * gemm / total:.1f}%")
    kinds: dict[str, float] = {}
    for e in events:
        kinds[kind(e.key)] = kinds.get(kind(e.key), 0.0) + e.self_device_time_total / 5 / 1e3
    print(f"step {wall:.2f} ms (wall, 20 steps unprofiled); kernels {total / 5 / 1e3:.2f} ms; "
          f"gap {wall - total / 5 / 1e3:.2f} ms")
    print("  " + ", ".join(f"{k} {v:.2f} ms" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])))
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[: args.rows]:
        print(f"{e.self_device_time_total / 5 / 1e3:8.3f} ms/step {100 * e.self_device_time_total / total:5.1f}%"
              f" x{e.count // 5:<4d} {e.key[:110]}")


if __name__ == "__main__":
    main()
