"""The ``bertctl`` Typer application.

Each command lives in ``bertctl/cli/<command>.py`` as a thin function that
parses options and calls the library.  ``BertctlError`` (bad input) becomes one
line on stderr and exit code 2; ``--debug`` shows the traceback instead.
"""
from __future__ import annotations

import functools
import importlib
import sys

import typer

from bertctl.errors import BertctlError

app = typer.Typer(
    name="bertctl",
    help="BERT pretraining, fine-tuning and embeddings, with fused kernels.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"debug": False}

# Command modules; each defines ``register(app)``.
COMMANDS = ("env", "tokenize", "embed", "build_data", "pretrain", "finetune", "eval", "bench")


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    _state["debug"] = debug


for _name in COMMANDS:
    try:
        _module = importlib.import_module(f"bertctl.cli.{_name}")
    except ModuleNotFoundError as _e:  # a command not written yet is simply absent
        if _e.name != f"bertctl.cli.{_name}":
            raise
        continue
    except BertctlError as _e:  # at import: BERTCTL_REQUIRE_EXT=1 and the compiled kernels did not load
        print(f"bertctl: error: {_e}", file=sys.stderr)
        sys.exit(2)
    _module.register(app)


def _fail(message: str) -> None:
    print(f"bertctl: error: {message}", file=sys.stderr)
    sys.exit(2)


def _guarded(callback):
    """Run a command; turn input errors into one line on stderr and exit code 2."""

    @functools.wraps(callback)
    def run(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except (BertctlError, FileNotFoundError, IsADirectoryError, PermissionError) as e:
            if _state["debug"]:
                raise
            message = str(e) if isinstance(e, BertctlError) else f"{e.filename}: {e.strerror}"
            typer.echo(f"bertctl: error: {message}", err=True)
            raise typer.Exit(2) from None

    return run


def _guard(typer_app: typer.Typer) -> None:
    for command in typer_app.registered_commands:
        command.callback = _guarded(command.callback)
    for group in typer_app.registered_groups:
        _guard(group.typer_instance)


_guard(app)


def main(argv: list[str] | None = None) -> None:
    debug = "--debug" in (argv if argv is not None else sys.argv[1:])
    try:
        app(args=argv, standalone_mode=True)
    except BertctlError as e:
        if debug:
            raise
        _fail(str(e))
    except (FileNotFoundError, IsADirectoryError, PermissionError, UnicodeDecodeError) as e:
        if debug:
            raise
        _fail(f"{e}")
    except KeyboardInterrupt:
        print("bertctl: interrupted", file=sys.stderr)
        sys.exit(130)
