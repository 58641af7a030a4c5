"""The one training configuration: each command's defaults kept, older saved configs still read."""
from __future__ import annotations

import inspect

import pytest

from bertctl.config import FinetuneConfig, PretrainConfig, TrainConfig


def _cli_defaults(command) -> dict:
    return {name: p.default.default for name, p in inspect.signature(command).parameters.items()
            if hasattr(p.default, "default")}


def test_fine_tuning_defaults_are_the_finetune_commands():
    from bertctl.cli.finetune import glue_command

    cli, t = _cli_defaults(glue_command), FinetuneConfig().train
    assert (t.lr, t.batch_size, t.seed, t.warmup_fraction, t.weight_decay, t.max_grad_norm) == (
        cli["lr"], cli["batch_size"], cli["seed"], cli["warmup_fraction"], cli["weight_decay"], cli["max_grad_norm"])
    assert (t.dropout_masks, t.graph_min_steps, t.log_every, t.save_every) == (
        cli["dropout_masks"], cli["graph_min_steps"], cli["log_every"], cli["save_every"])
    assert (FinetuneConfig().epochs, FinetuneConfig().eval_batch_size) == (cli["epochs"], cli["eval_batch_size"])


def test_pretraining_defaults_are_the_pretrain_commands():
    from bertctl.cli.pretrain import pretrain_command

    cli, t = _cli_defaults(pretrain_command), PretrainConfig(output="x").train
    assert (t.seed, t.warmup_fraction, t.save_minutes, t.keep, t.log_every, t.optimizer, t.schedule) == (
        cli["seed"], cli["warmup_fraction"], cli["save_minutes"], cli["keep"], cli["log_every"], cli["optimizer"],
        cli["schedule"])
    assert PretrainConfig(output="x").eval_batches == cli["eval_batches"]


def test_a_pretraining_config_saved_before_the_shared_one_still_loads():
    old = {"output": "run", "data": "d", "model_size": "tiny", "batch_size": 16, "lr": 2e-3, "eps": 1e-8,
           "betas": [0.9, 0.98], "seed": 3, "show_progress": False, "save_minutes": None, "eval_every": 10,
           "a_key_from_another_version": 1}
    cfg = PretrainConfig.from_dict(old)
    assert (cfg.output, cfg.data, cfg.model_size, cfg.eval_every) == ("run", "d", "tiny", 10)
    t = cfg.train
    assert (t.batch_size, t.lr, t.adam_eps, t.betas, t.seed, t.save_minutes) == (16, 2e-3, 1e-8, (0.9, 0.98), 3, None)
    assert t.warmup_fraction == 0.06  # not saved: pretraining's default, not the shared one's
    assert PretrainConfig.from_dict(cfg.to_dict()) == cfg


def test_options_in_code_are_checked_by_name():
    assert FinetuneConfig.of(epochs=1, lr=1e-3, progress=False).train.show_progress is False  # the older name
    assert FinetuneConfig.of(epochs=1, lr=1e-3).train == TrainConfig(**{**vars(FinetuneConfig().train), "lr": 1e-3})
    with pytest.raises(TypeError, match="unknown options lr_typo"):
        PretrainConfig.of(output="x", lr_typo=1)
