"""The convergence benchmark's accounting: fine-tuning stages counted apart, and the pretraining boxes
planned from the measured data preparation and from-scratch fine-tuning stage."""
from __future__ import annotations

import argparse
import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


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
