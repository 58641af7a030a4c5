"""Pretraining on CPU: learning, exact resume after SIGKILL, DDP = one process, atomic checkpoints,
SIGTERM, the Hugging Face export, and the built-in default job.

All runs use a tiny BERT on a few real inaugural addresses (../shared/data), built into shards
with ``build_data`` and a small WordPiece vocabulary made from the same text (conftest's data_dir).
"""
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
import torch

from bertctl.checkpoints import training
from bertctl.data.batching import pretraining_batches
from helpers import kill_at_checkpoint

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _args(data: Path, out: Path, *extra: str) -> list[str]:
    return ["pretrain", "--data", str(data), "--output", str(out), "--model-size", "tiny", "--batch-size", "16",
            "--lr", "2e-3", "--device", "cpu", "--no-progress", "--log-every", "2", "--eval-batches", "2",
            "--save-minutes", "1000", *extra]


def _cli(*args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "bertctl", *args], env=ENV, capture_output=True, text=True,
                          timeout=300, **kw)


def _in_process(*args: str) -> subprocess.CompletedProcess:
    """``bertctl ARGS`` run in this process through the CLI (its checks and one-line errors) without a fresh
    interpreter's start-up, for the refusals and short runs; a bug's exception is raised here."""
    from typer.testing import CliRunner

    from bertctl.cli.app import app

    r = CliRunner().invoke(app, list(args))
    if r.exception is not None and not isinstance(r.exception, SystemExit):
        raise r.exception
    return subprocess.CompletedProcess(list(args), r.exit_code, r.stdout, r.stderr)


def _weights(run: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(run / "model" / "model.safetensors")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- learning + export


@pytest.fixture(scope="module")
def trained(data_dir, tmp_path_factory):
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import pretrain

    out = tmp_path_factory.mktemp("pretrain-run") / "run"
    summary = pretrain(PretrainConfig.of(output=str(out), data=str(data_dir), model_size="tiny", batch_size=16, lr=2e-3,
                                   max_steps=40, device="cpu", log_every=5, eval_batches=4, show_progress=False,
                                   warmup_fraction=0.1))
    return out, summary


def test_tiny_model_lowers_the_loss(trained):
    out, summary = trained
    ev0, ev1 = summary["eval_start"], summary["eval_end"]
    assert ev1["mlm_loss"] < ev0["mlm_loss"] - 1.0, (ev0, ev1)
    assert ev1["mlm_acc"] > ev0["mlm_acc"]
    train = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in train if r["event"] == "train"]
    assert len(losses) == 8 and losses[-1] < losses[0] - 1.0, losses
    assert (out / "curves.png").stat().st_size > 1000
    assert summary["steps"] == 40 and summary["stopped"] is None
    # The final checkpoint records where the data stands and the configs.
    meta = json.loads((training.latest_checkpoint(out).path / "meta.json").read_text())
    assert meta["step"] == 40 and meta["data"]["global_step"] == 40
    assert meta["configs"]["model"]["num_hidden_layers"] == 2


def test_loss_is_mlm_plus_nsp_cross_entropy(trained, data_dir):
    """The logged loss equals mean masked-token CE + mean NSP CE, recomputed here in float64."""
    from bertctl.checkpoints.hf import load_pretrained
    from bertctl.data import PretrainingData
    from bertctl.model import BertForPreTraining
    from bertctl.runtime import resolve
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import Trainer
    from bertctl.train import distributed

    out, _ = trained
    model = load_pretrained(BertForPreTraining, out / "model").eval()
    ds = PretrainingData(data_dir, split="eval")
    batch = next(pretraining_batches(ds, 16, seed=0, epoch=0))
    t = Trainer(PretrainConfig.of(output=str(out / "x"), data=str(data_dir), eval_batches=1, eval_batch_size=16,
                            device="cpu", seed=0), distributed.Dist(), resolve("cpu"))
    t.data, t.eval_data, t.model, t.model_config, t.precision = ds, ds, model, model.config, "fp32"
    ev = t.evaluate()
    model.eval()  # evaluate() hands the model back in training mode
    with torch.no_grad():
        out_ = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"])
        logp = torch.log_softmax(out_.prediction_logits.double(), -1)       # (B, S, V) float64
        pos, lab = batch["masked_positions"], batch["masked_lm_labels"]
        valid = lab != -100
        picked = logp.gather(1, pos.unsqueeze(-1).expand(-1, -1, logp.shape[-1]))
        tok_ll = picked.gather(2, lab.clamp(min=0).unsqueeze(-1)).squeeze(-1)[valid]
        nsp = torch.log_softmax(out_.seq_relationship_logits.double(), -1)
        nsp_ll = nsp.gather(1, batch["next_sentence_label"].unsqueeze(1))
    # fp32 cross-entropy in training vs float64 here: ~1e-7 relative apart.
    assert ev["mlm_loss"] == pytest.approx(-tok_ll.mean().item(), rel=1e-5)
    assert ev["nsp_loss"] == pytest.approx(-nsp_ll.mean().item(), rel=1e-5)


