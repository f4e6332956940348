"""Device, ranks and collectives inside the training function, the same on every device.

Which path runs follows from what the backend planned (``RAY_TRAIN_XLA_PG_BACKEND``):

- ``xla`` (Neuron, TPU, or a single CPU worker): torch_xla's own collectives, traced into the
  graph; use them as you would ``xm.all_reduce``.
- ``gloo`` (several CPU workers): torch_xla 2.9 on CPU cannot reduce across processes, so the
  tensor is copied to the host, reduced through the gloo group, and copied back to the XLA
  device. Correct everywhere; each call cuts the graph, so call it per step, not per parameter.

- native (``TorchNeuronConfig``: the ``neuron`` group, or ``gloo`` on CPU): torch.distributed
  on the tensor's own device; torch_xla is not imported.

Raw ``xm.all_reduce`` silently returns the local value with several CPU workers; these helpers
do not.
"""

from __future__ import annotations

import os

import torch

import ray_train_xla.worker.device as _device
from ray_train_xla.runtimes.base import PG_BACKEND_VAR

_XM_OPS = {"sum": "sum", "mean": "sum", "max": "max", "min": "min", "product": "mul"}


def get_device() -> torch.device:
    """This worker's device (XLA; native ``neuron`` or ``cpu`` under TorchNeuronConfig)."""
    return _device.get_device()


def rank() -> int:
    """Global rank of this worker (``RANK``)."""
    return int(os.environ.get("RANK", "0"))


def local_rank() -> int:
    """Rank of this worker among the workers of its node (``LOCAL_RANK``)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def node_rank() -> int:
    """Rank of this worker's node (``GROUP_RANK``)."""
    return int(os.environ.get("GROUP_RANK", "0"))


def world_size() -> int:
    """Number of workers (``WORLD_SIZE``)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def uses_host_collectives() -> bool:
    """True when collectives go through gloo on host copies (several CPU workers)."""
    return os.environ.get(PG_BACKEND_VAR) == "gloo" and world_size() > 1


def _check_op(op: str) -> str:
    if op not in _XM_OPS:
        raise ValueError(f"all_reduce op={op!r} is not valid: expected one of {sorted(_XM_OPS)}")
    return op


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Reduce ``tensor`` over all workers and return the result on ``tensor``'s device.

    ``op`` is "sum", "mean", "max", "min" or "product". The input is not modified.
    """
    _check_op(op)
    n = world_size()
    if n == 1:
        return tensor.clone()
    if uses_host_collectives() or _device.is_native():
        import torch.distributed as dist

        gloo_op = {
            "sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
            "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT,
        }[op]
        host = tensor.detach().to(_device.comm_device(tensor), copy=True)
        dist.all_reduce(host, op=gloo_op)
        if op == "mean":
            host = host / n
        return host.to(tensor.device)
    import torch_xla.core.xla_model as xm

    return xm.all_reduce(_XM_OPS[op], tensor, scale=1.0 / n if op == "mean" else 1.0)


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Return worker ``src``'s value of ``tensor`` on every worker (on ``tensor``'s device)."""
    n = world_size()
    if not 0 <= src < n:
        raise ValueError(f"broadcast src={src} is not valid: expected a rank in [0, {n})")
    if n == 1:
        return tensor.clone()
    if uses_host_collectives() or _device.is_native():
        import torch.distributed as dist

        host = tensor.detach().to(_device.comm_device(tensor), copy=True)
        dist.broadcast(host, src=src)
        return host.to(tensor.device)
    import torch_xla.core.xla_model as xm

    out = tensor.clone()
    xm.collective_broadcast([out], root_ordinal=src)
    return out


def rendezvous(tag: str) -> None:
    """Block until every worker reaches the rendezvous named ``tag``.

    Bounded by ``TorchXLAConfig.timeout_s`` on the gloo path (the process group's timeout).
    """
    if world_size() == 1:
        return
    if uses_host_collectives() or _device.is_native():
        import torch.distributed as dist

        dist.barrier()
        return
    import torch_xla.core.xla_model as xm

    xm.rendezvous(tag)
