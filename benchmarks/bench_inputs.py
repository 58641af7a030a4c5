"""build-data throughput on compressed input against the same text uncompressed.

The shared corpus (~8 MB of raw text, ``*.txt`` files, one document per file) is
written once per codec, each file compressed on its own (``name.txt.gz``, ``.bz2``,
``.xz``, ``.zst``, at the command-line tools' default levels), and built at
max_seq_length 128, dupe_factor 1 with 1 and 2 workers, each build in a fresh
process.  Builds alternate over codecs and worker counts in every round, so all
see the same background load.  Every build of the same text must give the same
shards (their sha256 is compared).

Reported per codec and worker count, as medians over the rounds: wall seconds,
MB of raw text per second per worker and its ratio to plain text, CPU seconds
(this process's main thread, its reader thread, and its workers); and the CPU
cost of reading alone (decompress, decode, split into documents: one process,
no tokenization), in MB/s.  Decompression runs in a reader thread (the codecs
release the GIL), so with a core free for it its cost is off the critical path
(the main thread's CPU time is the 1-worker build's); the total CPU seconds say
what it costs on a machine with no core to spare.
Writes ``benchmarks/results/build-data-inputs-cpu.json``.

    python benchmarks/bench_inputs.py [--corpus ../shared/data/corpus] [--repeats 5]
"""
from __future__ import annotations

import argparse
import bz2
import gzip
import hashlib
import json
import lzma
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_build_data import config, vocab_path  # noqa: E402  (one build configuration for both benchmarks)

CODECS = {  # suffix -> compress at the command-line tool's default level
    "gz": lambda data: gzip.compress(data, compresslevel=6),
    "bz2": lambda data: bz2.compress(data, compresslevel=9),
    "xz": lambda data: lzma.compress(data, preset=6),
    "zst": lambda data: __import__("zstandard").ZstdCompressor(level=3).compress(data),
}


def write_variants(corpus: Path, folder: Path) -> dict[str, dict]:
    """plain: the corpus itself; one folder per codec with every file compressed on its own."""
    files = sorted(corpus.rglob("*.txt"))
    variants = {"plain": {"path": str(corpus), "bytes_on_disk": sum(f.stat().st_size for f in files)}}
    for suffix, compress in CODECS.items():
        out = folder / suffix
        size = 0
        for f in files:
            target = out / f.relative_to(corpus).with_name(f.name + "." + suffix)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(compress(f.read_bytes()))
            size += target.stat().st_size
        variants[suffix] = {"path": str(out), "bytes_on_disk": size}
    return variants


def run_one(path: str, workers: int) -> dict:
    """One build in this process: wall and CPU seconds, and a hash of the shards it wrote."""
    from bertctl.data.build import build_data
    from bertctl.tokenizer import BertTokenizer

    tokenizer = BertTokenizer.from_vocab_file(vocab_path())
    with tempfile.TemporaryDirectory() as tmp:
        cpu0, main0 = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]), time.thread_time()
        start = time.perf_counter()
        summary = build_data([path], Path(tmp) / "out", tokenizer, config(), workers=workers, progress=False)
        seconds = time.perf_counter() - start
        cpu, main = sum(resource.getrusage(resource.RUSAGE_SELF)[:2]) - cpu0, time.thread_time() - main0
        digest = hashlib.sha256()
        for shard in sorted((Path(tmp) / "out").glob("*.npy")):
            digest.update(shard.read_bytes())
    return {
        "workers": workers,
        "seconds": round(seconds, 3),
        "mb": round(summary["bytes"] / 1e6, 3),
        "mb_per_s_per_worker": round(summary["bytes"] / 1e6 / seconds / workers, 3),
        "instances": summary["instances"],
        "cpu_seconds_parent": round(cpu, 3),
        # The main thread alone: with 1 worker it reads lines and does all the work; the reader
        # thread (decompression) is the rest of the parent's CPU time.
        "cpu_seconds_main_thread": round(main, 3),
        "cpu_seconds_reader_thread": round(cpu - main, 3),
        "cpu_seconds_children": round(sum(resource.getrusage(resource.RUSAGE_CHILDREN)[:2]), 3),
        "shards_sha256": digest.hexdigest(),
    }


