"""Writers' failures as the operating-system errors they are (both checkpoint kinds write through these)."""
from __future__ import annotations

import contextlib
import errno
import os
from pathlib import Path


@contextlib.contextmanager
def write_errors(target: Path):
    """A writer's failure as the OSError it was: ``torch.save`` and safetensors report a full disk or a
    file-size limit as their own errors (``RuntimeError: [enforce fail at inline_container.cc...] file write
    failed``, ``SafetensorError``), which would reach the user as a traceback."""
    try:
        yield
    except OSError:
        raise
    except Exception as e:
        text = str(e)
        low = text.lower()
        if not any(k in low for k in ("inline_container", "write failed", "no space", "too large", "i/o error",
                                      "quota")):
            raise
        code = errno.EFBIG if "too large" in low else errno.EDQUOT if "quota" in low else errno.ENOSPC
        raise OSError(code, os.strerror(code), str(target)) from e
