"""What fine-tuning pays for torch's dropout masks: a training forward and backward of a model loaded for
fine-tuning with ``dropout_masks="torch"`` (torch's dropout before the fused LayerNorm, what fine-tuning
trains with) against ``"fused"`` (the fused sub-layer op drawing its own hashed masks), the same weights,
on batches of SST-2 training sentences in random order.

Rounds alternate the two; the first is a warm-up and the medians of the rest are reported. Writes a JSON
with device, versions, commit and every round.

    python benchmarks/bench_dropout_masks.py --model MINILM_DIR --data ../shared/data/glue/SST-2/train.tsv \\
        -o benchmarks/results/dropout-masks-cpu.json
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bertctl.bench import harness  # noqa: E402
from bertctl.checkpoint import load_pretrained  # noqa: E402
from bertctl.io import write_json  # noqa: E402
from bertctl.model import BertForSequenceClassification  # noqa: E402
from bertctl.tokenizer import load_tokenizer  # noqa: E402


def batches(model_dir: Path, tsv: Path, count: int, size: int, device: str) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of ``size`` sentences in random order (seed 0), each padded to its longest."""
    tok = load_tokenizer(model_dir)
    texts = [line.split("\t")[0] for line in tsv.read_text(encoding="utf-8").splitlines()[1:]]
    random.Random(0).shuffle(texts)
    out = []
    for b in range(count):
        ids = [tok.encode(t).input_ids[:128] for t in texts[b * size:(b + 1) * size]]
        n = max(map(len, ids))
        x = torch.tensor([i + [0] * (n - len(i)) for i in ids])
        out.append({"input_ids": x.to(device), "attention_mask": (x != 0).long().to(device),
                    "token_type_ids": torch.zeros_like(x).to(device), "labels": torch.randint(0, 2, (size,)).to(device)})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, required=True, help="a model directory (Hugging Face layout)")
    p.add_argument("--data", type=Path, required=True, help="SST-2's train.tsv")
    p.add_argument("--device", default="cpu")
    p.add_argument("--batches", type=int, default=12)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--rounds", type=int, default=6, help="the first is a warm-up (default 6)")
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args(argv)
    data = batches(a.model, a.data, a.batches, a.batch_size, a.device)
    models = {masks: load_pretrained(BertForSequenceClassification, a.model, fresh_heads=True, num_labels=2,
                                     dropout_masks=masks).to(a.device).train() for masks in ("torch", "fused")}
    rounds: dict[str, list[float]] = {masks: [] for masks in models}
    for _ in range(a.rounds):
        for masks, model in models.items():
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            for batch in data:
                model(**batch).loss.backward()
            if a.device.startswith("cuda"):
                torch.cuda.synchronize()
            rounds[masks].append(round(time.perf_counter() - t0, 4))
    medians = {masks: statistics.median(r[1:]) for masks, r in rounds.items()}
    result = {"benchmark": "dropout-masks", "device": harness.device_block(a.device), "model": a.model.name,
              "batches": a.batches, "batch_size": a.batch_size, "rounds_s": rounds, "median_s": medians,
              "torch_over_fused": round(medians["torch"] / medians["fused"], 3)}
    print(result, file=sys.stderr)
    write_json(a.output, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
