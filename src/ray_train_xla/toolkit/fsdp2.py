"""Sharded models on the native stacks: FSDP2 (``torch.distributed.fsdp.fully_shard``) over a
DeviceMesh of the job's devices (``TorchNeuronConfig``, ``TorchTPUConfig`` and their CPU twins).

Parameters, gradients and optimizer state are DTensors split over the mesh's ``fsdp`` axis;
FSDP2 all-gathers the parameters for each block's forward and backward and reduce-scatters the
gradients in backward, so a plain ``optimizer.step()`` (or :func:`optimizer_step`, which then
reduces nothing) is the whole step. A 2-D mesh ``("replicate", "fsdp")`` is HSDP: shards within
a row, replicas across rows (one row per node by default).

This module is only imported on native workers: it never imports torch_xla.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

from ray_train_xla.errors import ShardedStateError
from ray_train_xla.toolkit.checkpoint.names import remember
from ray_train_xla.toolkit.device import get_device
from ray_train_xla.toolkit.ranks import local_rank, node_rank, rank, world_size

FSDP_AXES = ("fsdp",)
HSDP_AXES = ("replicate", "fsdp")
# The data-parallel dims of a layout's mesh (tensor_parallel.data_parallel_mesh takes them).
DP_AXES = (("dp_shard",), ("dp_replicate", "dp_shard"))


def hsdp_shape() -> tuple[int, int]:
    """(nodes, workers per node) of this job, for an HSDP mesh with one replica per node.
    Raises ValueError when the nodes hold different numbers of workers, or ranks do not follow
    nodes."""
    from ray_train_xla.planning.contract import worker_context

    per_node = worker_context().local_world_size
    world = world_size()
    if world % per_node or rank() // per_node != node_rank() or rank() % per_node != local_rank():
        raise ValueError(
            f"get_sharded_mesh('hsdp'): rank {rank()} (node {node_rank()}, local rank "
            f"{local_rank()}, {per_node} workers on its node, {world} in all) does not lie in "
            "row node_rank of a (nodes, workers per node) grid; give the shape yourself, "
            "e.g. get_sharded_mesh((replicas, shards)).")
    return world // per_node, per_node


def native_mesh(shape: Any = None):
    """The DeviceMesh for FSDP2 over every worker of the job: ``("fsdp",)`` of ``(world,)`` by
    default; ``("replicate", "fsdp")`` for a 2-D ``shape`` (HSDP), or ``"hsdp"`` for one replica
    per node. Created once per shape (creating a 2-D mesh is collective: call it on every
    worker, in the same order)."""
    from torch.distributed.device_mesh import init_device_mesh

    world = world_size()
    if shape is None:
        shape = (world,)
    elif shape == "hsdp":
        shape = hsdp_shape()
    elif isinstance(shape, int):
        shape = (shape,)
    shape = tuple(int(d) for d in shape)
    if len(shape) not in (1, 2):
        raise ValueError(f"get_sharded_mesh: shape {shape} has {len(shape)} axes; FSDP2 takes "
                         "(shards,) or (replicas, shards) for HSDP")
    if math.prod(shape) != world:
        raise ValueError(f"get_sharded_mesh: shape {shape} holds {math.prod(shape)} workers, "
                         f"but the job has {world}")
    from ray_train_xla.toolkit.runtime import runtime

    meshes = runtime().meshes  # one per shape
    if shape not in meshes:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise RuntimeError("get_sharded_mesh: torch.distributed is not initialised on this "
                               "worker; call it inside a TorchTrainer training function")
        names = FSDP_AXES if len(shape) == 1 else HSDP_AXES
        meshes[shape] = init_device_mesh(get_device().type, shape, mesh_dim_names=names)
    return meshes[shape]


def block_classes_policy(policy: Any) -> Callable[[torch.nn.Module, int], bool] | None:
    """A test ``(module, numel not yet in a chosen block) -> shard it on its own`` for every
    policy form torch_xla's FSDPv2 path accepts: a set of module classes, torch's
    ``ModuleWrapPolicy``, or an FSDP auto-wrap callable such as
    ``functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})`` (called
    as FSDP calls it, with ``recurse=False``)."""
    if policy is None:
        return None
    classes = getattr(policy, "_module_classes", None)  # torch's ModuleWrapPolicy
    if isinstance(policy, (set, frozenset, list, tuple)):
        classes = policy
        if not all(isinstance(c, type) and issubclass(c, torch.nn.Module) for c in classes):
            raise TypeError(f"prepare_sharded_model: auto_wrap_policy {policy!r} is a collection "
                            "but not of torch.nn.Module classes")
    if classes is not None:
        classes = tuple(classes)
        return lambda module, numel: isinstance(module, classes)
    if callable(policy):
        return lambda module, numel: bool(policy(module=module, recurse=False, nonwrapped_numel=numel))
    raise TypeError(f"prepare_sharded_model: auto_wrap_policy {policy!r} is none of: a set of "
                    "module classes, ModuleWrapPolicy, an FSDP auto-wrap callable")


def chosen_blocks(model: torch.nn.Module, policy: Any) -> list[torch.nn.Module]:
    """The submodules (not the root) ``policy`` names, innermost first: the order FSDP2 needs
    (a block is sharded before the module holding it)."""
    test = block_classes_policy(policy)
    if test is None:
        return []
    chosen: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> int:
        inside = sum(visit(child) for child in module.children())
        own = sum(p.numel() for p in module.parameters(recurse=True))
        if module is not model and test(module, own - inside):
            chosen.append(module)
            return own
        return inside

    visit(model)
    return chosen


def mixed_precision_policy(mixed_precision: Any):
    """FSDP2's MixedPrecisionPolicy for ``"bf16"`` (bf16 parameters and compute, fp32 gradient
    reduction), ``None`` (none), or a MixedPrecisionPolicy given as is."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if mixed_precision is None or isinstance(mixed_precision, MixedPrecisionPolicy):
        return mixed_precision
    if mixed_precision in ("bf16", torch.bfloat16):
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    raise ValueError(f"prepare_sharded_model: mixed_precision {mixed_precision!r}: use 'bf16', "
                     "None, or a torch.distributed.fsdp.MixedPrecisionPolicy")


