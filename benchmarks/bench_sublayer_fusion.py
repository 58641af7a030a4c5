"""The training step with the sub-layer outputs fused (bias + dropout + residual + LayerNorm, one op each way)
against the ops apart (the Linear with its bias, torch's dropout, LayerNorm(+residual)), side by side in one
process: BERT-Base and -Large pretraining steps as ``bench model`` times them (bf16 autocast, fused AdamW).

    python benchmarks/bench_sublayer_fusion.py [--cases base-128,base-512,large-128] [--rounds 3] [-o out.json]

The two variants alternate in rounds over the same batches and weights; each row gives the median step time,
sequences/s, MFU (6 * parameters * real tokens + attention, ``bench model``'s) and peak memory.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

import bertctl.model as M
from bertctl.bench.harness import device_block
from bertctl.bench.model import CASES, _time, _train_step_fn, bertctl_model, synthetic_batches
from bertctl.config import BertConfig
from bertctl.io import write_json
from bertctl.train.metrics import batch_counts, peak_flops, train_flops_6nt
from bertctl.train.optim import build_optimizer

FUSED = M.dense_dropout_add_norm


def apart(dense, drop, ln, h, residual, fused):
    """The sub-layer output as the model ran it on CUDA before the fused op: the Linear (bias in the matmul),
    dropout, then LayerNorm(x + residual)."""
    return M.layer_norm(ln, M.dropout(drop, dense(h), fused), residual, fused)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="base-128,base-512,large-128")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("-o", "--output", type=Path)
    args = ap.parse_args()
    device = torch.device("cuda")
    peak = peak_flops(device)
    out = {"benchmark": "sublayer_fusion", "device": device_block(device), "peak_bf16_tflops": peak / 1e12,
           "rounds": args.rounds, "steps": args.steps, "rows": []}
    for case in args.cases.split(","):
        size, seq, batch = CASES[case]
        cpu_batches = synthetic_batches(30522, seq, batch, n=8, seed=seq)
        for b in cpu_batches:
            b["n_masked"] = float((b["masked_lm_labels"] != -100).sum())
        counts = [batch_counts(b) for b in cpu_batches]
        batches = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()} for b in cpu_batches]
        conf = BertConfig.preset(size, attn_implementation="sdpa", kernels="auto")
        torch.manual_seed(0)
        model = bertctl_model(conf, device)
        n_params = sum(p.numel() for p in model.parameters())
        flops = statistics.mean(train_flops_6nt(conf, n_params, c[0], c[1]) for c in counts)
        opt = build_optimizer(model, "adamw", lr=1e-5, fused=True)
        step = _train_step_fn("bertctl", model, opt)
        times: dict[str, list[float]] = {"fused": [], "apart": []}
        memory: dict[str, float] = {}
        for r in range(args.rounds):
            for name, fn in (("fused", FUSED), ("apart", apart)) if r % 2 == 0 else (("apart", apart), ("fused", FUSED)):
                M.dense_dropout_add_norm = fn
                torch.cuda.reset_peak_memory_stats(device)
                times[name].append(_time(step, batches, args.steps, warmup=3, device=device, repeats=1))
                memory[name] = max(memory.get(name, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)
        M.dense_dropout_add_norm = FUSED
        for name, ts in times.items():
            sec = statistics.median(ts)
            row = {"case": case, "variant": name, "step_ms": round(sec * 1e3, 2), "step_ms_rounds": [round(t * 1e3, 2) for t in ts],
                   "seq_per_s": round(batch / sec, 1), "mfu": round(flops / sec / peak, 4),
                   "peak_mem_gib": round(memory[name], 2)}
            out["rows"].append(row)
            print(json.dumps(row), file=sys.stderr)
        fused_ms = next(r["step_ms"] for r in out["rows"] if r["case"] == case and r["variant"] == "fused")
        apart_ms = next(r["step_ms"] for r in out["rows"] if r["case"] == case and r["variant"] == "apart")
        out.setdefault("speedup", {})[case] = round(apart_ms / fused_ms, 3)
        del model, opt, step, batches
        torch.cuda.empty_cache()
    if args.output:
        write_json(args.output, out)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
