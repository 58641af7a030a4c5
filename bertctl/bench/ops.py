"""Benchmark of the fused ops against eager PyTorch and torch.compile of the same expression.

For each op (softmax with scale + key-padding mask, LayerNorm + residual, bias + GELU,
bias + dropout + residual + LayerNorm, and the masked-LM cross-entropy over a 30,522-token
vocabulary), each mode (``fwd``, ``fwdbwd``) and each provider
(``fused``: bertctl.ops; ``eager``: the plain PyTorch expression the model runs with
``kernels="torch"``; ``compile``: torch.compile of that expression; ``separate``, for an op that
fuses other bertctl ops: those ops one after another, the path the model ran before), at BERT-Base
and BERT-Large shapes, it reports the median time per call, GB/s from the
minimal bytes moved (each input read once, each output written once) and that as a percentage of
the device-to-device copy bandwidth measured in the same run.  On CUDA the time per call is taken
with CUDA events around the queued call (``median_ms``: kernel time plus the device's launch
latency, about 3 us), and again from the profiler's kernel timestamps (``kernel_ms``: the span
from the call's first kernel start to its last kernel end), each with its own GB/s and speedups.
On CPU the providers are timed in alternating rounds, and the report keeps the load average
before and after the run (a shared machine's other work shows there).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from bertctl import ops
from bertctl.bench import harness

PROVIDERS = ("fused", "eager", "compile", "separate")
MODES = ("fwd", "fwdbwd")
OPS = ("softmax", "layer_norm", "bias_gelu", "bias_dropout_add_layer_norm", "cross_entropy")
DROPOUT_P = 0.1  # BERT's hidden dropout, for bias_dropout_add_layer_norm
# CPU: rounds of `reps` calls per provider, the providers alternating (harness.measure_interleaved).
CPU_ROUNDS = 5


@dataclass
class Case:
    op: str          # softmax | layer_norm | bias_gelu | bias_dropout_add_layer_norm | cross_entropy
    shape: tuple     # scores (B, heads, S, S); (masked tokens, vocabulary) for cross_entropy; tokens x features otherwise
    label: str       # e.g. "base s512 b64"
    quick: bool = False


# BERT-Base: hidden 768, 12 heads, intermediate 3072; BERT-Large: 1024, 16 heads, 4096.
# Tokens = batch x seq: 256 x 128 and 64 x 512 are both 32768 tokens.
CUDA_CASES = [
    Case("softmax", (64, 12, 512, 512), "base s512 b64", quick=True),
    Case("softmax", (256, 12, 128, 128), "base s128 b256", quick=True),
    Case("softmax", (32, 16, 512, 512), "large s512 b32"),
    Case("layer_norm", (32768, 768), "base 32768 tok", quick=True),
    Case("layer_norm", (8192, 768), "base 8192 tok"),
    Case("layer_norm", (32768, 1024), "large 32768 tok"),
    Case("bias_gelu", (32768, 3072), "base 32768 tok", quick=True),
    Case("bias_gelu", (8192, 3072), "base 8192 tok"),
    Case("bias_gelu", (32768, 4096), "large 32768 tok"),
    # A sub-layer output in training (dropout 0.1); "separate" adds the bias apart (in the model the matmul
    # adds it), then torch's dropout and LayerNorm(+residual).
    Case("bias_dropout_add_layer_norm", (32768, 768), "base 32768 tok", quick=True),
    Case("bias_dropout_add_layer_norm", (8192, 768), "base 8192 tok"),
    Case("bias_dropout_add_layer_norm", (32768, 1024), "large 32768 tok"),
    # The MLM loss of a pretraining step: 20 masked positions a sequence at seq 128, batch 256; 76 at seq
    # 512, batch 32. On CUDA the logits are a view of rows padded to a multiple of 8, as the model's.
    Case("cross_entropy", (5120, 30522), "base s128 b256", quick=True),
    Case("cross_entropy", (2432, 30522), "base s512 b32"),
]
# CPU: one BERT-Base batch of 8 x 128 tokens (attention scores 8 x 12 x 128 x 128; 1024 tokens
# through LayerNorm and the FFN), and 4096 tokens (32 x 128: scores 32 x 12 x 128 x 128), where a 4096 x 3072 fp32 tensor (50 MB) is past
# glibc's mmap threshold, so every fresh output is page-faulted in and that cost dominates.
CPU_CASES = [
    Case("softmax", (8, 12, 128, 128), "base s128 b8", quick=True),
    Case("softmax", (32, 12, 128, 128), "base s128 b32"),  # 4096 tokens
    Case("layer_norm", (1024, 768), "base s128 b8", quick=True),
    Case("bias_gelu", (1024, 3072), "base s128 b8", quick=True),
    Case("layer_norm", (4096, 768), "base 4096 tok"),
    Case("bias_gelu", (4096, 3072), "base 4096 tok"),
    # A sub-layer output in training (dropout 0.1).
    Case("bias_dropout_add_layer_norm", (1024, 768), "base s128 b8", quick=True),
    Case("bias_dropout_add_layer_norm", (4096, 768), "base 4096 tok"),
    Case("cross_entropy", (160, 30522), "base s128 b8", quick=True),
    Case("cross_entropy", (640, 30522), "base s128 b32"),
]
TINY_CASES = [  # for the CLI's test: seconds, not minutes
    Case("softmax", (2, 2, 16, 16), "tiny", quick=True),
    Case("layer_norm", (64, 32), "tiny", quick=True),
    Case("bias_gelu", (64, 64), "tiny", quick=True),
    Case("bias_dropout_add_layer_norm", (64, 32), "tiny", quick=True),
    Case("cross_entropy", (16, 50), "tiny", quick=True),
]


# --- the three expressions --------------------------------------------------------------

def eager_softmax(x, mask, scale):
    # The model's kernels="torch" path: scale, mask, softmax (three passes).
    return torch.softmax((x * scale).masked_fill(~mask[:, None, None, :], float("-inf")), dim=-1)


def eager_layer_norm(x, residual, weight, bias, eps):
    return F.layer_norm(x + residual, (x.shape[-1],), weight, bias, eps)


def eager_bias_gelu(x, bias):
    return F.gelu(x + bias, approximate="none")


def fused_softmax(x, mask, scale):
    return ops.softmax(x, mask, scale)


def fused_layer_norm(x, residual, weight, bias, eps):
    return ops.layer_norm(x, weight, bias, eps, residual=residual)


def fused_bias_gelu(x, bias):
    return ops.bias_gelu(x, bias, "none")


def eager_bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, eps, p):
    # kernels="torch": the bias (in the model, inside the matmul), torch's dropout, the add, LayerNorm.
    return F.layer_norm(F.dropout(x + bias, p, True) + residual, (x.shape[-1],), weight, ln_bias, eps)


def fused_bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, eps, p):
    return ops.bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, eps, p, True)


def separate_bias_dropout_add_layer_norm(x, bias, residual, weight, ln_bias, eps, p):
    # bertctl's ops apart: the bias add, dropout (the hashed mask on the CPU, torch's on CUDA), LayerNorm + residual.
    return ops.layer_norm(ops.dropout(x + bias, p, True), weight, ln_bias, eps, residual=residual)


def eager_cross_entropy(logits, labels):
    # The model's kernels="torch" path: cross-entropy on an fp32 copy of the logits, per row.
    return F.cross_entropy(logits.float(), labels, reduction="none")


def fused_cross_entropy(logits, labels):
    return ops.cross_entropy(logits, labels)[0]


# op: (fused, eager[, separate])
EXPRESSIONS = {
    "softmax": (fused_softmax, eager_softmax),
    "layer_norm": (fused_layer_norm, eager_layer_norm),
    "bias_gelu": (fused_bias_gelu, eager_bias_gelu),
    "bias_dropout_add_layer_norm": (fused_bias_dropout_add_layer_norm, eager_bias_dropout_add_layer_norm,
                                    separate_bias_dropout_add_layer_norm),
    "cross_entropy": (fused_cross_entropy, eager_cross_entropy),
}


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator,
                grad: bool) -> tuple[tuple, list[torch.Tensor]]:
    """(args, differentiable tensors) for one input set; parameters in the activation dtype."""
    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device=device, dtype=torch.float32) * std).to(dtype)

    if case.op == "cross_entropy":
        N, V = case.shape
        width = V + (-V % 8 if device.type == "cuda" else 0)  # the vocabulary projection's aligned rows
        logits = randn(N, width, std=3.0)[:, :V].requires_grad_(grad)
        labels = torch.randint(0, V, (N,), generator=gen, device=device)
        return (logits, labels), [logits]
    if case.op == "softmax":
        B, H, S, _ = case.shape
        x = randn(*case.shape, std=4.0).requires_grad_(grad)
        lengths = torch.randint(S // 2, S + 1, (B,), generator=gen, device=device)
        mask = torch.arange(S, device=device)[None, :] < lengths[:, None]  # (B, S) key padding
        return (x, mask, 0.125), [x]
    N, D = case.shape
    x = randn(N, D).requires_grad_(grad)
    if case.op == "layer_norm":
        res = randn(N, D).requires_grad_(grad)
        w = (1 + 0.1 * randn(D)).requires_grad_(grad)
        b = (0.1 * randn(D)).requires_grad_(grad)
        return (x, res, w, b, 1e-12), [x, res, w, b]
    if case.op == "bias_dropout_add_layer_norm":
        bias = (0.1 * randn(D)).requires_grad_(grad)
        res = randn(N, D).requires_grad_(grad)
        w = (1 + 0.1 * randn(D)).requires_grad_(grad)
        b = (0.1 * randn(D)).requires_grad_(grad)
        return (x, bias, res, w, b, 1e-12, DROPOUT_P), [x, bias, res, w, b]
    bias = (0.1 * randn(D)).requires_grad_(grad)
    return (x, bias), [x, bias]


def min_bytes(case: Case, mode: str, itemsize: int, from_output: bool = False) -> int:
    """Fewest bytes an implementation must move: each input read once, each output written once.
    from_output: bias+dropout+residual+LayerNorm's backward works from the output y, not x and residual
    (the CPU's, fp32 and fp64, with the weights make_inputs gives; backward_from_output in
    csrc/autograd.cpp)."""
    n = 1
    for d in case.shape:
        n *= d
    big = n * itemsize
    if case.op == "cross_entropy":
        rows = case.shape[0]
        # fwd: logits, labels -> the fp32 loss; fwd+bwd: then dloss, logits -> dlogits
        return big + 12 * rows if mode == "fwd" else 3 * big + 16 * rows
    if case.op == "softmax":
        mask = case.shape[0] * case.shape[3]
        # fwd: x -> y; bwd: dy, y -> dx
        return 2 * big + mask if mode == "fwd" else 5 * big + mask
    params = case.shape[1] * itemsize
    if case.op == "bias_dropout_add_layer_norm":
        # fwd: x, residual -> y (+ bias, weight, ln_bias; the mask is a hash, no bytes); fwd+bwd: the
        # forward also writes mean/rstd, the backward reads dy, x, residual, them (+ bias, weight) ->
        # dresidual, dx (+ dbias, dweight, dln_bias); from the output it reads dy, y and rstd (+ ln_bias)
        stats = case.shape[0] * 4 * 2
        if mode == "fwd":
            return 3 * big + 3 * params
        return 7 * big + 9 * params + 3 * stats // 2 if from_output else 8 * big + 8 * params + 2 * stats
    if case.op == "layer_norm":
        # fwd (no grad, so no statistics kept): x, residual -> y (+ weight, bias); fwd+bwd: the forward
        # also writes the fp32 mean/rstd rows, the backward reads dy, x, residual, them -> dx, dweight, dbias
        stats = case.shape[0] * 4 * 2
        return 3 * big + 2 * params if mode == "fwd" else 7 * big + 6 * params + 2 * stats
    # bias_gelu fwd: x -> y; bwd: dy, x -> dx, dbias
    return 2 * big + params if mode == "fwd" else 5 * big + 3 * params


def _runner(fn: Callable, mode: str, n_args_grad: int) -> Callable:
    if mode == "fwd":
        def run(args, wrt, dy):
            with torch.no_grad():
                return fn(*args)
    else:
        def run(args, wrt, dy):
            y = fn(*args)
            return torch.autograd.grad(y, wrt, dy)
    return run


@dataclass
class OpsBenchConfig:
    device: str = "cuda"
    dtypes: tuple[str, ...] = ("bfloat16",)
    quick: bool = False
    tiny: bool = False
    providers: tuple[str, ...] = PROVIDERS
    modes: tuple[str, ...] = MODES
    ops: tuple[str, ...] = OPS  # a subset times only those ops
    rounds: int = CPU_ROUNDS  # CPU: alternating rounds per measurement
    reps: int = 0            # 0: 100 on CUDA, 20 per round on CPU (10 / 5 with quick)
    seed: int = 0
    copy_gbps: float | None = None  # measured when None
    extra: dict[str, Any] = field(default_factory=dict)


def run_ops_bench(cfg: OpsBenchConfig, log: Callable[[str], None] = lambda s: print(s, file=sys.stderr)) -> dict:
    """Runs the benchmark described by ``cfg``; returns {"device": ..., "rows": [...], "summary": [...]}."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    copy = cfg.copy_gbps
    if copy is None and cfg.tiny:  # tests: a small copy is enough to fill the field
        copy = harness.copy_bandwidth(device, nbytes=16 * 2**20, reps=5)
    block = harness.device_block(device, copy)
    block["fused_kernels"] = ops.fused_available()
    block["loadavg_before"] = _loadavg()
    copy_gbps = block["copy_gbps"]
    log(f"device: {block['name']}  copy bandwidth {copy_gbps:.0f} GB/s  torch {block['torch']}  commit {block['commit']}")
    cases = TINY_CASES if cfg.tiny else (CUDA_CASES if device.type == "cuda" else CPU_CASES)
    if cfg.quick:
        cases = [c for c in cases if c.quick]
    cases = [c for c in cases if c.op in cfg.ops]
    reps = cfg.reps or ((10 if cfg.quick else 100) if device.type == "cuda" else (5 if cfg.quick else 20))
    gen = torch.Generator(device=device).manual_seed(cfg.seed)
    # One static graph per shape and mode, never a silent fall-back to eager after many shapes.
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    rows: list[dict[str, Any]] = []
    for dtype_name in cfg.dtypes:
        dtype = getattr(torch, dtype_name)
        itemsize = torch.empty((), dtype=dtype).element_size()
        for case in cases:
            fused_fn, eager_fn, *separate_fn = EXPRESSIONS[case.op]
            fns = {"fused": fused_fn, "eager": eager_fn, "compile": torch.compile(eager_fn, dynamic=False)}
            if separate_fn:
                fns["separate"] = separate_fn[0]
            providers = [p for p in cfg.providers if p in fns]
            for mode in cfg.modes:
                grad = mode == "fwdbwd"
                nbytes = min_bytes(case, mode, itemsize,
                                   from_output=device.type == "cpu" and dtype in (torch.float32, torch.float64))
                sets = []
                for _ in range(harness.rotation_count(nbytes, limit=4 if device.type == "cuda" else 2)):
                    args, wrt = make_inputs(case, dtype, device, gen, grad)
                    if case.op == "cross_entropy":  # one fp32 loss per row
                        dy = torch.randn(case.shape[:1], generator=gen, device=device, dtype=torch.float32)
                    else:
                        dy = torch.randn(case.shape, generator=gen, device=device, dtype=torch.float32).to(dtype)
                    sets.append((args, wrt, dy))
                runs = {p: _runner(fns[p], mode, len(sets[0][1])) for p in providers}
                if device.type == "cpu":  # providers alternate in rounds (a shared machine's slow spells hit all)
                    timings = harness.measure_interleaved(runs, sets, rounds=cfg.rounds, reps=reps)
                else:
                    timings = {p: harness.measure(run, sets, device, reps=reps, warmup=3 if p == "compile" else 5)
                               for p, run in runs.items()}
                for provider, run in runs.items():
                    t = timings[provider]
                    gbps = nbytes / (t.median_ms * 1e-3) / 1e9
                    row = {
                        "op": case.op, "mode": mode, "shape": list(case.shape), "label": case.label,
                        "dtype": dtype_name, "provider": provider, "median_ms": _sig(t.median_ms),
                        "p10_ms": _sig(t.p10_ms), "p90_ms": _sig(t.p90_ms), "runs": t.runs,
                        "min_bytes": nbytes, "gbps": _sig(gbps),
                        "pct_of_copy_bw": _sig(100 * gbps / copy_gbps),
                    }
                    note = ""
                    if device.type == "cuda":
                        k = harness.kernel_span(run, sets, device, reps=reps,
                                                warmup=3 if provider == "compile" else 5)
                        kgbps = nbytes / (k.median_ms * 1e-3) / 1e9
                        row.update({"kernel_ms": _sig(k.median_ms), "kernel_p10_ms": _sig(k.p10_ms),
                                    "kernel_p90_ms": _sig(k.p90_ms), "kernel_gbps": _sig(kgbps),
                                    "kernel_pct_of_copy_bw": _sig(100 * kgbps / copy_gbps)})
                        note = f"   kernels {k.median_ms:9.4f} ms {100 * kgbps / copy_gbps:5.1f}%"
                    rows.append(row)
                    log(f"{case.op:<10} {mode:<6} {case.label:<16} {dtype_name:<8} {provider:<7} "
                        f"{t.median_ms:9.4f} ms {gbps:8.1f} GB/s {100 * gbps / copy_gbps:5.1f}%{note}")
                del sets
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    summary = summarise(rows)
    columns = ["op", "mode", "label", "dtype", "fused_ms", "pct_of_copy_bw", "vs_eager", "vs_compile"]
    if any("vs_separate" in line for line in summary):
        columns.append("vs_separate")
    if any("kernel_pct_of_copy_bw" in line for line in summary):
        columns += ["kernel_pct_of_copy_bw", "kernel_vs_eager", "kernel_vs_compile"]
    log(harness.format_table(summary, columns))
    block["loadavg_after"] = _loadavg()
    log(f"load average (1, 5, 15 min) before {block['loadavg_before']}, after {block['loadavg_after']}")
    config = {"quick": cfg.quick, "reps": reps, "seed": cfg.seed}
    if device.type == "cpu":
        config["rounds"] = cfg.rounds
    return {"device": block, "config": config, "rows": rows, "summary": summary}


