"""The unfinished-run marker (rundir.Claim.begin): a run stopped between its last write and ``finish`` is
never taken for a finished run of an older version, and a run that wrote nothing leaves no marker."""
from __future__ import annotations

import json

from bertctl import rundir


def looks_finished(folder) -> bool:  # an older version's finished run: its model beside a final checkpoint
    return (folder / "model").is_dir()


def claim(folder, **kw):
    return rundir.claim(folder, command="pretrain", started=lambda f: "a final checkpoint" if
                        (f / "checkpoints").is_dir() else None, finished_before=looks_finished, **kw)


def test_a_marking_claim_marks_the_run_unfinished_until_finish(tmp_path):
    out = tmp_path / "run"
    c = claim(out, marks=True)
    assert json.loads((out / rundir.MARKER).read_text())["finished"] is False
    (out / "checkpoints").mkdir()
    (out / "model").mkdir()  # everything written, then stopped before finish
    c.release()
    assert not rundir.is_finished(out, looks_finished)  # the marker says unfinished: no legacy guess
    again = claim(out, resume=True, marks=True)
    assert again.state == "resume"
    again.finish(steps=1)
    again.release()
    assert rundir.is_finished(out, looks_finished)


def test_a_run_that_wrote_nothing_leaves_no_marker_nor_folder(tmp_path):
    out = tmp_path / "run"
    claim(out, marks=True).release()
    assert not out.exists()


def test_an_old_finished_run_without_marker_is_still_recognised(tmp_path):
    out = tmp_path / "run"
    (out / "model").mkdir(parents=True)
    assert rundir.is_finished(out, looks_finished)


def test_claims_that_do_not_mark_write_no_marker(tmp_path):
    out = tmp_path / "data"
    c = claim(out)
    (out / "manifest.json").write_text("{}")
    c.release()
    assert not (out / rundir.MARKER).exists()
