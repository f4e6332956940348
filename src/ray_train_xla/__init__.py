"""PyTorch/XLA (AWS Trainium, TPU, CPU) for Ray Train's TorchTrainer.

Driver side: pass ``TorchXLAConfig()`` as ``torch_config``. Inside the training function: the
helpers below (device, ranks, collectives) run the same code on every device.
"""

from ray_train_xla.config import TorchXLAConfig, XLAConfigError
from ray_train_xla.worker import (
    all_reduce,
    broadcast,
    get_device,
    get_mesh,
    local_rank,
    node_rank,
    rank,
    rendezvous,
    shard_batch,
    sharding_spec,
    uses_host_collectives,
    world_size,
)

__version__ = "0.1.0"

__all__ = [
    "TorchXLAConfig",
    "XLAConfigError",
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