def test_export_loads_in_transformers_with_same_outputs(trained):
    import transformers
    from bertctl.checkpoints.hf import load_pretrained
    from bertctl.model import BertForPreTraining

    out, _ = trained
    ours = load_pretrained(BertForPreTraining, out / "model").eval()
    hf = transformers.BertForPreTraining.from_pretrained(out / "model").eval()
    tok = transformers.BertTokenizer.from_pretrained(out / "model")
    enc = tok(["We the people hold these truths.", "Ask not what your country can do."], ["for", "you"],
              padding=True, return_tensors="pt")
    with torch.no_grad():
        a = ours(enc["input_ids"], enc["token_type_ids"], enc["attention_mask"])
        b = hf(**enc)
    mask = enc["attention_mask"].bool()
    torch.testing.assert_close(a.prediction_logits[mask], b.prediction_logits[mask], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(a.seq_relationship_logits, b.seq_relationship_logits, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- never lose work


def test_sigkill_then_resume_is_bit_identical(data_dir, tmp_path):
    common = ("--max-steps", "12", "--save-every", "2", "--keep", "2")
    a, b = tmp_path / "a", tmp_path / "b"
    done = _cli(*_args(data_dir, a, *common))
    assert done.returncode == 0, done.stderr
    killed_at = kill_at_checkpoint([sys.executable, "-m", "bertctl", *_args(data_dir, b, *common)], b, 4, ENV)
    assert killed_at < 12 and not (b / "model").exists()
    resumed = _cli(*_args(data_dir, b, *common, "--resume"))
    assert resumed.returncode == 0, resumed.stderr
    summary = json.loads(resumed.stdout)
    assert summary["start_step"] == killed_at and summary["steps"] == 12
    wa, wb = _weights(a), _weights(b)
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), f"{k} differs after resume"
    sa = torch.load(training.latest_checkpoint(a).path / "state.pt", weights_only=True)
    sb = torch.load(training.latest_checkpoint(b).path / "state.pt", weights_only=True)
    for i, st in sa["optimizer"]["state"].items():
        assert torch.equal(st["exp_avg_sq"], sb["optimizer"]["state"][i]["exp_avg_sq"])
    # --keep 2: only the two newest checkpoints remain.
    assert [c.step for c in training.list_checkpoints(b)] == [10, 12]


def test_cuda_graphs_are_off_on_the_cpu_and_asking_there_is_one_clear_error(data_dir, tmp_path):
    r = _in_process(*_args(data_dir, tmp_path / "g", "--max-steps", "2", "--cuda-graphs"))
    assert r.returncode == 2 and "--cuda-graphs: they need a CUDA device" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "g" / "checkpoints").exists()
    r = _in_process(*_args(data_dir, tmp_path / "auto", "--max-steps", "2"))  # the default: eager on the CPU
    assert r.returncode == 0, r.stderr[-2000:]
    assert not any(json.loads(x).get("event") == "cuda_graphs"
                   for x in (tmp_path / "auto" / "metrics.jsonl").read_text().splitlines())


