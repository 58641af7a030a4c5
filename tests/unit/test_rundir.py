"""The output-folder rule (bertctl.rundir): new, unfinished, finished and locked folders, each way a user meets them."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bertctl import rundir
from bertctl.errors import BertctlError


def checkpoint_started(folder: Path) -> str | None:
    steps = sorted((folder / "checkpoints").glob("step-*"))
    return f"a checkpoint at {steps[-1].name}" if steps else None


def claim(folder, **kw):
    return rundir.claim(folder, command="pretrain", started=checkpoint_started,
                        outputs=("checkpoints", "model", "metrics.jsonl"), **kw)


def test_a_new_folder_is_locked_by_this_process_and_freed(tmp_path):
    out = tmp_path / "run"
    c = claim(out)
    assert c.state == "new"
    held = json.loads((out / rundir.LOCK).read_text())
    assert held["pid"] == os.getpid() and held["command"] == "pretrain"
    c.release()
    assert not (out / rundir.LOCK).exists()


def test_an_unfinished_run_needs_resume(tmp_path):
    (tmp_path / "checkpoints" / "step-00000400").mkdir(parents=True)
    with pytest.raises(BertctlError, match=r"unfinished pretrain run \(a checkpoint at step-00000400\); pass --resume"):
        claim(tmp_path)
    assert not (tmp_path / rundir.LOCK).exists()  # a refusal leaves no lock behind
    with claim(tmp_path, resume=True) as c:
        assert c.state == "resume"
    assert (tmp_path / "checkpoints" / "step-00000400").is_dir()


def test_a_finished_run_is_refused_and_resume_says_it_is_finished(tmp_path):
    (tmp_path / "model").mkdir()
    with claim(tmp_path) as c:
        c.finish(steps=10)
    assert json.loads((tmp_path / rundir.MARKER).read_text())["finished"] is True
    with pytest.raises(BertctlError, match="finished pretrain run; pass --overwrite"):
        claim(tmp_path)
    with pytest.raises(BertctlError, match="nothing to resume"):
        claim(tmp_path, resume=True)


def test_overwrite_keeps_the_old_run_until_the_new_one_finishes(tmp_path):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "weights").write_text("old")
    (tmp_path / "notes.txt").write_text("the user's")
    # Finished by the command's own files (a folder written before the marker existed).
    with pytest.raises(BertctlError, match="finished finetune run"):
        rundir.claim(tmp_path, command="finetune", started=lambda f: None,
                     finished_before=lambda f: (f / "model").is_dir(), outputs=("model",))
    c = rundir.claim(tmp_path, command="finetune", started=lambda f: None, overwrite=True,
                     finished_before=lambda f: (f / "model").is_dir(), outputs=("model",))
    assert c.state == "overwrite"
    assert (tmp_path / rundir.REPLACED / "model" / "weights").read_text() == "old"
    assert not (tmp_path / "model").exists() and (tmp_path / "notes.txt").exists()
    (tmp_path / "model").mkdir()
    c.finish()
    c.release()
    assert not (tmp_path / rundir.REPLACED).exists()
    assert (tmp_path / "notes.txt").read_text() == "the user's"


def test_resume_and_overwrite_together_and_a_file_are_refused(tmp_path):
    with pytest.raises(BertctlError, match="choose one"):
        claim(tmp_path / "a", resume=True, overwrite=True)
    (tmp_path / "f").write_text("")
    with pytest.raises(BertctlError, match="not a folder"):
        claim(tmp_path / "f")


HOLDER = """
import sys, time
from bertctl import rundir
c = rundir.claim(sys.argv[1], command="finetune", started=lambda f: None)
print("held", flush=True)
time.sleep(60)
"""


def test_a_second_run_is_refused_while_the_first_lives_and_takes_over_once_it_is_gone(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(BertctlError, match=rf"another bertctl finetune \(pid {holder.pid}, since .*\) is writing"):
            claim(tmp_path)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert json.loads((tmp_path / rundir.LOCK).read_text())["pid"] == holder.pid  # SIGKILL frees nothing
    with claim(tmp_path) as c:  # the holder is gone: its lock is stale
        assert c.state == "new"
        assert json.loads((tmp_path / rundir.LOCK).read_text())["pid"] == os.getpid()


def test_a_reused_process_id_does_not_hold_the_folder(tmp_path):
    if rundir._start_time(os.getpid()) is None:
        pytest.fail("no /proc here: the start-time check cannot be tested")
    stale = {"pid": os.getpid(), "host": socket.gethostname(), "started": "0", "command": "pretrain", "since": "then"}
    (tmp_path / rundir.LOCK).write_text(json.dumps(stale))
    with claim(tmp_path) as c:
        assert c.state == "new"


def test_a_lock_from_another_host_is_left_to_the_user(tmp_path):
    other = {"pid": 1, "host": "elsewhere", "started": None, "command": "pretrain", "since": time.ctime()}
    (tmp_path / rundir.LOCK).write_text(json.dumps(other))
    with pytest.raises(BertctlError, match=rf"host elsewhere.*delete {tmp_path / rundir.LOCK}"):
        claim(tmp_path)


def test_only_the_main_process_claims(tmp_path):
    c = claim(tmp_path, main=False)
    assert c.lock is None and not (tmp_path / rundir.LOCK).exists()


def test_resume_takes_the_runs_input_moved_or_copied_but_refuses_other_input(tmp_path):
    """A path flag differs only in what it names: the saved folder gone (moved) or holding the same manifest is the
    run's input; a folder with another manifest is another run's, refused naming both."""
    from bertctl.errors import BertctlError

    def data(name: str, manifest: str) -> str:
        (tmp_path / name).mkdir()
        (tmp_path / name / "manifest.json").write_text(manifest)
        return str(tmp_path / name)

    said = []
    a, copy, other = data("a", '{"shards": 3}'), data("copy", '{"shards": 3}'), data("other", '{"shards": 4}')
    check = lambda saved, given: rundir.check_resume({"data": saved}, {"data": given}, (), folder=tmp_path,  # noqa: E731
                                                     command="pretrain", say=said.append)
    check(a, copy)
    check(str(tmp_path / "gone"), other)
    assert len(said) == 2 and "--data" in said[0] and "holds the same" in said[0]
    with pytest.raises(BertctlError, match=r"--data .*other: the pretrain run in .* was made with --data .*a, and"):
        check(a, other)
