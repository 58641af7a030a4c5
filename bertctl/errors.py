"""The exceptions the CLI turns into a one-line message and exit code 2: bad input (``BertctlError``), and a
worker process that died (``WorkerDied``, an operating-system event: the inputs are good, and finished work is kept)."""

import errno


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


class WorkerDied(ChildProcessError):
    """A worker process of a parallel stage ended while the command waited on it (the out-of-memory killer's
    KILL, any signal, or a worker that could not start): its task would never finish."""

    def __init__(self, message: str):
        super().__init__(errno.ECHILD, message)
