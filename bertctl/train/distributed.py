"""Process-group setup for ``torchrun`` and the few collectives training needs.

One process per GPU (NCCL) or per CPU process (gloo).  Without ``torchrun``'s
environment (``WORLD_SIZE`` unset or 1) everything here is a no-op and training
runs as a plain single process.
"""
from __future__ import annotations

import gc
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class Dist:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup(device: str | None = None) -> Dist:
    """Join the process group that ``torchrun`` describes; pick this rank's device.

    ``device``: "cpu", "cuda" or None (CUDA when available).  GPUs use NCCL, CPUs gloo.
    """
    want_cuda = torch.cuda.is_available() if device is None else device.startswith("cuda")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if want_cuda:
        dev = torch.device("cuda", local % max(1, torch.cuda.device_count()))
        torch.cuda.set_device(dev)
    else:
        dev = torch.device("cpu")
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if want_cuda else "gloo"
        kwargs = {"device_id": dev} if want_cuda else {}
        dist.init_process_group(backend=backend, **kwargs)
    return Dist(rank=rank, world_size=world, local_rank=local, device=dev)


def teardown(d: Dist, synchronize: bool = True) -> None:
    """Leave the process group.  After a clean run every rank waits for the others first: a rank
    that destroys its group while a peer is still in a collective (rank 0 writing the final
    checkpoint, say) can abort that peer inside gloo.  Unreachable objects that still hold the
    group (a DistributedDataParallel model in a reference cycle) are collected first: freed at
    interpreter exit instead, their gloo work aborts the process."""
    if d.enabled and dist.is_initialized():
        gc.collect()
        if synchronize:
            dist.barrier()
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, d: Dist) -> torch.Tensor:
    """In-place sum over ranks (asynchronous on GPU: no host sync)."""
    if d.enabled:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def gather_to_main(obj, d: Dist) -> list | None:
    """Every rank's ``obj`` as a list on rank 0 (None elsewhere)."""
    if not d.enabled:
        return [obj]
    out = [None] * d.world_size if d.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def all_gather_objects(obj, d: Dist) -> list:
    """Every rank's ``obj`` (pickled), in rank order, on every rank."""
    if not d.enabled:
        return [obj]
    out = [None] * d.world_size
    dist.all_gather_object(out, obj)
    return out


def broadcast_parameters(model: torch.nn.Module, d: Dist) -> None:
    """Rank 0's parameters and buffers on every rank (what DDP does when it wraps a model)."""
    if d.enabled:
        with torch.no_grad():
            for t in (*model.parameters(), *model.buffers()):
                dist.broadcast(t.data, src=0)


