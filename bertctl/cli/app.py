"""The ``bertctl`` Typer application.

Each command lives in ``bertctl/cli/<command>.py`` as a thin function that
parses options and calls the library.  ``BertctlError`` (bad input) becomes one
line on stderr and exit code 2; ``--debug`` shows the traceback instead.

``main`` imports only the module of the command it runs (``bertctl embed ...`` never loads the
training code, nor torch when ONNX Runtime embeds); ``bertctl --help``, an unknown command and
``from bertctl.cli.app import app`` get every command.
"""
from __future__ import annotations

import atexit
import functools
import importlib
import os
import sys
from pathlib import PurePath
from typing import get_args

import typer
from typer.core import TyperArgument, TyperCommand, TyperGroup, TyperOption

from bertctl.errors import BertctlError, WorkerDied

_state = {"debug": False}


def _plain_help(param):
    """``param`` with help that names what it takes: nothing for a flag (it takes no value), the element
    type for a list (``inputs... <path>``, ``--dtype <str>`` repeated).

    Typer 0.2x prints the Python annotation instead (``<bool>``, ``<list[Path]>``); versions without
    ``type_descriptor`` print no such types and are left alone."""
    desc = getattr(param, "type_descriptor", None)
    if desc is None or param.metavar is not None:
        return param
    if isinstance(param, TyperOption) and param.is_flag and not param.count:
        param.metavar = ""
    elif isinstance(param, TyperOption) and desc.is_list:
        param.metavar = _element_type(param, desc)
    elif isinstance(param, TyperArgument) and desc.is_list and not isinstance(param, _ListArgument):
        return _ListArgument.like(param)
    return param


def _element_type(param, desc) -> str:
    if desc.is_choice:  # a list of choices: <a|b>
        return param.display_type(None).replace("list[", "").replace("]>", ">")
    (element,) = get_args(desc.annotation) or (str,)
    if isinstance(element, type) and issubclass(element, PurePath):
        return "<path>"
    return f"<{getattr(element, '__name__', element)}>"


class _ListArgument(TyperArgument):
    """A positional list whose help gives its element type: Typer takes an argument's type column from
    ``display_type`` alone (a metavar would rename the argument instead)."""

    def display_type(self, ctx) -> str:
        return _element_type(self, self.type_descriptor)

    @classmethod
    def like(cls, arg: TyperArgument) -> "_ListArgument":
        return cls(param_decls=[arg.name], type_descriptor=arg.type_descriptor, required=arg.required,
                   default=arg.default, callback=arg.callback, nargs=arg.nargs, metavar=arg.metavar,
                   expose_value=arg.expose_value, is_eager=arg.is_eager, envvar=arg.envvar,
                   show_default=arg.show_default, show_choices=arg.show_choices, show_envvar=arg.show_envvar,
                   help=arg.help, hidden=arg.hidden, min=arg.min, max=arg.max, rich_help_panel=arg.rich_help_panel)


class _PlainHelp:
    """Help that shows what each value is (``_plain_help``), for bertctl's commands and groups alike."""

    def __init__(self, *args, params=None, **kwargs):
        super().__init__(*args, params=[_plain_help(p) for p in params or ()], **kwargs)

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        return option and _plain_help(option)


class Command(_PlainHelp, TyperCommand):
    """Every bertctl command (``build_app`` gives it to those declared with Typer's default class)."""


class Group(_PlainHelp, TyperGroup):
    """Every bertctl command group: the root, ``bench``, ``finetune``, ..."""


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
        cls=Group,
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
    if isinstance(e, WorkerDied):
        return e.strerror
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
    """Every command's errors as one line (``_guarded``), and its help as ``Command`` and ``Group`` show it."""
    for command in typer_app.registered_commands:
        command.callback = _guarded(command.callback)
        if command.cls in (None, TyperCommand):
            command.cls = Command
    for group in typer_app.registered_groups:
        if not isinstance(group.cls, type) or group.cls is TyperGroup:  # Typer's default, not set by the group
            group.cls = Group
        _guard(group.typer_instance)



def _cuda_context_started() -> bool:
    """Whether this process made a CUDA context (the native encoder's or torch's) and holds no process group
    (torchrun's ranks leave through torch.distributed's own teardown)."""
    native = sys.modules.get("bertctl.inference.backends.native")
    if native is not None and native.context_started:
        return True
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return False
    return not (torch.distributed.is_available() and torch.distributed.is_initialized())


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    debug = "--debug" in args
    command = command_of(args)
    try:
        build_app([command] if command else None)(args=args, standalone_mode=True)
    except SystemExit as e:  # how click's standalone mode ends every run
        # The quick exits below end the process, so they are taken only for the process's own command line:
        # a caller of main(argv) (a test runner, the fault harness) goes on after it.
        quick = e.code in (0, None) and argv is None
        if quick and _cuda_context_started():
            # The work is done and written; CUDA's teardown at exit (its memory freed, the context destroyed)
            # takes about a second and nothing needs it: leave without it.
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
        if quick and getattr(sys.modules.get("bertctl.tasks.launch"), "preloaded", False):
            # A suite loaded torch only for the runs it forked; unloading it again takes about a second.
            atexit._run_exitfuncs()
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
