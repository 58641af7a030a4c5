"""Optimizers and schedules against hand-computed values (float64 formulas written out here)."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from bertctl.errors import BertctlError
from bertctl.train.optim import Lamb, build_optimizer, build_scheduler, parameter_groups


class Tiny(nn.Module):
    """Names like the BERT model's: dense weight/bias, a LayerNorm, tied embeddings."""

    def __init__(self):
        super().__init__()
        self.word_embeddings = nn.Embedding(5, 3)
        self.dense = nn.Linear(3, 3)
        self.LayerNorm = nn.LayerNorm(3)
        self.decoder = nn.Linear(3, 5)
        self.decoder.weight = self.word_embeddings.weight  # tied, as the MLM decoder is


def _names(model, params):
    ids = {id(p) for p in params}
    return sorted(n for n, p in model.named_parameters() if id(p) in ids)


def test_no_decay_on_bias_and_layernorm():
    m = Tiny()
    decay, no_decay = parameter_groups(m, 0.01)
    assert decay["weight_decay"] == 0.01 and no_decay["weight_decay"] == 0.0
    assert _names(m, decay["params"]) == ["dense.weight", "word_embeddings.weight"]
    assert _names(m, no_decay["params"]) == ["LayerNorm.bias", "LayerNorm.weight", "decoder.bias", "dense.bias"]
    # The tied tensor appears once.
    assert sum(len(g["params"]) for g in (decay, no_decay)) == len(list(m.parameters()))


def _adamw_reference(w, grads, lr, b1, b2, eps, wd):
    """Torch AdamW = decoupled decay then bias-corrected Adam, in float64 by hand."""
    w = [float(x) for x in w]
    m = [0.0] * len(w)
    v = [0.0] * len(w)
    for t, g in enumerate(grads, start=1):
        for i in range(len(w)):
            w[i] -= lr * wd * w[i]
            m[i] = b1 * m[i] + (1 - b1) * g[i]
            v[i] = b2 * v[i] + (1 - b2) * g[i] ** 2
            mh, vh = m[i] / (1 - b1 ** t), v[i] / (1 - b2 ** t)
            w[i] -= lr * mh / (math.sqrt(vh) + eps)
    return w


def test_adamw_matches_hand_computation():
    m = nn.Linear(2, 1)
    with torch.no_grad():
        m.weight.copy_(torch.tensor([[0.5, -1.0]]))
        m.bias.copy_(torch.tensor([0.25]))
    opt = build_optimizer(m, "adamw", lr=0.1, weight_decay=0.1, eps=1e-6)
    assert isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["fused"]  # on the CPU too: one pass per tensor (foreach loops there)
    gw = [[0.3, -0.2], [0.1, 0.4], [-0.5, 0.05]]
    gb = [[1.0], [-2.0], [0.5]]
    for a, b in zip(gw, gb):
        m.weight.grad = torch.tensor([a])
        m.bias.grad = torch.tensor(b)
        opt.step()
    ref_w = _adamw_reference([0.5, -1.0], gw, 0.1, 0.9, 0.999, 1e-6, 0.1)
    ref_b = _adamw_reference([0.25], gb, 0.1, 0.9, 0.999, 1e-6, 0.0)  # no decay on the bias
    assert m.weight.detach().flatten().tolist() == pytest.approx(ref_w, rel=1e-5)
    assert m.bias.detach().tolist() == pytest.approx(ref_b, rel=1e-5)


