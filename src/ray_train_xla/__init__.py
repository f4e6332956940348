"""PyTorch/XLA (AWS Trainium, TPU, CPU) for Ray Train's TorchTrainer.

Driver side: pass ``TorchXLAConfig()`` as ``torch_config`` (``TorchNeuronConfig()`` for native
TorchNeuron, Neuron SDK 2.30+; ``TorchTPUConfig()`` for native TorchTPU, ``torch-tpu``). Inside
the training function: the toolkit helpers below (device, ranks, collectives, data loading,
optimizer step, checkpoints, compile metrics) run the same code on every device.

The package, by role (imports go down this list, never up):

- ``errors``: every error type;
- ``planning/``: options, topology, the environment contract, one module per runtime (no Ray,
  no torch);
- ``toolkit/``: what the training function calls;
- ``startup/``: what runs on every worker at start-up and shutdown;
- ``driver/``: the config classes and Ray's Backend classes;
- ``tools/``: the ``ray-train-xla`` command (plan, doctor, demo, consolidate).

Names are imported on first use, so ``import ray_train_xla.planning`` loads neither Ray nor
torch, and of the toolkit the driver imports only the memory tier's store
(``toolkit/checkpoint/memory/store.py``), which loads no torch.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    **dict.fromkeys(("TorchXLAConfig", "TorchNeuronConfig", "check_scaling_config", "TorchTPUConfig"),
                    "ray_train_xla.driver.config"),
    **dict.fromkeys(("NeuronOptions", "TPUOptions", "XLAOptions"), "ray_train_xla.planning.options"),
    **dict.fromkeys(("XLAConfigError", "WorkerSetupError", "XLAInitError", "RendezvousTimeoutError",
                     "NeuronCompileError", "ShardedStateError", "CheckpointMismatchError",
                     "ReportError"), "ray_train_xla.errors"),
    **{name: "ray_train_xla.toolkit" for name in (
        "CompileMonitor",
        "DivergentGraphsWarning",
        "RecompilationWarning",
        "XLADataLoader",
        "all_reduce",
        "broadcast",
        "check_graphs_every",
        "checkpoint_if_preempted",
        "clip_grad_norm_",
        "configure_reports",
        "configure_timeline",
        "count_flops",
        "export_pretrained",
        "flush_reports",
        "get_device",
        "get_mesh",
        "get_sharded_mesh",
        "is_graph_extraction_run",
        "is_sharded",
        "iter_xla_batches",
        "keep_in_memory",
        "load_checkpoint",
        "load_pretrained",
        "local_rank",
        "meta_parameters",
        "metrics",
        "model_flops_per_token",
        "node_rank",
        "optimizer_step",
        "pad_batch",
        "prepare_data_loader",
        "report",
        "prepare_model",
        "prepare_sharded_model",
        "pretrained_path",
        "profile_steps",
        "profile_windows",
        "rank",
        "reduce_gradients",
        "rendezvous",
        "save_checkpoint",
        "shard_batch",
        "sharding_spec",
        "spmd_global",
        "step_done",
        "sync",
        "to_cpu",
        "uses_host_collectives",
        "wait_for_snapshots",
        "world_size",
    )},
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ray_train_xla' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

