"""Model and optimizer helpers: start every worker from rank 0's parameters, average gradients.

On accelerators (and a single CPU worker) gradient averaging is torch_xla's own
(``xm.optimizer_step`` semantics: an all-reduce traced into the step graph). With several CPU
workers torch_xla cannot reduce across processes, so the gradients are reduced through the gloo
group in buckets: each bucket is flattened on the XLA device and crosses to the host once.

Under SPMD on an accelerator the gradients are global tensors that XLA has already reduced over
the mesh: nothing is averaged again and nothing crosses to the host. A model sharded with FSDP2
(``prepare_sharded_model`` on the native configs) has reduce-scattered its gradients in backward:
``optimizer_step`` steps it without reducing anything, and a plain ``optimizer.step()`` does the
same. How the steps are counted, whichever way the loop steps: ``toolkit/steps.py``.
"""

from __future__ import annotations

import types
import weakref

import torch

from ray_train_xla.toolkit import events
from ray_train_xla.toolkit.buckets import DEFAULT_BUCKET_MB, buckets, flatten, unflatten_into
from ray_train_xla.toolkit.collectives import broadcast
from ray_train_xla.toolkit.device import get_device
from ray_train_xla.toolkit.device import sync as _sync  # optimizer_step has a `sync` argument
from ray_train_xla.toolkit.observability.flops import note_model
from ray_train_xla.toolkit.ranks import spmd_global, world_size
from ray_train_xla.toolkit.runtime import runtime
from ray_train_xla.toolkit.sharding import find_sharded, refuse_sharded
from ray_train_xla.toolkit.stacks import stack
from ray_train_xla.toolkit.steps import marks_own_step, step_done

SHARDED_STEP = ("optimizer.step() followed by torch_xla.sync(): with SPMD/FSDPv2 (prepare_sharded_model) "
                "XLA reduce-scatters the gradients in the step graph, and torch_xla FSDP reduces them in "
                "backward")
# The same on the native configs: FSDP2 reduce-scatters gradients in backward; a model sharded
# with fully_shard elsewhere is taken as is by prepare_sharded_model, after which optimizer_step
# knows it (toolkit/fsdp2.py).
SHARDED_STEP_NATIVE = ("rtx.prepare_sharded_model(model) first, for a model you sharded with "
                       "fully_shard yourself (it takes the model as is; optimizer_step then only "
                       "steps it, as FSDP2 reduced the gradients in backward), or optimizer.step()")


@torch.no_grad()
def prepare_model(model: torch.nn.Module, bucket_mb: float = DEFAULT_BUCKET_MB) -> torch.nn.Module:
    """Move ``model`` to this worker's XLA device and give every worker rank 0's parameters
    and buffers (so workers agree even when their random initialisation differed).

    Under SPMD on an accelerator each host feeds its own copy into the global tensors, so the
    copies are made equal on the host (through the gloo group) before the move.

    Raises ShardedStateError for a sharded model (see ``prepare_sharded_model``)."""
    refuse_sharded(model, "prepare_model", "copies rank 0's parameters and buffers into every worker")
    note_model(model)  # the timeline's model FLOPs (``observability/flops.py``)
    many = world_size() > 1
    on_host = many and spmd_global()
    model = model.cpu() if on_host else model.to(get_device())
    if many:
        tensors = [t for t in (*model.parameters(), *model.buffers()) if t.numel() > 0]
        for bucket in buckets(tensors, bucket_mb):
            unflatten_into(broadcast(flatten(bucket), src=0), bucket)
        if on_host:
            return model.to(get_device())
        _sync()
    return model


def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [
        p.grad for group in optimizer.param_groups for p in group["params"]
        if p.grad is not None and p.grad.numel() > 0
    ]


def _checked() -> weakref.WeakKeyDictionary:
    """The optimizers whose parameters were checked for sharding, with their parameter count
    then (the check walks every parameter, so it runs again only when the parameters change,
    not every step)."""
    return runtime().part("checked", weakref.WeakKeyDictionary)


def _reduced() -> dict:
    """The gradients clip_grad_norm_ averaged for the next step: id(param) -> (a weak reference
    to the param, its grad's id and version then). Keyed by id: a weak-keyed dict compares
    parameters with ``==``, which is elementwise for tensors."""
    return runtime().part("reduced", dict)


def _grad_mark(p: torch.Tensor) -> tuple:
    return id(p.grad), p.grad._version


def _fsdp2_params(params: list) -> bool:
    """True when every one of ``params`` is a parameter of a model FSDP2 shards (its gradients
    are reduce-scattered in backward); False when none is."""
    if not params or not stack().native:
        return False
    from torch.distributed.fsdp import FSDPModule

    from ray_train_xla.toolkit.checkpoint.names import prepared_models

    managed = {id(p) for m in prepared_models() if isinstance(m, FSDPModule) for p in m.parameters()}
    return all(id(p) in managed for p in params)