def test_lamb_one_step_by_hand():
    """First step: m̂ = g, v̂ = g², so u = g/(|g|+eps) + λw; r = ||w||/||u||."""
    m = nn.Linear(2, 1)
    w0, b0 = [3.0, 4.0], [2.0]
    g_w, g_b = [0.6, -0.8], [0.0]
    with torch.no_grad():
        m.weight.copy_(torch.tensor([w0]))
        m.bias.copy_(torch.tensor(b0))
    m.weight.grad = torch.tensor([g_w])
    m.bias.grad = torch.tensor(g_b)
    lr, wd, eps = 0.01, 0.1, 1e-6
    opt = build_optimizer(m, "lamb", lr=lr, weight_decay=wd, eps=eps, grad_pre_normalization=False)
    assert isinstance(opt, Lamb)
    opt.step()
    u = [g / (abs(g) + eps) + wd * w for g, w in zip(g_w, w0)]       # ≈ [1.3, -0.6]
    r = math.hypot(*w0) / math.hypot(*u)                              # 5 / ||u||
    expect_w = [w - lr * r * ui for w, ui in zip(w0, u)]
    assert m.weight.detach().flatten().tolist() == pytest.approx(expect_w, rel=1e-6)
    # The bias has a zero gradient and no decay: u = 0, no trust ratio, no change.
    assert m.bias.item() == pytest.approx(2.0)


def test_lamb_two_steps_pre_normalised_and_no_trust_ratio_on_bias():
    m = nn.Linear(2, 1)
    w0, b0 = [1.0, -2.0], [0.5]
    with torch.no_grad():
        m.weight.copy_(torch.tensor([w0]))
        m.bias.copy_(torch.tensor(b0))
    lr, wd, eps, b1, b2 = 0.05, 0.01, 1e-6, 0.9, 0.999
    opt = build_optimizer(m, "lamb", lr=lr, weight_decay=wd, eps=eps, max_grad_norm=1.0)
    grads = [([3.0, 0.0], [4.0]), ([0.1, 0.2], [-0.2])]  # step 1 global norm 5 -> divide by 5; step 2 norm 0.3 -> as is
    w, b = list(w0), list(b0)
    mw, vw, mb, vb = [0.0, 0.0], [0.0, 0.0], [0.0], [0.0]
    for t, (gw, gb) in enumerate(grads, start=1):
        m.weight.grad = torch.tensor([gw])
        m.bias.grad = torch.tensor(gb)
        opt.step()
        norm = math.sqrt(sum(x * x for x in gw + gb))
        c = max(norm / 1.0, 1.0)
        gw, gb = [x / c for x in gw], [x / c for x in gb]
        mw = [b1 * a + (1 - b1) * g for a, g in zip(mw, gw)]
        vw = [b2 * a + (1 - b2) * g * g for a, g in zip(vw, gw)]
        mb = [b1 * a + (1 - b1) * g for a, g in zip(mb, gb)]
        vb = [b2 * a + (1 - b2) * g * g for a, g in zip(vb, gb)]
        uw = [(a / (1 - b1 ** t)) / (math.sqrt(s / (1 - b2 ** t)) + eps) + wd * x for a, s, x in zip(mw, vw, w)]
        ub = [(a / (1 - b1 ** t)) / (math.sqrt(s / (1 - b2 ** t)) + eps) for a, s in zip(mb, vb)]
        r = math.sqrt(sum(x * x for x in w)) / math.sqrt(sum(x * x for x in uw))
        w = [x - lr * r * u for x, u in zip(w, uw)]
        b = [x - lr * u for x, u in zip(b, ub)]  # bias: plain Adam step, no trust ratio
    assert m.weight.detach().flatten().tolist() == pytest.approx(w, rel=1e-5)
    assert m.bias.detach().tolist() == pytest.approx(b, rel=1e-5)


def test_lamb_state_round_trip():
    torch.manual_seed(0)
    a, b = nn.Linear(4, 3), nn.Linear(4, 3)
    b.load_state_dict(a.state_dict())
    oa, ob = build_optimizer(a, "lamb", lr=0.01), build_optimizer(b, "lamb", lr=0.01)
    x = torch.randn(8, 4)
    for step in range(4):
        for mod, opt in ((a, oa), (b, ob)):
            opt.zero_grad()
            mod(x).pow(2).sum().backward()
            opt.step()
        if step == 1:
            # deepcopy: load_state_dict keeps the very tensors it is given (as a checkpoint round trip would not)
            ob.load_state_dict(copy.deepcopy(oa.state_dict()))
    assert torch.equal(a.weight, b.weight)


