"""Where a fine-tuning step's time goes on the host: the real engine step on real SST-2 batches.

    python benchmarks/finetune/profile_step.py --vocab VOCAB --sst2 TRAIN.tsv [--size base] [--attn unpadded] [--compile]
    python benchmarks/finetune/profile_step.py --vocab VOCAB --squad DEV.json --articles split.json:train --cuda-graphs
    torchrun --nproc-per-node 2 benchmarks/finetune/profile_step.py --vocab VOCAB --sst2 TRAIN.tsv \
        --config MODEL/config.json --attn sdpa --cuda-graphs --batch-size 64 -o OUT.json   # OUT.rank1.json too

Builds the ``--size`` architecture (random weights) with a 2-label head (with ``--squad``, a span head
over SQuAD's 384-token windows), the one training engine
(``Engine.train_step``: bf16 autocast, fused AdamW, clipping) and the fine-tuning loader's batches of
32 (random order, pinned, prefetched), then, after a warm-up, reports per step: the wall time
(synchronised over ``--steps`` steps), the host time spent issuing the step (``train_step`` returns
before the GPU finishes, so host time close to the wall time means the host is the bottleneck), the
CUDA kernels launched, the host-device synchronisations (``cudaStreamSynchronize``,
``cudaDeviceSynchronize``, device-to-host copies) and the operators with the most host time. JSON
on stdout (``-o`` writes it too).

With ``--cuda-graphs`` each step replays as the engine's whole-step graph; the warm-up steps capture
the shapes (their host time, split into the eager warm-up, the recording and the instantiation, is
reported), and the timed steps replay. Under ``torchrun`` every rank takes its slice of the global
``--batch-size`` (the graphs then hold the gradient all-reduces); the report adds the GPU's busy time
per step (the union of its kernels' spans), the NCCL kernels' time and the part of it that no other
kernel overlaps, per rank.
"""
from __future__ import annotations

import argparse
import contextlib
import collections
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bertctl.config import MIN_SHAPE_STEPS, BertConfig, TrainConfig  # noqa: E402
from bertctl.data.batching import Prefetcher, steps_per_epoch, task_batches  # noqa: E402
from bertctl.model import BertForQuestionAnswering, BertForSequenceClassification  # noqa: E402
from bertctl.nn.attention import varied_shapes  # noqa: E402
from bertctl.tasks import squad  # noqa: E402
from bertctl.tasks.glue import featurize, read_glue_tsv, task_spec  # noqa: E402
from bertctl.tasks.trainer import TaskObjective, label_loss, span_loss  # noqa: E402
from bertctl.text.wordpiece import BertTokenizer  # noqa: E402
from bertctl.runtime import resolve  # noqa: E402
from bertctl.train import distributed  # noqa: E402
from bertctl.train.engine import Engine  # noqa: E402
from bertctl.bench import harness  # noqa: E402
from bertctl.io import write_json  # noqa: E402



