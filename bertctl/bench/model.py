"""Whole-model benchmark: pretraining-step and encoder-inference throughput, bertctl vs Hugging Face.

Cases (paper sizes, §3): BERT-Base at seq 128 (batch 256) and 512 (batch 32), BERT-Large at 128.
Providers, all on the same synthetic batches, bf16 autocast on a GPU (fp32 on the CPU, where a CPU without
bf16 instructions runs bf16 matmuls many times slower), fused AdamW (no decay on bias / LayerNorm), gradient
clipping at 1.0:

- ``bertctl``: BertForPreTraining with SDPA and the fused ops; the MLM head runs at the masked
  positions only (gathered before the vocabulary projection); batches trimmed to their longest
  sequence; loss sums normalised by host-side counts (no host sync in the step).
- ``bertctl/unpadded``: the same with the ``unpadded`` attention: the encoder on the real
  tokens only and FlashAttention's variable-length kernel, the batches packed on the host as the loader
  packs them (``bertctl.nn.packing.layout``; a batch with < 10% padding runs padded).
- ``bertctl/graphs`` (GPU): ``bertctl pretrain``'s own step, its default on a GPU: the one training
  engine and the pretraining objective (which also counts correct predictions), each step replayed as
  one CUDA graph (``bertctl.train.graphs``), inputs copied from pinned host memory as the loader
  gives them. The model and maths are ``bertctl``'s; the host issues one launch a step instead of
  every kernel. Under torchrun the graph holds the gradient all-reduces too. ``bertctl/unpadded/graphs``:
  the same step on packed batches (one graph per packed size).
- ``hf``: ``transformers.BertForPreTraining(attn_implementation="sdpa")``, labels on all positions
  with -100 elsewhere (as HF's MLM collator makes them), the model's own loss.
- ``+compile``: the same under ``torch.compile``; ``bertctl/torch-ops+compile`` compiles the model
  with plain PyTorch LayerNorm / GELU instead of the fused ops (inductor fuses those itself).
Encoder inference (``model.bert`` forward, no grad) is timed for the eager providers on the first case.

Synthetic data looks like ``build-data`` output: 90% of sequences fill ``max_seq_length`` and
10% are short (the reference's ``short_seq_prob``), 15% of tokens masked (at most
``max_predictions``), random NSP labels.  Throughput is wall-clock over ``steps`` steps after
warm-up (median of 3 repeats).  ``mfu`` counts 6 · parameters · real tokens + attention (the
customary convention), ``mfu_useful`` only the work MLM+NSP needs (bertctl.train.metrics); both
for every provider alike, so MFU ratios equal throughput ratios.
"""
from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Any, Callable

import torch

from bertctl.bench.harness import synchronize
from bertctl.train.metrics import batch_counts, forward_flops, peak_flops, train_flops, train_flops_6nt

CASES: dict[str, tuple[str, int, int]] = {
    "base-128": ("base", 128, 256),
    "base-512": ("base", 512, 32),
    "large-128": ("large", 128, 256),
    "base-mixed": ("base", 128, 256),  # fine-tuning's lengths: see MIXED_CASES
    "tiny-64": ("tiny", 64, 8),  # a smoke case: runs anywhere in seconds
}
# Cases whose lengths are those of fine-tuning data, not pretraining's: log-uniform on [8, seq] (mean 43
# of 128, about 3 padded tokens per real one, as random batches of SST-2 sentences: 3.3).
MIXED_CASES = {"base-mixed"}
MASK_ID, CLS_ID, SEP_ID = 4, 2, 3


