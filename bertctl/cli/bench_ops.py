"""``bertctl bench ops``: the fused ops against eager PyTorch and torch.compile."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

from bertctl.errors import BertctlError


def register(bench_app: typer.Typer) -> None:
    @bench_app.command("ops")
    def ops_cmd(
        device: str = typer.Option("auto", "--device", help="cpu, cuda, or auto: cuda when a GPU is available, "
                                                            "else cpu."),
        dtype: list[str] = typer.Option(None, "--dtype", help="float32, float16 or bfloat16 (repeatable). "
                                        "Default: bfloat16 on cuda, float32 on cpu."),
        quick: bool = typer.Option(False, "--quick", help="BERT-Base shapes only, fewer repetitions."),
        tiny: bool = typer.Option(False, "--tiny", hidden=True, help="Tiny shapes (tests)."),
        provider: list[str] = typer.Option(None, "--provider", help="fused, eager, compile, separate (bertctl's "
                                           "ops apart, for an op that fuses them) (repeatable; default all)."),
        op: list[str] = typer.Option(None, "--op", help="softmax, layer_norm, bias_gelu, bias_dropout_add_layer_norm, "
                                     "cross_entropy (repeatable; default all)."),
        reps: int = typer.Option(0, "--reps", help="Timed calls per measurement; on CPU per round, the providers "
                                                   "alternating (0: default for the device)."),
        rounds: int = typer.Option(0, "--rounds", help="CPU: rounds per measurement, the providers' order "
                                                       "rotated each round (0: 5)."),
        threads: int = typer.Option(0, "--threads", help="CPU threads for torch (0: torch's default)."),
        output: Path = typer.Option(None, "--output", "-o", help="Write the JSON report here (else to stdout)."),
    ) -> None:
        """Time softmax, LayerNorm+residual, bias+GELU and (CPU) bias+dropout+residual+LayerNorm (fwd and fwd+bwd):
        median ms, GB/s, % of copy bandwidth."""
        import torch

        from bertctl.bench.ops import CPU_ROUNDS, MODES, OPS, PROVIDERS, OpsBenchConfig, run_ops_bench
        from bertctl.io import write_json

        if threads > 0:
            torch.set_num_threads(threads)
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise BertctlError(f"--device must be auto, cpu or cuda, not {device!r}")
        if device == "cuda" and not torch.cuda.is_available():
            raise BertctlError("--device cuda: no CUDA device is available")
        dtypes = tuple(dtype) if dtype else (("bfloat16",) if device == "cuda" else ("float32",))
        for d in dtypes:
            if d not in ("float32", "float16", "bfloat16"):
                raise BertctlError(f"--dtype must be float32, float16 or bfloat16, not {d!r}")
        providers = tuple(provider) if provider else PROVIDERS
        for p in providers:
            if p not in PROVIDERS:
                raise BertctlError(f"--provider must be one of {', '.join(PROVIDERS)}, not {p!r}")
        op_names = tuple(op) if op else OPS
        for o in op_names:
            if o not in OPS:
                raise BertctlError(f"--op must be one of {', '.join(OPS)}, not {o!r}")
        if rounds < 0:
            raise BertctlError(f"--rounds must be 0 (the default, 5) or more, not {rounds}")
        cfg = OpsBenchConfig(device=device, dtypes=dtypes, quick=quick, tiny=tiny, providers=providers,
                             modes=MODES, ops=op_names, reps=reps,
                             rounds=rounds or CPU_ROUNDS)
        report = run_ops_bench(cfg)
        if output is None:
            json.dump(report, sys.stdout, indent=1)
            sys.stdout.write("\n")
        else:
            write_json(output, report)
            typer.echo(str(output))
