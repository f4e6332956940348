"""The toolkit: helpers used inside the training function (imported on workers, never by the
backend). Each module is one concern:

- ``runtime``: one object per worker and training function, holding every other module's
  options and components (no module holds state of its own);
- ``device``: the worker's device and the device layer (XLA, native Neuron, CPU);
- ``ranks``: ranks and world sizes from the planned environment;
- ``collectives``: all_reduce, broadcast, rendezvous on every device;
- ``data``: data loaders and Ray Data batches on the device, sharded per worker;
- ``optim``: the replicated model and optimizer step (gradient reduction);
- ``spmd``, ``sharding`` and ``fsdp2``: meshes, sharded batches, sharded models (FSDPv2 under
  torch_xla, FSDP2 on the native stacks);
- ``pretrained``: Hugging Face models loaded into a sharded model and exported, by slices;
- ``reporting``: reports and checkpoints handed to a background thread, off the step path;
- ``checkpoint``: one seam, two implementations (replicated, sharded) and their on-disk format;
- ``preemption``: a checkpoint before a drained node goes away;
- ``steps``: step boundaries (``optimizer_step``, ``step_done``, a plain ``optimizer.step()`` seen
  through torch's optimizer hook; each step once) and the hooks that run at each;
- ``observability/``: what observes the run (the step timeline, Ray metrics, goodput, compile
  metrics and causes, profiles: its docstring lists the modules); ``events``: what the training
  path (loaders, checkpoints, reports) tells it.
"""

from ray_train_xla.toolkit.checkpoint.memory.tier import keep_in_memory
from ray_train_xla.toolkit.checkpoint.seam import load_checkpoint, save_checkpoint
from ray_train_xla.toolkit.checkpoint.staging import wait_for_snapshots
from ray_train_xla.toolkit.collectives import all_reduce, broadcast, rendezvous
from ray_train_xla.toolkit.data import XLADataLoader, iter_xla_batches, pad_batch, prepare_data_loader
from ray_train_xla.toolkit.device import get_device, sync, to_cpu
from ray_train_xla.toolkit.observability.compile_causes import DivergentGraphsWarning, check_graphs_every
from ray_train_xla.toolkit.observability.flops import count_flops, model_flops_per_token
from ray_train_xla.toolkit.observability.metrics import (
    CompileMonitor,
    RecompilationWarning,
    is_graph_extraction_run,
    metrics,
)
from ray_train_xla.toolkit.observability.profiling import profile_steps, profile_windows
from ray_train_xla.toolkit.observability.timeline import configure_timeline
from ray_train_xla.toolkit.optim import clip_grad_norm_, optimizer_step, prepare_model, reduce_gradients
from ray_train_xla.toolkit.preemption import checkpoint_if_preempted
from ray_train_xla.toolkit.pretrained import (
    export_pretrained,
    load_pretrained,
    meta_parameters,
    pretrained_path,
)
from ray_train_xla.toolkit.ranks import (
    local_rank,
    node_rank,
    rank,
    spmd_global,
    uses_host_collectives,
    world_size,
)
from ray_train_xla.toolkit.reporting import configure_reports, flush_reports, report
from ray_train_xla.toolkit.sharding import (
    ShardedStateError,
    get_sharded_mesh,
    is_sharded,
    prepare_sharded_model,
)
from ray_train_xla.toolkit.spmd import get_mesh, shard_batch, sharding_spec
from ray_train_xla.toolkit.steps import step_done

__all__ = [
    "CompileMonitor",
    "DivergentGraphsWarning",
    "RecompilationWarning",
    "ShardedStateError",
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
    "is_sharded",
    "is_graph_extraction_run",
    "iter_xla_batches",
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
    "prepare_model",
    "prepare_sharded_model",
    "pretrained_path",
    "profile_steps",
    "profile_windows",
    "rank",
    "reduce_gradients",
    "report",
    "rendezvous",
    "shard_batch",
    "sharding_spec",
    "save_checkpoint",
    "keep_in_memory",
    "spmd_global",
    "step_done",
    "sync",
    "to_cpu",
    "uses_host_collectives",
    "wait_for_snapshots",
    "world_size",
]