def flat_gradients(model: torch.nn.Module) -> torch.Tensor:
    """One zeroed buffer that every trainable parameter's ``.grad`` is a view of, so that one
    all-reduce averages them all (backward accumulates into existing gradients in place)."""
    params = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in params}
    if len(dtypes) != 1:
        raise ValueError(f"one gradient buffer needs one parameter dtype, not {sorted(map(str, dtypes))}")
    flat = torch.zeros(sum(p.numel() for p in params), dtype=dtypes.pop(), device=params[0].device)
    offset = 0
    for p in params:
        p.grad = flat[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    return flat


def ddp_options() -> dict:
    """``BERTCTL_DDP``, comma-separated: ``bucket_mb=N``, the all-reduce bucket size in MB (absent:
    the default), and ``reduce=fp32|bf16``, the dtype the gradients travel in (absent: the default)."""
    from bertctl.errors import BertctlError

    out: dict = {}
    for opt in filter(None, (s.strip() for s in os.environ.get("BERTCTL_DDP", "").split(","))):
        key, _, value = opt.partition("=")
        if key == "bucket_mb":
            out["bucket_mb"] = float(value)
        elif key == "reduce" and value in REDUCE_DTYPES:
            out["reduce"] = value
        else:
            raise BertctlError(f"BERTCTL_DDP: unknown option {opt!r} (known: bucket_mb=N, reduce=fp32|bf16)")
    return out


#: The dtypes gradients may travel in between ranks.
REDUCE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class GradientReducer:
    """Sums the flat gradient buffer (``flat_gradients``) over ranks in a form a CUDA graph can hold,
    overlapped with backward as DDP's buckets are. The engine's loss scales carry the 1 / world size
    that makes the sum a mean, so no division runs here.

    - Dense buckets of about ``bucket_mb`` MB, contiguous in the buffer and taken from its end (the
      last layers' gradients are ready first): each bucket's all-reduce starts, asynchronously, once
      backward has accumulated every parameter in it, and always in bucket order, so that every rank
      issues the same collectives in the same order. Parameters that got no gradient in the first
      step (a pooler the task does not use) are not waited for after it; a bucket backward has not
      started by the end is started then.
    - The word embeddings, when untied (fine-tuning), are summed on the rows the step's input ids
      touch and nowhere else: their gradient is zero on every other row of every rank. Every rank
      knows every rank's ids from the global batch (``StepBatch.every_ids``), so only the touched
      rows are all-reduced, not the whole vocabulary: for MiniLM half the gradient bytes, and the
      last gradient backward produces, which no bucket could overlap.

    ``bucket_mb=0`` is one all-reduce of the whole buffer after backward (no overlap, no rows).
    ``reduce_dtype`` (bf16 for an fp32 buffer) sends each bucket and the rows as a copy in that dtype,
    summed there and copied back: half the bytes on the wire. Under bf16 autocast the weights'
    gradients are bf16 products already; what rounds is the sum over ranks and micro-batches.
    ``arm()`` before the last micro-batch's backward (earlier ones only accumulate); ``finish()``
    after it. The result is that of summing the whole buffer over ranks, which the tests compare with.
    """

    def __init__(self, model: torch.nn.Module, flat: torch.Tensor, d: Dist, *, bucket_mb: float = 25.0,
                 reduce_dtype: torch.dtype | None = None):
        self.d, self.flat = d, flat
        self.wire = None if reduce_dtype in (None, flat.dtype) else torch.empty_like(flat, dtype=reduce_dtype)
        self.armed = False
        self.rows: torch.nn.Parameter | None = None
        self.buckets: list[tuple[int, int]] = []
        if bucket_mb <= 0:
            return
        emb = next((m for n, m in model.named_modules()
                    if n.endswith("word_embeddings") and isinstance(m, torch.nn.Embedding)), None)
        if emb is not None and emb.weight.requires_grad and \
                sum(p is emb.weight for _, p in model.named_parameters(remove_duplicate=False)) == 1:
            self.rows = emb.weight
        cap = max(1, int(bucket_mb * 2 ** 20 / flat.element_size()))
        spans: list[list] = []  # [start, end, parameters], from the buffer's end
        cut = True
        for p in reversed([p for p in model.parameters() if p.requires_grad]):
            if p is self.rows:
                cut = True
                continue
            lo = (p.grad.data_ptr() - flat.data_ptr()) // flat.element_size()
            last = spans[-1] if spans else None
            if cut or last[1] - lo > cap or lo + p.numel() != last[0]:
                spans.append([lo, lo + p.numel(), []])
                cut = False
            spans[-1][0] = lo
            spans[-1][2].append(p)
        self.buckets = [(lo, hi) for lo, hi, _ in spans]
        members = [ps for _, _, ps in spans]
        self._remaining = [len(m) for m in members]
        self._size = list(self._remaining)
        self._bucket_of = {}
        for b, ps in enumerate(members):
            for p in ps:
                self._bucket_of[p] = b
                p.register_post_accumulate_grad_hook(self._ready)
        self._next = 0
        self._works: list = []
        self._fired: set | None = set()  # the first step's: which parameters get gradients at all
        self._unused: set = set()

    def arm(self) -> None:
        self.armed = True

    def _ready(self, p: torch.Tensor) -> None:
        if not self.armed:
            return
        if self._fired is not None:
            self._fired.add(p)
        elif p in self._unused:  # its bucket may be on the wire already
            raise RuntimeError("a parameter without a gradient in the first step has one now: the gradient "
                               "buckets assume every step uses the same parameters")
        b = self._bucket_of[p]
        self._remaining[b] -= 1
        while self._next < len(self.buckets) and self._remaining[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, b: int) -> None:
        lo, hi = self.buckets[b]
        self._works.append(self._all_reduce(self.flat[lo:hi], None if self.wire is None else self.wire[lo:hi]))

    @staticmethod
    def _all_reduce(t: torch.Tensor, wire: torch.Tensor | None):
        """Start summing ``t`` over ranks, in place, or through ``wire`` (the reduce dtype; ``finish``
        copies it back once waited for); returns the asynchronous work."""
        return dist.all_reduce(t if wire is None else wire.copy_(t), op=dist.ReduceOp.SUM, async_op=True)

    def finish(self, every_ids: torch.Tensor | None = None) -> None:
        """Complete the sum: the buckets backward did not start, then the embedding rows that
        ``every_ids`` (every rank's input ids of the step, the same tensor on every rank) touch, or,
        without it, the whole embedding."""
        if not self.buckets and self.rows is None:
            self._all_reduce(self.flat, self.wire).wait()
            if self.wire is not None:
                self.flat.copy_(self.wire)
            return
        while self._next < len(self.buckets):
            self._launch(self._next)
            self._next += 1
        for (lo, hi), w in zip(self.buckets, self._works):
            w.wait()
            if self.wire is not None:
                self.flat[lo:hi].copy_(self.wire[lo:hi])
        if self.rows is not None:
            grad = self.rows.grad
            touched = grad if every_ids is None else grad.index_select(0, every_ids)
            wire = None if self.wire is None else torch.empty_like(touched, dtype=self.wire.dtype)
            self._all_reduce(touched, wire).wait()
            if every_ids is not None:
                grad.index_copy_(0, every_ids, touched if wire is None else wire.to(grad.dtype))
            elif wire is not None:
                grad.copy_(wire)
        if self._fired is not None and self.armed:  # unused from now on: their buckets need not wait
            self._unused = {p for p in self._bucket_of if p not in self._fired}
            for p in self._unused:
                self._size[self._bucket_of[p]] -= 1
            self._fired = None
        self.armed = False
        self._next = 0
        self._works = []
        self._remaining = list(self._size)


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def wrap_ddp(model: torch.nn.Module, device: torch.device, reduce_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """``model`` in DistributedDataParallel, gradients written straight into the all-reduce buckets,
    sent in ``reduce_dtype`` when it is bf16 (PyTorch's bf16 compression hook).

    ``BERTCTL_DDP=bucket_mb=N`` sets the all-reduce bucket size (PyTorch's default: 25 MB).
    (``static_graph=True`` is not offered: with gradient accumulation it changed the loss of a
    2-process run against one process.)
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    kwargs: dict = {"gradient_as_bucket_view": True}
    bucket_mb = ddp_options().get("bucket_mb")
    if bucket_mb is not None:
        kwargs["bucket_cap_mb"] = bucket_mb
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)
    if reduce_dtype == torch.bfloat16:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import bf16_compress_hook

        ddp.register_comm_hook(None, bf16_compress_hook)
    return ddp