def read_only(path: str) -> dict:
    """CPU seconds to read the variant into documents (decompress, decode, paragraphs), one process."""
    from bertctl.data.documents import ReadStats, list_inputs, read_documents

    best = None
    for _ in range(3):
        stats = ReadStats()
        cpu0 = time.process_time()
        for _doc in read_documents(list_inputs([path], "*.txt", "text"), "text", stats):
            pass
        cpu = time.process_time() - cpu0
        best = cpu if best is None else min(best, cpu)
    return {"cpu_seconds": round(best, 3), "mb_per_cpu_s": round(stats.bytes / 1e6 / best, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default=str(ROOT.parent / "shared" / "data" / "corpus"))
    parser.add_argument("--repeats", type=int, default=5, help="rounds: builds per codec and worker count")
    parser.add_argument("--workers", default="1,2", help="worker counts, comma-separated")
    parser.add_argument("--run-one", nargs=2, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--output", default=str(ROOT / "benchmarks" / "results" / "build-data-inputs-cpu.json"))
    args = parser.parse_args()
    if args.run_one is not None:
        print(json.dumps(run_one(args.run_one[0], int(args.run_one[1]))))
        return

    env = dict(os.environ, OMP_NUM_THREADS="1")
    worker_counts = [int(w) for w in args.workers.split(",")]
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as tmp:
        variants = write_variants(Path(args.corpus), Path(tmp))
        runs: dict[tuple[str, int], list[dict]] = {(v, w): [] for v in variants for w in worker_counts}
        order = list(runs)
        for r in range(args.repeats):
            for variant, workers in order[r % len(order):] + order[: r % len(order)]:  # rotate the order each round
                out = subprocess.run([sys.executable, __file__, "--run-one", variants[variant]["path"], str(workers)],
                                     capture_output=True, text=True, env=env, check=True)
                runs[variant, workers].append(json.loads(out.stdout.strip().splitlines()[-1]))
                print(variant, json.dumps(runs[variant, workers][-1]), file=sys.stderr)
        reading = {v: read_only(info["path"]) for v, info in variants.items()}
    load_after = os.getloadavg()

    hashes = {r["shards_sha256"] for rs in runs.values() for r in rs}
    assert len(hashes) == 1, "builds of the same text gave different shards"
    metrics = ("seconds", "cpu_seconds_parent", "cpu_seconds_children", "cpu_seconds_main_thread",
               "cpu_seconds_reader_thread")
    results: dict = {}
    for (variant, workers), rs in runs.items():
        # Medians over the rounds (a shared machine's slow spells hit single runs), and the fastest run.
        row = {"workers": workers, "mb": rs[0]["mb"], "instances": rs[0]["instances"]}
        row.update({f"median_{m}": round(statistics.median(r[m] for r in rs), 3) for m in metrics})
        row["median_cpu_seconds_total"] = round(statistics.median(
            r["cpu_seconds_parent"] + r["cpu_seconds_children"] for r in rs), 3)
        row["fastest_seconds"] = min(r["seconds"] for r in rs)
        row["median_mb_per_s_per_worker"] = round(row["mb"] / row["median_seconds"] / workers, 3)
        row["runs"] = [{k: v for k, v in r.items() if k != "shards_sha256"} for r in rs]
        results.setdefault(variant, {"bytes_on_disk": variants[variant]["bytes_on_disk"],
                                     "read_only": reading[variant]})[f"workers_{workers}"] = row
    for variant, res in results.items():
        for workers in worker_counts:
            key = f"workers_{workers}"
            row, plain = res[key], results["plain"][key]
            row["throughput_vs_plain"] = round(plain["median_seconds"] / row["median_seconds"], 3)
            row["cpu_vs_plain"] = round(row["median_cpu_seconds_total"] / plain["median_cpu_seconds_total"], 3)
            if workers == 1:  # the critical path when a core is free for the reader thread
                row["main_thread_cpu_vs_plain"] = round(
                    row["median_cpu_seconds_main_thread"] / plain["median_cpu_seconds_main_thread"], 3)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    report = {
        "benchmark": "build_data_inputs",
        "corpus": args.corpus,
        "config": {"format": "text", "max_seq_length": 128, "dupe_factor": 1, "pattern": "*.txt"},
        "host": platform.node(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "commit": commit,
        "date": time.strftime("%Y-%m-%d"),
        "load_average_before": [round(x, 2) for x in load_before],
        "load_average_after": [round(x, 2) for x in load_after],
        "shards_identical": True,
        "results": results,
    }
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    Path(args.output).write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
