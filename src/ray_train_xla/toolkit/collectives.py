"""Collectives inside the training function, the same on every device.

Which path runs follows from what the backend planned (``RAY_TRAIN_XLA_PG_BACKEND``):

- ``xla`` (Neuron, TPU, or a single CPU worker): torch_xla's own collectives, traced into the
  graph; use them as you would ``xm.all_reduce``.
- a ``gloo`` group (several CPU workers): torch_xla 2.9 on CPU cannot reduce across processes,
  so the tensor is copied to the host, reduced through gloo, and copied back to the XLA device.
  Correct everywhere; each call cuts the graph, so call it per step, not per parameter.
- native (``TorchNeuronConfig``: the ``neuron`` group, or ``gloo`` on CPU): torch.distributed
  on the tensor's own device; torch_xla is not imported.

With several CPU workers the backend also bridges torch_xla's own collectives (the CPU
development mode, ``startup/devmode.py``), so raw ``xm.all_reduce`` agrees with these helpers.

Ranks are **Ray Train ranks** (``ranks.py``). XLA numbers processes by its own ordinals, which
need not follow them (on TPU the task id follows chip and host order), so no rank is ever passed
to torch_xla as an ordinal.

SPMD on an accelerator (``spmd=True`` on TPU or Neuron): the mesh spans every worker, and an XLA
tensor is one **global** value that all processes share; see :func:`all_reduce`.
"""

from __future__ import annotations

import torch

from ray_train_xla.planning.contract import worker_context
from ray_train_xla.toolkit.ranks import rank, spmd_global, world_size
from ray_train_xla.toolkit.runtime import runtime
from ray_train_xla.toolkit.stacks import stack

_XM_OPS = {"sum": "sum", "mean": "sum", "max": "max", "min": "min", "product": "mul"}


def pg_rank(ray_rank: int) -> int:
    """The torch.distributed rank of the worker with Ray Train rank ``ray_rank``. The same with
    ``env://``; through ``xla://`` (SPMD) the group numbers processes by PJRT process index,
    so the map is gathered once per process group (kept by the runtime)."""
    if worker_context().init_method != "xla://":
        return ray_rank
    import torch.distributed as dist

    rt = runtime()
    group = dist.group.WORLD
    if rt.group_ranks is None or rt.group_ranks[0] is not group:
        ranks: list = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, rank())
        rt.group_ranks = (group, {r: i for i, r in enumerate(ranks)})
    return rt.group_ranks[1][ray_rank]


def all_reduce(tensor: torch.Tensor, op: str = "sum", dim: str | None = None) -> torch.Tensor:
    """Reduce ``tensor`` over all workers and return the result on ``tensor``'s device.

    ``op`` is "sum", "mean", "max", "min" or "product". The input is not modified. ``dim``: over
    this worker's peers along one dimension of the layout only (``parallel.py``: "tp", "dp" for
    both data-parallel dimensions, "dp_shard", "dp_replicate"), e.g. a loss over the
    data-parallel ranks (``all_reduce(loss, "mean", dim="dp")``), which tensor-parallel peers
    share.

    Under SPMD on an accelerator an XLA tensor is one global value (each worker holds the same
    logical tensor, XLA has already combined the devices' shards), so there is nothing to
    reduce: the result is a copy of it, for every op, with no host round trip and no scaling
    (``sum`` does not multiply it by the number of hosts). A CPU tensor there is a host-local
    value and is reduced over the workers through the gloo group.
    """
    if op not in _XM_OPS:
        raise ValueError(f"all_reduce op={op!r} is not valid: expected one of {sorted(_XM_OPS)}")
    if dim is not None:
        from ray_train_xla.toolkit.parallel import group, group_size

        size = group_size(dim)
        if size == 1:
            return tensor.clone()
        if size != world_size():  # a part of the workers: the layout's group of this worker
            import torch.distributed as dist

            host = tensor.detach().to(stack().comm_device(tensor), copy=True)
            dist.all_reduce(host, op=getattr(dist.ReduceOp, "SUM" if op == "mean" else op.upper()),
                            group=group(dim, host=host.device.type == "cpu"))
            return (host / size if op == "mean" else host).to(tensor.device)
    n = world_size()
    if n == 1 or (spmd_global() and tensor.device.type == "xla"):
        return tensor.clone()
    if stack().over_process_group():
        import torch.distributed as dist

        host = tensor.detach().to(stack().comm_device(tensor), copy=True)
        dist.all_reduce(host, op=getattr(dist.ReduceOp, "SUM" if op == "mean" else op.upper()))
        if op == "mean":
            host = host / n
        return host.to(tensor.device)
    import torch_xla.core.xla_model as xm

    return xm.all_reduce(_XM_OPS[op], tensor, scale=1.0 / n if op == "mean" else 1.0)


def broadcast(tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
    """Return worker ``src``'s value of ``tensor`` on every worker (on ``tensor``'s device).

    ``src`` is a Ray Train rank. Under SPMD on an accelerator an XLA tensor is already the same
    global value on every worker: the result is a copy of it.
    """
    n = world_size()
    if not 0 <= src < n:
        raise ValueError(f"broadcast src={src} is not valid: expected a rank in [0, {n})")
    if n == 1 or (spmd_global() and tensor.device.type == "xla"):
        return tensor.clone()
    if stack().over_process_group():
        import torch.distributed as dist

        host = tensor.detach().to(stack().comm_device(tensor), copy=True)
        dist.broadcast(host, src=pg_rank(src))
        return host.to(tensor.device)
    import torch_xla.core.xla_model as xm

    # xm.collective_broadcast takes an XLA ordinal, which need not be the Ray rank: keep the
    # value on Ray rank src, zero elsewhere, and sum. The zeroing is a select on device data,
    # so every worker runs the same graph (and a NaN elsewhere cannot leak in, as with a 0 *).
    keep = torch.tensor(rank() == src).to(tensor.device)
    out = torch.where(keep, tensor.detach(), torch.zeros_like(tensor))
    return xm.all_reduce("sum", out)


def rendezvous(tag: str) -> None:
    """Block until every worker reaches the rendezvous named ``tag``.

    Bounded by ``TorchXLAConfig.timeout_s`` on the gloo path (the process group's timeout).
    """
    if world_size() == 1:
        return
    stack().barrier(tag)


def group_timeout():
    """The config's ``timeout_s`` as the timeout of a process group's operations: every group
    the package creates takes it, so a rank that withholds a collective fails the others
    within it (torch's default for a new group is 30 minutes)."""
    from datetime import timedelta

    return timedelta(seconds=worker_context().timeout_s)


def host_group(purpose: str = "checkpoint"):
    """A gloo group of its own over every worker for CPU tensors, one per ``purpose`` so that
    two threads never share a communicator (``"checkpoint"``: the background writes of sharded
    checkpoints; ``"startup"``: FSDP2's start-up broadcast on the training thread). Created on
    first use, on every rank in the same order (that call is collective); None without
    torch.distributed. Its operations are bounded by ``timeout_s`` (:func:`group_timeout`)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    rt = runtime()
    with rt.lock:
        if rt.host_groups_of is not dist.group.WORLD:  # a new default group: the old are gone
            rt.host_groups.clear()
            rt.host_groups_of = dist.group.WORLD
        if purpose not in rt.host_groups:
            rt.host_groups[purpose] = dist.new_group(backend="gloo", timeout=group_timeout())
        return rt.host_groups[purpose]
