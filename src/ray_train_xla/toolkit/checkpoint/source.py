"""Where a restore reads from: a checkpoint as it lies (a directory on the local file system, on a
pyarrow filesystem such as the run's storage, or in the memory tier's stores), opened once as
one of its two formats (``open_source``):

- :class:`ShardedSource`: a sharded checkpoint (``format.py``), read by DCP (torch's
  ``FileSystemReader``; the memory tier's ``rank_files.SlotReader`` for one written rank by
  rank);
- :class:`FileSource`: a replicated checkpoint, one plain file, held whole once read; sharded
  targets read it through DCP too (:class:`WholeReader`), each rank taking its slices.

Each tells a restore what it reads into what (``plan``: checked against the targets before
anything is read), the optimizers' saved parameter groups, the rest of the saved state, and,
for a replicated target, every entry whole (``read_whole``, checked by :func:`check_whole`).
"""

from __future__ import annotations

import io
import os
from collections.abc import Mapping
from typing import Any, NamedTuple

import torch
from torch.distributed.checkpoint import StorageReader

from ray_train_xla.errors import CheckpointMismatchError
from ray_train_xla.toolkit.checkpoint.files import load_small, read_file
from ray_train_xla.toolkit.checkpoint.format import (
    CHECKPOINT_FILE,
    EXTRA_FILE,
    GROUPS_FILE,
    SHARDED_MARKER,
    check_fits,
    flat_specs,
    is_sharded_checkpoint,
    read_full_state,
    reader_for,
    saved_specs,
    spec_of,
)
from ray_train_xla.toolkit.checkpoint.names import (
    index_optimizer_state,
    module_name,
    named_model_state,
    positional_names,
)

FSDP_V2_PREFIX = "_orig_module."


class Plan(NamedTuple):
    """What ``dcp.load`` reads: into ``state`` (under the checkpoint's own keys), by ``reader``."""

    state: dict[str, Any]
    reader: Any


def open_source(path: str, filesystem=None, where: str = "", filename: str = CHECKPOINT_FILE):
    """The checkpoint in directory ``path`` (on ``filesystem``, a pyarrow filesystem; None: the
    local one), as a restore reads it; ``where`` names it in messages, ``filename`` is the plain
    file's name."""
    sharded = is_sharded_checkpoint(path, filesystem)
    return (ShardedSource if sharded else FileSource)(path, filesystem, where, filename)


class Source:
    """What both formats share: where the checkpoint lies."""

    def __init__(self, path: str, filesystem=None, where: str = "",
                 filename: str = CHECKPOINT_FILE) -> None:
        self.path, self.filesystem, self.filename = path, filesystem, filename
        self.where = where or f"checkpoint {path}"

    def require(self, target) -> None:
        """Raise ``CheckpointMismatchError`` before anything is read when the checkpoint lacks an
        entry ``target`` restores (a model, an optimizer, an object with ``load_state_dict``):
        none is left as it was without a word."""
        held = self.entries()
        wanted = [p.key for p in target.models] + [o.key for o in target.optimizers]
        missing = [k for k in wanted + list(target.objects) if k not in held]
        if missing:
            raise CheckpointMismatchError(
                f"load_checkpoint: {self.where} has no {', '.join(map(repr, missing))} to "
                f"restore (it holds {sorted(held)})")


