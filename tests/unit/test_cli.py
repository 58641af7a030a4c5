"""The CLI shell: every command has --help, errors are one line with exit code 2, env reports kernels."""
from __future__ import annotations

import json
import subprocess
import sys

import typer
from typer.testing import CliRunner

from bertctl.cli.app import app

runner = CliRunner()


def all_command_paths():
    """Every leaf command and group, as argument lists."""
    root = typer.main.get_command(app)
    paths = []

    def walk(cmd, prefix):
        paths.append(prefix)
        if hasattr(cmd, "commands"):
            for name, sub in cmd.commands.items():
                walk(sub, prefix + [name])

    walk(root, [])
    return paths


def test_every_command_has_help():
    paths = all_command_paths()
    names = {p[0] for p in paths if p}
    assert {"env", "embed"} <= names
    for path in paths:
        result = runner.invoke(app, [*path, "--help"])
        assert result.exit_code == 0, (path, result.output)
        assert "Usage" in result.output


def test_env_reports_versions_and_kernels():
    result = runner.invoke(app, ["env", "--json"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    import torch

    assert info["torch"] == torch.__version__
    assert info["devices"][0] == "cpu"
    assert isinstance(info["kernels"], dict)


def _fresh(code: str, **env: str) -> str:
    import os

    base = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "BERTCTL_CPU_ALLOC")}
    return subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          check=True).stdout


def test_cli_tunes_the_cpu_allocator_unless_told_not_to():
    """Importing the CLI sets glibc's thresholds and torch's THP_MEM_ALLOC_ENABLE (bertctl.allocator);
    BERTCTL_CPU_ALLOC=default or a caller's own THP_MEM_ALLOC_ENABLE leaves the allocator alone."""
    probe = "import json, bertctl.cli; from bertctl import allocator; print(json.dumps(allocator.status()))"
    tuned = json.loads(_fresh(probe))
    assert tuned["bertctl_tuned"] and tuned["thp_mem_alloc_enable"] == "1"
    assert not json.loads(_fresh(probe, BERTCTL_CPU_ALLOC="default"))["bertctl_tuned"]
    theirs = json.loads(_fresh(probe, THP_MEM_ALLOC_ENABLE="0"))
    assert not theirs["bertctl_tuned"] and theirs["thp_mem_alloc_enable"] == "0"


def test_tuned_allocator_reuses_blocks_and_faults_large_ones_in_by_huge_pages():
    """Page faults counted in fresh processes.  An 8 MB tensor allocated and freed 200 times: tuned,
    the rounds settle on one heap block (small allocations in between can push the first few onto
    fresh memory, depending on where the heap starts) and the last 100 fault nothing in, where
    torch's huge pages alone (THP_MEM_ALLOC_ENABLE=1 without the thresholds) fault in a fresh
    mmapped block every round.  With the kernel's THP mode "madvise" or "always" a 64 MB tensor
    takes a few hundred faults instead of the 16,384 of 4 KB pages."""
    from bertctl import allocator

    code = ("import resource, sys, bertctl.cli, torch\n"
            "faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt\n"
            "rounds = []\n"
            "for _ in range(200):\n"
            "    f = faults(); b = torch.ones(2 * 2**20); rounds.append(faults() - f); del b\n"
            "f = faults(); t = torch.ones(16 * 2**20); print(sum(rounds[100:]), faults() - f)")
    settled, big = map(int, _fresh(code).split())
    settled_thp_alone, _ = map(int, _fresh(code, THP_MEM_ALLOC_ENABLE="1").split())
    _, big_default = map(int, _fresh(code, BERTCTL_CPU_ALLOC="default").split())
    assert settled < 100 and settled_thp_alone > 100 * 400, (settled, settled_thp_alone)
    if allocator.status()["kernel_thp"] in ("madvise", "always"):
        assert big_default >= 16_000 and big < big_default / 4, (big, big_default)


def test_input_error_is_one_line_exit_2_and_debug_shows_traceback(tmp_path):
    args = [sys.executable, "-m", "bertctl", "embed", "--model", str(tmp_path / "missing"),
            "--output", str(tmp_path / "o.npy"), str(tmp_path / "missing.txt")]
    plain = subprocess.run(args, capture_output=True, text=True)
    assert plain.returncode == 2
    lines = [line for line in plain.stderr.splitlines() if line.strip() and "RuntimeWarning" not in line
             and "warnings.warn" not in line]
    assert len(lines) == 1 and lines[0].startswith("bertctl: error:") and "missing.txt" in lines[0], plain.stderr
    debug = subprocess.run([args[0], "-m", "bertctl", "--debug", *args[3:]], capture_output=True, text=True)
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_usage_error_exit_code_2():
    result = runner.invoke(app, ["embed", "--pooling"])
    assert result.exit_code == 2


def test_openmp_threads_spin_briefly_unless_the_caller_chose():
    """GOMP_SPINCOUNT=1000 before torch loads libgomp (long spinning made a step 50x slower beside busy
    processes); a caller's GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is."""
    import os
    import subprocess
    import sys

    probe = "import bertctl.cli, os; print(os.environ.get('GOMP_SPINCOUNT'))"
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = lambda env: subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,  # noqa: E731
                                     text=True, check=True).stdout.strip()
    assert run(base) == "1000"
    assert run({**base, "GOMP_SPINCOUNT": "7"}) == "7"
    assert run({**base, "OMP_WAIT_POLICY": "ACTIVE"}) == "None"
