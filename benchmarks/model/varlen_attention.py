"""Attention on packed mixed-length batches, by kernel, forward and backward of one BERT-Base layer's
attention (12 heads of 64) with dropout, bf16, on ``bench model``'s mixed lengths: FlashAttention's
variable-length kernel (what ``unpadded`` runs), the same with ``max_seqlen`` bounded by the batch's length,
the sequences bin-packed into rows under a block-diagonal mask (memory-efficient and cuDNN kernels), and
cuDNN and the memory-efficient kernel on the padded batch.

    python benchmarks/model/varlen_attention.py -o OUT.json

Each packed kernel is checked against FlashAttention without dropout (output and gradients, on the real
rows); so is cuDNN's ragged (THD) attention, which is checked only: it runs two orders of magnitude slower
(``varlen-attention-cudnn-ragged-h200-a20850c.json``). The FlashAttention cases are also captured and
replayed as a CUDA graph (no host sync inside). Times are ``bertctl.bench.harness.measure``'s medians.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bertctl.bench import harness
from bertctl.bench.model import synthetic_batches
from bertctl.nn.attention import VarlenAttention
from bertctl.nn.packing import Packed, layout


def cudnn_ragged(q, k, v, cu, max_seqlen, dropout_p, scale):
    """cuDNN's attention on (T, nh, hs) with ``cu`` int32 offsets; autograd through aten's own formula."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_seqlen, max_seqlen, True, dropout_p,
                                                   False, False, scale=scale)[0]


def flash(q, k, v, cu, max_seqlen, dropout_p, scale):
    return VarlenAttention.apply(q, k, v, cu, max_seqlen, dropout_p, scale)


