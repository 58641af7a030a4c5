"""One case of the matrix: a command with a fault at a phase, then, unless the run says it finished, ``--resume``;
either way the folder must end with the uninterrupted run's results, and the interrupted run must have said
what it kept."""
from __future__ import annotations

import re
from pathlib import Path

from bertctl import rundir
from harness import assert_same, run

#: The phases of the matrix (each reached at a fault point, ``conftest.Reference.fault``) and the faults.
PHASES = ("before-first-step", "mid-step", "checkpoint", "evaluation", "final-save")
FAULTS = ("SIGINT", "SIGTERM", "SIGKILL", "ENOSPC")

#: What a stopped run's message says it kept (each is one of bertctl's phrasings of "what is kept").
KEPT = re.compile(r"is kept|nothing is kept|the run is complete|trained model is in .* --resume to evaluate it|"
                  r"checkpoint in .*continue with --resume")


def check(reference, phase: str, kind: str, out: Path) -> None:
    fault = reference.fault(phase, kind)
    r = run([*reference.argv, "--output", str(out)], fault=fault)
    if kind == "SIGKILL":
        assert r.rc == -9, (fault, r.rc, r.stderr[-2000:])
    elif kind == "ENOSPC":
        errors = [line for line in r.stderr.splitlines() if line.startswith("bertctl: error:")]
        assert r.rc == 2 and len(errors) == 1, (fault, r.rc, r.stderr[-2000:])
        assert "no space left on the device" in errors[0], errors
        assert "Traceback" not in r.stderr, r.stderr[-2000:]
    else:
        assert r.rc == 0, (fault, r.rc, r.stderr[-2000:])
        assert f"stopped ({kind})" in r.text or "the run is complete" in r.text, (fault, r.stderr[-2000:])
        assert KEPT.search(r.text), (fault, r.stderr[-2000:])
    if not rundir.is_finished(out):
        again = run([*reference.argv, "--output", str(out), "--resume"])
        assert again.rc == 0, (fault, again.stderr[-3000:])
    assert_same(out, reference.results)


def check_file_size_limit(reference, out: Path, limit: int = 1 << 20) -> None:
    """A real full disk: the command in a fresh interpreter under RLIMIT_FSIZE (set in ``preexec_fn``), so its
    first large write fails as the kernel fails it; one line says so and what is kept, and a resume with room
    to write ends with the uninterrupted run's results."""
    r = run([*reference.argv, "--output", str(out)], real=True, fsize=limit)
    errors = [line for line in r.stderr.splitlines() if line.startswith("bertctl: error:")]
    assert r.rc == 2 and len(errors) == 1 and "Traceback" not in r.stderr, (r.rc, r.stderr[-3000:])
    assert re.search(r"no space left on the device|file too large", errors[0]), errors
    assert KEPT.search(" ".join(errors[0].split())), errors
    again = run([*reference.argv, "--output", str(out), "--resume"])
    assert again.rc == 0, again.stderr[-3000:]
    assert_same(out, reference.results)
