"""The convergence benchmark's accounting: fine-tuning stages counted apart, and the pretraining boxes
planned from the measured data preparation and from-scratch fine-tuning stage."""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _module():
    spec = importlib.util.spec_from_file_location("convergence_run", ROOT / "benchmarks" / "convergence" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _write(work: Path, name: str, rec: dict) -> None:
    (work / "records").mkdir(parents=True, exist_ok=True)
    (work / "records" / f"{name}.json").write_text(json.dumps(rec))


def _args(work: Path, **kw) -> argparse.Namespace:
    return argparse.Namespace(work=work, minutes=None, budget_minutes=25.0, **kw)


def test_stages_on_one_gpu_count_apart_and_the_boxes_fill_the_budget(tmp_path):
    run = _module()
    for name, seconds in [("vocab", 17.0), ("data-nsp", 7.0), ("data-mlm", 6.0), ("architecture", 20.0)]:
        _write(tmp_path, name, {"seconds": seconds})
    # nine scratch runs from t=100 to t=250 on GPU 0; the later stage's runs start after pretraining
    for i in range(9):
        _write(tmp_path, f"ft-scratch-sst2-{i}", {"started": 100.0 + i, "seconds": 142.0, "gpu": "0",
                                                  "stage": "scratch"})
    _write(tmp_path, "ft-pretrained-sst2-42", {"started": 2000.0, "seconds": 90.0, "gpu": "0",
                                               "stage": "pretrained+mlm"})
    t = run.benchmark_time(run.load_records(_args(tmp_path)))
    assert t["finetune_stage_seconds"] == {"gpu 0, pretrained+mlm": 90.0, "gpu 0, scratch": 150.0}
    assert t["prepare_seconds"]["architecture"] == 20.0
    minutes, plan = run.plan_minutes(_args(tmp_path))
    expected = (25 * 60 - 50.0 - 3 * 150.0 - 2 * run.PRETRAIN_OVERHEAD_S - run.PLAN_MARGIN_S) / 2 / 60
    assert minutes == pytest.approx(expected, abs=0.01) and plan["finetune_scratch_stage_seconds"] == 150.0
    # a given --minutes wins; too small a budget is one clear line
    assert run.plan_minutes(argparse.Namespace(work=tmp_path, minutes=7.0, budget_minutes=25.0))[0] == 7.0
    with pytest.raises(SystemExit, match="leaves"):
        run.plan_minutes(argparse.Namespace(work=tmp_path, minutes=None, budget_minutes=9.0))


def test_planning_without_a_measured_scratch_stage_says_what_to_run(tmp_path):
    run = _module()
    _write(tmp_path, "vocab", {"seconds": 17.0})
    # records of an older run: every init in one stage, no stage name
    _write(tmp_path, "ft-scratch-sst2-42", {"started": 0.0, "seconds": 100.0, "gpu": "0"})
    assert run.benchmark_time(run.load_records(_args(tmp_path)))["finetune_stage_seconds"] == {"gpu 0": 100.0}
    with pytest.raises(SystemExit, match="finetune-scratch"):
        run.plan_minutes(_args(tmp_path))


def test_pretraining_without_dropout_fine_tunes_every_init_at_the_papers_dropout(tmp_path):
    run = _module()
    a = argparse.Namespace(work=tmp_path, data=tmp_path / "data", model_size="medium", batch=128, eval_every=500,
                           eval_batches=20, seed=0, compile=True, cuda_graphs=False, seq=256, pretrain_dropout=0.0)
    pre = run.pretrain_cmd(a, "data-nsp", tmp_path / "pretrain-main", minutes=8.0)
    assert pre[pre.index("--dropout") + 1] == "0"
    assert "--compile" in pre and "--cuda-graphs" not in pre
    a.cuda_graphs = True  # graphs instead of compile
    pre = run.pretrain_cmd(a, "data-nsp", tmp_path / "pretrain-main", minutes=8.0)
    assert "--cuda-graphs" in pre and "--compile" not in pre
    a.cuda_graphs = False
    for init in ("pretrained", "scratch", "mlm"):
        ft = run.finetune_cmd(a, "sst2", init, 42, tmp_path / "out")
        assert ft[ft.index("--dropout") + 1] == "0.1"
    # by default both keep the checkpoint's dropout: no flag
    a.pretrain_dropout = None
    assert "--dropout" not in run.pretrain_cmd(a, "data-nsp", tmp_path / "p", minutes=8.0)
    assert "--dropout" not in run.finetune_cmd(a, "conll", "pretrained", 42, tmp_path / "out")


def test_preset_runs_on_several_gpus_keep_the_global_batch(tmp_path, monkeypatch):
    run = _module()
    commands = []
    monkeypatch.setattr(run, "build_data", lambda *a, **k: None)
    monkeypatch.setattr(run, "run", lambda cmd, a, name: commands.append(cmd) or {"seconds": 1.0})
    a = argparse.Namespace(work=tmp_path, seq=128, dupe=5, preset_sizes=["large"], preset_batches=[256, 2048],
                           preset_steps=1000, preset_lr=None, preset_warmup=None, preset_optimizer=None,
                           preset_micro_batch=512, preset_nproc=4, model_size="medium", batch=128, eval_every=1000,
                           eval_batches=20, seed=0, cuda_graphs=True, compile=True, pretrain_dropout=None, force=False)
    run.presets(a)
    assert len(commands) == 2
    for cmd, batch, steps in zip(commands, ("256", "2048"), ("1000", "500")):
        assert cmd[1:7] == ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4", "-m"]
        assert cmd[7:9] == ["bertctl", "pretrain"] and cmd[cmd.index("--data") + 1] == str(tmp_path / "data-nsp")
        assert cmd[cmd.index("--batch-size") + 1] == batch and cmd[cmd.index("--max-steps") + 1] == steps
        assert "--cuda-graphs" not in cmd and "--compile" not in cmd
    assert "--micro-batch-size" not in commands[0] and commands[1][commands[1].index("--micro-batch-size") + 1] == "512"


def _report(seed: int, sst2: list[float], nsp: float, scratch: list[float] | None = None, **settings) -> dict:
    table = {"sst2": {"pretrained": {"mean": sum(sst2) / len(sst2), "values": sst2}}}
    if scratch:
        table["sst2"]["scratch"] = {"mean": sum(scratch) / len(scratch), "values": scratch}
    return {"settings": {"seed": seed, "model_size": "medium", "minutes": 7.99, **settings},
            "run_commits": ["c"], "devices": ["gpu"], "finetune": {"table": table},
            "pretrain_main": {"steps": 100 + seed, "eval_end": {"mlm_acc": 0.5, "nsp_acc": nsp},
                              "curve": [{"step": 0, "mlm_acc": 0.0, "nsp_acc": 0.5}]}}


def test_pooled_pretraining_seeds_judge_the_targets_on_the_means(tmp_path):
    run = _module()
    paths = []
    for seed, sst2, nsp, scratch in [(0, [86.0, 87.0], 0.84, [81.0, 83.0]), (1, [88.0, 88.0], 0.86, None),
                                     (2, [87.0, 87.0], 0.85, None)]:
        paths.append(tmp_path / f"r{seed}.json")
        paths[-1].write_text(json.dumps(_report(seed, sst2, nsp, scratch)))
    a = argparse.Namespace(reports=paths, results=tmp_path / "out", note="")
    res = run.pool(a)
    sst2 = res["finetune"]["sst2"]
    # per-seed means 86.5, 88, 87 against scratch 82: gaps 4.5, 6, 5 (mean 5.1667)
    assert sst2["pretrained_over_pretraining_seeds"]["values"] == [86.5, 88.0, 87.0]
    assert sst2["gap_per_pretraining_seed"] == pytest.approx([4.5, 6.0, 5.0])
    assert sst2["gap_pretrained_minus_scratch"] == pytest.approx(31 / 6) and sst2["meets_target"]
    assert sst2["seeds_meeting_target"] == 2
    nsp = res["pretraining"]["heldout_nsp_acc"]
    assert nsp["mean"] == pytest.approx(0.85) and nsp["std"] == pytest.approx(0.01)
    assert res["pretraining"]["seeds_meeting_nsp_target"] == 2
    assert json.loads((tmp_path / "out" / "convergence-seeds.json").read_text())["pretraining_seeds"] == [0, 1, 2]
    assert (tmp_path / "out" / "convergence-seeds.png").stat().st_size > 0


def test_pooling_refuses_reports_of_different_recipes_or_a_repeated_seed(tmp_path):
    run = _module()
    a0, a1, b = tmp_path / "a0.json", tmp_path / "a1.json", tmp_path / "b.json"
    a0.write_text(json.dumps(_report(0, [86.0], 0.85)))
    a1.write_text(json.dumps(_report(0, [87.0], 0.85)))
    b.write_text(json.dumps(_report(1, [87.0], 0.85, model_size="base")))
    with pytest.raises(SystemExit, match="beyond the seed: model_size"):
        run.pool(argparse.Namespace(reports=[a0, b], results=tmp_path, note=""))
    with pytest.raises(SystemExit, match="appears twice"):
        run.pool(argparse.Namespace(reports=[a0, a1], results=tmp_path, note=""))