class ShardedSource(Source):
    """A sharded checkpoint: DCP's files, ``param_groups.pt``, ``extra.pt``, ``sharded.json``."""

    def __init__(self, *args, **kwargs) -> None:
        import json

        super().__init__(*args, **kwargs)
        self._rest: dict[str, Any] | None = None
        marker = read_file(self.path, SHARDED_MARKER, self.filesystem)
        # 1: written before names (names.py)
        self.version = 1 if marker is None else int(json.loads(marker).get("format_version", 1))

    def plan(self, target: dict[str, Any], optimizers: Mapping[str, list[list[str]]],
             where: str = "") -> Plan | None:
        """What ``dcp.load`` reads into ``target`` (each entry's tensors, named; ``optimizers``:
        each optimizer entry's parameter names), after checking that the checkpoint holds every
        entry, and that every tensor of the target has the shape and dtype the checkpoint saved,
        no key missing on either side (``format.check_fits``): the models first, then
        everything. torch_xla's SPMDLoadPlanner compares sizes only for unsharded tensors. None
        when there is nothing to read."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        what = f"load_checkpoint: the sharded checkpoint {self.path}"
        reader, metadata = reader_for(self.path, self.filesystem)
        saved = {_top_key(metadata, k) for k in metadata.state_dict_metadata}
        missing = sorted(set(target) - saved)
        if missing:  # (Source.require refused it before: a caller of its own)
            raise CheckpointMismatchError(f"{what} has no {missing} (it holds {sorted(saved)})")
        if not target:
            return None
        state = in_saved_keys(target, optimizers, metadata, self.version)
        specs = saved_specs(metadata)
        for entries in ({k: v for k, v in state.items() if k not in optimizers}, state):
            # Only the entries loaded: a checkpoint with an optimizer loads into a model alone.
            check_fits({k: v for k, v in specs.items() if _top_key(metadata, k) in entries},
                       {k: spec_of(v) for k, v in flatten_state_dict(entries)[0].items()}, what,
                       " and ".join(f"the {k}" for k in sorted(entries)))
        return Plan(state, reader)

    def entries(self) -> set[str]:
        """The entries the checkpoint holds: its sharded tensors' and the rest's."""
        _, metadata = reader_for(self.path, self.filesystem)
        return {_top_key(metadata, k) for k in metadata.state_dict_metadata} | set(self.rest())

    def groups(self) -> dict[str, list]:
        """Each optimizer's parameter groups (``param_groups.pt``), by entry; {} before format 2."""
        data = read_file(self.path, GROUPS_FILE, self.filesystem)
        if data is None:
            return {}
        groups = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        return groups if self.version >= 3 else {"optimizer": groups}

    def rest(self) -> dict[str, Any]:
        """The rest of the saved state (``extra.pt``: step, epoch, an LR scheduler's, ...)."""
        if self._rest is None:
            extra = load_small(self.path, EXTRA_FILE, self.filesystem)
            self._rest = {} if extra is None else extra
        return self._rest

    def read_whole(self, target) -> dict[str, Any]:
        """The target's entries whole (every rank reads every shard), in the form of its own
        state dicts (the module's keys; numbered optimizer state)."""
        keys = tuple([p.key for p in target.models] + [o.key for o in target.optimizers])
        full = read_full_state(self.path, keys, filesystem=self.filesystem) if keys else {}
        state: dict[str, Any] = {}
        for part in target.models:
            if part.key in full:
                named = named_model_state(full[part.key])
                state[part.key] = ({k: named[n] for k, n in part.keys.items()}
                                   if set(part.keys.values()) == set(named) else named)
        groups = self.groups()
        for part in target.optimizers:
            if part.key not in full:
                continue
            if self.version < 2:
                state[part.key] = full[part.key]
                continue
            if part.names is None or part.key not in groups:
                raise KeyError(f"load_checkpoint: {self.path}: a sharded checkpoint's optimizer "
                               "state is named; give the model with the optimizer")
            named = {"state": full[part.key].get("state", {}), "param_groups": groups[part.key]}
            state[part.key] = index_optimizer_state(named, part.optimizer.state_dict(),
                                                    part.names, f"load_checkpoint: {self.path}")
        return state


class FileSource(Source):
    """A replicated checkpoint: one plain torch file (``checkpoint.pt``), read whole once."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._state: dict[str, Any] | None = None
        self._groups: dict[str, list] = {}

    def rest(self) -> dict[str, Any]:
        """The state the file holds (CPU tensors). Raises FileNotFoundError naming the
        checkpoint when it is not there."""
        if self._state is None:
            file = os.path.join(self.path, self.filename)
            data = (read_file(self.path, self.filename, self.filesystem)
                    if self.filesystem is not None else None)
            if data is None and (self.filesystem is not None or not os.path.exists(file)):
                found = sorted(os.listdir(self.path)) if self.filesystem is None else "other files"
                raise FileNotFoundError(f"{self.where} has no {self.filename!r} (found {found}); "
                                        "was it written by save_checkpoint()?")
            # weights_only: the file comes from shared storage; plain tensors, containers and
            # numbers (what save_checkpoint writes) load without unpickling arbitrary objects.
            self._state = torch.load(file if data is None else io.BytesIO(data),
                                     map_location="cpu", weights_only=True)
        return self._state

    def entries(self) -> set[str]:
        """The entries the file holds."""
        return set(self.rest())

    def plan(self, target: dict[str, Any], optimizers: Mapping[str, list[list[str]]],
             where: str = "") -> Plan | None:
        """What ``dcp.load`` reads into sharded targets (as :meth:`ShardedSource.plan`): the
        file's whole tensors (its optimizers' state named by position), every rank taking its
        slices; checked against the targets first."""
        state = self.rest()
        whole = {k: named_model_state(state.get(k) or {}) for k in target if k not in optimizers}
        named = {k: positional_names(state[k], optimizers[k]) for k in optimizers if k in state}
        whole.update({k: {"state": v["state"]} for k, v in named.items()})
        self._groups = {k: v["param_groups"] for k, v in named.items()}
        for key in whole:
            check_fits(flat_specs(whole[key], f"{key}."), flat_specs(target[key], f"{key}."),
                       f"load_checkpoint: {where}", f"the {key}")
        return Plan({k: v for k, v in target.items() if k in whole}, WholeReader(whole))

    def groups(self) -> dict[str, list]:
        """Each optimizer's parameter groups, by entry, its parameters named by position (as
        the last :meth:`plan` named them)."""
        return self._groups

    def read_whole(self, target) -> dict[str, Any]:
        """The state the file holds."""
        return self.rest()


def check_whole(state: Mapping[str, Any], target, where: str) -> None:
    """Raise ``CheckpointMismatchError`` (``format.check_fits``) unless the whole ``state``
    fits ``target``: each model part every tensor of its module's state dict, of the same
    shape and dtype (``load_state_dict`` would cast a dtype silently), no key missing on either
    side; each optimizer's saved state its own, when it has some."""
    for part in target.models:
        saved = state.get(part.key)
        if not isinstance(saved, dict):
            check_fits({}, {part.key: None}, where, f"the {part.key}")
        # under the unwrapped model's names (an FSDPv2 model loads the plain model's keys)
        specs = [{k.replace(FSDP_V2_PREFIX, ""): v for k, v in flat_specs(s, f"{part.key}.").items()}
                 for s in (saved, part.module.state_dict())]
        check_fits(*specs, where, f"the {part.key}")
    for part in target.optimizers:
        if not part.optimizer.state:
            continue
        saved = state.get(part.key)
        saved_state = saved.get("state") if isinstance(saved, dict) else None
        if saved_state is None:
            check_fits({}, {part.key: None}, where, f"the {part.key}")
        check_fits(flat_specs(saved_state, f"{part.key}.state."),
                   flat_specs(part.optimizer.state_dict()["state"], f"{part.key}.state."),
                   where, f"the {part.key}")


