"""Speed of ``bertctl tokenize train`` (WordPiece) by phase, against an earlier commit's trainer.

    python benchmarks/bench_vocab_speed.py CORPUS... [--format jsonl --pattern '*.jsonl'] \
        [--vocab-size 30522] [--workers 1 2 16] [--baseline e62ef29]

Times the two phases of training: counting words (reading, sampling and BERT basic tokenisation;
once per ``--workers`` value) and learning the pieces from the counts (``train_from_counts``, one
process). ``--baseline COMMIT`` also runs both phases with ``bertctl/vocab.py`` as it was at that
commit (e62ef29: one process, every pair of a merged word recounted), in this same run, and checks
that both write the same vocabulary, byte for byte, whatever the number of workers. Writes
benchmarks/results/vocab-speed-cpu<N>.json (N: the CPU count).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's bertctl, whatever is installed


def module_at(commit: str, directory: Path):
    """``bertctl/vocab.py`` of ``commit``, imported as its own module (it uses today's bertctl otherwise)."""
    source = subprocess.run(["git", "show", f"{commit}:bertctl/vocab.py"], cwd=ROOT, capture_output=True, text=True,
                            check=True).stdout
    path = directory / f"vocab_{commit}.py"
    path.write_text(source, encoding="utf-8")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def timed(fn, *args, **kwargs):
    """(result, wall seconds, CPU seconds of this process and its finished children)."""
    def cpu() -> float:
        own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
        return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime

    w0, c0 = time.perf_counter(), cpu()
    result = fn(*args, **kwargs)
    return result, round(time.perf_counter() - w0, 2), round(cpu() - c0, 2)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("inputs", nargs="+")
    parser.add_argument("--format", default="text")
    parser.add_argument("--pattern", default=None)
    parser.add_argument("--vocab-size", type=int, default=30522)
    parser.add_argument("--workers", type=int, nargs="+", default=sorted({1, 2, os.cpu_count() or 1}))
    parser.add_argument("--baseline", default=None, help="a commit whose trainer runs too, for comparison")
    args = parser.parse_args()

    import bertctl
    from bertctl import vocab

    config = vocab.VocabConfig(vocab_size=args.vocab_size, format=args.format, pattern=args.pattern)
    files = vocab.collect_files(args.inputs, config)
    report: dict = {
        "benchmark": "WordPiece vocabulary training by phase",
        "inputs": args.inputs, "files": len(files), "input_bytes": sum(f.stat().st_size for f in files),
        "config": config.to_dict(),
    }
    runs = {}
    tokens = None
    for workers in args.workers:
        counts, wall, cpu = timed(vocab.count_words, files, config, vocab._pretokenizer(config), workers=workers)
        runs[f"count_words_workers_{workers}"] = {"wall_s": wall, "cpu_s": cpu, "word_types": len(counts)}
        if tokens is None:
            tokens, wall, cpu = timed(vocab.train_from_counts, counts, config)
            runs["train_from_counts"] = {"wall_s": wall, "cpu_s": cpu}
        else:
            assert vocab.train_from_counts(counts, config) == tokens, f"workers={workers} changed the vocabulary"
    report["current"] = runs
    if args.baseline:
        with tempfile.TemporaryDirectory() as tmp:
            old = module_at(args.baseline, Path(tmp))
            old_config = old.VocabConfig(vocab_size=args.vocab_size, format=args.format, pattern=args.pattern)
            counts, count_wall, count_cpu = timed(old.count_words, files, old_config, old._pretokenizer(old_config))
            old_tokens, merge_wall, merge_cpu = timed(old.train_from_counts, counts, old_config)
        report["baseline"] = {"commit": args.baseline, "count_words": {"wall_s": count_wall, "cpu_s": count_cpu},
                              "train_from_counts": {"wall_s": merge_wall, "cpu_s": merge_cpu}}
        report["identical_to_baseline"] = old_tokens == tokens
    report.update(
        machine={"cpus": os.cpu_count(), "platform": platform.platform(), "processor": platform.processor()},
        versions={"python": platform.python_version(), "bertctl": bertctl.__version__},
        commit=subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    out = ROOT / "benchmarks" / "results" / f"vocab-speed-cpu{os.cpu_count()}.json"
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2), file=sys.stderr)
    if args.baseline and not report["identical_to_baseline"]:
        raise SystemExit("the vocabulary differs from the baseline's")
    print(out)


if __name__ == "__main__":
    main()
