"""Sharded checkpoints: every rank writes only its own shards with ``torch.distributed.checkpoint``.

The directory layout is in ``format.py``. Under Ray every worker writes into its own local
directory and reports it; Ray Train merges the workers' directories into the one checkpoint of
that step.

SPMD tensors go through torch_xla's ``SPMDSavePlanner`` / ``SPMDLoadPlanner``: a rank writes the
shards its devices hold and reads back exactly the pieces its devices need, so a checkpoint
restores onto another mesh shape, device count or worker count. Shards held by several workers
(replicated across hosts) are written once, by the worker with the least to write so far.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch

from ray_train_xla.toolkit.checkpoint.format import (
    EXTRA_FILE,
    SHARDED_KEYS,
    SHARDED_MARKER,
    check_fits,
    saved_specs,
    spec_of,
)
from ray_train_xla.toolkit.device import to_cpu
from ray_train_xla.toolkit.sharding import ShardedStateError, walk_sharded


def unsupported_sharding(state: Any) -> tuple[str, str] | None:
    """The first sharded thing that is not an SPMD tensor (DTensor, torch_xla FSDP v1 shards):
    the sharded checkpoint cannot restore those onto another layout."""
    for path, desc in walk_sharded(state, ""):
        if not desc.startswith(("an SPMD tensor", "an XLAShardedTensor", "a torch_xla FSDPv2 module")):
            return path, desc
    return None


def _split(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    dist_state = {k: v for k, v in state.items() if k in SHARDED_KEYS}
    extra = {k: v for k, v in state.items() if k not in SHARDED_KEYS}
    found = next(walk_sharded(extra, ""), None)
    if found is not None:
        raise ShardedStateError(
            f"save_checkpoint: state entry {found[0]} is {found[1]}; sharded tensors must be under "
            f"{' or '.join(repr(k) for k in SHARDED_KEYS)} (the model's and optimizer's state dicts)")
    return dist_state, extra


def _dist() -> tuple[bool, int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(), dist.get_world_size()
    return False, 0, 1


def _planner():
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class BalancedSPMDSavePlanner(SPMDSavePlanner):
        """SPMDSavePlanner whose duplicate shards go to the rank with the least to write
        (torch_xla's own keeps every duplicate on the lowest rank)."""

        def create_global_plan(self, all_plans):
            import dataclasses
            from collections import ChainMap

            from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

            all_plans = dedup_save_plans(all_plans, save_to_lowest_rank=False)
            global_plan, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
            mappings = dict(ChainMap(*[p.planner_data for p in global_plan]))
            return global_plan, dataclasses.replace(metadata, planner_data=mappings)

    return BalancedSPMDSavePlanner()


def stage_sharded(state: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Copy this rank's shards (and the rest of ``state``) to host memory: the only part of a
    sharded save that must happen before training goes on. Returns what :func:`write_staged`
    writes."""
    import torch_xla
    from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict

    found = unsupported_sharding(state)
    if found is not None:
        raise ShardedStateError(
            f"save_checkpoint: {found[0]} is {found[1]}. The sharded checkpoint handles SPMD "
            "tensors (prepare_sharded_model / FSDPv2); save this state with its own library's "
            "per-rank checkpoint, or train with rtx.prepare_sharded_model(model).")
    dist_state, extra = _split(state)
    torch_xla.sync()
    # As torch_xla's CheckpointManager.save_async: local shards to CPU, in one transfer.
    return _sharded_cpu_state_dict(dist_state), to_cpu(extra)


def write_staged(staged: tuple[dict[str, Any], dict[str, Any]], directory: str,
                 process_group=None) -> dict[str, Any]:
    """Write staged state into ``directory`` with ``torch.distributed.checkpoint`` (collective:
    every rank calls it, in the same order; ``process_group`` defaults to the default group).
    Returns what this rank wrote: ``{"files": [...], "bytes": n}``."""
    import torch.distributed.checkpoint as dcp
    import torch_xla.runtime as xr

    dist_state, extra = staged
    distributed, rank, world = _dist()
    os.makedirs(directory, exist_ok=True)
    before = set(os.listdir(directory))
    dcp.save(dist_state, storage_writer=dcp.FileSystemWriter(directory), planner=_planner(),
             process_group=process_group, no_dist=not distributed)
    if rank == 0:
        torch.save(extra, os.path.join(directory, EXTRA_FILE))
        with open(os.path.join(directory, SHARDED_MARKER), "w") as f:
            json.dump({
                "format": "torch.distributed.checkpoint",
                "planner": "torch_xla SPMDSavePlanner",
                "workers": world,
                "devices": xr.global_runtime_device_count(),
                "keys": sorted(dist_state),
            }, f)
    files = sorted(set(os.listdir(directory)) - before)
    return {"files": files,
            "bytes": sum(os.path.getsize(os.path.join(directory, f)) for f in files)}


def save_sharded(state: Mapping[str, Any], directory: str) -> dict[str, Any]:
    """Write this rank's shards of ``state["model"]`` / ``state["optimizer"]`` into ``directory``
    (and, on rank 0, the rest of ``state`` and the metadata). Call it on every rank.

    Returns what this rank wrote: ``{"files": [...], "bytes": n}``.
    """
    return write_staged(stage_sharded(state), directory)


def _saved_keys(metadata) -> set[str]:
    mappings = metadata.planner_data or {}
    return {str(mappings[k][0]) if k in mappings else k.split(".")[0]
            for k in metadata.state_dict_metadata}


def _check_target(metadata, target: dict[str, Any], directory: str) -> None:
    """Every tensor of ``target`` of the shape and dtype the checkpoint saved, no key missing
    on either side (``format.check_fits``), before DCP reads anything: torch_xla's
    SPMDLoadPlanner compares sizes only for unsharded tensors."""
    # The keys torch_xla's SPMD planners give the entries (lists of values stay one entry).
    from torch_xla.experimental.distributed_checkpoint._helpers import flatten_state_dict

    flat, _ = flatten_state_dict(target)
    saved = saved_specs(metadata)
    mappings = metadata.planner_data or {}
    # Only the entries loaded: a checkpoint with an optimizer loads into a model alone.
    saved = {k: v for k, v in saved.items()
             if (str(mappings[k][0]) if k in mappings else k.split(".")[0]) in target}
    check_fits(saved, {k: spec_of(v) for k, v in flat.items()},
               f"load_checkpoint: the sharded checkpoint {directory}",
               " and ".join(f"the {k}" for k in sorted(target)))


def load_sharded(
    directory: str,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """Restore ``model`` and ``optimizer`` in place from a :func:`save_sharded` directory, onto
    whatever mesh, device count and worker count they now have. Call it on every rank.

    Returns the rest of the saved state (``extra.pt``: step, epoch, ...). Raises
    ``CheckpointMismatchError`` naming every tensor whose saved shape or dtype differs from the
    model's or optimizer's, and every key missing on either side, before anything is read.
    """
    import torch.distributed.checkpoint as dcp
    import torch_xla
    from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner, prime_optimizer

    reader = dcp.FileSystemReader(directory)
    metadata = reader.read_metadata()
    saved = _saved_keys(metadata)
    target: dict[str, Any] = {}
    if model is not None:
        target["model"] = model.state_dict()
        if "model" in saved:  # before priming the optimizer, which steps the parameters
            _check_target(metadata, target, directory)
    if optimizer is not None:
        if not optimizer.state:
            # DCP loads in place: the optimizer state must exist (a zero-gradient step).
            prime_optimizer(optimizer)
        target["optimizer"] = optimizer.state_dict()
    missing = sorted(set(target) - saved)
    if missing:
        raise KeyError(f"load_checkpoint: the sharded checkpoint {directory} has no {missing} "
                       f"(it holds {sorted(saved)})")
    distributed, _, _ = _dist()
    if target:
        _check_target(metadata, target, directory)
        dcp.load(target, storage_reader=reader, planner=SPMDLoadPlanner(), no_dist=not distributed)
        if model is not None:
            model.load_state_dict(target["model"])
        if optimizer is not None:
            optimizer.load_state_dict(target["optimizer"])
        torch_xla.sync()
    extra_file = os.path.join(directory, EXTRA_FILE)
    if os.path.exists(extra_file):
        return torch.load(extra_file, map_location="cpu", weights_only=False)
    return {}