def test_schedules_by_hand():
    p = nn.Parameter(torch.zeros(1))
    seen = {}
    for kind in ("linear", "cosine", "constant"):
        opt = torch.optim.SGD([p], lr=2.0)
        sched = build_scheduler(opt, warmup_steps=4, total_steps=12, kind=kind)
        lrs = []
        for _ in range(14):
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            sched.step()
        seen[kind] = lrs
    # warm-up: step/4 of 2.0 for steps 0..3, identical for all three
    for lrs in seen.values():
        assert lrs[:4] == pytest.approx([0.0, 0.5, 1.0, 1.5])
    # linear: (12 - s)/8 of 2.0 from s = 4, floor at 0
    assert seen["linear"][4:] == pytest.approx([2.0, 1.75, 1.5, 1.25, 1.0, 0.75, 0.5, 0.25, 0.0, 0.0])
    # cosine: 0.5 (1 + cos(pi (s-4)/8)) of 2.0; at the midpoint s = 8 it is exactly 1.0
    assert seen["cosine"][8] == pytest.approx(1.0)
    assert seen["cosine"][6] == pytest.approx(1 + math.cos(math.pi / 4))
    assert seen["cosine"][12:] == pytest.approx([0.0, 0.0], abs=1e-12)
    assert seen["constant"][4:] == pytest.approx([2.0] * 10)


def test_no_warmup_starts_at_full_lr():
    p = nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=1.0)
    build_scheduler(opt, warmup_steps=0, total_steps=10)
    assert opt.param_groups[0]["lr"] == 1.0


def test_bad_names_are_user_errors():
    with pytest.raises(BertctlError, match="unknown optimizer"):
        build_optimizer(nn.Linear(2, 2), "sgdx")
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(BertctlError, match="unknown lr schedule"):
        build_scheduler(opt, 1, 10, kind="step")


def test_a_replanned_schedule_keeps_its_lr_and_ends_at_zero():
    """replan(step, total): the multiplier at `step` is kept and decays linearly to 0 at the new total."""
    from bertctl.train.optim import Schedule

    s = Schedule(10, 100)
    before = s(50)
    s.replan(50, 60)
    assert s(50) == pytest.approx(before) and s(60) == 0.0 and s(55) == pytest.approx(before / 2)
    assert s(5) == pytest.approx(0.5)  # warm-up untouched
    s.replan(55, 200)  # slower steps than planned, then faster: a later plan takes over from where it is
    assert s(55) == pytest.approx(before / 2) and s(200) == 0.0
    w = Schedule(600, 10_000)  # re-planned during warm-up: the warm-up keeps its 6% of the run
    w.replan(5, 200)
    assert w.warmup == 12 and w(12) == 1.0 and w(200) == 0.0
    w2 = Schedule(600, 10_000)
    w2.replan(100, 150)  # the new warm-up (9 steps) is already over: decay from the lr reached
    assert w2(100) == pytest.approx(100 / 600) and w2(150) == 0.0


def test_a_time_boxed_run_fits_its_schedule_to_the_time(data_dir, tmp_path):
    """fit_to_minutes: a plan of far too many steps is re-planned from the measured pace, so the run
    ends its schedule (lr 0) inside the time box instead of being cut off mid-decay."""
    import json

    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import pretrain

    s = pretrain(PretrainConfig.of(output=str(tmp_path / "run"), data=str(data_dir), model_size="tiny", batch_size=8,
                             lr=1e-3, max_steps=100_000, minutes=0.25, fit_to_minutes=True, log_every=5,
                             eval_at_start=False, eval_batches=1, device="cpu", show_progress=False,
                             save_minutes=1000, tensorboard=False))
    assert s["max_steps"] < 100_000
    # Ended with its schedule; on a machine that got much busier mid-run the hard time box may cut the last few
    # steps, but never far from the end of the decay.
    if s["stopped"] is None:
        assert s["steps"] == s["max_steps"] and s["final_lr"] == 0.0
    else:
        assert s["stopped"] == "time limit" and s["final_lr"] < 0.1 * 1e-3
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert any(e["event"] == "replan" for e in events)


