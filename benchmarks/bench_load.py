"""How long loading a checkpoint for fine-tuning takes: ``checkpoint.load_pretrained`` (the model built
on the meta device, the checkpoint's tensors taken as they are, only the fresh head allocated and
drawn) against building the model on the CPU, drawing every weight, then copying the checkpoint in.

Per preset (``--sizes``, random weights saved once as a Hugging Face directory), rounds alternate
the two ways; the first round reads the file cold from the page cache's point of view, so medians
are reported. Writes a JSON with device, versions, commit and every round.

    python benchmarks/bench_load.py --sizes base,large -o benchmarks/results/load-cpu.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bertctl.bench import harness  # noqa: E402
from bertctl.checkpoint import load_config, load_pretrained, load_state, read_state_dict, save_pretrained  # noqa: E402
from bertctl.config import BertConfig  # noqa: E402
from bertctl.io import write_json  # noqa: E402
from bertctl.model import BertForPreTraining, BertForSequenceClassification  # noqa: E402


def built_then_loaded(directory: Path) -> torch.nn.Module:
    """What loading did before: the whole model drawn at random on the CPU, then overwritten."""
    model = BertForSequenceClassification(load_config(directory))
    return load_state(model, read_state_dict(directory), fresh_heads=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="base,large")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args(argv)
    rows = []
    for size in a.sizes.split(","):
        with tempfile.TemporaryDirectory() as d:
            save_pretrained(BertForPreTraining(BertConfig.preset(size)), d)
            times: dict[str, list[float]] = {"on_meta": [], "built_then_loaded": []}
            for _ in range(a.rounds):
                for name, load in (("on_meta", lambda: load_pretrained(BertForSequenceClassification, d,
                                                                        fresh_heads=True)),
                                   ("built_then_loaded", lambda: built_then_loaded(Path(d)))):
                    t0 = time.perf_counter()
                    model = load()
                    times[name].append(round(time.perf_counter() - t0, 4))
                    del model
        row = {"size": size, "rounds_s": times, **{f"{k}_median_s": statistics.median(v) for k, v in times.items()}}
        row["speedup"] = round(row["built_then_loaded_median_s"] / row["on_meta_median_s"], 1)
        rows.append(row)
        print(row, file=sys.stderr)
    write_json(a.output, {"benchmark": "checkpoint-load", "device": harness.device_block("cpu"), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
