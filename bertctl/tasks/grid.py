"""The suite's flags that may list values (``--lr 5e-5,3e-5``) read as numbers, and whether finetune glue's flags
ask for the protocol at all; without torch, so that a single run's flags are checked before it loads."""
from __future__ import annotations

import math
from typing import Sequence

from bertctl.errors import BertctlError


def parse_list(flag: str, text: str | float | int | Sequence, kind: type) -> tuple:
    """``5e-5,3e-5`` (or one value, or a sequence) as a tuple of ``kind``, each > 0, no repeats."""
    items = text if isinstance(text, (list, tuple)) else str(text).split(",")
    values = []
    for item in items:
        item = str(item).strip()
        try:
            v = kind(float(item)) if kind is int and float(item).is_integer() else kind(item)
        except ValueError:
            raise BertctlError(f"{flag}: {item!r} is not a{'n integer' if kind is int else ' number'}") from None
        if not v > 0 or (isinstance(v, float) and not math.isfinite(v)):
            raise BertctlError(f"{flag} must be greater than 0, not {item}")
        if v in values:
            raise BertctlError(f"{flag}: {item} is given twice")
        values.append(v)
    if not values:
        raise BertctlError(f"{flag}: no value")
    return tuple(values)


def wanted(task: str | None, lr: str, batch_size: str, epochs: str, restarts: int, grid: str | None) -> bool:
    """Whether finetune glue's flags ask for the protocol (--task all, --restarts, --grid or a list of values)
    rather than one fine-tuning run."""
    lists = any("," in str(v) for v in (lr, batch_size, epochs))
    return task == "all" or restarts != 1 or grid is not None or lists


def one_setting(lr: str, batch_size: str, epochs: str) -> tuple[float, int, float]:
    """A single run's --lr, --batch-size and --epochs, as numbers."""
    return (parse_list("--lr", lr, float)[0], parse_list("--batch-size", batch_size, int)[0],
            parse_list("--epochs", epochs, float)[0])