def test_pretrain_minutes_without_max_steps_plans_the_schedule_to_the_time_box(data_dir, tmp_path):
    """`pretrain --minutes` alone: the schedule ends (lr 0) inside the time box; with --max-steps too the time
    box only cuts the run short."""
    import json

    from typer.testing import CliRunner

    from bertctl.cli.app import app

    common = ["pretrain", "--data", str(data_dir), "--model-size", "tiny", "--batch-size", "8", "--device", "cpu",
              "--log-every", "5", "--eval-batches", "1", "--no-progress", "--no-tensorboard"]
    r = CliRunner().invoke(app, common + ["-o", str(tmp_path / "fit"), "--minutes", "0.2"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout[r.stdout.index("{"):])
    # Planned to end in time: lr 0 at the end (on a machine that got much busier mid-run the hard time box may
    # cut the last few steps, but never far from the end of the decay).
    assert s["final_lr"] == 0.0 if s["stopped"] is None else s["final_lr"] < 0.1 * 1e-3
    data = json.loads((data_dir / "manifest.json").read_text())
    per_epoch = data["splits"]["train"]["num_instances"] // 8
    assert s["epochs"] == pytest.approx(s["steps"] / per_epoch, abs=1e-3)
    assert s["passes_over_text"] == pytest.approx(s["epochs"] * data["data_config"]["dupe_factor"], abs=0.01)
    r = CliRunner().invoke(app, common + ["-o", str(tmp_path / "cut"), "--minutes", "0.05", "--max-steps", "100000"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout[r.stdout.index("{"):])
    assert s["stopped"] == "time limit" and s["max_steps"] == 100_000 and s["final_lr"] > 0


def test_memorising_note_names_the_gap_and_the_passes():
    from bertctl.train.pretrain import memorising_note

    note = memorising_note({"mlm_acc": 0.64}, {"mlm_acc": 0.47}, 24.0)
    assert note is not None and "0.170" in note and "24 passes" in note
    assert memorising_note({"mlm_acc": 0.64}, {"mlm_acc": 0.60}, 24.0) is None  # small gap
    assert memorising_note({"mlm_acc": 0.64}, {"mlm_acc": 0.47}, 1.0) is None  # first pass: not memorising
    assert memorising_note({"mlm_acc": 0.64}, None, 24.0) is None


def test_memorising_note_names_nsp_on_known_text():
    """The built-in job's run (training NSP accuracy 1.000, held-out 0.525 after 7.9 passes over the
    text), and the convergence benchmark's run with 20 build passes (each pair seen about once, 0.73
    epochs, 14.6 passes over the text): the same NSP gap, so the note goes by passes, not epochs."""
    from bertctl.train.pretrain import memorising_note

    train, held = {"mlm_acc": 0.212, "nsp_acc": 1.0}, {"mlm_acc": 0.155, "nsp_acc": 0.525}
    note = memorising_note(train, held, 7.9)
    assert note is not None and "NSP accuracy 1.000 is 0.475 above held-out 0.525 after 7.9 passes" in note
    assert "MLM" not in note and "more documents" in note  # the MLM gap (0.057) is below the threshold
    assert memorising_note(train, held, 1.5) is None  # the text not yet seen twice
    assert memorising_note({"mlm_acc": 0.6}, {"mlm_acc": 0.5}, 7.9) is None  # MLM-only data: no NSP to judge
    dupe20 = memorising_note({"mlm_acc": 0.560, "nsp_acc": 0.996}, {"mlm_acc": 0.481, "nsp_acc": 0.863}, 14.61)
    assert dupe20 is not None and "NSP accuracy 0.996" in dupe20 and "MLM" not in dupe20
    both = memorising_note({"mlm_acc": 0.606, "nsp_acc": 0.996}, {"mlm_acc": 0.502, "nsp_acc": 0.857}, 18.4)
    assert both is not None and "MLM accuracy 0.606" in both and "NSP accuracy 0.996" in both