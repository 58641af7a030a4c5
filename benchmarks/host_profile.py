"""What a torch.profiler trace says about the host side of a loop: the profile_* benchmarks' one
summary (per unit of work: CUDA kernels, their busy time and the busiest, host-device synchronisations,
device-to-host copies, and the operators with the most host time) and their one JSON output."""
from __future__ import annotations

import collections
import json
from pathlib import Path

import torch

SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
D2H_COPIES = ("Memcpy DtoH (Device -> Pinned)", "Memcpy DtoH (Device -> Pageable)")


def summarize(prof, per: int, unit: str, rows: int) -> dict:
    """The trace of ``per`` units (steps, batches) of work, per ``unit``."""
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    syncs = collections.Counter(e.name for e in events if e.name in SYNC_CALLS)
    top = sorted(prof.key_averages(), key=lambda k: -k.self_cpu_time_total)[:rows]
    busy = collections.Counter()
    for e in kernels:
        busy[e.name[:90]] += e.device_time_total
    return {f"gpu_kernel_ms_per_{unit}": sum(e.device_time_total for e in kernels) / 1e3 / per,
            f"kernels_per_{unit}": len(kernels) / per,
            f"syncs_per_{unit}": {name: count / per for name, count in syncs.items()},
            f"d2h_copies_per_{unit}": sum(1 for e in events if e.name in D2H_COPIES) / per,
            "top_host_ops": [{"op": k.key, f"calls_per_{unit}": k.count / per,
                              f"self_host_ms_per_{unit}": k.self_cpu_time_total / 1e3 / per} for k in top],
            "top_kernels": [{"kernel": name, f"gpu_ms_per_{unit}": us / 1e3 / per}
                            for name, us in busy.most_common(rows)]}


def emit(out: dict, output: Path | None) -> None:
    """The result as JSON on stdout, and in ``output`` when given."""
    text = json.dumps(out, indent=1)
    print(text)
    if output:
        output.write_text(text + "\n")