def _loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages (Linux), which say how busy a shared machine was."""
    try:
        with open("/proc/loadavg") as f:
            return [float(v) for v in f.read().split()[:3]]
    except (OSError, ValueError):
        return None


def _sig(x: float) -> float:
    return float(f"{x:.6g}")


def summarise(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One line per (op, mode, shape, dtype): fused time, % of copy bandwidth, speedups over eager and compile."""
    by_key: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        by_key.setdefault((r["op"], r["mode"], tuple(r["shape"]), r["dtype"]), {})[r["provider"]] = r
    out = []
    for (op, mode, shape, dtype), prov in by_key.items():
        if "fused" not in prov:
            continue
        f = prov["fused"]
        line = {"op": op, "mode": mode, "shape": list(shape), "label": f["label"], "dtype": dtype,
                "fused_ms": f["median_ms"], "pct_of_copy_bw": f["pct_of_copy_bw"]}
        if "kernel_pct_of_copy_bw" in f:
            line["kernel_pct_of_copy_bw"] = f["kernel_pct_of_copy_bw"]
        for other in ("eager", "compile", "separate"):
            if other in prov:
                line[f"vs_{other}"] = round(prov[other]["median_ms"] / f["median_ms"], 3)
                if "kernel_ms" in f and "kernel_ms" in prov[other]:
                    line[f"kernel_vs_{other}"] = round(prov[other]["kernel_ms"] / f["kernel_ms"], 3)
        out.append(line)
    return out
