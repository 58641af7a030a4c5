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


def broadcast_from_main(obj, d: Dist):
    if not d.enabled:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def barrier(d: Dist) -> None:
    if d.enabled:
        dist.barrier()


def wrap_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """``model`` in DistributedDataParallel, gradients written straight into the all-reduce buckets.

    ``BERTCTL_DDP=bucket_mb=N`` sets the all-reduce bucket size (PyTorch's default: 25 MB).
    (``static_graph=True`` is not offered: with gradient accumulation it changed the loss of a
    2-process run against one process.)
    """
    from torch.nn.parallel import DistributedDataParallel as DDP

    from bertctl.errors import BertctlError

    kwargs: dict = {"gradient_as_bucket_view": True}
    for opt in filter(None, (s.strip() for s in os.environ.get("BERTCTL_DDP", "").split(","))):
        if opt.startswith("bucket_mb="):
            kwargs["bucket_cap_mb"] = float(opt.split("=", 1)[1])
        else:
            raise BertctlError(f"BERTCTL_DDP: unknown option {opt!r} (known: bucket_mb=N)")
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, **kwargs)
