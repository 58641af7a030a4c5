"""The ``bertctl`` Typer application.

Each command lives in ``bertctl/cli/<command>.py`` as a thin function that
parses options and calls the library.  ``BertctlError`` (bad input) becomes one
line on stderr and exit code 2; ``--debug`` shows the traceback instead.

``main`` imports only the module of the command it runs (``bertctl embed ...`` never loads the
training code, nor torch when ONNX Runtime embeds); ``bertctl --help``, an unknown command and
``from bertctl.cli.app import app`` get every command.
"""
from __future__ import annotations

import functools
import importlib
import os
import sys

import typer

from bertctl.errors import BertctlError

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

# Command name -> its module in bertctl/cli/; each module defines ``register(app)``.
COMMANDS = {"env": "env", "tokenize": "tokenize", "embed": "embed", "build-data": "build_data",
            "pretrain": "pretrain", "finetune": "finetune", "eval": "eval", "export": "export", "bench": "bench"}


def _root(debug: bool = typer.Option(False, "--debug", help="Show full tracebacks on errors.")) -> None:
    _state["debug"] = debug


def build_app(commands=None) -> typer.Typer:
    """The application with ``commands`` (names in ``COMMANDS``; default all of them)."""
    app = typer.Typer(
        name="bertctl",
        help="BERT pretraining, fine-tuning and embeddings, with fused kernels.",
        no_args_is_help=True,
        add_completion=False,
        pretty_exceptions_enable=False,
    )
    app.callback()(_root)
    for name in commands or COMMANDS:
        module_name = f"bertctl.cli.{COMMANDS[name]}"
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:  # a command not written yet is simply absent
            if e.name != module_name:
                raise
            continue
        except BertctlError as e:  # at import: BERTCTL_REQUIRE_EXT=1 and the compiled kernels did not load
            print(f"bertctl: error: {e}", file=sys.stderr)
            sys.exit(2)
        module.register(app)
    _guard(app)
    return app


def __getattr__(name: str):
    """``app``: the whole application, built on first use (``from bertctl.cli.app import app``)."""
    if name == "app":
        globals()["app"] = build_app()
        return globals()["app"]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def command_of(argv: list[str]) -> str | None:
    """The command ``argv`` runs (its first word that is not an option), if it is one of ``COMMANDS``.
    The root's only option, ``--debug``, takes no value."""
    word = next((a for a in argv if not a.startswith("-")), None)
    return word if word in COMMANDS else None


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
    if getattr(callback, "_bertctl_guarded", False):  # a sub-application registered by an earlier build_app
        return callback

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

    run._bertctl_guarded = True
    return run


def _guard(typer_app: typer.Typer) -> None:
    for command in typer_app.registered_commands:
        command.callback = _guarded(command.callback)
    for group in typer_app.registered_groups:
        _guard(group.typer_instance)



def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    command = command_of(args)
    try:
        build_app([command] if command else None)(args=args, standalone_mode=True)
    except SystemExit as e:  # how click's standalone mode ends every run
        native = sys.modules.get("bertctl.inference.backends.native")
        if e.code in (0, None) and native is not None and native.context_started:
            # The work is done and written; CUDA's teardown of the native encoder's context at exit (its
            # memory freed, the context destroyed) took a quarter of a second on an H200: leave without it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        raise
    except (BertctlError, OSError) as e:
        message = _one_line(e)
        if debug or message is None:
            raise
        _fail(message)
    except UnicodeDecodeError as e:  # a reader that skipped bertctl.text.files.iter_lines: still one line
        if debug:
            raise
        _fail(f"input is not valid UTF-8 ({e})")
    except KeyboardInterrupt:
        print("bertctl: interrupted", file=sys.stderr)
        sys.exit(130)
