"""``bertctl bench model``: training-step and inference throughput of the whole model (GPU)."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from bertctl.errors import BertctlError


def bench_model_command(
    output: Optional[Path] = typer.Option(None, "--output", "-o", help="Write the JSON result here."),
    compare: Optional[str] = typer.Option(None, "--compare", help="'hf': also time transformers "
                                          "BertForPreTraining (sdpa, bf16, fused AdamW) on the same batches."),
    compile: bool = typer.Option(False, "--compile", help="Also time under torch.compile (bertctl with the fused "
                                 "ops and with plain PyTorch ops, and hf)."),
    steps: int = typer.Option(20, "--steps", help="Timed steps per repeat (3 repeats, median)."),
    warmup: int = typer.Option(5, "--warmup", help="Untimed steps first (compilation happens here)."),
    cases: str = typer.Option("base-128,base-512,large-128", "--cases",
                              help="Comma-separated: base-128 (batch 256), base-512 (batch 32), large-128 (batch 256), base-mixed "
                              "(batch 256, fine-tuning's lengths: log-uniform on [8, 128]), tiny-64 (a smoke case)."),
    compile_cases: Optional[str] = typer.Option(None, "--compile-cases", help="Cases timed under torch.compile "
                                                "(default: the first of --cases; each compile costs about a minute)."),
    no_inference: bool = typer.Option(False, "--no-inference", help="Skip the encoder inference timing."),
) -> None:
    """Pretraining-step throughput (sequences/s, MFU, peak memory) and encoder inference, bf16, on this GPU.

    bertctl runs eagerly; bertctl/graphs is pretrain's own step (each step one CUDA graph, its GPU default).

    bertctl/unpadded runs without padding, packed on the host; bertctl/unpadded/graphs is pretrain's step on
    packed batches; bertctl/explicit runs explicit attention (matmuls, fused softmax).

    Under torchrun: bertctl in DistributedDataParallel (the case batch a GPU), bertctl/graphs with its all-reduces."""
    from bertctl.bench.model import CASES, bench_model
    from bertctl.progress import stderr

    chosen = [c.strip() for c in cases.split(",") if c.strip()]
    bad = [c for c in chosen if c not in CASES]
    if bad:
        raise BertctlError(f"--cases: unknown {', '.join(bad)} (choose from {', '.join(CASES)})")
    if compare not in (None, "hf"):
        raise BertctlError(f"--compare: only 'hf' is supported, not {compare!r}")
    providers = (["bertctl", "bertctl/graphs", "bertctl/unpadded", "bertctl/unpadded/graphs", "bertctl/explicit"]
                 + (["hf"] if compare else []))
    if compile:
        providers += ["bertctl+compile", "bertctl/torch-ops+compile"] + (["hf+compile"] if compare else [])
    from bertctl.io import write_json

    compile_on = [c.strip() for c in compile_cases.split(",") if c.strip()] if compile_cases else None
    result = bench_model(chosen, providers, steps=steps, warmup=warmup, inference=not no_inference,
                         log=lambda m: stderr.print(m), compile_cases=compile_on,
                         on_row=(lambda partial: write_json(output, partial)) if output else None)
    if int(os.environ.get("RANK", "0")) != 0:
        return
    text = json.dumps(result, indent=2)
    if output:
        write_json(output, result)
    print(text)


def register(bench_app: typer.Typer) -> None:
    bench_app.command("model")(bench_model_command)
