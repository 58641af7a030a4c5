"""transformers' BertForPreTraining on bertctl's shards: the baseline of the pretraining race.

The setup ``bertctl bench model --compare hf`` uses: ``transformers.BertForPreTraining`` with SDPA
attention, bf16 autocast, fused AdamW; the same recipe as ``bertctl pretrain``: AdamW betas (0.9,
0.999), eps 1e-6, weight decay 0.01 off biases and LayerNorm weights, linear warm-up over 6% of the
steps then linear decay to 0, gradient clipping at 1.0, dropout 0.1, initialisation N(0, 0.02).
Batches are the ones ``bertctl pretrain`` draws with the same ``--seed`` (``PretrainingData.batches``,
padding trimmed to the longest row as a padding collator does); masked-LM labels go to every
position as transformers expects (-100 where nothing is masked), so the MLM head runs on every
token, as it does in transformers.

Held-out evaluation is bertctl's: the first ``--eval-batches`` batches of the held-out split with
their fixed masks, MLM accuracy over masked positions and NSP accuracy.

``--minutes`` plans the run like ``bertctl pretrain --minutes``: the pace is measured over the
first steps (after a few launch warm-up steps), then the step count is fixed so that the schedule
ends at lr 0 inside the time box (a user picking --max-steps for a budget would do the same).

    python benchmarks/convergence/hf_pretrain.py --data DATA -o OUT --model-size medium \\
        --batch-size 128 --minutes 5 --eval-every 500
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bertctl.bench import harness  # noqa: E402
from bertctl.bench.model import hf_model  # noqa: E402
from bertctl.config import BertConfig  # noqa: E402
from bertctl.data import PretrainingData  # noqa: E402
from bertctl.data.batching import pretraining_batches, trim  # noqa: E402
from bertctl.train.pretrain import PRESET_LR  # noqa: E402

IGNORE = -100
CALIBRATION_STEPS = 40  # steps 10..40 give the pace for --minutes
PLAN_SHARE = 0.97        # of the time left after calibration (evaluations accounted for separately)


def hf_labels(batch: dict) -> torch.Tensor:
    """(B, P) masked positions/labels -> (B, S) labels, -100 where nothing is predicted."""
    ids, pos, lab = batch["input_ids"], batch["masked_positions"], batch["masked_lm_labels"]
    out = torch.full_like(ids, IGNORE)
    valid = lab != IGNORE
    rows = torch.arange(ids.shape[0])[:, None].expand_as(pos)
    out[rows[valid], pos[valid]] = lab[valid]
    return out


def to_hf(batch: dict, device) -> dict:
    b = trim(batch)
    return {"input_ids": b["input_ids"].to(device, non_blocking=True),
            "token_type_ids": b["token_type_ids"].to(device, non_blocking=True),
            "attention_mask": b["attention_mask"].to(device, non_blocking=True),
            "labels": hf_labels(b).to(device, non_blocking=True),
            "next_sentence_label": b["next_sentence_label"].to(device, non_blocking=True)}


@torch.no_grad()
def evaluate(model, data: PretrainingData, batch_size: int, n_batches: int, seed: int, device) -> dict:
    """bertctl's held-out evaluation (``Pretraining.evaluate``): the same batches, masks and sums."""
    model.eval()
    n = max(1, min(n_batches, data.steps_per_epoch(batch_size)))
    mlm_sum = mlm_ok = n_masked = nsp_ok = n_seq = 0.0
    for _, batch in zip(range(n), pretraining_batches(data, batch_size, seed=seed, epoch=0)):
        b = to_hf(batch, device)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
            out = model(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"],
                        attention_mask=b["attention_mask"])
        labels = b["labels"]
        sel = labels != IGNORE
        logits = out.prediction_logits[sel].float()
        mlm_sum += float(torch.nn.functional.cross_entropy(logits, labels[sel], reduction="sum"))
        mlm_ok += float((logits.argmax(-1) == labels[sel]).sum())
        n_masked += float(sel.sum())
        nsp_ok += float((out.seq_relationship_logits.argmax(-1) == b["next_sentence_label"]).sum())
        n_seq += labels.shape[0]
    model.train()
    loss = mlm_sum / max(n_masked, 1)
    return {"mlm_loss": loss, "mlm_acc": mlm_ok / max(n_masked, 1), "perplexity": math.exp(min(loss, 80.0)),
            "nsp_acc": nsp_ok / max(n_seq, 1), "masked_tokens": int(n_masked), "sequences": int(n_seq)}