def time_ms(fn) -> float:
    """The harness's median milliseconds of ``fn()``."""
    return harness.measure(fn, [()], "cuda", warmup=3, reps=20).median_ms


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-o", "--output")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--dropout", type=float, default=0.1)
    args = ap.parse_args()
    torch.manual_seed(0)
    nh, hs = 12, 64
    scale = 1 / math.sqrt(hs)
    b = synthetic_batches(30522, args.seq, args.batch, 1, seed=args.seq, mixed=True)[0]
    mask = b["attention_mask"].bool()
    packed = Packed.from_layout(layout(b["attention_mask"]).cuda(), mask.cuda())
    lengths = mask.sum(1)
    cu_tight = packed.cu_seqlens
    T = packed.pack_index.shape[0]
    rows = {"device": harness.environment("cuda"), "batch": args.batch, "seq": args.seq, "packed_rows": T,
            "real_tokens": int(lengths.sum()), "max_seqlen_layout": packed.max_seqlen,
            "dropout": args.dropout, "cases": []}
    q, k, v = (torch.randn(T, nh, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    go = torch.randn(T, nh, hs, device="cuda", dtype=torch.bfloat16)

    def step(fn, max_seqlen, p):
        def run():
            out = fn(q, k, v, cu_tight, max_seqlen, p, scale)
            out.backward(go)
        return run

    # the reference: FlashAttention, no dropout
    ref = flash(q, k, v, cu_tight, packed.max_seqlen, 0.0, scale)
    ref_g = torch.autograd.grad(ref, (q, k, v), go)
    graphs = []
    for name, fn, max_seqlen in (("flash", flash, packed.max_seqlen), ("flash-seq-bound", flash, args.seq)):
        row = {"kernel": name, "max_seqlen": max_seqlen}
        try:
            out = fn(q, k, v, cu_tight, max_seqlen, 0.0, scale)
            g = torch.autograd.grad(out, (q, k, v), go)
            real = slice(0, int(lengths.sum()))
            row["max_abs_diff_out"] = float((out - ref)[real].abs().max())
            row["max_abs_diff_grad"] = [float((a - r)[real].abs().max()) for a, r in zip(g, ref_g)]
            row["max_abs_grad"] = [float(r[real].abs().max()) for r in ref_g]
            row["fwd_bwd_ms"] = round(time_ms(step(fn, max_seqlen, args.dropout)), 4)
            with torch.no_grad():
                row["fwd_ms"] = round(time_ms(lambda: fn(q, k, v, cu_tight, max_seqlen, args.dropout, scale)), 4)
            graphs.append((row, fn, max_seqlen))
        except Exception as e:  # a kernel that refuses these shapes: record why, time the rest
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows["cases"].append(row)
        print(json.dumps(row), flush=True)
    # without the dummy sequence: the real tokens alone
    n = int(lengths.sum())
    qs, ks, vs = (t.detach()[:n].clone().requires_grad_() for t in (q, k, v))
    cu_real = cu_tight[:-1].contiguous()
    for name, fn in (("flash-nodummy", flash), ("cudnn-ragged-nodummy", cudnn_ragged)):
        out = fn(qs, ks, vs, cu_real, args.seq, 0.0, scale)
        g = torch.autograd.grad(out, (qs, ks, vs), go[:n])
        row = {"kernel": name, "max_abs_diff_out": float((out - ref[:n]).abs().max()),
               "max_abs_diff_grad": [float((a - r[:n]).abs().max()) for a, r in zip(g, ref_g)]}
        rows["cases"].append(row)
        print(json.dumps(row), flush=True)
    # the sequences packed into rows of ``seq`` (first fit, longest first) with a block-diagonal mask
    S = args.seq
    order = sorted(range(len(lengths)), key=lambda i: -int(lengths[i]))
    free, place = [], {}
    for i in order:
        L = int(lengths[i])
        for b_, room in enumerate(free):
            if room >= L:
                place[i] = (b_, S - room)
                free[b_] -= L
                break
        else:
            place[i] = (len(free), 0)
            free.append(S - L)
    nb = len(free)
    seg = torch.full((nb, S), -1, dtype=torch.long)
    slot = torch.empty(n, dtype=torch.long)  # flat real row -> its slot in (nb * S)
    starts = cu_real.cpu().tolist()
    for i in range(len(lengths)):
        b_, o = place[i]
        L = int(lengths[i])
        seg[b_, o:o + L] = i
        slot[starts[i]:starts[i] + L] = b_ * S + torch.arange(o, o + L)
    seg = seg.cuda()
    slot = slot.cuda()
    bmask = ((seg[:, :, None] == seg[:, None, :]) & (seg[:, None, :] >= 0))[:, None]  # (nb, 1, S, S)
    bmask = bmask | torch.eye(S, dtype=torch.bool, device="cuda")  # empty slots attend to themselves
    rows["bins"] = nb
    rows["bin_fill"] = round(n / (nb * S), 4)

    def binned(t):  # (n, nh, hs) real rows -> (nb, nh, S, hs)
        out = t.new_zeros(nb * S, nh, hs).index_copy(0, slot, t)
        return out.view(nb, S, nh, hs).transpose(1, 2)

    for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        row = {"kernel": f"binned-{backend.lower()}", "bins": nb}
        try:
            qb, kb, vb = (binned(t.detach()[:n]).detach().requires_grad_() for t in (q, k, v))
            gob = binned(go[:n])
            with sdpa_kernel(getattr(SDPBackend, backend)):
                out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bmask, scale=scale)
                g = torch.autograd.grad(out, (qb, kb, vb), gob)
                back = lambda x: x.transpose(1, 2).reshape(nb * S, nh, hs).index_select(0, slot)
                row["max_abs_diff_out"] = float((back(out) - ref[:n]).abs().max())
                row["max_abs_diff_grad"] = [float((back(a) - r[:n]).abs().max()) for a, r in zip(g, ref_g)]

                def run():
                    F.scaled_dot_product_attention(qb, kb, vb, attn_mask=bmask, dropout_p=args.dropout,
                                                   scale=scale).backward(gob)
                row["fwd_bwd_ms"] = round(time_ms(run), 4)
        except Exception as e:
            row["error"] = f"{type(e).__name__}: {e}"[:300]
        rows["cases"].append(row)
        print(json.dumps(row), flush=True)
    # the padded batch through SDPA (cuDNN, as the padded step runs), for scale
    S = mask.shape[1]
    qp, kp, vp = (torch.randn(args.batch, nh, S, hs, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(3))
    gop = torch.randn_like(qp)
    am = mask.cuda()[:, None, None, :]
    for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        with sdpa_kernel(getattr(SDPBackend, backend)):
            def run():
                F.scaled_dot_product_attention(qp, kp, vp, attn_mask=am, dropout_p=args.dropout).backward(gop)
            try:
                row = {"kernel": f"padded-{backend.lower()}", "fwd_bwd_ms": round(time_ms(run), 4)}
            except Exception as e:
                row = {"kernel": f"padded-{backend.lower()}", "error": f"{type(e).__name__}: {e}"[:300]}
        rows["cases"].append(row)
        print(json.dumps(row), flush=True)
    for row, fn, max_seqlen in graphs:  # last: a failed capture leaves the generator unusable
        try:
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                fn(qg, kg, vg, cu_tight, max_seqlen, args.dropout, scale).backward(go)
            torch.cuda.current_stream().wait_stream(s)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                fn(qg, kg, vg, cu_tight, max_seqlen, args.dropout, scale).backward(go)
            graph.replay()
            torch.cuda.synchronize()
            row["graph"] = True
        except Exception as e:
            row["graph"] = f"{type(e).__name__}: {e}"[:200]
        print(row["kernel"], "graph", row["graph"], flush=True)
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
