"""The fine-tuning step with ``attn_implementation="unpadded"`` against the padded model (``sdpa``).

MiniLM-L6's architecture (6 layers, hidden 384) or BERT-Base's (random weights: the timing does not
depend on them) with a 2-label head, forward and backward of the classification loss, on batches of 32
SST-2 training sentences in the default random order, each padded to its own longest row (what
``bertctl finetune`` feeds the model). The two models share their weights; rounds alternate
(padded, unpadded, padded, ...), and the figure is the ratio of the medians. Records the padding
(padded tokens / real tokens), device, versions, commit and load average.

    python benchmarks/bench_unpadded.py --tokenizer MINILM --device cpu --threads 2 -o benchmarks/results/unpadded-cpu.json
    python benchmarks/bench_unpadded.py --tokenizer MINILM --device cuda --bf16 --batches 50 -o unpadded-gpu.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from finetune_vs_hf import commit  # noqa: E402

from bertctl.config import BertConfig  # noqa: E402
from bertctl.model import BertForSequenceClassification  # noqa: E402
from bertctl.tokenizer import load_tokenizer  # noqa: E402


def batches(data: Path, tokenizer: Path, n: int, size: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    tok = load_tokenizer(tokenizer)
    rows = [line.split("\t")[0] for line in (data / "glue" / "SST-2" / "train.tsv").read_text().splitlines()[1:]]
    random.Random(seed).shuffle(rows)
    out = []
    for b in range(n):
        ids = [tok.encode(t).input_ids[:128] for t in rows[b * size:(b + 1) * size]]
        S = max(map(len, ids))
        x = torch.zeros(len(ids), S, dtype=torch.long)
        m = torch.zeros_like(x)
        for i, r in enumerate(ids):
            x[i, :len(r)] = torch.tensor(r)
            m[i, :len(r)] = 1
        out.append((x, m))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    p.add_argument("--tokenizer", type=Path, required=True, help="MiniLM's folder (bert-base-uncased WordPiece)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--model-size", choices=("minilm", "base"), default="minilm",
                   help="MiniLM-L6's architecture or BERT-Base's (default minilm)")
    p.add_argument("--bf16", action="store_true", help="under bf16 autocast (on a GPU: the varlen FlashAttention path)")
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    device = torch.device(a.device)
    data = [(x.to(device), m.to(device)) for x, m in batches(a.data, a.tokenizer, a.batches, a.batch_size, 0)]
    padding = sum(m.numel() for _, m in data) / sum(int(m.sum()) for _, m in data)
    models = {}
    for attn in ("sdpa", "unpadded"):
        torch.manual_seed(0)
        shape = (dict(hidden_size=384, num_hidden_layers=6, num_attention_heads=12, intermediate_size=1536)
                 if a.model_size == "minilm" else
                 dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072))
        c = BertConfig(vocab_size=30522, attn_implementation=attn, num_labels=2, **shape)
        models[attn] = BertForSequenceClassification(c).to(device)
    models["unpadded"].load_state_dict(models["sdpa"].state_dict())
    load_before = os.getloadavg()
    seconds: dict[str, list[float]] = {k: [] for k in models}
    for r in range(a.rounds + 1):  # round 0 warms up (allocator, kernels' autotuning) and is not counted
        for attn, model in models.items():
            t = time.perf_counter()
            for x, m in data:
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=a.bf16):
                    out = model(x, None, m, labels=torch.zeros(x.shape[0], dtype=torch.long, device=device))
                out.loss.backward()
            if device.type == "cuda":
                torch.cuda.synchronize()
            if r:
                seconds[attn].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in seconds.items()}
    result = {
        "benchmark": "unpadded fine-tuning step (forward + backward)", "commit": commit(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "threads": a.threads, "cpu_count": os.cpu_count(),
        "versions": {"torch": torch.__version__, "python": platform.python_version()},
        "model": f"{'MiniLM-L6' if a.model_size == 'minilm' else 'BERT-Base'} architecture, 2 labels",
        "dtype": "bf16 autocast" if a.bf16 else "fp32", "batches": a.batches, "batch_size": a.batch_size,
        "padded_over_real_tokens": round(padding, 3),
        "seconds_per_round": {k: [round(t, 3) for t in v] for k, v in seconds.items()},
        "median_seconds": {k: round(v, 3) for k, v in med.items()},
        "speedup_unpadded": round(med["sdpa"] / med["unpadded"], 3),
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
    }
    a.output.parent.mkdir(parents=True, exist_ok=True)
    tmp = a.output.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(a.output)
    print(json.dumps({k: result[k] for k in ("padded_over_real_tokens", "median_seconds", "speedup_unpadded")}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