def test_a_finished_run_is_refused_without_overwrite_and_resume_says_it_is_finished(trained, data_dir):
    out, _ = trained
    before = (out / "model" / "model.safetensors").read_bytes()
    r = _in_process(*_args(data_dir, out, "--max-steps", "2"))
    assert r.returncode == 2 and "finished pretrain run; pass --overwrite" in " ".join(r.stderr.split())
    r = _in_process(*_args(data_dir, out, "--max-steps", "50", "--resume"))
    said = " ".join(r.stderr.split())
    assert r.returncode == 2 and "finished its 40" in said and "--init-from" in said and "Traceback" not in r.stderr
    assert (out / "model" / "model.safetensors").read_bytes() == before


def test_an_unfinished_run_needs_resume_and_overwrite_replaces_a_finished_one(data_dir, tmp_path):
    out = tmp_path / "run"
    killed_at = kill_at_checkpoint([sys.executable, "-m", "bertctl", *_args(data_dir, out, "--max-steps", "200",
                                                                            "--save-every", "2")], out, 2, ENV)
    r = _in_process(*_args(data_dir, out, "--max-steps", "200", "--save-every", "2"))
    assert r.returncode == 2 and f"unfinished pretrain run (a checkpoint at step {killed_at})" in " ".join(r.stderr.split())
    assert training.latest_checkpoint(out).step == killed_at  # nothing was touched
    done = _in_process(*_args(data_dir, out, "--max-steps", "3", "--overwrite"))
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout)["steps"] == 3 and not (out / ".replaced").exists()
    assert training.latest_checkpoint(out).step == 3


KILL_IN_SAVE = r"""
import os, signal, sys, torch
calls = []
real_save = torch.save
def dying_save(obj, f, *a, **k):
    calls.append(f)
    if len(calls) == 2:  # the second checkpoint: write part of it, then die like a power cut
        with open(f, "wb") as fh:
            fh.write(b"PK\x03\x04" + b"\0" * 1000)
        os.kill(os.getpid(), signal.SIGKILL)
    return real_save(obj, f, *a, **k)
torch.save = dying_save
from bertctl.cli.app import main
main(sys.argv[1:])
"""


