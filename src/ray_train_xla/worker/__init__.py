"""Helpers used inside the training function (imported on workers, never by the backend)."""

from ray_train_xla.worker.collectives import (
    all_reduce,
    broadcast,
    get_device,
    local_rank,
    node_rank,
    rank,
    rendezvous,
    uses_host_collectives,
    world_size,
)
from ray_train_xla.worker.spmd import get_mesh, shard_batch, sharding_spec

__all__ = [
    "all_reduce",
    "broadcast",
    "get_device",
    "get_mesh",
    "local_rank",
    "node_rank",
    "rank",
    "rendezvous",
    "shard_batch",
    "sharding_spec",
    "uses_host_collectives",
    "world_size",
]