def lr_factor(step: int, warmup: int, total: int, anchor: tuple[int, float] | None = None) -> float:
    """Linear warm-up then linear decay to 0 at ``total``; after a plan whose warm-up is already over,
    decay from ``anchor`` = (step, factor) reached (bertctl's ``Schedule.replan``)."""
    if anchor is not None and step >= anchor[0]:
        return anchor[1] * max(0.0, total - step) / max(1, total - anchor[0])
    if step < warmup:
        return step / max(1, warmup)
    return max(0.0, (total - step) / max(1, total - warmup))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True, type=Path)
    p.add_argument("-o", "--output", required=True, type=Path)
    p.add_argument("--model-size", default="medium")
    p.add_argument("--batch-size", type=int, default=256)
    p.add_argument("--lr", type=float, default=None, help="default: bertctl's preset for --model-size")
    p.add_argument("--warmup-fraction", type=float, default=0.06)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--eval-every", type=int, default=1000)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--log-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    if (a.max_steps is None) == (a.minutes is None):
        p.error("give exactly one of --max-steps and --minutes")
    t_process = time.time()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.backends.cuda.matmul.allow_tf32 = True
    data = PretrainingData(a.data)
    held = PretrainingData(a.data, split="eval")
    lr = a.lr or PRESET_LR[a.model_size]
    torch.manual_seed(a.seed)
    config = BertConfig.preset(a.model_size, vocab_size=data.vocab_size)
    model = hf_model(config, device)
    model.train()
    no_decay = [p_ for n, p_ in model.named_parameters() if n.endswith("bias") or "LayerNorm" in n]
    decay = [p_ for n, p_ in model.named_parameters() if not (n.endswith("bias") or "LayerNorm" in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": a.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999), eps=1e-6, fused=device.type == "cuda")
    a.output.mkdir(parents=True, exist_ok=True)
    log = open(a.output / "metrics.jsonl", "w", encoding="utf-8")

    def emit(**rec):
        rec["time"] = round(time.time(), 3)
        log.write(json.dumps(rec) + "\n")
        log.flush()

    eval_batch = min(a.batch_size, 256)
    total = a.max_steps or 10**9
    warmup = max(1, round(a.warmup_fraction * (a.max_steps or 10_000)))  # provisional until the plan
    emit(event="config", model_size=a.model_size, config=config.to_dict(), batch_size=a.batch_size, lr=lr,
         parameters=sum(p_.numel() for p_ in model.parameters()), torch=torch.__version__,
         transformers=__import__("transformers").__version__,
         device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
         environment=harness.environment(device))
    t_eval = time.perf_counter()
    ev = evaluate(model, held, eval_batch, a.eval_batches, a.seed, device)
    eval_seconds = time.perf_counter() - t_eval
    emit(event="eval", step=0, **ev)
    steps_per_epoch = data.steps_per_epoch(a.batch_size)
    step, train_seconds = 0, 0.0
    losses = []
    pace_mark, anchor = None, None
    epoch = 0
    while step < total:
        for batch in pretraining_batches(data, a.batch_size, seed=a.seed, epoch=epoch):
            if step >= total:
                break
            t0 = time.perf_counter()
            b = to_hf(batch, device)
            for g in opt.param_groups:
                g["lr"] = lr * lr_factor(step, warmup, total, anchor)
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model(**b).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(loss.detach())
            step += 1
            if step % a.log_every == 0 or step in (10, CALIBRATION_STEPS):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                emit(event="train", step=step, loss=float(torch.stack(losses).mean()), lr=opt.param_groups[0]["lr"],
                     train_seconds=train_seconds + time.perf_counter() - t0)
                losses = []
            train_seconds += time.perf_counter() - t0
            if a.minutes is not None and step == 10:
                pace_mark = (step, train_seconds)
            if a.minutes is not None and step == CALIBRATION_STEPS:
                pace = (train_seconds - pace_mark[1]) / (step - pace_mark[0])
                elapsed = time.time() - t_process
                evals_left = lambda n: n // a.eval_every + 1  # noqa: E731
                left = a.minutes * 60 - elapsed
                n_more = int(PLAN_SHARE * left / pace)
                while n_more > 0 and n_more * pace + evals_left(step + n_more) * eval_seconds > PLAN_SHARE * left:
                    n_more = int(n_more * 0.98)
                total = step + max(1, n_more)
                planned = max(1, round(a.warmup_fraction * total))
                if planned <= step:  # the planned warm-up is already over: decay from the lr reached
                    anchor = (step, lr_factor(step, warmup, total))
                warmup = planned
                emit(event="plan", step=step, max_steps=total, warmup_steps=warmup, seconds_per_step=pace)
            if step % a.eval_every == 0 and step < total:
                ev = evaluate(model, held, eval_batch, a.eval_batches, a.seed, device)
                emit(event="eval", step=step, train_seconds=train_seconds, **ev)
        epoch += 1
        if steps_per_epoch == 0:
            break
    ev = evaluate(model, held, eval_batch, a.eval_batches, a.seed, device)
    emit(event="eval", step=step, train_seconds=train_seconds, **ev)
    summary = {"steps": step, "max_steps": total, "warmup_steps": warmup, "lr": lr, "batch_size": a.batch_size,
               "train_seconds": train_seconds, "wall_seconds": time.time() - t_process, "eval_end": ev,
               "final_lr": lr * lr_factor(step, warmup, total, anchor)}
    emit(event="end", **summary)
    (a.output / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