def test_kill_during_checkpoint_write_keeps_previous(data_dir, tmp_path):
    out = tmp_path / "run"
    r = subprocess.run([sys.executable, "-c", KILL_IN_SAVE, *_args(data_dir, out, "--max-steps", "8",
                                                                   "--save-every", "3")],
                       env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr
    ckpts = training.list_checkpoints(out)
    assert [c.step for c in ckpts] == [3]
    assert any(p.name.endswith(".tmp") for p in (out / "checkpoints").iterdir())  # the half-written one
    st = training.load_checkpoint(ckpts[0].path)
    assert st["step"] == 3 and st["data"]["global_step"] == 3
    # ...and a resumed run starts from it.
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import pretrain

    summary = pretrain(PretrainConfig.of(output=str(out), data=str(data_dir), model_size="tiny", batch_size=16, lr=2e-3,
                                   max_steps=8, device="cpu", resume=True, show_progress=False,
                                   eval_batches=1, save_minutes=1000, save_every=3))
    assert summary["start_step"] == 3 and summary["steps"] == 8


def test_sigterm_checkpoints_and_exits_zero(data_dir, tmp_path):
    out = tmp_path / "run"
    p = subprocess.Popen([sys.executable, "-m", "bertctl", *_args(data_dir, out, "--max-steps", "100000")],
                         env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 240
    metrics = out / "metrics.jsonl"
    while not (metrics.is_file() and '"event": "train"' in metrics.read_text()):
        assert p.poll() is None, p.stderr.read()
        assert time.time() < deadline
        time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    summary = json.loads(stdout)
    assert summary["stopped"] == "SIGTERM" and summary["steps"] >= 2
    last = training.latest_checkpoint(out)
    assert last.step == summary["steps"]
    assert json.loads((last.path / "meta.json").read_text())["reason"] == "interrupted"


def test_ctrl_c_says_what_happens_and_a_second_aborts_at_once(data_dir, tmp_path):
    """The first SIGINT is answered at once ("stopping at step N, then saving"); a second one ends the
    process at once (exit 130) and the newest complete checkpoint stays loadable."""
    import threading

    out = tmp_path / "run"
    # A step long enough (BERT-mini, batch 64) that the interpreter sits inside torch when the signals come.
    args = ["pretrain", "--data", str(data_dir), "--output", str(out), "--model-size", "mini", "--batch-size", "64",
            "--lr", "1e-3", "--device", "cpu", "--no-progress", "--no-tensorboard", "--save-every", "2",
            "--save-minutes", "1000", "--eval-every", "100000", "--eval-batches", "1", "--max-steps", "100000"]
    p = subprocess.Popen([sys.executable, "-m", "bertctl", *args], env=ENV, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: [lines.append((time.monotonic(), ln)) for ln in p.stderr], daemon=True)
    reader.start()
    deadline = time.time() + 240
    while training.latest_checkpoint(out) is None:
        assert p.poll() is None, "".join(ln for _, ln in lines)
        assert time.time() < deadline
        time.sleep(0.05)
    first = time.monotonic()
    p.send_signal(signal.SIGINT)
    while not any("then saving" in ln for _, ln in lines):
        assert time.monotonic() - first < 10, "".join(ln for _, ln in lines)
        time.sleep(0.01)
    said = next(t for t, ln in lines if "then saving" in ln)
    assert said - first < 2.0  # at once, not after the step (on a loaded machine: within 2 s)
    second = time.monotonic()
    p.send_signal(signal.SIGINT)
    p.wait(timeout=30)
    assert p.returncode == 130
    assert time.monotonic() - second < 3.0
    last = training.latest_checkpoint(out)
    blob = training.load_checkpoint(last.path)
    assert blob["step"] == last.step >= 2 and all(torch.isfinite(v).all() for v in blob["model"].values())


# --------------------------------------------------------------------------- distributed


def test_two_gloo_processes_equal_one_process(data_dir, tmp_path):
    """Same global batch (16): 1 process x 2 micro-batches of 8 vs 2 ranks x 2 micro-batches of 4.

    Both accumulate (DDP's no_sync path too), and ranks hold different numbers of masked
    tokens, so this checks the global normalisation of the MLM loss."""
    common = ("--max-steps", "4", "--dropout", "0", "--save-every", "100")
    one = _cli(*_args(data_dir, tmp_path / "one", *common, "--micro-batch-size", "8"))
    assert one.returncode == 0, one.stderr
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(_free_port()), "-m", "bertctl",
                          *_args(data_dir, tmp_path / "two", *common, "--micro-batch-size", "4")],
                         env=ENV, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr
    s1, s2 = json.loads(one.stdout), json.loads(two.stdout)
    assert s2["world_size"] == 2
    for key in ("loss", "mlm_loss", "nsp_loss", "mlm_acc", "nsp_acc"):
        assert s2["train"][key] == pytest.approx(s1["train"][key], rel=1e-5, abs=1e-6), key
    w1, w2 = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    for k in w1:
        torch.testing.assert_close(w2[k], w1[k], rtol=1e-5, atol=1e-6, msg=k)


# --------------------------------------------------------------------------- two phases, init-from


def test_phase_two_continues_from_phase_one(trained, data_dir, tmp_path):
    """--init-from a run: its weights (and with --keep-optimizer its Adam moments) carry over; steps restart."""
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import pretrain

    phase1, s1 = trained
    out = tmp_path / "phase2"
    s2 = pretrain(PretrainConfig.of(output=str(out), data=str(data_dir), init_from=str(phase1), keep_optimizer=True,
                              batch_size=16, lr=1e-3, max_steps=2, device="cpu", eval_batches=4, show_progress=False))
    assert s2["start_step"] == 0 and s2["steps"] == 2
    # Same held-out batches, same weights before phase 2's first step: the same loss as phase 1's end.
    assert s2["eval_start"]["mlm_loss"] == pytest.approx(s1["eval_end"]["mlm_loss"], rel=1e-6)
    st1 = torch.load(training.latest_checkpoint(phase1).path / "state.pt", weights_only=True)
    st2 = torch.load(training.latest_checkpoint(out).path / "state.pt", weights_only=True)
    assert float(st2["optimizer"]["state"][0]["step"]) == float(st1["optimizer"]["state"][0]["step"]) + 2
    assert st2["optimizer"]["param_groups"][0]["initial_lr"] == 1e-3


@pytest.fixture(scope="module")
def minilm_data_dir(shared_data, minilm_dir, tmp_path_factory) -> Path:
    """Shards built with MiniLM's own vocabulary (continued pretraining needs the model's vocabulary)."""
    from bertctl.data import DataConfig, build_data
    from bertctl.text.wordpiece import BertTokenizer

    from helpers import PRETRAIN_FILES

    files = [str(shared_data / "corpus" / "inaugural" / f"{n}.txt") for n in PRETRAIN_FILES[:3]]
    out = tmp_path_factory.mktemp("minilm-data") / "data"
    build_data(files, out, BertTokenizer.from_pretrained(minilm_dir),
               DataConfig(format="text", max_seq_length=64, dupe_factor=1, seed=3), progress=False)
    return out


def test_init_from_a_model_with_another_vocabulary_is_refused(minilm_dir, data_dir, tmp_path):
    """Data built with a 690-token vocabulary cannot train MiniLM (30,522): one line naming the fix."""
    from bertctl.errors import BertctlError
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import pretrain

    with pytest.raises(BertctlError, match=r"690-token vocabulary, not the 30522-token .*build-data --vocab"):
        pretrain(PretrainConfig.of(output=str(tmp_path / "x"), data=str(data_dir), init_from=str(minilm_dir),
                             batch_size=8, max_steps=1, device="cpu", show_progress=False))
    assert not (tmp_path / "x").exists()
    r = _in_process(*_args(data_dir, tmp_path / "cli", "--init-from", str(minilm_dir), "--max-steps", "1"))
    assert r.returncode == 2 and "build-data --vocab" in r.stderr
    assert not (tmp_path / "cli").exists()  # a failed run leaves no half-made folder


def test_init_from_hf_directory_with_fresh_heads(minilm_dir, minilm_data_dir, tmp_path):
    """MiniLM has no MLM/NSP heads: they start fresh, the encoder starts from MiniLM's weights."""
    from bertctl.checkpoints.hf import load_pretrained
    from bertctl.model import BertModel
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import pretrain

    out = tmp_path / "cont"
    s = pretrain(PretrainConfig.of(output=str(out), data=str(minilm_data_dir), init_from=str(minilm_dir), batch_size=8,
                             lr=1e-12, max_steps=1, device="cpu", eval_at_start=False, eval_batches=1,
                             show_progress=False, save_minutes=1000))
    assert s["steps"] == 1
    ref = load_pretrained(BertModel, minilm_dir)
    got = load_pretrained(BertModel, out / "model")
    w = "encoder.layer.3.attention.self.query.weight"
    torch.testing.assert_close(got.state_dict()[w], ref.state_dict()[w], atol=1e-6, rtol=0)  # lr 1e-12: unchanged


# --------------------------------------------------------------------------- the default job


def test_default_job_runs_end_to_end(tmp_path):
    from bertctl.default_job import run_default_job

    out = tmp_path / "default"
    s = run_default_job(out, max_steps=6, minutes=2, max_modules=12, vocab_size=600, max_seq_length=64,
                        eval_batches=2, show_progress=False)
    job = s["default_job"]
    assert job["corpus"]["documents"] > 80            # the language reference topics at least
    assert s["steps"] == 6 and (out / "model" / "vocab.txt").is_file()
    assert 0 < job["majority_token_baseline"] < 1
    assert job["eval_mlm_accuracy_start"] is not None and job["eval_mlm_accuracy_end"] is not None
    assert s["eval_end"]["mlm_loss"] < s["eval_start"]["mlm_loss"]


def test_pretrain_help():
    r = _in_process("pretrain", "--help")
    assert r.returncode == 0 and "--resume" in r.stdout and "--init-from" in r.stdout


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(data_dir, tmp_path, monkeypatch):
    from bertctl.errors import BertctlError
    from bertctl.config import PretrainConfig
    from bertctl.train import pretrain as pt

    real, calls = pt.pretraining_sums, []

    def poisoned(model, mb):  # from the 4th step on, the loss is NaN (one micro-batch per step)
        s = real(model, mb)
        calls.append(1)
        if len(calls) >= 4 and model.training:
            s["mlm_sum"] = s["mlm_sum"] * float("nan")
        return s

    monkeypatch.setattr(pt, "pretraining_sums", poisoned)
    out = tmp_path / "run"
    with pytest.raises(BertctlError, match="non-finite loss.*step-00000002"):
        pt.pretrain(PretrainConfig.of(output=str(out), data=str(data_dir), model_size="tiny", batch_size=16,
                                   max_steps=8, save_every=2, device="cpu", eval_at_start=False,
                                   show_progress=False, save_minutes=1000))
    assert [c.step for c in training.list_checkpoints(out)] == [2]
    st = training.load_checkpoint(training.latest_checkpoint(out).path)
    assert all(torch.isfinite(v).all() for v in st["model"].values())


def test_lamb_with_accumulation_lowers_the_loss(data_dir, tmp_path):
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import pretrain

    s = pretrain(PretrainConfig.of(output=str(tmp_path / "lamb"), data=str(data_dir), model_size="tiny", batch_size=32,
                             micro_batch_size=8, optimizer="lamb", lr=2e-2, max_steps=12, device="cpu",
                             eval_batches=2, log_every=4, show_progress=False, save_minutes=1000))
    assert s["eval_end"]["mlm_loss"] < s["eval_start"]["mlm_loss"] - 0.5  # 6.57 -> 5.75 seen


def test_model_from_a_config_file(data_dir, tmp_path):
    from bertctl.config import BertConfig
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import pretrain

    conf = tmp_path / "config.json"
    BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
               max_position_embeddings=64).to_json_file(conf)
    s = pretrain(PretrainConfig.of(output=str(tmp_path / "run"), data=str(data_dir), model_config=str(conf), batch_size=8,
                             max_steps=1, device="cpu", eval_at_start=False, eval_batches=1, show_progress=False))
    exported = json.loads((tmp_path / "run" / "model" / "config.json").read_text())
    assert (exported["num_hidden_layers"], exported["hidden_size"], exported["vocab_size"]) == (1, 32, 1000)
    assert s["parameters"] < 100_000