def synthetic_batches(vocab_size: int, seq: int, batch: int, n: int, seed: int = 0,
                      short_seq_prob: float = 0.1, mixed: bool = False) -> list[dict[str, torch.Tensor]]:
    """``n`` CPU batches shaped like the loader's, plus ``hf_labels`` (B, S) for Hugging Face. ``mixed``:
    every length log-uniform on [8, seq] instead of pretraining's (``seq``, 10% shorter)."""
    g = torch.Generator().manual_seed(seed)
    max_pred = 4 * math.ceil(0.15 * seq / 4)
    out = []
    for _ in range(n):
        if mixed:
            lengths = torch.exp(torch.empty(batch).uniform_(math.log(8), math.log(seq + 1), generator=g)).long()
            lengths = lengths.clamp(8, seq)
        else:
            short = torch.rand(batch, generator=g) < short_seq_prob
            lengths = torch.where(short, torch.randint(8, seq + 1, (batch,), generator=g), torch.full((batch,), seq))
        s = int(-(-int(lengths.max()) // 8) * 8)
        ids = torch.randint(5, vocab_size, (batch, s), generator=g)
        att = (torch.arange(s)[None] < lengths[:, None]).long()
        tt = torch.zeros(batch, s, dtype=torch.long)
        pos = torch.zeros(batch, max_pred, dtype=torch.long)
        lab = torch.full((batch, max_pred), -100, dtype=torch.long)
        for i, L in enumerate(lengths.tolist()):
            a = L // 2
            ids[i, 0], ids[i, a], ids[i, L - 1] = CLS_ID, SEP_ID, SEP_ID
            ids[i, L:] = 0
            tt[i, a + 1:L] = 1
            cand = torch.tensor([j for j in range(1, L - 1) if j != a])
            k = min(max_pred, max(1, round(0.15 * (L - 3))))
            chosen = cand[torch.randperm(len(cand), generator=g)[:k]].sort().values
            pos[i, :k] = chosen
            lab[i, :k] = ids[i, chosen]
            ids[i, chosen] = MASK_ID
        hf_labels = torch.full((batch, s), -100, dtype=torch.long)
        valid = lab != -100
        hf_labels[torch.arange(batch)[:, None].expand_as(pos)[valid], pos[valid]] = lab[valid]
        out.append({"input_ids": ids, "token_type_ids": tt, "attention_mask": att, "masked_positions": pos,
                    "masked_lm_labels": lab, "next_sentence_label": torch.randint(0, 2, (batch,), generator=g),
                    "hf_labels": hf_labels})
    return out


def bertctl_model(config, device="cpu", runtime=None):
    from bertctl.model import BertForPreTraining

    return BertForPreTraining(config, runtime).to(device)


def hf_model(config, device="cpu"):
    """transformers' BertForPreTraining with the same architecture, SDPA attention."""
    import transformers

    d = {k: v for k, v in config.to_dict().items() if k != "model_type"}
    return transformers.BertForPreTraining(transformers.BertConfig(**d, attn_implementation="sdpa")).to(device)


def step_loss(provider: str, fwd, b: dict) -> torch.Tensor:
    """The pretraining loss of one batch as each provider computes it (mean MLM CE + mean NSP CE)."""
    from bertctl.train.pretrain import pretraining_sums

    if provider.startswith("hf"):
        return fwd(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"],
                   labels=b["hf_labels"], next_sentence_label=b["next_sentence_label"]).loss
    s = pretraining_sums(fwd, b)
    return s["mlm_sum"] / b["n_masked"] + s["nsp_sum"] / b["input_ids"].shape[0]


def _train_step_fn(provider: str, model, opt, device_type: str = "cuda") -> Callable[[dict], None]:
    fwd = torch.compile(model) if provider.endswith("+compile") else model
    params = [p for p in model.parameters() if p.requires_grad]

    def step(b: dict) -> None:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
            loss = step_loss(provider, fwd, b)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def _engine_step_fn(model, cpu_batches: list[dict], gpu_batches: list[dict], dist,
                    max_seq_length: int, pack: bool = False) -> Callable[[dict], None]:
    """``bertctl pretrain``'s step (the ``bertctl/graphs`` provider): the engine with the pretraining
    objective and whole-step CUDA graphs. The step of ``gpu_batches[i]`` trains on ``cpu_batches[i]``
    (pinned), which the engine copies into its graph's input buffers; under torchrun padded to
    ``max_seq_length``, as pretrain pads them there."""
    from bertctl.config import TrainConfig
    from bertctl.runtime import resolve
    from bertctl.train.engine import Engine
    from bertctl.data.batching import PAD_MULTIPLE, pretraining_step
    from bertctl.train.pretrain import PretrainingObjective

    objective = PretrainingObjective()
    batch = int(cpu_batches[0]["input_ids"].shape[0])
    cfg = TrainConfig(batch_size=batch * dist.world_size, lr=1e-4, warmup_steps=0, show_progress=False)
    engine = Engine(cfg, resolve(str(dist.device), "bf16", attn=model.runtime.attn, cuda_graphs=True), model,
                    objective, dist=dist, max_steps=1 << 40)
    keys = ("input_ids", "token_type_ids", "attention_mask", "masked_positions", "masked_lm_labels",
            "next_sentence_label")
    one_length = dist.world_size > 1  # every rank captures and replays the same graphs: one length, as pretrain pads
    steps = {}
    for c, g in zip(cpu_batches, gpu_batches):
        b = {k: c[k] for k in keys}
        if one_length:
            for k in ("input_ids", "token_type_ids", "attention_mask"):
                b[k] = torch.nn.functional.pad(b[k], (0, max_seq_length - b[k].shape[1]))
        steps[id(g)] = pretraining_step({k: v.pin_memory() for k, v in b.items()}, batch,
                                        max_seq_length if one_length else PAD_MULTIPLE, pack and not one_length)
    stats = torch.zeros(len(objective.loss_terms) + len(objective.stat_names), device=dist.device)

    def step(b: dict) -> None:
        engine.train_step(steps[id(b)], stats)

    return step


def _infer_fn(provider: str, model, device_type: str = "cuda") -> Callable[[dict], None]:
    enc = model.bert
    fwd = torch.compile(enc) if provider.endswith("+compile") else enc

    @torch.no_grad()
    def step(b: dict) -> None:
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=device_type == "cuda"):
            fwd(input_ids=b["input_ids"], token_type_ids=b["token_type_ids"], attention_mask=b["attention_mask"],
                packing=b.get("packing"))

    return step


def _time(step: Callable[[dict], None], batches: list[dict], steps: int, warmup: int, device: torch.device,
          repeats: int = 3) -> float:
    """Median seconds per step over ``repeats`` runs of ``steps`` steps (wall clock, synchronised)."""
    for i in range(warmup):
        step(batches[i % len(batches)])
    synchronize(device)
    per_step = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for i in range(steps):
            step(batches[i % len(batches)])
        synchronize(device)
        per_step.append((time.perf_counter() - t0) / steps)
    return statistics.median(per_step)


def bench_model(cases: list[str] | None = None, providers: list[str] | None = None, steps: int = 20,
                warmup: int = 5, inference: bool = True, log: Callable[[str], None] = print,
                compile_cases: list[str] | None = None, device: str = "cuda",
                on_row: Callable[[dict], None] | None = None) -> dict[str, Any]:
    """Time every (case, provider); returns a JSON-able dict (with the harness's device block on rank 0).

    Compiled providers run only for ``compile_cases`` (default: the first case), since each
    compilation costs a minute.  ``on_row(partial_result)`` is called after every measurement
    (the CLI writes the JSON each time, so a run cut short keeps what it measured).
    Under ``torchrun`` (WORLD_SIZE > 1) only ``bertctl`` runs, wrapped in DistributedDataParallel
    with the case batch per GPU, and the result is the global throughput (weak scaling).
    """
    from bertctl.bench.harness import device_block
    from bertctl.config import BertConfig
    from bertctl.runtime import resolve
    from bertctl.train import distributed
    from bertctl.train.optim import build_optimizer

    if device == "cuda" and not torch.cuda.is_available():
        from bertctl.errors import BertctlError

        raise BertctlError("bench model needs a CUDA GPU")
    dist = distributed.setup(device)
    rank, world = dist.rank, dist.world_size
    device = dist.device
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    cases = cases or list(CASES)
    providers = providers or ["bertctl", "hf"]
    if world > 1:
        providers = [p for p in providers if not p.startswith("hf")] or ["bertctl"]
    peak = peak_flops(device)
    compile_cases = compile_cases if compile_cases is not None else cases[:1]
    results, infer_results = [], []
    out: dict[str, Any] = {"benchmark": "model", "steps": steps, "warmup": warmup,
                           "precision": "bf16 autocast" if device.type == "cuda" else "fp32",
                           "peak_bf16_tflops": peak / 1e12 if peak else None, "train": results,
                           "inference": infer_results}
    if rank == 0:
        out["device"] = device_block(device)
    for case in cases:
        size, seq, batch = CASES[case]
        cpu_batches = synthetic_batches(30522, seq, batch, n=8, seed=1000 * rank + seq, mixed=case in MIXED_CASES)
        for b in cpu_batches:
            b["n_masked"] = float((b["masked_lm_labels"] != -100).sum())
        counts = [batch_counts(b) for b in cpu_batches]
        gpu_batches = [{k: (v.to(device) if torch.is_tensor(v) else v) for k, v in b.items()} for b in cpu_batches]
        for provider in providers:
            if provider.endswith("+compile") and case not in compile_cases:
                continue
            torch.manual_seed(0)
            try:
                # "/torch-ops": plain PyTorch LayerNorm / GELU / softmax instead of the fused ops, so
                # that under torch.compile inductor may fuse them with their neighbours.
                kernels = "torch" if "/torch-ops" in provider else "auto"
                attn = ("unpadded" if provider.startswith("bertctl/unpadded")
                        else "explicit" if provider.startswith("bertctl/explicit") else "sdpa")
                conf = BertConfig.preset(size)
                model = (hf_model(conf, device) if provider.startswith("hf")
                         else bertctl_model(conf, device, resolve(str(device), attn=attn, kernels=kernels)))
                config = _config_of(model)
                train_model = opt = None
                batches = gpu_batches
                if attn == "unpadded":  # packed on the host, as the loader packs them
                    from bertctl.nn.packing import layout

                    batches = [dict(g, packing=layout(c["attention_mask"]).to(device))
                               for c, g in zip(cpu_batches, gpu_batches)]
                if provider in ("bertctl/graphs", "bertctl/unpadded/graphs"):
                    step = _engine_step_fn(model, cpu_batches, batches, dist, seq, pack=attn == "unpadded")
                else:
                    train_model = model
                    if world > 1:
                        from bertctl.train.distributed import wrap_ddp

                        train_model = wrap_ddp(model, device)
                    opt = build_optimizer(model, "adamw", lr=1e-4)  # fused (CUDA or CPU)
                    step = _train_step_fn(provider, train_model, opt, device.type)
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                t0 = time.perf_counter()
                sec = _time(step, batches, steps, warmup, device)
                mem = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
                useful = statistics.mean(train_flops(config, *c) for c in counts)
                n_params = sum(p.numel() for p in model.parameters())
                flops = statistics.mean(train_flops_6nt(config, n_params, c[0], c[1]) for c in counts)
                row = {"case": case, "model": size, "seq": seq, "batch_per_gpu": batch, "world_size": world,
                       "provider": provider, "step_ms": round(sec * 1e3, 2),
                       "seq_per_s": round(batch * world / sec, 1),
                       "tokens_per_s": round(statistics.mean(c[0] for c in counts) * world / sec),
                       "model_tflops_per_gpu": round(flops / sec / 1e12, 1),
                       "mfu": round(flops / sec / peak, 4) if peak else None,
                       "mfu_useful": round(useful / sec / peak, 4) if peak else None,
                       "peak_mem_gib": round(mem, 2) if mem is not None else None,
                       "wall_s": round(time.perf_counter() - t0, 1)}
                results.append(row)
                log(f"train {case} {provider}: {row['seq_per_s']} seq/s, MFU {row['mfu']}, {row['peak_mem_gib']} GiB")
                del opt, step, train_model
                if inference and world == 1 and case == cases[0] and not provider.endswith("+compile") \
                        and not provider.endswith("/graphs"):
                    model.eval()
                    f = _infer_fn(provider, model, device.type)
                    sec = _time(f, batches, steps, warmup, device)
                    fl = statistics.mean(forward_flops(config, c[0], c[1], 0, c[3]) for c in counts)
                    irow = {"case": case, "provider": provider, "seq_per_s": round(batch / sec, 1),
                            "step_ms": round(sec * 1e3, 2), "model_tflops": round(fl / sec / 1e12, 1),
                            "mfu": round(fl / sec / peak, 4) if peak else None}
                    infer_results.append(irow)
                    log(f"infer {case} {provider}: {irow['seq_per_s']} seq/s, MFU {irow['mfu']}")
            except Exception as e:  # out of memory, a compile failure: record it, time the rest
                results.append({"case": case, "provider": provider, "error": f"{type(e).__name__}: {e}"[:300]})
                log(f"train {case} {provider}: {type(e).__name__}: {str(e)[:300]}")
            finally:
                model = None
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
                torch._dynamo.reset()
            out["speedups"] = _speedups(results, infer_results)
            if on_row is not None and rank == 0:
                on_row(out)
    distributed.teardown(dist)
    return out


def _config_of(model):
    """The architecture numbers FLOP counting needs, from either implementation's config."""
    return model.config


def _speedups(train: list[dict], infer: list[dict]) -> dict[str, float]:
    sp = {}
    for rows, kind in ((train, "train"), (infer, "infer")):
        by = {(r["case"], r["provider"]): r.get("seq_per_s") for r in rows if r.get("seq_per_s")}
        for (case, prov), v in by.items():
            if not prov.startswith("bertctl"):
                continue
            for ref in ("hf", "hf+compile"):
                if (case, ref) in by:
                    sp[f"{kind} {case} {prov} / {ref}"] = round(v / by[(case, ref)], 3)
    return sp
