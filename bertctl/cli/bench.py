"""``bertctl bench``: benchmarks of the fused ops and of the whole model.

The sub-commands live in ``bertctl/cli/bench_<name>.py`` (each defines
``register(bench_app)``); the timing harness they share is ``bertctl.bench``.
"""
from __future__ import annotations

import importlib

import typer

bench_app = typer.Typer(help="Benchmark the fused ops and the model (eager PyTorch and torch.compile beside them).",
                        no_args_is_help=True)

for _name in ("ops", "model"):
    try:
        _module = importlib.import_module(f"bertctl.cli.bench_{_name}")
    except ModuleNotFoundError as _e:
        if _e.name != f"bertctl.cli.bench_{_name}":
            raise
        continue
    _module.register(bench_app)


def register(app: typer.Typer) -> None:
    if bench_app.registered_commands or bench_app.registered_groups:
        app.add_typer(bench_app, name="bench")
