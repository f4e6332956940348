"""PyTorch/XLA (AWS Trainium, TPU, CPU) for Ray Train's TorchTrainer.

Driver side: pass ``TorchXLAConfig()`` as ``torch_config``. Inside the training function: the
helpers below (device, ranks, collectives, data loading, optimizer step, checkpoints, compile
metrics) run the same code on every device.
"""

from ray_train_xla.config import TorchXLAConfig, XLAConfigError
from ray_train_xla.worker import (
    CompileMonitor,
    RecompilationWarning,
    ShardedStateError,
    XLADataLoader,
    all_reduce,
    broadcast,
    checkpoint_if_preempted,
    get_device,
    get_mesh,
    get_sharded_mesh,
    is_graph_extraction_run,
    is_sharded,
    iter_xla_batches,
    load_checkpoint,
    local_rank,
    metrics,
    node_rank,
    optimizer_step,
    pad_batch,
    prepare_data_loader,
    prepare_model,
    prepare_sharded_model,
    rank,
    reduce_gradients,
    rendezvous,
    save_checkpoint,
    shard_batch,
    sharding_spec,
    to_cpu,
    uses_host_collectives,
    world_size,
)

__version__ = "0.1.0"

__all__ = [
    "TorchXLAConfig",
    "XLAConfigError",
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
    "to_cpu",
    "uses_host_collectives",
    "world_size",
]
