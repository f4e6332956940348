"""Helpers used inside the training function (imported on workers, never by the backend)."""

from ray_train_xla.worker.checkpoint import load_checkpoint, save_checkpoint
from ray_train_xla.worker.collectives import (
    all_reduce,
    broadcast,
    get_device,
    local_rank,
    node_rank,
    rank,
    rendezvous,
    spmd_global,
    sync,
    uses_host_collectives,
    world_size,
)
from ray_train_xla.worker.data import XLADataLoader, iter_xla_batches, pad_batch, prepare_data_loader
from ray_train_xla.worker.device import to_cpu
from ray_train_xla.worker.metrics import (
    CompileMonitor,
    RecompilationWarning,
    is_graph_extraction_run,
    metrics,
)
from ray_train_xla.worker.optim import optimizer_step, prepare_model, reduce_gradients
from ray_train_xla.worker.preemption import checkpoint_if_preempted
from ray_train_xla.worker.sharding import (
    ShardedStateError,
    get_sharded_mesh,
    is_sharded,
    prepare_sharded_model,
)
from ray_train_xla.worker.spmd import get_mesh, shard_batch, sharding_spec

__all__ = [
    "CompileMonitor",
    "RecompilationWarning",
    "ShardedStateError",
    "XLADataLoader",
    "all_reduce",
    "broadcast",
    "checkpoint_if_preempted",
    "get_device",
    "get_mesh",
    "get_sharded_mesh",
    "is_sharded",
    "is_graph_extraction_run",
    "iter_xla_batches",
    "load_checkpoint",
    "local_rank",
    "metrics",
    "node_rank",
    "optimizer_step",
    "pad_batch",
    "prepare_data_loader",
    "prepare_model",
    "prepare_sharded_model",
    "rank",
    "reduce_gradients",
    "rendezvous",
    "shard_batch",
    "sharding_spec",
    "save_checkpoint",
    "spmd_global",
    "sync",
    "to_cpu",
    "uses_host_collectives",
    "world_size",
]
