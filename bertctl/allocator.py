"""Host memory for large CPU tensors: what the bertctl command line sets before torch loads.

With glibc's defaults a CPU training step pays for its big activations twice over:
- any block of 128 KB or more (raised dynamically up to 32 MB) is mmapped, and freed blocks above
  the trim threshold go back to the kernel;
- so each step's fresh activations are page-faulted in again, 4 KB at a time.

``configure()`` changes two things (glibc on Linux only, and only where the caller set none of
the variables involved):
- glibc's mmap threshold goes to its 32 MB maximum and the trim threshold to 1 GB, so blocks under
  32 MB are reused from the heap instead of being returned and faulted in again;
- torch's own ``THP_MEM_ALLOC_ENABLE=1`` puts blocks of 2 MB and more on transparent huge pages
  (madvised), so the larger mmapped ones fault in 2 MB at a time.

A block under 32 MB freed and allocated again each step settles on one heap block.  The first few
rounds may land on fresh memory (small allocations made in between split the freed block; how often
depends on where the heap starts), then the rounds fault nothing in (tests/unit/test_cli.py counts it).

The cost: up to 1 GB of freed heap stays with the process, as with any caching allocator.

Why both: with them the CPU ops on large activations (bias+GELU at 4096 x 3072) ran several times
faster and the small rows were unchanged; THP alone, without the thresholds, made the 3-12 MB rows
slower, each call faulting in fresh huge pages where the heap had been reusing memory
(``bertctl bench ops --device cpu --threads 2``: ``benchmarks/results/ops-cpu-fp32-2threads-16c9432-a.json``).

``BERTCTL_CPU_ALLOC=default`` leaves glibc and torch as they are.
"""
from __future__ import annotations

import ctypes
import os
import platform

_M_TRIM_THRESHOLD = -1  # glibc <malloc.h>
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 2**20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD = 2**30
_OWN_VARIABLES = ("THP_MEM_ALLOC_ENABLE", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_",
                  "GLIBC_TUNABLES", "LD_PRELOAD")

_applied: dict[str, object] = {}


def configure() -> dict[str, object]:
    """Set the thresholds and THP_MEM_ALLOC_ENABLE; call before torch allocates (torch reads the
    variable once).  Returns what was applied ({} when nothing was)."""
    if _applied or os.environ.get("BERTCTL_CPU_ALLOC") == "default":
        return dict(_applied)
    if any(v in os.environ for v in _OWN_VARIABLES):
        return {}  # the caller tuned the allocator (or swapped it: jemalloc, tcmalloc): keep theirs
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return {}
    try:
        mallopt = ctypes.CDLL(None).mallopt
        ok = mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    except (OSError, AttributeError):
        return {}
    if not ok:
        return {}
    os.environ["THP_MEM_ALLOC_ENABLE"] = "1"
    _applied.update(mmap_threshold=MMAP_THRESHOLD, trim_threshold=TRIM_THRESHOLD, thp_mem_alloc_enable="1")
    return dict(_applied)


def status() -> dict[str, object]:
    """What this process runs with: the settings configure() applied (if any), torch's
    THP_MEM_ALLOC_ENABLE and the kernel's transparent-huge-page mode."""
    mode = None
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            text = f.read()
        mode = text[text.index("[") + 1:text.index("]")] if "[" in text else text.strip()
    except (OSError, ValueError):
        pass
    return {"bertctl_tuned": bool(_applied), "thp_mem_alloc_enable": os.environ.get("THP_MEM_ALLOC_ENABLE"),
            "kernel_thp": mode}