def _refuse_sharded_params(optimizer: torch.optim.Optimizer) -> bool:
    """True when the optimizer steps an FSDP2 model (nothing to reduce); raises
    ShardedStateError for other sharded parameters."""
    count = sum(len(group["params"]) for group in optimizer.param_groups)
    checked = _checked()
    if count and checked.get(optimizer, (None,))[0] == count:
        return checked[optimizer][1]
    params = [p for group in optimizer.param_groups for p in group["params"]]
    fsdp2 = _fsdp2_params(params)
    if not fsdp2:
        groups = {f"param_groups[{g}].params": group["params"]
                  for g, group in enumerate(optimizer.param_groups)}
        refuse_sharded(groups, "optimizer_step", "averages every gradient over all workers",
                       use=SHARDED_STEP_NATIVE if stack().native else SHARDED_STEP)
    checked[optimizer] = (count, fsdp2)
    return fsdp2


def reduce_gradients(optimizer: torch.optim.Optimizer, bucket_mb: float = DEFAULT_BUCKET_MB) -> None:
    """Average the gradients of ``optimizer``'s parameters over all workers, in place.

    Nothing to do for a model FSDP2 shards (``prepare_sharded_model`` on the native configs),
    or for gradients :func:`clip_grad_norm_` averaged since the backward pass. Raises
    ShardedStateError for other sharded parameters (XLA reduces those gradients itself)."""
    if _refuse_sharded_params(optimizer):
        return
    n = world_size()
    if n == 1 or spmd_global():  # one worker, or XLA reduces over the mesh: nothing to average
        return
    params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
    reduced = _reduced()
    done = bool(params) and all(id(p) in reduced and reduced[id(p)][0]() is p
                                and reduced[id(p)][1] == _grad_mark(p) for p in params)
    reduced.clear()  # a mark serves one step: a new backward changes the gradients' version
    if done:
        return  # clip_grad_norm_ averaged exactly these gradients, untouched since
    with torch.no_grad():
        _reduce(optimizer, n, bucket_mb)


def clip_grad_norm_(parameters, max_norm: float, norm_type: float = 2.0,
                    bucket_mb: float = DEFAULT_BUCKET_MB) -> torch.Tensor:
    """Clip the gradients of ``parameters`` (or a module's) in place by their global norm, as
    ``torch.nn.utils.clip_grad_norm_`` does on one device, and return that norm (a plain
    tensor, the same on every worker).

    Call it between ``backward()`` and the optimizer step. Sharded models (FSDP2, FSDPv2): the
    norm is taken over every shard of every worker. Replicated models on several workers: the
    gradients are averaged over the workers first (the next ``optimizer_step`` does not average
    them again), so every worker clips the same averaged gradients by the same norm."""
    if isinstance(parameters, torch.nn.Module):
        parameters = parameters.parameters()
    elif isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.tensor(0.0)
    fsdp2 = _fsdp2_params(params)
    sharded = fsdp2 or find_sharded(params) is not None
    average = not sharded and world_size() > 1 and not spmd_global()
    if sharded:
        events.arrived()  # the norm over every shard is a collective
    if average:
        with torch.no_grad():
            # the smallest optimizer-like view of the parameters (what _reduce reads)
            _reduce(types.SimpleNamespace(param_groups=[{"params": params}]), world_size(), bucket_mb)
    if fsdp2:  # DTensors, on several meshes under tensor parallelism (norms apart from TP)
        from ray_train_xla.toolkit.tensor_parallel import clip_grad_norm_ as clip_dtensors

        return clip_dtensors(params, max_norm, norm_type).to(params[0].grad.device)
    total = torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type=norm_type)
    if average:
        reduced = _reduced()
        for p in params:  # these exact gradients, as they are now, are averaged
            reduced[id(p)] = (weakref.ref(p), _grad_mark(p))
    full = getattr(total, "full_tensor", None)
    return full() if full is not None else total


def _reduce(optimizer: torch.optim.Optimizer, n: int, bucket_mb: float) -> None:
    if not stack().over_process_group():
        import torch_xla.core.xla_model as xm

        events.arrived()
        xm.reduce_gradients(optimizer)
        return
    import torch.distributed as dist

    groups = list(buckets(_gradients(optimizer), bucket_mb))
    flats = [flatten(b) for b in groups]
    # One execution computes the backward pass and every flattened bucket; the copies to the
    # host below are then plain transfers, one per bucket.
    _sync()
    events.arrived()  # this rank's own part of the step is done: the first collective
    for bucket, flat in zip(groups, flats):
        host = flat.to(stack().comm_device(flat))
        dist.all_reduce(host, op=dist.ReduceOp.SUM)
        host.div_(n)
        unflatten_into(host.to(flat.device), bucket)


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

    It ends one step of the step timeline (``steps.step_done``, after the graph cut), once: the
    step count's hook on ``optimizer.step()`` stands down for its ``step()`` and, from then on,
    for every plain ``step()`` of the training function (``toolkit/steps.py``: a loop that
    calls ``optimizer_step`` marks its own steps).
    """
    reduce_gradients(optimizer, bucket_mb=bucket_mb)
    marks_own_step()
    result = optimizer.step(**step_kwargs)
    if sync:
        _sync()
    step_done()
    return result
