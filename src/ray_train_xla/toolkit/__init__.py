"""The toolkit: helpers used inside the training function (imported on workers; the backend
imports only the memory tier's store, ``checkpoint/memory/store.py``, which loads no torch). Its
names are imported on first use, so importing a module of it loads only what that module needs.
Each module is one concern, which its docstring names; ``docs/architecture.md`` maps them all.
No module holds state of its own: ``runtime`` holds every module's options and components, one
object per worker and training function.
"""

from __future__ import annotations

from ray_train_xla.toolkit.lazy import lazy_names

# Public name -> the module of the toolkit that defines it (``ray_train_xla.toolkit.<module>``).
_EXPORTS = {
    "keep_in_memory": "checkpoint.memory.tier",
    **dict.fromkeys(("load_checkpoint", "save_checkpoint"), "checkpoint.seam"),
    "wait_for_snapshots": "checkpoint.staging",
    **dict.fromkeys(("all_reduce", "broadcast", "rendezvous"), "collectives"),
    **dict.fromkeys(("XLADataLoader", "iter_xla_batches", "pad_batch", "prepare_data_loader"), "data"),
    **dict.fromkeys(("get_device", "sync", "to_cpu"), "device"),
    **dict.fromkeys(("DivergentGraphsWarning", "check_graphs_every"), "observability.compile_causes"),
    **dict.fromkeys(("count_flops", "model_flops_per_token"), "observability.flops"),
    **dict.fromkeys(("CompileMonitor", "RecompilationWarning", "is_graph_extraction_run", "metrics"),
                    "observability.metrics"),
    **dict.fromkeys(("profile_steps", "profile_windows"), "observability.profiling"),
    "configure_timeline": "observability.timeline",
    **dict.fromkeys(("clip_grad_norm_", "optimizer_step", "prepare_model", "reduce_gradients"), "optim"),
    "checkpoint_if_preempted": "preemption",
    **dict.fromkeys(("export_pretrained", "load_pretrained", "meta_parameters", "pretrained_path"),
                    "pretrained"),
    **dict.fromkeys(("local_rank", "node_rank", "rank", "spmd_global", "uses_host_collectives",
                     "world_size"), "ranks"),
    **dict.fromkeys(("configure_reports", "flush_reports", "report"), "reporting"),
    **dict.fromkeys(("ShardedStateError", "get_sharded_mesh", "is_sharded", "prepare_sharded_model"),
                    "sharding"),
    **dict.fromkeys(("get_mesh", "shard_batch", "sharding_spec"), "spmd"),
    **dict.fromkeys(("configure_parallelism", "data_parallel", "get_layout"), "parallel"),
    "step_done": "steps",
}

__all__ = sorted(_EXPORTS)

__getattr__, __dir__ = lazy_names(__name__, _EXPORTS)
