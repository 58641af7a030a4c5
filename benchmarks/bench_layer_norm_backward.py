"""The CPU sub-layer output's backward from the output y against from the input (x and the residual), in one process.

    python benchmarks/bench_layer_norm_backward.py --output benchmarks/results/ln-backward-cpu.json

On the CPU in fp32 the bias+dropout+residual+LayerNorm node keeps y and gives xhat back as (y - ln_bias) /
weight when the weights allow it (``backward_from_output`` in csrc/autograd.cpp), else x and the residual. Both
paths run here in the same process, on the same data, alternating in rounds: the input path is forced by making
one LayerNorm unit ill-conditioned (its bias 100 times its weight), which changes nothing else. Two levels:
- the op, forward then backward, hidden 768, 1024 and 4096 tokens;
- BERT's pretraining step (``--sizes`` preset:batch, sequences of 128, 20 masked positions), its time and the
  bytes autograd keeps for the backward (unique storages).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import bertctl.model as M  # noqa: E402
from bertctl import ops  # noqa: E402
from bertctl.config import BertConfig  # noqa: E402
from bertctl.train.optim import build_optimizer  # noqa: E402
from bertctl.train.pretrain import pretraining_sums  # noqa: E402
from bench_cpu_step import random_batch  # noqa: E402  (the same random batch as the step benchmark)

PATHS = ("from_output", "from_input")


def ill_conditioned(weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """bias with its first unit at 100 times the weight: the backward then works from the input."""
    b = bias.detach().clone()
    b[0] = 100 * weight.detach()[0]
    return b.requires_grad_(bias.requires_grad)


def interleaved(fns: dict, args: list, rounds: int, reps: int) -> dict[str, float]:
    """Median ms of each function over rounds in rotated order, reps calls a round over the argument sets."""
    for f in fns.values():
        for a in args:
            f(*a)
    times: dict[str, list[float]] = {k: [] for k in fns}
    names = list(fns)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            for i in range(reps):
                t = time.perf_counter()
                fns[name](*args[i % len(args)])
                times[name].append((time.perf_counter() - t) * 1e3)
    return {k: round(statistics.median(v), 4) for k, v in times.items()}


def op_rows(tokens: int, rounds: int, reps: int) -> dict:
    H, g = 768, torch.Generator().manual_seed(tokens)
    args = [tuple(torch.randn(tokens, H, generator=g).requires_grad_(k < 2) for k in range(3)) for _ in range(2)]
    w = (1 + 0.1 * torch.randn(H, generator=g)).requires_grad_()
    b = (0.1 * torch.randn(H, generator=g)).requires_grad_()
    c = (0.1 * torch.randn(H, generator=g)).requires_grad_()

    def bdaln(ln_bias):
        def run(x, r, dy):
            y = ops.bias_dropout_add_layer_norm(x, c, r, w, ln_bias, 1e-12, 0.1, True)
            return torch.autograd.grad(y, (x, c, r, w, ln_bias), dy)
        return run

    ms = interleaved({"from_output": bdaln(b), "from_input": bdaln(ill_conditioned(w, b))}, args, rounds, reps)
    return {"tokens": tokens, "hidden": H, "p": 0.1, "fwd_bwd_ms": ms}


def step_row(size: str, batch: int, rounds: int, steps: int) -> dict:
    cfg = BertConfig.preset(size, vocab_size=4000 if size == "tiny" else 30522)
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    model = M.BertForPreTraining(cfg)
    opt = build_optimizer(model, "adamw", lr=0.0, fused=True)  # lr 0: the LayerNorm biases stay as set
    mb = random_batch(cfg.vocab_size, batch, g)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)]
    biases = {"from_output": [m.bias.detach().clone() for m in norms],
              "from_input": [ill_conditioned(m.weight, m.bias).detach() for m in norms]}

    def use(path: str) -> None:
        with torch.no_grad():
            for m, b in zip(norms, biases[path]):
                m.bias.copy_(b)

    def step() -> None:
        s = pretraining_sums(model, mb)
        (s["mlm_sum"] / mb["masked_lm_labels"].numel() + s["nsp_sum"] / batch).backward()
        opt.step()
        opt.zero_grad()

    def kept_bytes() -> int:
        storages: dict[int, int] = {}

        def pack(t):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            s = pretraining_sums(model, mb)
        (s["mlm_sum"] + s["nsp_sum"]).backward()
        opt.zero_grad()
        return sum(storages.values())

    kept, times = {}, {p: [] for p in PATHS}
    for path in PATHS:
        use(path)
        kept[path] = round(kept_bytes() / 2**20, 1)
    for r in range(rounds):
        for path in PATHS if r % 2 == 0 else PATHS[::-1]:
            use(path)
            step()
            t = time.perf_counter()
            for _ in range(steps):
                step()
            times[path].append(round((time.perf_counter() - t) / steps * 1e3, 2))
    return {"size": size, "batch": batch, "seq": 128, "steps_per_round": steps, "ms_per_step": times,
            "median_ms": {p: statistics.median(t) for p, t in times.items()}, "kept_for_backward_mib": kept}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="tiny:8,mini:32", help="preset:batch, comma-separated")
    ap.add_argument("--rounds", type=int, default=20, help="rounds of the op timings (the step's: a third)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--output", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    commit = os.environ.get("BERTCTL_COMMIT") or subprocess.run(
        ["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    load_before = os.getloadavg()
    out = {"what": __doc__.split("\n\n")[0], "commit": commit, "machine": platform.machine(),
           "processor": platform.processor(), "cpus": os.cpu_count(), "threads": a.threads,
           "torch": torch.__version__, "python": platform.python_version(), "load_average_before": load_before,
           "ops": [], "steps": []}
    for tokens in (1024, 4096):
        out["ops"].append(op_rows(tokens, a.rounds, 10))
        print(json.dumps(out["ops"][-1]), flush=True)
    for item in a.sizes.split(","):
        size, batch = item.split(":")
        out["steps"].append(step_row(size, int(batch), max(2, a.rounds // 3), 40 if size == "tiny" else 8))
        print(json.dumps(out["steps"][-1]), flush=True)
    out["load_average_after"] = os.getloadavg()
    a.output.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
