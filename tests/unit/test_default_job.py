"""The built-in job sizes its training from the corpus and the machine (``plan_job``), and says what it did.

The reference for the cap is the measurement that motivated it: on an H200 the job ran 110,366 steps at
batch 8, which were 262 passes over its text (so 421 steps a pass), and its held-out loss rose from
about step 2,000 on. A plan for that machine must stop before that step; a slow machine's plan fills
its time box instead.
"""
from __future__ import annotations

import json

import pytest

from bertctl.default_job import MAX_PASSES, JobPlan, plan_job
from bertctl.errors import BertctlError

# The H200 run's corpus: 3 copies of the text, 421 steps a pass at batch 8, so 421 * 8 * 3 instances.
H200_STEPS, H200_PASSES, H200_TURN = 110_366, 262, 2_000
H200_INSTANCES = round(H200_STEPS / H200_PASSES) * 8 * 3
H200_STEP_SECONDS = 116 / H200_STEPS  # its steps in its 116 s of training
CPU_STEP_SECONDS = 0.036  # the 2-core CPU's tiny-BERT step at batch 8


def passes(plan: JobPlan, instances: int, dupe: int = 3, batch: int = 8) -> float:
    """Passes over the text, counted independently: sequences seen / sequences in one copy of the text."""
    return plan.max_steps * batch / (instances / dupe)


def test_a_fast_machine_stops_at_the_pass_cap_before_held_out_loss_turns():
    plan = plan_job(H200_INSTANCES, H200_STEP_SECONDS, 110.0)
    assert plan.limited_by == "passes" and not plan.fit_to_minutes  # no re-planning past the cap
    assert plan.max_steps < H200_TURN
    assert passes(plan, H200_INSTANCES) == pytest.approx(MAX_PASSES, abs=0.01)
    assert plan.passes == pytest.approx(passes(plan, H200_INSTANCES), abs=0.01)
    assert "passes over the text at most" in plan.reason
    # More time on the same machine changes nothing: the corpus, not the clock, bounds the run.
    assert plan_job(H200_INSTANCES, H200_STEP_SECONDS, 1100.0).max_steps == plan.max_steps


def test_a_slow_machine_fills_its_time_box_under_the_cap():
    seconds = 110.0
    plan = plan_job(H200_INSTANCES, 0.2, seconds)
    assert plan.limited_by == "time" and plan.fit_to_minutes
    assert plan.max_steps == int(0.85 * seconds / 0.2)  # 85% of the box: evaluations and the export take the rest
    assert passes(plan, H200_INSTANCES) < MAX_PASSES
    assert "the time box" in plan.reason


@pytest.mark.parametrize("step_seconds", [0.2, CPU_STEP_SECONDS, 0.01, 0.003, H200_STEP_SECONDS, 1e-5])
def test_no_machine_goes_past_the_cap(step_seconds):
    plan = plan_job(H200_INSTANCES, step_seconds, 110.0)
    assert passes(plan, H200_INSTANCES) <= MAX_PASSES + 1e-9
    assert plan == plan_job(H200_INSTANCES, step_seconds, 110.0)  # a pure function of its inputs
    assert plan.model_size == "tiny" and plan.batch_size == 8
    assert JobPlan(**json.loads(json.dumps(plan.to_dict()))) == plan  # kept in work/plan.json for --resume


def test_a_larger_corpus_gets_more_steps_and_the_same_passes():
    small = plan_job(H200_INSTANCES, H200_STEP_SECONDS, 110.0)
    large = plan_job(4 * H200_INSTANCES, H200_STEP_SECONDS, 110.0)
    assert large.max_steps == pytest.approx(4 * small.max_steps, abs=4)
    assert large.passes == pytest.approx(small.passes, abs=0.01)


def test_a_corpus_smaller_than_a_batch_is_refused():
    with pytest.raises(BertctlError, match="fewer than one batch of 8"):
        plan_job(7, 0.01, 60.0)


def test_the_job_on_a_simulated_fast_machine_says_what_it_did(tmp_path, monkeypatch):
    """The whole job with the calibration declaring an H200's pace: it plans by passes, trains that many
    steps, and its summary, metrics log and curves say how many, how many passes and why it stopped."""
    import bertctl.default_job as job
    from matplotlib.image import imread

    monkeypatch.setattr(job, "_calibrate_step_seconds", lambda *a, **k: H200_STEP_SECONDS)
    monkeypatch.setattr(job, "MAX_PASSES", 0.2)  # about 80 steps: the unit tier's time, the same decisions
    out = tmp_path / "run"
    s = job.run_default_job(out, max_modules=4, vocab_size=400, max_seq_length=32, eval_batches=2,
                            show_progress=False, tensorboard=False)
    d = s["default_job"]
    manifest = json.loads((out / "work" / "data" / "manifest.json").read_text())
    instances = manifest["splits"]["train"]["num_instances"]
    assert d["plan"]["limited_by"] == "passes" and d["plan"]["max_steps"] == s["steps"] == s["max_steps"]
    assert s["passes_over_text"] == pytest.approx(0.2, abs=0.01)
    assert s["passes_over_text"] == pytest.approx(s["steps"] * 8 / (instances // 8 * 8) * 3, abs=0.01)
    assert d["stopped_by"].startswith("the cap of 0.2 passes")
    notes = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    notes = [r for r in notes if r.get("kind") == "default-job"]
    assert len(notes) == 1 and f"{s['steps']:,} steps" in notes[0]["message"]
    assert notes[0]["limited_by"] == "passes"
    assert imread(out / "curves.png").shape[0] == 440  # the 400-pixel plot and its 40-pixel caption
    assert json.loads((out / "work" / "plan.json").read_text()) == d["plan"]
