"""Where ``embed``'s time goes on a GPU: the real ``embed_texts`` loop on real sentences, in process.

    python benchmarks/embed/profile_embed.py --model MINILM_DIR --data SST2_TRAIN.tsv [--n 0] [--attn sdpa] [--backend native]

Loads the encoder as ``bertctl embed`` does, tokenises once, then, for each of ``--batch-sizes``,
times ``--repeats`` warm runs of ``embed_texts`` (mean pooling, normalised, ``--precision``), each
synchronised, and profiles one more: per batch, the host time, the CUDA kernels, the host-device synchronisations and the
operators with the most host time; over the run, the GPU's busy time. A run whose wall time is far
above the GPU's busy time is bound by the host. ``--backend native`` profiles bertctl's own CUDA encoder
(``bertctl.inference.backends.native``: the profiler sees its kernels and cuBLASLt's too) at ``--precision``, its first,
cold run timed apart. JSON on stdout (``-o`` writes it too).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bertctl.data.batching import length_batches  # noqa: E402
from bertctl.inference.backends import load_encoder  # noqa: E402
from bertctl.inference.backends.torch import TorchEncoder  # noqa: E402
from bertctl.inference.embed import EmbedConfig, embed_texts, tokenize_texts  # noqa: E402
from bertctl._ext import kernels_loaded  # noqa: E402
from bertctl.text import load_tokenizer  # noqa: E402
from bertctl.bench import harness  # noqa: E402
from bertctl.io import write_json  # noqa: E402


def read_sentences(path: Path, n: int) -> list[str]:
    rows = path.read_text(encoding="utf-8").splitlines()[1:]
    texts = [r.split("\t")[0] for r in rows if r.strip()]
    return texts[:n] if n else texts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="a BERT checkpoint directory (all-MiniLM-L6-v2)")
    ap.add_argument("--data", type=Path, required=True, help="SST-2 train.tsv: its sentences")
    ap.add_argument("--n", type=int, default=0, help="sentences (0: all)")
    ap.add_argument("--device", default="cuda", help="cuda (what this is for) or cpu (a smoke test)")
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--attn", default=None, help="the model's attention backend instead of its runtime's")
    ap.add_argument("--weights", default="fp32", choices=("fp32", "bf16", "fp16"),
                    help="the encoder's weights: fp32 (autocast to --precision, as embed runs), or cast once to "
                         "bf16/fp16 and run without autocast (as sentence-transformers' model.half())")
    ap.add_argument("--batch-sizes", type=lambda v: [int(x) for x in v.split(",")], default=[256, 0],
                    help="embed's --batch-size values to compare, 0 for none (default 256,0)")
    ap.add_argument("--backend", default="torch", choices=("torch", "native"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--rows", type=int, default=20)
    ap.add_argument("-o", "--output", type=Path)
    a = ap.parse_args()

    device = torch.device(a.device)
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    texts = read_sentences(a.data, a.n)
    model = load_encoder(a.model, device)
    if a.attn:
        model.model.set_runtime(dataclasses.replace(model.model.runtime, attn=a.attn))
    tokenizer = load_tokenizer(a.model)
    config = EmbedConfig(pooling="mean", normalize=True, precision="fp32", device=a.device, backend="torch")
    reference = embed_texts(model, tokenizer, texts, config, progress=False)  # fp32: what the variants must match
    if a.backend == "native":
        from bertctl.inference.backends.native import NativeEncoder

        t = time.perf_counter()
        model = NativeEncoder(a.model, "cuda:0", a.precision)
        start_s = time.perf_counter() - t
        config.backend, config.precision = "native", a.precision
    elif a.weights != "fp32":
        model = TorchEncoder(model.model.to(torch.bfloat16 if a.weights == "bf16" else torch.float16), a.weights)
    elif cuda:
        model = TorchEncoder(model.model, a.precision)  # autocast on the fp32 weights
    t = time.perf_counter()
    flat, lengths = tokenize_texts(tokenizer, texts, model.config.max_position_embeddings)
    tokenize_s = time.perf_counter() - t

    from torch.profiler import ProfilerActivity, profile

    results = []
    for batch_size in a.batch_sizes:
        config.batch_size = batch_size or None
        batches = length_batches(lengths, config.batch_size, 65536 if cuda else 1024)
        sync()
        t = time.perf_counter()
        vectors = embed_texts(model, tokenizer, texts, config, progress=False)  # also the warm-up
        sync()
        first_s = time.perf_counter() - t
        least_cosine = float((vectors * reference).sum(-1).min())  # both normalised
        runs = []
        for _ in range(a.repeats):
            sync()
            t = time.perf_counter()
            embed_texts(model, tokenizer, texts, config, progress=False)
            sync()
            runs.append(time.perf_counter() - t)
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            embed_texts(model, tokenizer, texts, config, progress=False)
            sync()
        n = len(batches)
        wall = statistics.median(runs)
        results.append({"batch_size": batch_size or "none (the token budget)", "batches": n,
                        "least_cosine_vs_fp32": least_cosine, "first_run_s": round(first_s, 3),
                        "warm_runs_s": [round(r, 3) for r in runs],
                        "wall_s_median": round(wall, 3), "ms_per_batch": wall * 1e3 / n,
                        **harness.profile_summary(prof, n, "batch", a.rows)})
    out = {"what": "embed_texts host profile (benchmarks/embed/profile_embed.py)", "model": str(a.model),
           "backend": a.backend, **({"native_start_s": round(start_s, 3)} if a.backend == "native" else {}),
           "attn": model.model.runtime.attn, "precision": model.precision, "weights": a.weights,
           "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "environment": harness.environment(device),
           "compiled_kernels": kernels_loaded() or "none: the extension did not load (plain PyTorch ops)",
           "texts": len(texts), "tokens": int(lengths.sum()), "tokenize_s_one_process": round(tokenize_s, 3),
           "by_batch_size": results}
    print(json.dumps(out, indent=1))
    if a.output:
        write_json(a.output, out, indent=1)


if __name__ == "__main__":
    main()
