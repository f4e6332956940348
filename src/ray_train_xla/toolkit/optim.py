"""Model and optimizer helpers: start every worker from rank 0's parameters, average gradients.

On accelerators (and a single CPU worker) gradient averaging is torch_xla's own
(``xm.optimizer_step`` semantics: an all-reduce traced into the step graph). With several CPU
workers torch_xla cannot reduce across processes, so the gradients are reduced through the gloo
group in buckets: each bucket is flattened on the XLA device and crosses to the host once.

Under SPMD on an accelerator the gradients are global tensors that XLA has already reduced over
the mesh: nothing is averaged again and nothing crosses to the host.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator

import torch

from ray_train_xla.toolkit import device as _device
from ray_train_xla.toolkit.collectives import broadcast
from ray_train_xla.toolkit.device import get_device
from ray_train_xla.toolkit.device import sync as _sync  # optimizer_step has a `sync` argument
from ray_train_xla.toolkit.ranks import spmd_global, uses_host_collectives, world_size
from ray_train_xla.toolkit.sharding import refuse_sharded

DEFAULT_BUCKET_MB = 25.0
SHARDED_STEP = ("optimizer.step() followed by torch_xla.sync(): with SPMD/FSDPv2 (prepare_sharded_model) "
                "XLA reduce-scatters the gradients in the step graph, and torch_xla FSDP reduces them in "
                "backward")


def _buckets(tensors: Iterable[torch.Tensor], bucket_mb: float) -> Iterator[list[torch.Tensor]]:
    """Group tensors of the same dtype into buckets of at most ``bucket_mb`` (one tensor may exceed)."""
    cap = max(1, int(bucket_mb * 1024 * 1024))
    open_buckets: dict[torch.dtype, tuple[list[torch.Tensor], int]] = {}
    for t in tensors:
        bucket, size = open_buckets.get(t.dtype, ([], 0))
        nbytes = t.numel() * t.element_size()
        if bucket and size + nbytes > cap:
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        open_buckets[t.dtype] = (bucket, size + nbytes)
    for bucket, _ in open_buckets.values():
        if bucket:
            yield bucket


def _flatten(bucket: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1) for t in bucket])


def _unflatten_into(flat: torch.Tensor, bucket: list[torch.Tensor]) -> None:
    offset = 0
    for t in bucket:
        n = t.numel()
        t.copy_(flat[offset:offset + n].view_as(t))
        offset += n


@torch.no_grad()
def prepare_model(model: torch.nn.Module, bucket_mb: float = DEFAULT_BUCKET_MB) -> torch.nn.Module:
    """Move ``model`` to this worker's XLA device and give every worker rank 0's parameters
    and buffers (so workers agree even when their random initialisation differed).


    Under SPMD on an accelerator each host feeds its own copy into the global tensors, so the
    copies are made equal on the host (through the gloo group) before the move.

    Raises ShardedStateError for a sharded model (see ``prepare_sharded_model``)."""
    refuse_sharded(model, "prepare_model", "copies rank 0's parameters and buffers into every worker")
    many = world_size() > 1
    if many and spmd_global():
        model = model.cpu()
        tensors = [t for t in (*model.parameters(), *model.buffers()) if t.numel() > 0]
        for bucket in _buckets(tensors, bucket_mb):
            _unflatten_into(broadcast(_flatten(bucket), src=0), bucket)
        return model.to(get_device())
    model = model.to(get_device())
    if many:
        tensors = [t for t in (*model.parameters(), *model.buffers()) if t.numel() > 0]
        for bucket in _buckets(tensors, bucket_mb):
            _unflatten_into(broadcast(_flatten(bucket), src=0), bucket)
        _sync()
    return model


def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        p.grad for group in optimizer.param_groups for p in group["params"]
        if p.grad is not None and p.grad.numel() > 0
    ]


# Optimizers whose parameters were checked for sharding, with their parameter count then: the
# check walks every parameter, so it runs again only when the parameters change, not every step.
_checked: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _refuse_sharded_params(optimizer: torch.optim.Optimizer) -> None:
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    if _checked.get(optimizer) == count:
        return
    params = {f"param_groups[{g}].params": group["params"] for g, group in enumerate(optimizer.param_groups)}
    refuse_sharded(params, "optimizer_step", "averages every gradient over all workers", use=SHARDED_STEP)
    _checked[optimizer] = count


def reduce_gradients(optimizer: torch.optim.Optimizer, bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
    """Average the gradients of ``optimizer``'s parameters over all workers, in place.

    Raises ShardedStateError when a parameter is sharded (XLA reduces those gradients itself)."""
    _refuse_sharded_params(optimizer)
    n = world_size()
    if n == 1 or spmd_global():  # one worker, or XLA reduces over the mesh: nothing to average
        return
    with torch.no_grad():
        _reduce(optimizer, n, bucket_mb)


def _reduce(optimizer: torch.optim.Optimizer, n: int, bucket_mb: float) -> None:
    if not (uses_host_collectives() or _device.is_native()):
        import torch_xla.core.xla_model as xm

        xm.reduce_gradients(optimizer)
        return
    import torch.distributed as dist

    buckets = list(_buckets(_gradients(optimizer), bucket_mb))
    flats = [_flatten(b) for b in buckets]
    # One execution computes the backward pass and every flattened bucket; the copies to the
    # host below are then plain transfers, one per bucket.
    _sync()
    for bucket, flat in zip(buckets, flats):
        host = flat.to(_device.comm_device(flat))
        dist.all_reduce(host, op=dist.ReduceOp.SUM)
        host.div_(n)
        _unflatten_into(host.to(flat.device), bucket)


def optimizer_step(
    optimizer: torch.optim.Optimizer,
    sync: bool = True,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    **step_kwargs,
):
    """Average gradients across workers, run ``optimizer.step()`` and (``sync``) cut the graph.

    Use it in place of ``optimizer.step()`` for replicated models; returns what ``step()``
    returns. ``bucket_mb`` bounds the size of each host transfer on the CPU (gloo) path, which
    always cuts the graph before reducing, whatever ``sync``.
    """
    reduce_gradients(optimizer, bucket_mb=bucket_mb)
    result = optimizer.step(**step_kwargs)
    if sync:
        _sync()
    return result
