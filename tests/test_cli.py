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