def _top_key(metadata, key: str) -> str:
    """The entry of the state a flat key of a sharded checkpoint's metadata is under."""
    mappings = metadata.planner_data or {}
    return str(mappings[key][0]) if key in mappings else key.split(".")[0]


def in_saved_keys(target: dict[str, Any], optimizers: Mapping[str, list[list[str]]], metadata,
                  version: int) -> dict[str, Any]:
    """``target`` (named) under the keys a format-1 checkpoint used: FSDPv2's prefixed model
    keys, the optimizer state by position (``optimizers``: each optimizer's parameter names, in
    its order). Format 2 and later: ``target`` itself."""
    if version >= 2:
        return target
    out: dict[str, Any] = {}
    for key, value in target.items():
        if key in optimizers:
            order = [n for group in optimizers[key] for n in group]
            position = {n: i for i, n in enumerate(order)}
            out[key] = {"state": {position[n]: v for n, v in value["state"].items()}}
        else:
            keys = [k[len(key) + 1:] for k in metadata.state_dict_metadata
                    if _top_key(metadata, k) == key]
            saved = {module_name(k): k for k in keys}
            out[key] = {saved.get(n, n): v for n, v in value.items()}
    return out


class WholeReader(StorageReader):
    """DCP's ``StorageReader`` of state held whole in memory (a replicated checkpoint's tensors):
    each tensor one chunk, from which ``dcp.load`` copies the slices a target's shards need."""

    def __init__(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        self.flat, mappings = flatten_state_dict(state)
        self.metadata = Metadata(state_dict_metadata={
            key: TensorStorageMetadata(TensorProperties(dtype=v.dtype), v.size(),
                                       [ChunkStorageMetadata(torch.Size([0] * v.dim()), v.size())])
            if isinstance(v, torch.Tensor) else BytesStorageMetadata()
            for key, v in self.flat.items()}, planner_data=mappings)

    def reset(self, checkpoint_id=None) -> None:
        pass

    def read_metadata(self, *args, **kwargs):
        return self.metadata

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    def read_data(self, plan, planner):
        from torch.distributed.checkpoint.planner import LoadItemType

        for item in plan.items:
            value = self.flat[item.storage_index.fqn]
            if item.type == LoadItemType.BYTE_IO:
                data = io.BytesIO()
                torch.save(value, data)
                data.seek(0)
                planner.load_bytes(item, data)
                continue
            for dim, (start, length) in enumerate(zip(item.storage_offsets, item.lengths)):
                value = value.narrow(dim, start, length)
            target = planner.resolve_tensor(item).detach()
            target.copy_(value)
            planner.commit_tensor(item, target)
        future = torch.futures.Future()
        future.set_result(None)
        return future

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


__all__ = ["FileSource", "Plan", "ShardedSource", "Source", "WholeReader", "check_whole",
           "in_saved_keys", "open_source"]