def test_length_bucketed_order_sees_every_instance_with_less_padding(data_dir):
    """An epoch in bucketed order = the loader's instances once each; less padding; exact seek; rank slices."""
    from bertctl.data import PretrainingData
    from bertctl.data.batching import bucketed_batches, trim

    ds = PretrainingData(data_dir)
    G, steps = 8, ds.steps_per_epoch(8)

    def key(batch):  # an instance's identity: its real tokens
        return [tuple(r[m.bool()].tolist()) for r, m in zip(batch["input_ids"], batch["attention_mask"])]

    plain = [x for b in pretraining_batches(ds, G, seed=5, epoch=1) for x in key(b)]
    bucketed = list(bucketed_batches(ds, G, seed=5, epoch=1, window=64))
    assert len(bucketed) == steps
    assert sorted(x for b in bucketed for x in key(b)) == sorted(plain)
    pad = lambda bs: sum(trim(b)["attention_mask"].numel() - int(b["attention_mask"].sum()) for b in bs)  # noqa: E731
    assert pad(bucketed) < 0.75 * pad(list(pretraining_batches(ds, G, seed=5, epoch=1)))  # ~0.45-0.55 seen
    # Seeking to step 70 (second window) gives steps 70.. exactly; two ranks' slices make up each global batch.
    again = list(bucketed_batches(ds, G, seed=5, epoch=1, start_step=70, window=64))
    assert [key(b) for b in again] == [key(b) for b in bucketed[70:]]
    r0 = list(bucketed_batches(ds, G, seed=5, epoch=1, rank=0, world_size=2, window=64))
    r1 = list(bucketed_batches(ds, G, seed=5, epoch=1, rank=1, world_size=2, window=64))
    assert [key(a) + key(b) for a, b in zip(r0, r1)] == [key(b) for b in bucketed]


