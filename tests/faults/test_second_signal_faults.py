"""A second Ctrl-C at every phase of pretraining and fine-tuning: the run stops at once (exit 130) or as the first
signal asked, says what it kept, and the last complete state is intact: a resume ends with the uninterrupted
run's results."""
from __future__ import annotations

import re

import pytest

from bertctl import rundir
from harness import assert_same, run
from matrix import KEPT, PHASES


@pytest.mark.parametrize("command", ["pretrain", "finetune-glue"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_second_ctrl_c_keeps_the_last_complete_state(reference, command, phase, tmp_path):
    ref = reference(command)
    out = tmp_path / "out"
    fault = ref.fault(phase, "SIGINT2")
    r = run([*ref.argv, "--output", str(out)], fault=fault)
    assert r.rc in (0, 130), (fault, r.rc, r.stderr[-2000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    text = " ".join(r.stderr.split())
    if r.rc == 130:  # the second signal ended it: it says so, and what is kept
        assert "second interrupt" in text, (fault, text[-2000:])
    assert KEPT.search(text) or re.search(r"stopped \(SIGINT\)", text), (fault, text[-2000:])
    if not rundir.is_finished(out):
        again = run([*ref.argv, "--output", str(out), "--resume"])
        assert again.rc == 0, (fault, again.stderr[-3000:])
    assert_same(out, ref.results)
