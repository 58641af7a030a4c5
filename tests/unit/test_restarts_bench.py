"""The restarts benchmark's GPU utilisation sampler: ``nvidia-smi dmon``'s table read per GPU (from a stand-in
that prints what dmon prints), and nothing where there is no nvidia-smi."""
from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

RESTARTS = Path(__file__).resolve().parents[2] / "benchmarks" / "finetune" / "restarts.py"
DMON = """# gpu     sm    mem    enc    dec    jpg    ofa
# Idx      %      %      %      %      %      %
    0     12      3      0      0      0      0
    1      -      -      -      -      -      -
    0     40     20      0      0      0      0
# gpu     sm    mem    enc    dec    jpg    ofa
# Idx      %      %      %      %      %      %
    0     68     31      0      0      0      0
    1     90     50      0      0      0      0
"""


def load():
    spec = importlib.util.spec_from_file_location("restarts_under_test", RESTARTS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_dmon_samples_are_read_per_gpu(tmp_path):
    r = load()
    (tmp_path / "dmon.txt").write_text(DMON)
    printed = tmp_path / "printed"
    stand_in = [sys.executable, "-c", f"import sys, time; sys.stdout.write(open({str(tmp_path / 'dmon.txt')!r}).read()); "
                f"sys.stdout.flush(); open({str(printed)!r}, 'w').close(); time.sleep(60)"]
    with r.GpuUtilisation(tuple(stand_in)) as gpu:
        deadline = time.monotonic() + 60
        while not printed.exists() and time.monotonic() < deadline:  # it prints, then runs on until stopped, as dmon
            time.sleep(0.05)
    s = gpu.summary()
    assert s["0"] == {"sm_percent": [12, 40, 68], "mem_percent": [3, 20, 31], "sm_mean": 40.0, "mem_mean": 18.0}
    assert s["1"]["sm_percent"] == [90] and s["1"]["sm_mean"] == 90.0  # the "-" row (no sample) is skipped


def test_no_nvidia_smi_gives_no_summary(tmp_path):
    r = load()
    with r.GpuUtilisation((str(tmp_path / "no-such-program"),)) as gpu:
        pass
    assert gpu.summary() is None