# --------------------------------------------------------------------------- collapse


def _ev(acc: float, loss: float) -> dict:
    return {"mlm_acc": acc, "mlm_loss": loss, "mlm_majority_baseline": 0.06, "mlm_unigram_entropy": 6.5}


def test_collapse_needs_two_stuck_evaluations_well_after_warm_up():
    from bertctl.train.pretrain import collapse_warning

    stuck, learning = _ev(0.06, 6.6), _ev(0.20, 4.0)
    assert collapse_warning(stuck, stuck, 3000, 180, 3000, 4e-4).startswith("collapse: at step 3000")
    assert "--lr 0.0004 too high" in collapse_warning(stuck, stuck, 3000, 180, 3000, 4e-4)
    assert collapse_warning(stuck, stuck, 300, 180, 3000, 4e-4) is None      # before 2x warm-up and 30% of the run
    assert collapse_warning(stuck, stuck, 900, 10, 1000, 4e-4) is None       # a short run may still be there
    # A large batch sees as many sequences in fewer steps: batch 2048, 500 steps, pinned from step 62 on
    assert collapse_warning(stuck, stuck, 186, 30, 500, 1e-4, batch_size=2048).startswith("collapse: at step 186")
    assert collapse_warning(stuck, stuck, 124, 30, 500, 1e-4, batch_size=2048) is None  # 254k sequences: not yet
    assert collapse_warning(stuck, stuck, 1500, 10, 1000, 4e-4, batch_size=32) is not None  # small batches: 1000 steps
    assert collapse_warning(None, stuck, 3000, 180, 3000, 4e-4) is None      # one evaluation is not a trend
    assert collapse_warning(stuck, learning, 3000, 180, 3000, 4e-4) is None
    assert collapse_warning(stuck, _ev(0.06, 5.0), 3000, 180, 3000, 4e-4) is None  # loss below the unigram entropy


