"""build-data under faults: a SIGINT, SIGTERM, SIGKILL or full disk (ENOSPC) at each of its phases.

The phases are ``bertctl.faults``' points: ``start`` (inputs checked, folder claimed, no work done),
``shard`` (between two work units' shards) and ``write`` (a shard, or the manifest, written under its
temporary name and not yet renamed). Each cell runs ``bertctl build-data`` in a subprocess with
``BERTCTL_FAULT`` set, then asserts one of the two outcomes the output-folder rule promises:

- a new build: the same command with ``--resume`` completes to the uninterrupted build, shards,
  vocabulary and manifest byte for byte, and the fault's message said what was kept and how to go on;
- an ``--overwrite`` of a finished build: the previous build is intact (put back in place, or kept in
  ``OUT/.replaced/`` while finished work units of the new one wait for ``--resume``), and the message
  says so.

The reference is an uninterrupted build of the same tiny corpus in its own folder. One worker, so that a
``write`` fault reaches the process that writes (with a pool the workers write); a build with two workers
is interrupted between units.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

KINDS = ("SIGINT", "SIGTERM", "SIGKILL", "ENOSPC")
# The exit status each fault gives: Ctrl-C and TERM end as an interrupt (130), a KILL is the signal's,
# a full disk is bertctl's one-line error (2).
EXIT = {"SIGINT": 130, "SIGTERM": 130, "SIGKILL": -signal.SIGKILL, "ENOSPC": 2}
WORDS = ("the cat dog sat ran on a mat under tree house big small red blue green quickly slowly near far "
         "old new bird fish").split()


def _corpus(folder: Path) -> list[Path]:
    """Three files of short documents, sentence per line: about 30 KB, six work units at --unit-mb 0.005."""
    import random

    r = random.Random(0)
    folder.mkdir(parents=True, exist_ok=True)
    files = []
    for f in range(3):
        lines = []
        for _ in range(40):
            lines += [" ".join(r.choice(WORDS) for _ in range(r.randint(4, 12))).capitalize() + "." for _ in range(6)]
            lines.append("")
        (folder / f"doc{f}.txt").write_text("\n".join(lines) + "\n", encoding="utf-8")
        files.append(folder / f"doc{f}.txt")
    (folder / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS]) + "\n",
                                      encoding="utf-8")
    return files


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("corpus")
    files = _corpus(root)
    reference = root / "reference"
    run(files, root / "vocab.txt", reference)
    manifest = json.loads((reference / "manifest.json").read_text())
    writes = sum(len(s["shards"]) for s in manifest["splits"].values()) + 1  # every shard, then the manifest
    return {"files": files, "vocab": root / "vocab.txt", "reference": reference, "writes": writes}


def run(files, vocab, out: Path, *flags: str, fault: str | None = None, check: bool = True,
        seed: str = "12345", workers: int = 1) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "BERTCTL_FAULT"}
    if fault:
        env["BERTCTL_FAULT"] = fault
    p = subprocess.run([sys.executable, "-m", "bertctl", "build-data", "--vocab", str(vocab), "--max-seq-length", "32",
                        "--unit-mb", "0.005", "--dupe-factor", "2", "--seed", seed, "--holdout-fraction", "0.1",
                        "--workers", str(workers), "--no-progress", "-o", str(out), *flags, *map(str, files)],
                       env=env, capture_output=True, text=True, timeout=120)
    if check:
        assert p.returncode == 0, p.stderr
    return p


def outputs(out: Path) -> dict[str, bytes]:
    """The build's files: shards, vocabulary and manifest (everything but the rule's lock)."""
    return {p.name: p.read_bytes() for p in sorted(out.iterdir()) if p.is_file() and p.name != ".bertctl.lock"}


def cells():
    for kind in KINDS:
        for where in ("start", "shard", "write", "write-manifest"):
            yield pytest.param(kind, where, id=f"{where}-{kind}")


def fault_spec(where: str, writes: int) -> str:
    return {"start": "start", "shard": "shard@2", "write": "write@2", "write-manifest": f"write@{writes}"}[where]


@pytest.mark.parametrize("kind, where", list(cells()))
def test_a_new_build_resumes_to_the_uninterrupted_bytes(tmp_path, corpus, kind, where):
    out = tmp_path / "data"
    p = run(corpus["files"], corpus["vocab"], out, fault=f"{fault_spec(where, corpus['writes'])}:{kind}", check=False)
    assert p.returncode == EXIT[kind], p.stderr
    assert not (out / "manifest.json").exists()  # never a manifest over an unfinished build
    if kind != "SIGKILL":  # a KILL lets nothing run: the next command finds the folder as it was left
        said = p.stderr.splitlines()[0]
        if where == "start":
            assert said == f"bertctl: build-data: stopped before any work unit finished; nothing was kept in {out}"
            assert not out.exists()
        else:
            units = {"shard": 2, "write": 1, "write-manifest": corpus["writes"] - 1}[where]
            assert said == (f"bertctl: build-data: kept the partial build in {out} ({units} finished work units); "
                            "run the same command with --resume to continue it, or delete the folder")
        if kind == "ENOSPC":
            assert p.stderr.splitlines()[1].startswith("bertctl: error: ") and "no space left" in p.stderr
    if out.exists() and (out / ".build").is_dir():  # without --resume the unfinished build is refused, untouched
        before = outputs(out / ".build")
        again = run(corpus["files"], corpus["vocab"], out, check=False)
        assert again.returncode == 2 and "holds an unfinished build-data run" in again.stderr
        assert "pass --resume" in again.stderr and outputs(out / ".build") == before
    resumed = run(corpus["files"], corpus["vocab"], out, "--resume")
    summary = json.loads(resumed.stdout)
    if where in ("shard", "write-manifest"):
        assert summary["resumed_units"] >= 1
    assert outputs(out) == outputs(corpus["reference"])
    assert not (out / ".build").exists() and not (out / ".bertctl.lock").exists()
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())


@pytest.mark.parametrize("kind", KINDS)
def test_a_parallel_build_resumes_to_the_uninterrupted_bytes(tmp_path, corpus, kind):
    """Two worker processes: the fault reaches the main process between units while workers build the next
    ones; the workers stop with it, and the units they finished count as finished."""
    out = tmp_path / "data"
    p = run(corpus["files"], corpus["vocab"], out, fault=f"shard@2:{kind}", check=False, workers=2)
    assert p.returncode == EXIT[kind], p.stderr
    if kind != "SIGKILL":
        assert f"kept the partial build in {out} (" in p.stderr.splitlines()[0]
    run(corpus["files"], corpus["vocab"], out, "--resume", workers=2)
    assert outputs(out) == outputs(corpus["reference"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", ("start", "shard"))
def test_an_overwrite_keeps_the_previous_build(tmp_path, corpus, kind, where):
    """--overwrite moves the finished build aside; a fault before the new build finishes never loses it."""
    out = tmp_path / "data"
    run(corpus["files"], corpus["vocab"], out, seed="1")
    old = outputs(out)
    p = run(corpus["files"], corpus["vocab"], out, "--overwrite", fault=f"{fault_spec(where, 0)}:{kind}",
            check=False)
    assert p.returncode == EXIT[kind], p.stderr
    if where == "start" and kind != "SIGKILL":
        assert p.stderr.splitlines()[0] == (f"bertctl: build-data: stopped before any work unit finished; the "
                                            f"previous build in {out} is kept as it was")
        assert outputs(out) == old and not (out / ".replaced").exists() and not (out / ".build").exists()
        return
    assert outputs(out / ".replaced") == old  # the previous build, whole, until the new one finishes
    if kind != "SIGKILL":
        assert f"the build it replaces stays in {out / '.replaced'} until this one finishes" in p.stderr
    run(corpus["files"], corpus["vocab"], out, "--resume")
    assert outputs(out) == outputs(corpus["reference"]) and not (out / ".replaced").exists()


def test_a_second_build_into_the_folder_is_refused_while_the_first_lives(tmp_path, corpus):
    """The rule's lock, not a check for an empty folder: the second build exits 2 and names the first."""
    out = tmp_path / "data"
    slow = tmp_path / "slow.py"
    # The first build stops at its start point, folder claimed, until this test lets it go on.
    slow.write_text("import sys, time\nfrom bertctl import faults\nfaults.point = lambda name: name == 'start' and "
                    "(print('claimed', flush=True), time.sleep(60))\nfrom bertctl.cli.app import main\n"
                    "main(sys.argv[1:])\n")
    first = subprocess.Popen([sys.executable, str(slow), "build-data", "--vocab", str(corpus["vocab"]),
                              "--max-seq-length", "32", "--unit-mb", "0.005", "--dupe-factor", "2",
                              "--holdout-fraction", "0.1", "--workers", "1", "--no-progress", "-o", str(out),
                              *map(str, corpus["files"])], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert first.stdout.readline().strip() == "claimed"
        second = run(corpus["files"], corpus["vocab"], out, check=False)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines() == [
            f"bertctl: error: {out}: another bertctl build-data (pid {first.pid}, since "
            f"{json.loads((out / '.bertctl.lock').read_text())['since']}) is writing this folder; wait for it to end, "
            f"or choose another --output"]
        assert run(corpus["files"], corpus["vocab"], out, "--resume", check=False).returncode == 2
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    deadline = time.time() + 10
    while (out / ".bertctl.lock").exists() and time.time() < deadline:  # freed by the first build's exit
        time.sleep(0.05)
    assert not (out / ".bertctl.lock").exists()
    run(corpus["files"], corpus["vocab"], out, "--resume")
    assert outputs(out) == outputs(corpus["reference"])


def test_a_worker_killed_mid_build_ends_the_build_and_a_rerun_completes_it(tmp_path, corpus):
    """The out-of-memory killer takes a worker as it writes a shard: the build ends at once with one line
    naming the worker and the signal (the pool would have waited forever for the lost unit), keeps what
    finished, and the same command (with --resume where a partial build was kept) completes it."""
    out = tmp_path / "data"
    p = run(corpus["files"], corpus["vocab"], out, fault="write@2:SIGKILL", check=False, workers=2)
    assert p.returncode == 2, p.stderr
    assert "bertctl: error: worker process" in p.stderr and "was killed by SIGKILL" in p.stderr, p.stderr
    run(corpus["files"], corpus["vocab"], out, *(["--resume"] if out.exists() else []), workers=2)
    assert outputs(out) == outputs(corpus["reference"])
    assert not (out / ".build").exists() and not any(p.name.endswith(".tmp") for p in out.iterdir())