def _refuse_wrapped(model: torch.nn.Module) -> None:
    for name, module in model.named_modules():
        kind = type(module).__name__
        if kind in ("DistributedDataParallel", "FullyShardedDataParallel"):
            raise ShardedStateError(
                f"prepare_sharded_model: {name or 'model'} is already wrapped in {kind}; pass the "
                "plain model (Ray's prepare_model wraps it in DDP: do not call it as well)")


@torch.no_grad()
def _same_start(model: torch.nn.Module, group) -> None:
    """Every worker starts from rank 0's parameters and buffers (before sharding), as
    prepare_model does for replicated models; skipped for parameters on the meta device."""
    import torch.distributed as dist

    from ray_train_xla.toolkit.buckets import DEFAULT_BUCKET_MB, buckets, flatten, unflatten_into

    tensors = [t for t in (*model.parameters(), *model.buffers())
               if t.numel() > 0 and t.device.type != "meta"]
    for bucket in buckets(tensors, DEFAULT_BUCKET_MB):
        host = flatten(bucket).cpu()
        dist.broadcast(host, src=0, group=group)
        unflatten_into(host, bucket)  # copied back to each tensor's device


def prepare_fsdp2(
    model: torch.nn.Module,
    mesh=None,
    *,
    auto_wrap_policy=None,
    mixed_precision=None,
    activation_checkpointing: bool = False,
    reshard_after_forward: bool = True,
    before_sharding: Callable[[torch.nn.Module], None] | None = None,
) -> torch.nn.Module:
    """Shard ``model`` with FSDP2 on ``mesh`` (default :func:`native_mesh`; or the
    data-parallel dims of a layout's mesh, ``("dp_shard",)`` or ``("dp_replicate",
    "dp_shard")``): each block ``auto_wrap_policy`` names on its own (innermost first), then the
    root. Every worker starts from rank 0's values. ``before_sharding(model)`` runs between the
    two (tensor parallelism splits the parameters there). Returns the model (now an
    FSDPModule)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from ray_train_xla.toolkit.collectives import host_group

    _refuse_wrapped(model)
    if isinstance(model, FSDPModule):
        remember(model)
        return model
    mesh = mesh if mesh is not None else native_mesh()
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (FSDP_AXES, HSDP_AXES, *DP_AXES):
        raise ValueError(f"prepare_sharded_model: the mesh axes {names} are neither {FSDP_AXES} "
                         f"nor {HSDP_AXES}; build it with get_sharded_mesh(shape)")
    if dist.is_initialized() and dist.get_world_size() > 1:
        _same_start(model, host_group("startup"))
    if before_sharding is not None:
        before_sharding(model)
    kwargs: dict[str, Any] = {"mesh": mesh, "reshard_after_forward": reshard_after_forward}
    policy = mixed_precision_policy(mixed_precision)
    if policy is not None:
        kwargs["mp_policy"] = policy
    blocks = chosen_blocks(model, auto_wrap_policy)
    if activation_checkpointing:
        if not blocks:
            raise ValueError("prepare_sharded_model: activation_checkpointing recomputes each "
                             "block named by auto_wrap_policy; give auto_wrap_policy")
        from torch.distributed._composable import checkpoint

        for block in blocks:
            checkpoint(block)  # composable: the module's names do not change
    for block in blocks:
        fully_shard(block, **kwargs)
    fully_shard(model, **kwargs)
    # The forward's first all-gather is the step's first collective: the timeline counts this
    # rank's own time of the step up to it (stragglers). Before FSDP2's own pre-forward hook.
    model.register_forward_pre_hook(_arrived, prepend=True)
    remember(model)
    return model


def _arrived(module: torch.nn.Module, args: Any) -> None:
    from ray_train_xla.toolkit import events

    events.arrived()
