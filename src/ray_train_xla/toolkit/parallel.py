"""This worker's parallelism layout, and what is made from it once per runtime: the device mesh,
the process groups of each dimension, which batch this worker trains on.

The layout (``planning/layout.py``) is the config's ``parallelism``, planned for every worker
(``RAY_TRAIN_XLA_LAYOUT``), else a call's (``configure_parallelism``, or
``prepare_sharded_model(..., parallelism=...)``) made before anything used the layout, else FSDP
over every device. The runtime holds it; a request that differs from the layout in effect raises
``ValueError`` naming both.

Ranks here are the process group's (``torch.distributed``'s, ``RANK``): the layout's
coordinates follow them, as ``init_device_mesh`` does. Under torch_xla SPMD a worker holds
several devices of the layout and the mesh is the SPMD mesh's (``spmd.py``): a worker's data is
its process's, split over its devices by ``shard_batch``.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from ray_train_xla.planning.layout import DIMS, Layout, Parallelism
from ray_train_xla.toolkit.ranks import rank, world_size
from ray_train_xla.toolkit.runtime import runtime

# The groups ``group(dim)`` knows: every dimension, and "dp" (all data-parallel dimensions).
GROUP_DIMS = (*DIMS, "dp")


def get_layout() -> Layout:
    """This job's layout (see the module docstring); FSDP over every device unless the config
    or a call asked for another. Read from the plan each time, so a worker group of another
    size (an elastic resize) gets its own."""
    rt = runtime()
    planned = rt.ctx.layout
    if planned:
        return Layout.from_text(planned)
    with rt.lock:
        if rt.layout is not None and rt.layout.world == _devices():
            return rt.layout
    return Layout(dp_shard=_devices())


def configure_parallelism(parallelism: Any) -> Layout:
    """Ask for a layout on this worker (``Parallelism``, or a dict such as ``{"tp": 2}``): call
    it on every worker, before the first helper that uses the layout. Returns the layout; raises
    ``ValueError`` when another one is in effect (the config's, a call's, or the default that a
    helper already used)."""
    wanted = Parallelism.of(parallelism, "configure_parallelism")
    if wanted is None:
        return get_layout()
    layout = wanted.resolve(_devices(), "configure_parallelism")
    rt = runtime()
    with rt.lock:
        current = get_layout()
        if layout == current:
            rt.layout = layout
            return layout
        if rt.ctx.layout or rt.layout is not None or rt.layout_used:
            which = ("the config's parallelism" if rt.ctx.layout else
                     "configure_parallelism" if rt.layout is not None else
                     "the default, which a helper used already")
            raise ValueError(f"configure_parallelism: {layout.to_text()} conflicts with "
                             f"{current.to_text()}, set by {which}: ask for one layout, in the "
                             "config or before the first helper that uses it")
        rt.layout = layout
        return layout


def _devices() -> int:
    """The devices of the job: the workers, or under SPMD every worker's devices."""
    if runtime().ctx.spmd:
        import torch_xla.runtime as xr

        return xr.global_runtime_device_count()
    return world_size()


def data_parallel() -> tuple[int, int]:
    """(this worker's data-parallel rank, the data-parallel degree): which of the step's
    batches this worker trains on. Tensor-parallel peers share one. Under SPMD, the process's
    rank and the processes (its devices split its batch through the mesh)."""
    rt = runtime()
    if rt.ctx.spmd:
        return rank(), world_size()
    layout = get_layout()
    rt.layout_used = True
    return layout.dp_rank(rank()), layout.dp


def device_mesh():
    """The DeviceMesh over the layout's dimensions (``DIMS``, sizes 1 included), made once per
    runtime on every worker (collective: call it on every worker, in the same order). Native
    configs and their CPU twins only."""
    from torch.distributed.device_mesh import init_device_mesh

    from ray_train_xla.toolkit.device import get_device

    rt = runtime()
    layout = get_layout()
    with rt.lock:
        rt.layout_used = True
        if rt.layout_mesh is None or rt.layout_mesh[0] != layout:
            _require_distributed("the layout's device mesh")
            mesh = init_device_mesh(get_device().type, layout.shape, mesh_dim_names=DIMS)
            rt.layout_mesh = (layout, mesh)
        return rt.layout_mesh[1]


