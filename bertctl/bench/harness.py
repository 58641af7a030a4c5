"""The timing harness every bertctl benchmark uses (``bertctl bench`` and the scripts in ``benchmarks/``).

- ``device_block(device)``: the JSON ``device`` block (device name, torch / CUDA versions, date,
  git commit, CPU threads, measured device-to-device copy bandwidth).
- ``environment(device, packages)``: the same row without the bandwidth, plus the host and the
  versions of ``packages``: for benchmarks that time whole processes rather than kernels.
- ``copy_bandwidth(device)``: GB/s of a large tensor copy, counting bytes read + written: the
  practical ceiling for memory-bound kernels, measured in the same run.
- ``measure(fn, inputs, device)``: warm-up, then the median of many timed calls.  On CUDA each
  call is timed with CUDA events after a short device-side sleep that lets the host queue the
  call's kernels ahead, so host launch overhead is excluded (the device's own launch latency,
  about 3 us on an H100/H200, is not); on CPU with ``time.perf_counter``.  ``inputs`` is a list
  of argument tuples used in rotation, so that inputs smaller than the last-level cache are not
  timed hot (``rotation_count`` sizes it).
- ``measure_interleaved(fns, inputs, device)`` (CPU): several functions timed in alternating
  rounds, so that a slow spell of a shared machine (another process on the cores, a frequency
  drop) lands on all of them rather than on whichever was being timed.
- ``kernel_span(fn, inputs, device)`` (CUDA): the same calls under the profiler (CUPTI); per call
  the span from its first kernel's start to its last kernel's end, i.e. kernel time without the
  device launch latency before and after (gaps between a call's kernels are counted).
- ``profile_summary(prof, per, unit)``: what a torch.profiler trace says about the host side of a
  loop (kernels, host-device synchronisations, the operators with the most host time), per unit of work.
"""
from __future__ import annotations

import collections
import datetime as _dt
import os
import platform
import statistics
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

# Bytes the rotated input sets should exceed: about twice the largest cache in the way
# (H100/H200 L2 is 50 MB; a server CPU's L3 is of that order too).
CACHE_BYTES = 128 * 2**20