def main() -> distributed.Dist:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", required=True, help="vocab.txt (uncased WordPiece)")
    data = ap.add_mutually_exclusive_group(required=True)
    data.add_argument("--sst2", help="SST-2 train.tsv")
    data.add_argument("--squad", help="a SQuAD v1.1 file (its windows of --max-seq-length, stride 128)")
    ap.add_argument("--articles", default=None, help="with --squad: SPLIT.json:KEY, the articles to take")
    ap.add_argument("--max-seq-length", type=int, default=None, help="default: 128 for SST-2, 384 for SQuAD")
    ap.add_argument("--size", default="base")
    ap.add_argument("--config", type=Path, default=None, help="a model's config.json (instead of --size)")
    ap.add_argument("--batch-size", type=int, default=32, help="the global batch")
    ap.add_argument("--cuda-graphs", action="store_true", help="the engine's whole-step CUDA graphs")
    ap.add_argument("--attn", default="unpadded", help="sdpa, explicit or unpadded")
    ap.add_argument("--dropout-masks", default="torch", help="torch (fine-tuning's default) or fused")
    ap.add_argument("--cudnn-attention", action="store_true",
                    help="let SDPA pick cuDNN's attention (fine-tuning turns it off: a plan per batch shape)")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--compile-mode", default=None,
                    help="torch.compile's mode for the model (e.g. reduce-overhead: CUDA graphs, one per batch shape)")
    ap.add_argument("--examples", type=int, default=8192)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--rows", type=int, default=25)
    ap.add_argument("--device", default="cuda", help="cuda (what this is for) or cpu (a smoke test)")
    ap.add_argument("-o", "--output", type=Path)
    a = ap.parse_args()

    tok = BertTokenizer.from_vocab_file(a.vocab)
    if a.squad:
        scfg = squad.SquadConfig(max_seq_length=a.max_seq_length or 384)
        feats = squad.featurize(squad.read_squad(a.squad, articles=a.articles, training=True), tok, scfg,
                                training=True)[: a.examples]
        head = BertForQuestionAnswering
    else:
        spec = task_spec("sst2")
        examples = read_glue_tsv(a.sst2, spec)[0][: a.examples]
        feats = featurize(examples, tok, spec, max_seq_length=a.max_seq_length or 128)
        head = BertForSequenceClassification
    over = dict(vocab_size=len(tok.vocab), num_labels=2)
    config = BertConfig.from_json_file(a.config, **over) if a.config else BertConfig.preset(a.size, **over)
    torch.manual_seed(0)
    model = head(config)
    dist = distributed.setup(a.device)
    device = dist.device
    cuda = device.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    total = a.warmup + 2 * a.steps + 2
    cfg = TrainConfig(batch_size=a.batch_size, lr=5e-5, warmup_steps=10, seed=0, show_progress=False)
    runtime = resolve(str(device), "bf16" if cuda else "fp32", attn=a.attn, dropout_masks=a.dropout_masks,
                      compile=a.compile, cuda_graphs=bool(a.cuda_graphs))
    model.set_runtime(runtime)
    engine = Engine(cfg, runtime, model, TaskObjective(span_loss if a.squad else label_loss), dist=dist, max_steps=total, compile_dynamic=True)
    if a.compile_mode:  # the engine's compile with another mode (what the engine would need to offer)
        engine.step_model = torch.compile(engine.model, dynamic=True, mode=a.compile_mode)
        step = engine.train_step

        def train_step(sb, stats):
            torch.compiler.cudagraph_mark_step_begin()  # a new iteration: earlier graph outputs may be overwritten
            return step(sb, stats)
        engine.train_step = train_step
    per_epoch = steps_per_epoch(len(feats), a.batch_size, dist.world_size)
    batches = Prefetcher(task_batches(feats, a.batch_size, seed=0, start_step=0, steps_per_epoch=per_epoch,
                                      group_by_length=False, rank=dist.rank, world_size=dist.world_size,
                                      max_steps=total, min_shape_steps=MIN_SHAPE_STEPS if a.cuda_graphs else None,
                                      pack=a.attn == "unpadded", fixed_length=a.cuda_graphs),
                         lambda sb: sb, pin=cuda)
    stats = torch.zeros(1, device=device)
    shapes = contextlib.nullcontext() if a.cudnn_attention else varied_shapes()
    shapes.__enter__()
    t_warm = time.perf_counter()
    for _ in range(a.warmup):
        engine.train_step(next(batches), stats)
    sync()
    t_warm = time.perf_counter() - t_warm
    graphs_warm = engine.graphs.summary() if engine.graphs is not None else None

    host = []
    t0 = time.perf_counter()
    for _ in range(a.steps):
        sb = next(batches)
        h = time.perf_counter()
        engine.train_step(sb, stats)
        host.append(time.perf_counter() - h)
    sync()
    wall = (time.perf_counter() - t0) / a.steps

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
        for _ in range(a.steps):
            engine.train_step(next(batches), stats)
        sync()
    batches.close()
    shapes.__exit__(None, None, None)
    out = {"what": "fine-tuning step host profile", "task": "squad" if a.squad else "sst2",
           "size": str(a.config) if a.config else a.size, "attn": a.attn,
           "dropout_masks": a.dropout_masks, "cudnn_attention": a.cudnn_attention, "compile": a.compile_mode or a.compile, "cuda_graphs": a.cuda_graphs, "batch_size": a.batch_size,
           "rank": dist.rank, "world_size": dist.world_size,
           "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
           "environment": harness.environment(device),
           "examples": len(feats), "mean_tokens": sum(len(f["input_ids"]) for f in feats) / len(feats),
           "warmup_steps": a.warmup, "warmup_seconds": t_warm, "graphs_after_warmup": graphs_warm,
           "graphs_at_end": engine.graphs.summary() if engine.graphs is not None else None,
           "wall_ms_per_step": wall * 1e3, "host_issue_ms_per_step": sum(host) / len(host) * 1e3,
           **gpu_timeline(prof, a.steps), **harness.profile_summary(prof, a.steps, "step", a.rows)}
    output = a.output
    if output is not None and dist.rank:
        output = output.with_suffix(f".rank{dist.rank}.json")
    if dist.is_main:
        print(json.dumps(out, indent=1))
    if output is not None:
        write_json(output, out, indent=1)
    return dist


def gpu_timeline(prof, steps: int) -> dict:
    """The GPU's busy time per step (the union of its kernels' spans, so that kernels on several
    streams count once), the NCCL kernels' own time and the part of it no other kernel overlaps, from
    a trace of ``steps`` steps."""
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start)

    def union(intervals) -> float:
        total, end = 0.0, float("-inf")
        for lo, hi, _ in intervals:
            if hi > end:
                total += hi - max(lo, end)
                end = hi
        return total

    busy = union(spans)
    compute = union([s for s in spans if "nccl" not in s[2].lower()])
    nccl = sum(hi - lo for lo, hi, name in spans if "nccl" in name.lower())
    window = (spans[-1][1] - spans[0][0]) if spans else 0.0
    by_name = collections.Counter()
    for lo, hi, name in spans:
        by_name[name] += hi - lo
    return {"gpu_busy_ms_per_step": busy / 1e3 / steps, "gpu_span_ms_per_step": window / 1e3 / steps,
            "nccl_kernel_ms_per_step": nccl / 1e3 / steps,
            "nccl_alone_ms_per_step": (busy - compute) / 1e3 / steps,
            "top_kernels_ms_per_step": {name[:160]: round(us / 1e3 / steps, 4) for name, us in by_name.most_common(30)}}


if __name__ == "__main__":
    # Leave the process group after main returns, its engine unreachable, as finetune does: left from inside
    # main, with the engine's CUDA graphs (which hold NCCL collectives) alive, both ranks hung (2 H100s).
    distributed.teardown(main(), synchronize=False)
