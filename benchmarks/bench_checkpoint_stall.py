"""How long a mid-run checkpoint holds training up: ``Engine.save`` written in place (``wait=True``,
what final checkpoints do) against written in the background (``wait=False``, what periodic and
epoch-end checkpoints do: the state is copied to host memory, then written by a thread while
training goes on).

The model is a preset (``--size``, random weights) with AdamW's state (one optimizer step), on
``--device``. Per round and mode: the seconds ``save`` blocks the caller, and the seconds until the
checkpoint is complete. Modes alternate over ``--rounds``; medians are reported. Writes a JSON with
device, versions, commit, the checkpoint's size and the timings.

    python benchmarks/bench_checkpoint_stall.py --size base --device cpu -o benchmarks/results/checkpoint-stall-cpu.json
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bertctl import allocator  # noqa: E402
from bertctl.bench import harness  # noqa: E402
from bertctl.config import BertConfig  # noqa: E402
from bertctl.io import write_json  # noqa: E402
from bertctl.model import BertForPreTraining  # noqa: E402
from bertctl.tasks.trainer import TaskObjective  # noqa: E402
from bertctl.train import distributed, state  # noqa: E402
from bertctl.train.engine import Engine, EngineConfig  # noqa: E402
from bertctl.progress import MetricsLog  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="base", help="model preset (default base)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--rounds", type=int, default=3, help="rounds per mode (default 3)")
    p.add_argument("--work", type=Path, default=None, help="folder for the checkpoints (default: a temporary one)")
    p.add_argument("-o", "--output", type=Path, required=True)
    a = p.parse_args(argv)
    allocator.configure()
    device = torch.device(a.device)
    model = BertForPreTraining(BertConfig.preset(a.size, vocab_size=30522)).to(device)
    engine = Engine(EngineConfig(batch_size=8, max_steps=10, keep=1), model, TaskObjective(),
                    dist=distributed.Dist(device=device), run_dir=None, log=MetricsLog(None))
    for p_ in model.parameters():  # one step, so that AdamW holds its moments
        p_.grad = torch.randn_like(p_) * 1e-3
    engine.optimizer.step()
    engine.optimizer.zero_grad()
    work = a.work or Path(tempfile.mkdtemp(prefix="checkpoint-stall-"))
    engine.run_dir = work
    load_before = os.getloadavg()
    times: dict[str, dict[str, list[float]]] = {m: {"blocked_s": [], "complete_s": []} for m in ("in place", "background")}
    for r in range(a.rounds):
        for mode in times:
            engine.step = r
            t0 = time.perf_counter()
            engine.save({}, reason="periodic", wait=mode == "in place")
            blocked = time.perf_counter() - t0
            engine.wait_for_checkpoints()
            complete = time.perf_counter() - t0
            times[mode]["blocked_s"].append(round(blocked, 3))
            times[mode]["complete_s"].append(round(complete, 3))
            print(mode, round(blocked, 3), round(complete, 3), file=sys.stderr)
    size = sum(f.stat().st_size for f in state.latest_checkpoint(work).path.iterdir())
    if a.work is None:
        shutil.rmtree(work, ignore_errors=True)
    summary = {m: {k: statistics.median(v) for k, v in t.items()} for m, t in times.items()}
    write_json(a.output, {"benchmark": "checkpoint-stall", "device": harness.device_block(device), "size": a.size,
                          "parameters": sum(p_.numel() for p_ in model.parameters()), "checkpoint_bytes": size,
                          "rounds": a.rounds, "loadavg_before": load_before, "loadavg_after": os.getloadavg(),
                          "median": summary, "runs": times})
    print(summary, file=sys.stderr)


if __name__ == "__main__":
    main()
