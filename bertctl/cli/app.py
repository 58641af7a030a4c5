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


def _plain_help_types() -> None:
    """Help without ``<bool>`` on flags and ``<list[Path]>`` on lists.

    Typer 0.2x (with its own copy of Click) prints each parameter's Python type in angle
    brackets: a flag takes no value, so it gets none, and a list is many values of its element
    type (``inputs... <path>``, ``--dtype <str>`` repeated).  Typer versions without
    ``type_descriptor`` print no such types, and are left alone."""
    from pathlib import PurePath
    from typing import get_args

    from typer import core

    param, option = getattr(core, "_TyperParameter", None), getattr(core, "TyperOption", None)
    if param is None or option is None or not hasattr(param, "display_type") or getattr(param, "_bertctl", False):
        return
    display_type, option_display = param.display_type, option.display_type_rich

    def element_type(self, ctx):
        desc = getattr(self, "type_descriptor", None)
        if desc is None or not desc.is_list:
            return display_type(self, ctx)
        label = display_type(self, ctx)
        if label.startswith("<list[") and label.endswith("]>"):  # choices: <list[a|b]> -> <a|b>
            label = f"<{label[6:-2]}>"
        (element,) = get_args(desc.annotation) or (str,)
        if isinstance(element, type) and issubclass(element, PurePath):
            label = "<path>"
        return label

    def no_type_on_flags(self, ctx):
        if self.is_flag and not self.count and self.metavar is None:
            return None
        return option_display(self, ctx)

    param.display_type = element_type
    option.display_type_rich = no_type_on_flags
    param._bertctl = True


_plain_help_types()

# Command modules; each defines ``register(app)``.
COMMANDS = ("env", "tokenize", "embed", "build_data", "pretrain", "finetune", "eval", "export", "bench")


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


def _one_line(e: BaseException) -> str | None:
    """The one-line message for an error the user can act on, or None for a bug (keep its traceback).

    Input errors (BertctlError) and operating-system errors that name a path or have a known fix
    (unwritable output, full disk, a path under a file) qualify."""
    from bertctl.io import OS_ERROR_FIXES, describe_os_error

    if isinstance(e, BertctlError):
        return str(e)
    if isinstance(e, OSError) and (e.filename is not None or e.errno in OS_ERROR_FIXES):
        return describe_os_error(e)
    return None


def _guarded(callback):
    """Run a command; turn input and operating-system errors into one line on stderr and exit code 2."""

    @functools.wraps(callback)
    def run(*args, **kwargs):
        try:
            return callback(*args, **kwargs)
        except (BertctlError, OSError) as e:
            message = _one_line(e)
            if _state["debug"] or message is None:
                raise
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
    except (BertctlError, OSError) as e:
        message = _one_line(e)
        if debug or message is None:
            raise
        _fail(message)
    except UnicodeDecodeError as e:  # a reader that skipped bertctl.tokenizer.iter_lines: still one line
        if debug:
            raise
        _fail(f"input is not valid UTF-8 ({e})")
    except KeyboardInterrupt:
        print("bertctl: interrupted", file=sys.stderr)
        sys.exit(130)