def group(dim: str, host: bool = False):
    """The process group of this worker's peers along ``dim`` (one of ``DIMS``, or "dp": both
    data-parallel dimensions); ``host``: a gloo group, for CPU tensors and objects. Made once per
    runtime with torch's public ``new_subgroups_by_enumeration`` (collective: every worker makes
    every group, in the same order) and bounded by ``timeout_s``; None with one worker."""
    from ray_train_xla.toolkit.collectives import group_timeout

    if dim not in GROUP_DIMS:
        raise ValueError(f"group: dim={dim!r} is not valid: expected one of {GROUP_DIMS}")
    if world_size() == 1:
        return None
    import torch.distributed as dist

    rt = runtime()
    layout = get_layout()
    key = (layout, dim, host)
    with rt.lock:
        rt.layout_used = True
        if key not in rt.layout_groups:
            _require_distributed(f"the {dim} group")
            members = _members(layout, dim)
            rt.layout_groups[key] = dist.new_subgroups_by_enumeration(
                members, timeout=group_timeout(), backend="gloo" if host else None)[0]
        return rt.layout_groups[key]


def shared_with_tp_peers(batches: Iterable[Any]) -> Iterator[Any]:
    """``batches`` (one epoch of this worker's own shard) as the batches its tensor-parallel
    group trains on, the same on every peer: the k-th comes from peer ``k % tp``, which reads
    it from its own shard and broadcasts it over a gloo group of the peers. Every shard is read
    in step, one batch every ``tp`` steps, and every row is trained on once. Without tensor
    parallelism (or under SPMD, whose mesh splits a process's batch) the batches as they are."""
    layout = get_layout()
    if layout.tp == 1 or runtime().ctx.spmd:
        yield from batches
        return
    import torch.distributed as dist

    peers = layout.group(rank(), "tp")
    me, peer_group = peers.index(rank()), group("tp", host=True)
    own = iter(batches)
    # Every peer starts its own shard's epoch now: Ray Data's split starts an epoch only once
    # every consumer of the dataset asked for its first batch.
    ready = next(own, None)
    step = 0
    while True:
        owner = step % layout.tp
        box = [ready if owner == me else None]
        dist.broadcast_object_list(box, src=peers[owner], group=peer_group)
        if box[0] is None:  # the owner's shard ended: so did every peer's (equal shards)
            return
        if owner == me:
            ready = next(own, None)
        yield box[0]
        step += 1


def group_size(dim: str) -> int:
    """How many workers this worker's group along ``dim`` holds (``group``'s dims)."""
    if dim not in GROUP_DIMS:
        raise ValueError(f"dim={dim!r} is not valid: expected one of {GROUP_DIMS}")
    layout = get_layout()
    if runtime().ctx.spmd:  # a worker's devices share its process: the process group is the world
        return world_size() if dim in ("dp", "dp_shard") else 1
    return layout.dp if dim == "dp" else getattr(layout, dim)


def _members(layout: Layout, dim: str) -> list[list[int]]:
    """Every group of ``dim`` as its ranks, each group once, in the order of its first rank."""
    seen: dict[tuple[int, ...], None] = {}
    for r in range(layout.world):
        if dim == "dp":
            tp = layout.coordinates(r)["tp"]
            ranks = tuple(x for x in range(layout.world) if layout.coordinates(x)["tp"] == tp)
        else:
            ranks = tuple(layout.group(r, dim))
        seen.setdefault(ranks, None)
    return [list(g) for g in seen]


def _require_distributed(what: str) -> None:
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError(f"{what}: torch.distributed is not initialised on this worker; "
                           "call it inside a TorchTrainer training function")
