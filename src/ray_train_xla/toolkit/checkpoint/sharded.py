"""Sharded state: every rank writes and reads only its own shards with
``torch.distributed.checkpoint``. Two kinds, one object each (``describe.kind_of`` picks it),
one format (``format.py``, names in ``names.py``), so that either restores onto another mesh,
device count, worker count or layout:

- ``SPMD_SHARDS``: torch_xla SPMD tensors (FSDPv2, ``TorchXLAConfig(spmd=True)``), through
  torch_xla's ``SPMDSavePlanner`` / ``SPMDLoadPlanner``: a rank writes the shards its devices
  hold and reads back exactly the pieces its devices need;
- ``DTENSOR_SHARDS``: DTensors (FSDP2 and tensor parallelism on the native stacks,
  ``TorchNeuronConfig`` / ``TorchTPUConfig`` and their CPU twins, any placements on any mesh),
  through DCP's default planners, read into the modules' own state dicts (``describe.py``)
  and given back with ``load_state_dict``; the optimizers' state under their parameters'
  names, primed first (``names.py``).

Each kind stages a save (``stage``), gives its writer (``writer``) and restores (``restore``): a
sharded checkpoint in place, each rank reading the pieces its shards need; a replicated one
(``checkpoint.pt``) by every rank taking its shards of the whole tensors. torch_xla is imported
only for SPMD state: native workers never import it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ray_train_xla.errors import ShardedStateError
from ray_train_xla.toolkit.checkpoint.names import index_optimizer_state
from ray_train_xla.toolkit.checkpoint.staging import Staged, stage_dtensors
from ray_train_xla.toolkit.checkpoint.writer import process_info, write_staged
from ray_train_xla.toolkit.collectives import host_group
from ray_train_xla.toolkit.device import to_cpu
from ray_train_xla.toolkit.sharding import DTENSOR, SPMD


class Shards:
    """What both kinds of sharded state share: every rank stages, writes and restores its own
    shards. A kind sets what differs (the methods below its docstring's first line)."""

    layout = ""  # what sharded.json says
    sharded = True  # every rank writes its own shards
    in_place = False  # the memory tier writes it rank by rank, in place (rank_files.py)
    writer_process = False  # torch's writer process writes it (dcp.async_save)

    # -- a save
    def stage(self, state, overlap: bool = False, shared: bool = False, stager=None) -> Staged:
        """Copy ``state`` (``describe.CheckpointState``) to host memory: the part of a save
        that must happen before training goes on."""
        raise NotImplementedError

    def writer(self, staged: Staged, filename: str, writer_process: bool = False):
        """``write(directory, filesystem)``: every rank writes its shards with DCP, collectively
        over a gloo group of its own (made here, on the training thread: every rank, in order),
        through torch's writer process where ``writer_process`` and the kind allows."""
        group = host_group("checkpoint")

        def write(directory: str, filesystem) -> dict[str, Any]:
            return write_staged(staged, directory, group, filesystem, writer_process,
                                self.save_planner())

        return write

    def save_planner(self):
        from torch.distributed.checkpoint import DefaultSavePlanner

        return DefaultSavePlanner()

    # -- what a restore needs of the kind
    def prime(self, optimizer) -> None:
        """Give an optimizer without state its state (a zero-gradient step at a learning rate
        of 0, which moves no parameter), for DCP to load into in place."""
        raise NotImplementedError

    def load_args(self) -> dict[str, Any]:
        """The planner and process group of ``dcp.load``."""
        return {}

    def done(self) -> None:
        """After a restore: nothing left pending on the device."""

    # -- a restore
    def restore(self, target, source) -> dict[str, Any]:
        """Fill ``target`` (``describe.CheckpointState``) in place from ``source`` (either
        format, ``source.py``): DCP reads into the targets' own tensors the pieces their shards
        need (of a replicated checkpoint: the slices of its whole tensors); then the optimizers
        take the saved parameter groups. Returns what ``target.restored`` gives of the saved
        rest. Raises ``CheckpointMismatchError`` naming every tensor whose saved shape or dtype
        differs, and every key missing on either side, before anything is read: the models
        first; an optimizer primed for the check is left without state again."""
        import torch.distributed.checkpoint as dcp

        where = f"load_checkpoint: {source.where}"
        source.require(target)  # every entry it restores: before anything is read
        saved = source.rest()
        for part in target.optimizers:
            if part.names is None:
                raise ShardedStateError(
                    f"{where}: the optimizer {part.key!r} steps parameters that no model given "
                    "holds; its sharded state is named by them: pass the model it steps")
        primed = [p.optimizer for p in target.optimizers if not p.optimizer.state]
        for optimizer in primed:
            self.prime(optimizer)
        loaded = {p.key: p.state for p in target.models}
        for part in target.optimizers:  # the optimizer's own state tensors, by name
            params = [p for group in part.optimizer.param_groups for p in group["params"]]
            loaded[part.key] = {"state": {n: part.optimizer.state[p] for p, n in zip(
                params, (n for group in part.names for n in group)) if p in part.optimizer.state}}
        try:
            plan = source.plan(loaded, {p.key: p.names for p in target.optimizers}, source.where)
        except Exception:
            for optimizer in primed:  # as it was: without state
                optimizer.state.clear()
            raise
        state = plan.state if plan is not None else {}
        for optimizer in primed:  # one the checkpoint has no state for: as it was
            if not any(p.optimizer is optimizer and p.key in state for p in target.optimizers):
                optimizer.state.clear()
        if plan is not None:
            dcp.load(plan.state, storage_reader=plan.reader, no_dist=not process_info()[0],
                     **self.load_args())
        groups = source.groups()
        for part in target.models:  # DCP filled its tensors in place: the module's own again
            part.module.load_state_dict({k: loaded[part.key][n] for k, n in part.keys.items()})
        for part in target.optimizers:
            if part.key not in state:
                continue
            osd = part.optimizer.state_dict()
            saved_groups = groups.get(part.key) or [{**g, "params": list(names)} for g, names
                                                    in zip(osd["param_groups"], part.names)]
            named = {"state": loaded[part.key]["state"], "param_groups": saved_groups}
            part.optimizer.load_state_dict(index_optimizer_state(named, osd, part.names, where))
        self.done()
        return target.restored(saved)


class DTensorShards(Shards):
    """DTensors: FSDP2 and tensor parallelism, any placements on any mesh. Staged by their local
    shards into the reused host buffers, while the next step runs where ``overlap``
    (``staging.py``); written by torch's writer process where asked; restored in place, DCP
    coordinating over a gloo group of its own."""

    layout = DTENSOR
    in_place = True
    writer_process = True

    def stage(self, state, overlap: bool = False, shared: bool = False, stager=None) -> Staged:
        entries, names = _entries(state)
        tree, specs, copy, release = stage_dtensors(entries, overlap, stager)
        return Staged(self, copy, release, *names, tree, specs)

    def prime(self, optimizer) -> None:
        # As torch's own get_optimizer_state_dict primes an optimizer, by public calls.
        with _at_zero_lr(optimizer):
            for group in optimizer.param_groups:
                for param in group["params"]:
                    if param.requires_grad:
                        param.grad = torch.zeros_like(param)
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def load_args(self) -> dict[str, Any]:
        return {"process_group": host_group("load")}


class SPMDShards(Shards):
    """torch_xla SPMD tensors (FSDPv2): staged in one transfer of the local shards (as torch_xla's
    ``CheckpointManager`` does), written and read with torch_xla's SPMD planners in the
    reporter's thread, restored through the module's own ``load_state_dict``."""

    layout = SPMD

    def stage(self, state, overlap: bool = False, shared: bool = False, stager=None) -> Staged:
        import torch_xla
        import torch_xla.runtime as xr
        from torch_xla.experimental.distributed_checkpoint._helpers import _sharded_cpu_state_dict

        entries, names = _entries(state)
        torch_xla.sync()
        # As torch_xla's CheckpointManager.save_async: local shards to CPU, in one transfer.
        return Staged(self, _one_copy_per_chunk(_sharded_cpu_state_dict(entries)), None, *names,
                      devices=xr.global_runtime_device_count())

    def save_planner(self):
        import dataclasses
        from collections import ChainMap

        from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
        from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

        class BalancedSPMDSavePlanner(SPMDSavePlanner):
            """SPMDSavePlanner whose duplicate shards go to the rank with the least to write
            (torch_xla's own keeps every duplicate on the lowest rank)."""

            def create_global_plan(self, all_plans):
                from torch.distributed.checkpoint.default_planner import (
                    create_default_global_save_plan,
                )

                all_plans = dedup_save_plans(all_plans, save_to_lowest_rank=False)
                global_plan, metadata = create_default_global_save_plan(
                    all_plans, rewrite_index_hints=False)
                mappings = dict(ChainMap(*[p.planner_data for p in global_plan]))
                return global_plan, dataclasses.replace(metadata, planner_data=mappings)

        return BalancedSPMDSavePlanner()

    def prime(self, optimizer) -> None:
        from torch_xla.experimental.distributed_checkpoint import prime_optimizer

        with _at_zero_lr(optimizer):
            prime_optimizer(optimizer)

    def load_args(self) -> dict[str, Any]:
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        return {"planner": SPMDLoadPlanner(), "process_group": None}

    def done(self) -> None:
        import torch_xla

        torch_xla.sync()


def _entries(state) -> tuple[dict[str, Any], tuple]:
    """A save's sharded entries (each model part's and optimizer's state, by entry), and what
    ``Staged`` takes after the copy and its release: the optimizers' parameter groups, the
    replicated rest (on the CPU), the model and optimizer entries."""
    entries = {**{p.key: p.state for p in state.models},
               **{o.key: o.state for o in state.optimizers}}
    return entries, ({o.key: o.groups for o in state.optimizers}, to_cpu(state.extras),
                     [p.key for p in state.models], [o.key for o in state.optimizers])


def _one_copy_per_chunk(tree):
    """``tree`` with each local shards' object (``shards``, ``global_shape``) keeping one shard
    per chunk of the tensor: torch_xla lists a chunk once per local device that holds it (a
    tensor replicated over the mesh's ``model`` axis under TP, or over replicas), and its
    planner would write and declare every copy, so the metadata would count the tensor's
    elements twice. DCP keeps one copy of a chunk that several processes hold."""
    if isinstance(tree, dict):
        for value in tree.values():
            _one_copy_per_chunk(value)
    elif isinstance(tree, (list, tuple)):
        for value in tree:
            _one_copy_per_chunk(value)
    elif hasattr(tree, "shards") and hasattr(tree, "global_shape"):
        seen, kept = set(), []
        for shard in sorted(tree.shards, key=lambda s: s.replica_id):
            chunk = ("...",) if shard.indices is Ellipsis else tuple(
                (s.start, s.stop) for s in shard.indices)
            if chunk not in seen:
                seen.add(chunk)
                kept.append(shard)
        tree.shards = kept
    return tree


@contextlib.contextmanager
def _at_zero_lr(optimizer) -> Iterator[None]:
    """Each parameter group's learning rate 0 inside (a step moves no parameter, weight decay
    included), as it was after."""
    lrs = [group.get("lr") for group in optimizer.param_groups]
    for group in optimizer.param_groups:
        if "lr" in group:
            group["lr"] = torch.tensor(0.0) if isinstance(group["lr"], torch.Tensor) else 0.0
    try:
        yield
    finally:
        for group, lr in zip(optimizer.param_groups, lrs):
            if lr is not None:
                group["lr"] = lr


DTENSOR_SHARDS, SPMD_SHARDS = DTensorShards(), SPMDShards()


__all__ = ["DTENSOR_SHARDS", "SPMD_SHARDS", "DTensorShards", "SPMDShards", "Shards",
           "process_info"]