def test_a_collapsed_run_says_so(data_dir, tmp_path, monkeypatch):
    """lr 0.05 with a 2-step warm-up pins a post-LN BERT at token frequencies: the summary, the progress
    line and metrics.jsonl (a warning event, the evaluations flagged) say so (the 1000-step floor is
    lowered to keep the test short)."""
    from bertctl.train import pretrain as pt
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import pretrain

    monkeypatch.setattr(pt, "COLLAPSE_MIN_STEPS", 0)

    s = pretrain(PretrainConfig.of(output=str(tmp_path / "run"), data=str(data_dir), model_size="tiny", batch_size=16,
                             lr=0.05, max_steps=40, warmup_steps=2, eval_every=10, eval_batches=2, device="cpu",
                             show_progress=False, save_minutes=1000))
    assert s["collapsed"]
    events = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    warnings = [e for e in events if e["event"] == "warning"]
    assert len(warnings) == 1 and warnings[0]["kind"] == "collapse" and "--lr" in warnings[0]["message"]
    assert any(e["event"] == "eval" and e.get("collapsed") for e in events)


def test_a_held_out_split_smaller_than_the_batch_is_still_evaluated(data_dir, tmp_path):
    """A small corpus's held-out split can hold fewer instances than one batch: it is then evaluated
    as one batch of all of them, not silently skipped."""
    from bertctl.data.dataset import PretrainingData
    from bertctl.config import PretrainConfig
    from bertctl.train.pretrain import pretrain

    held_out = PretrainingData(str(data_dir), split="eval").num_instances
    batch = 2 * held_out
    s = pretrain(PretrainConfig.of(output=str(tmp_path / "run"), data=str(data_dir), model_size="tiny", batch_size=batch,
                             max_steps=1, device="cpu", show_progress=False, eval_batches=4))
    assert s["eval_start"] is not None and s["eval_end"] is not None
    assert s["eval_end"]["sequences"] == held_out