@dataclass
class Timing:
    median_ms: float
    p10_ms: float
    p90_ms: float
    runs: int


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def git_commit(repo: Path | None = None, paths: Sequence[str] = ()) -> str:
    """HEAD of the checkout this package lives in, '+dirty' when it has local changes (only under
    ``paths`` when given, so a benchmark writing its results into the tree stays clean); 'unknown'
    outside git.

    ``BERTCTL_COMMIT`` overrides it (a copy of the tree without .git, e.g. on a remote GPU machine)."""
    if os.environ.get("BERTCTL_COMMIT"):
        return os.environ["BERTCTL_COMMIT"]
    repo = repo or Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", *paths], cwd=repo,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def rotation_count(bytes_per_set: int, limit: int = 16) -> int:
    """How many input sets to rotate through so that together they exceed CACHE_BYTES."""
    return max(1, min(limit, -(-CACHE_BYTES // max(bytes_per_set, 1))))


def _percentiles(samples: list[float]) -> Timing:
    s = sorted(samples)
    pick = lambda q: s[min(len(s) - 1, int(q * len(s)))]  # noqa: E731
    return Timing(statistics.median(s), pick(0.1), pick(0.9), len(s))


def _sleep_cycles(fn: Callable[..., Any], inputs: Sequence[tuple], device: torch.device) -> int:
    """Cycles of device-side sleep that keep the GPU busy while the host queues one call (CUDA)."""
    t0 = time.perf_counter()
    for i in range(3):
        fn(*inputs[i % len(inputs)])
    host_s = (time.perf_counter() - t0) / 3
    synchronize(device)
    clock_hz = 2.0e9  # about a Hopper SM clock; only sizes the sleep, which needs no precision
    return int(min(2 * host_s + 20e-6, 0.05) * clock_hz)


def measure(fn: Callable[..., Any], inputs: Sequence[tuple], device: torch.device | str, *,
            warmup: int = 5, reps: int = 50, min_time_s: float = 0.0) -> Timing:
    """Median time of ``fn(*inputs[i % len(inputs)])`` over ``reps`` calls (more if ``min_time_s`` asks)."""
    device = torch.device(device)
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    synchronize(device)
    if device.type != "cuda":
        samples: list[float] = []
        start_all = time.perf_counter()
        i = 0
        while i < reps or time.perf_counter() - start_all < min_time_s:
            args = inputs[i % len(inputs)]
            t0 = time.perf_counter()
            fn(*args)
            samples.append((time.perf_counter() - t0) * 1e3)
            i += 1
        return _percentiles(samples)
    sleep_cycles = _sleep_cycles(fn, inputs, device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        torch.cuda._sleep(sleep_cycles)
        start.record()
        fn(*inputs[i % len(inputs)])
        end.record()
    torch.cuda.synchronize(device)
    return _percentiles([s.elapsed_time(e) for s, e in events])


def measure_interleaved(fns: dict[str, Callable[..., Any]], inputs: Sequence[tuple], *, rounds: int = 5,
                        reps: int = 20, warmup: int = 5) -> dict[str, Timing]:
    """CPU: median time of each of ``fns`` over ``rounds`` x ``reps`` calls, timed in rounds of
    ``reps`` calls per function with the order rotated every round."""
    names = list(fns)
    for name in names:
        for i in range(warmup):
            fns[name](*inputs[i % len(inputs)])
    samples: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            fn = fns[name]
            for i in range(reps):
                args = inputs[i % len(inputs)]
                t0 = time.perf_counter()
                fn(*args)
                samples[name].append((time.perf_counter() - t0) * 1e3)
    return {name: _percentiles(samples[name]) for name in names}


# The kernel of torch.cuda._sleep, which separates the calls in a profiled sequence.
SLEEP_KERNEL = "spin_kernel"


def call_spans(events: Sequence[tuple[str, float, float]], marker: str = SLEEP_KERNEL) -> list[float]:
    """Busy spans (last end minus first start) of the device activities between marker kernels.

    ``events``: (name, start, end) of every kernel, copy and fill, in any order.  Each call is
    what runs after one marker and before the next (or the end); calls with no activity are
    skipped.  Activities before the first marker are not part of a call."""
    spans: list[float] = []
    first = last = None
    seen_marker = False
    for name, start, end in sorted(events, key=lambda e: e[1]):
        if marker in name:
            if first is not None:
                spans.append(last - first)
            first = last = None
            seen_marker = True
        elif seen_marker:
            first = start if first is None else first
            last = end if last is None else max(last, end)
    if first is not None:
        spans.append(last - first)
    return spans


def kernel_span(fn: Callable[..., Any], inputs: Sequence[tuple], device: torch.device | str, *,
                warmup: int = 5, reps: int = 50) -> Timing:
    """Median device busy span (ms) of ``fn(*inputs[i % len(inputs)])``, from profiler timestamps (CUDA only)."""
    from torch.profiler import ProfilerActivity, profile

    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError("kernel_span needs a CUDA device")
    for i in range(warmup):
        fn(*inputs[i % len(inputs)])
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        # Sized under the profiler, whose per-launch cost lengthens the host's side of a call: a
        # sleep sized without it let the GPU idle between a call's kernels (a 14 us fwd+bwd
        # spanned 79 us).  These calls come before the first marker, outside every span.
        sleep_cycles = _sleep_cycles(fn, inputs, device)
        for i in range(reps):
            torch.cuda._sleep(sleep_cycles)  # a marker between calls, and time for the host to queue the call
            fn(*inputs[i % len(inputs)])
        torch.cuda.synchronize(device)
    cuda = torch.autograd.DeviceType.CUDA
    events = [(e.name, e.time_range.start, e.time_range.end) for e in prof.events() if e.device_type == cuda]
    spans = call_spans(events)
    if len(spans) != reps:
        raise RuntimeError(f"kernel_span: found {len(spans)} profiled calls, expected {reps}")
    return _percentiles([us * 1e-3 for us in spans])


SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
D2H_COPIES = ("Memcpy DtoH (Device -> Pinned)", "Memcpy DtoH (Device -> Pageable)")


def profile_summary(prof, per: int, unit: str, rows: int = 15) -> dict[str, Any]:
    """The trace of ``per`` units (steps, batches) of work, per ``unit``: CUDA kernels and their busy
    time, host-device synchronisations, device-to-host copies, the operators with the most host time."""
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    syncs = collections.Counter(e.name for e in events if e.name in SYNC_CALLS)
    top = sorted(prof.key_averages(), key=lambda k: -k.self_cpu_time_total)[:rows]
    busy: collections.Counter = collections.Counter()
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


def copy_bandwidth(device: torch.device | str, nbytes: int | None = None, reps: int = 20) -> float:
    """GB/s (1e9 bytes/s) of ``dst.copy_(src)``, counting bytes read plus bytes written."""
    device = torch.device(device)
    if nbytes is None:
        nbytes = 1 * 2**30 if device.type == "cuda" else 256 * 2**20
    n = nbytes // 4
    src = torch.randn(n, device=device)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), [()], device, warmup=3, reps=reps)
    return 2 * nbytes / (t.median_ms * 1e-3) / 1e9


def environment(device: torch.device | str = "cpu", packages: Sequence[str] = ()) -> dict[str, Any]:
    """What a run was measured on: device, host, versions (torch, CUDA, Python and ``packages``), commit, date."""
    from importlib import metadata

    device = torch.device(device)
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        name = props.name
        extra = {"sm_count": props.multi_processor_count, "capability": f"{props.major}.{props.minor}",
                 "memory_gib": round(props.total_memory / 2**30, 1)}
    else:
        name = platform.processor() or platform.machine()
        try:
            with open("/proc/cpuinfo") as f:
                name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
        except OSError:
            pass
        from bertctl import allocator

        extra = {"threads": torch.get_num_threads(), "cpu_count": os.cpu_count(), "allocator": allocator.status()}
    row = {
        "type": device.type,
        "name": name,
        **extra,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "commit": git_commit(),
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
    }
    if packages:
        def version(pkg: str) -> str | None:
            try:
                return metadata.version(pkg)
            except metadata.PackageNotFoundError:
                return None

        row["versions"] = {pkg: version(pkg) for pkg in packages}
    return row


def device_block(device: torch.device | str, copy_gbps: float | None = None) -> dict[str, Any]:
    """What the numbers were measured on (``environment``) and its copy bandwidth (GB/s)."""
    return {**environment(device),
            "copy_gbps": float(f"{copy_gbps if copy_gbps is not None else copy_bandwidth(device):.6g}")}


def format_table(rows: list[dict[str, Any]], columns: list[str]) -> str:
    """A plain fixed-width table (for stderr)."""
    cells = [[str(r.get(c, "")) for c in columns] for r in rows]
    widths = [max([len(c)] + [len(row[i]) for row in cells]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(lines)
