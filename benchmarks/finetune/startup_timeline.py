"""Where a ``bertctl`` command's time goes before and around its training steps: runs the command in
this process with timers around its stages and prints, on stderr, a timeline in seconds since the
process started (the kernel's start time, so the interpreter's own start-up counts too).

    python benchmarks/finetune/startup_timeline.py finetune glue --task sst2 --data-dir SST-2 --model MODEL -o out

Stages timed: importing torch and bertctl, the tokenizer's load, tokenising (GLUE ``featurize``), the model's
load, CUDA's initialisation, the engine (``build_optimizer`` inside it, whose first parameter group imports
``torch._dynamo``), each CUDA-graph capture, the training loop, the evaluations and the model's save.
For ``embed`` (no torch imported on its native path): reading the texts, the tokenizer, tokenising (started,
and its result waited for), opening the encoder (the native module's load, its weights, the GPU's start),
each batch's features, the Dense and normalisation steps and the write.
``--json PATH`` (before the command) also writes the events as JSON, with the harness's environment row.
"""
from __future__ import annotations

import functools
import importlib
import json
import os
import runpy
import sys
from pathlib import Path

EVENTS: list[tuple[float, str]] = []


def since_start() -> float:
    """Seconds since this process started, from /proc (Linux)."""
    fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
    uptime = float(Path("/proc/uptime").read_text().split()[0])
    return uptime - int(fields[19]) / os.sysconf("SC_CLK_TCK")


def mark(what: str) -> None:
    EVENTS.append((round(since_start(), 3), what))
    print(f"[{EVENTS[-1][0]:7.2f}] {what}", file=sys.stderr, flush=True)


def timed(owner, attr: str, name: str) -> None:
    """Wrap ``owner.attr`` so that its start and end are marked."""
    fn = getattr(owner, attr)

    @functools.wraps(fn)
    def inner(*args, **kwargs):
        mark(f"> {name}")
        try:
            return fn(*args, **kwargs)
        finally:
            mark(f"< {name}")
    setattr(owner, attr, inner)


def instrument_embed() -> None:
    """``embed``: the stages of its path that imports no torch (the native backend) and of the others."""
    for name in ("bertctl.cli.app", "bertctl.inference.embed", "bertctl.inference.backends",
                 "bertctl.inference.backends.native", "bertctl.text"):
        importlib.import_module(name)
    mark("bertctl imported")
    embed, backends = sys.modules["bertctl.inference.embed"], sys.modules["bertctl.inference.backends"]
    native = sys.modules["bertctl.inference.backends.native"]
    for owner, attr in ((embed, "read_texts"), (sys.modules["bertctl.text"], "load_tokenizer"),
                        (backends, "open_encoder"), (embed, "embed_texts"), (embed, "finish_features"),
                        (embed, "write_embeddings"), (native, "start"), (native, "started"),
                        (native, "encoder_weights"),
                        (backends, "resolve_device"), (backends, "load_encoder")):
        timed(owner, attr, f"{owner.__name__.rsplit('.', 1)[-1]}.{attr}")
    for cls, attr in ((embed.Tokenizing, "__init__"), (embed.Tokenizing, "result"), (native.NativeEncoder, "__init__"),
                      (native.NativeEncoder, "features")):
        timed(cls, attr, f"{cls.__name__}.{attr}")


def instrument(command: list[str]) -> None:
    if command[:1] == ["embed"]:
        return instrument_embed()
    import torch
    mark("torch imported")
    for name in ("bertctl.cli.app", "bertctl.tasks.glue", "bertctl.tasks.common", "bertctl.train.engine",
                 "bertctl.train.graphs", "bertctl.checkpoints.hf"):
        importlib.import_module(name)
    mark("bertctl imported")
    glue, common = sys.modules["bertctl.tasks.glue"], sys.modules["bertctl.tasks.common"]
    engine, graphs = sys.modules["bertctl.train.engine"], sys.modules["bertctl.train.graphs"]
    for owner, attr in ((common, "load_tokenizer"), (glue, "featurize"), (common, "load_for_finetuning"),
                        (glue, "evaluate_devs"), (sys.modules["bertctl.checkpoints.hf"], "save_pretrained"),
                        (engine, "build_optimizer")):
        timed(owner, attr, f"{owner.__name__.rsplit('.', 1)[-1]}.{attr}")
    timed(engine.Engine, "__init__", "Engine.__init__")
    timed(engine.Engine, "run", "Engine.run")
    timed(graphs.StepGraphs, "_capture", "capture")
    lazy_init = torch.cuda._lazy_init

    def cuda_init():
        if torch.cuda.is_initialized():
            return lazy_init()
        mark("> cuda init")
        lazy_init()
        mark("< cuda init")
    torch.cuda._lazy_init = cuda_init


def write(out: Path, args: list[str]) -> None:
    """The events and, described after the last mark so that the timeline is the command's alone, the
    harness's row naming the device, versions and commit."""
    import torch

    from bertctl.bench import harness

    env = harness.environment("cuda" if torch.cuda.is_available() else "cpu")
    out.write_text(json.dumps({"command": args, "events": EVENTS, "environment": env}, indent=1) + "\n")


def main() -> None:
    mark("interpreter up")
    args = sys.argv[1:]
    out = None
    if args[:1] == ["--json"]:
        out, args = Path(args[1]), args[2:]
    instrument(args)
    sys.argv = ["bertctl", *args]
    leave, main_process = os._exit, os.getpid()

    def exit_marked(code: int) -> None:  # bertctl's main leaves so after a native embed: mark it first
        if os.getpid() != main_process:  # a forked worker's own exit
            leave(code)
        mark(f"os._exit({code})")
        if out is not None:
            write(out, args)
        leave(code)
    os._exit = exit_marked
    try:
        runpy.run_module("bertctl", run_name="__main__", alter_sys=True)
    finally:
        mark("end")
        if out is not None:
            write(out, args)


if __name__ == "__main__":
    main()
