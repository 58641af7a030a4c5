"""What a new batch shape costs each of SDPA's attention kernels in a training step, and what a step costs.

    python benchmarks/bench_attention_plans.py -o OUT.json [--heads 12 --head-dim 64]

For each backend (cuDNN's attention; the memory-efficient kernel, what SDPA picks without cuDNN when a
padding mask and dropout are given), a forward and backward of padded attention with a boolean key mask
and dropout 0.1 at each of ``--lengths`` in turn (batch ``--batch``): the first call at a length (a new
shape: cuDNN builds an execution plan, and the process's first call loads the library and its kernels)
and the median of the next ``--repeats`` (the steady cost). Run it twice in a row on a fresh machine: the
first process pays what is compiled once per machine, the second shows what every run pays.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def timed(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lengths", default="384,376,368,352,320,288,256,224,192,160,128,96,64,48,32")
    ap.add_argument("--backends", default="cudnn,efficient")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--label", default="")
    ap.add_argument("-o", "--output", type=Path)
    a = ap.parse_args()
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    torch.ones(1, device=dev)
    init_s = time.perf_counter() - t0
    lengths = [int(x) for x in a.lengths.split(",")]
    gen = torch.Generator().manual_seed(0)
    out = {"what": __doc__.split("\n\n")[0], "label": a.label, "device": torch.cuda.get_device_name(0),
           "torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "batch": a.batch,
           "heads": a.heads, "head_dim": a.head_dim, "dtype": "bf16", "dropout": 0.1, "cuda_init_s": init_s,
           "backends": {}}
    for name in a.backends.split(","):
        rows = []
        for S in lengths:
            q, k, v = (torch.randn(a.batch, a.heads, S, a.head_dim, device=dev, dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            real = torch.randint(S // 2, S + 1, (a.batch,), generator=gen).to(dev)
            mask = (torch.arange(S, device=dev)[None, :] < real[:, None])[:, None, None, :]
            grad = torch.randn(a.batch, a.heads, S, a.head_dim, device=dev, dtype=torch.bfloat16)

            def step():
                with sdpa_kernel(BACKENDS[name]):
                    o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.1)
                o.backward(grad)

            first = timed(step)
            steady = statistics.median(timed(step) for _ in range(a.repeats))
            rows.append({"length": S, "first_call_ms": round(first * 1e3, 3), "steady_ms": round(steady * 1e3, 4)})
        out["backends"][name] = {
            "rows": rows,
            "first_shape_extra_ms": round(rows[0]["first_call_ms"] - rows[0]["steady_ms"], 2),
            "later_shapes_extra_ms_median": round(statistics.median(
                r["first_call_ms"] - r["steady_ms"] for r in rows[1:]), 3) if len(rows) > 1 else None}
    text = json.dumps(out, indent=1)
    print(text)
    if a.output:
        a.output.write_text(text + "\n")


if __name__ == "__main__":
    sys.exit(main())
