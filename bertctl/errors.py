"""The one exception type that the CLI turns into a one-line message and exit code 2."""


class BertctlError(Exception):
    """A usage or input error: bad argument, unreadable file, malformed row.

    The message must name what is wrong (file, line, argument) in one line;
    the CLI prints it to stderr and exits with code 2 (``--debug`` shows the traceback).
    """


def where(path, line: int | None = None) -> str:
    """``path:line`` for error messages."""
    return f"{path}:{line}" if line is not None else str(path)


class Stopped(SystemExit):
    """A run stopped on request (SIGINT/SIGTERM) after saving a checkpoint: exit code 0, no traceback.

    Raised by the fine-tuning loop so that no task code after training (evaluation, export) runs;
    the message saying where the checkpoint is has already been printed.
    """

    def __init__(self):
        super().__init__(0)
