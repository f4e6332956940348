"""Sharded checkpoints: every rank writes only its own shards with ``torch.distributed.checkpoint``.
Here: what a state is (:func:`describe`, a save's first step, for every layout) and the loading
of both layouts; the writing is ``writer.py``'s.

Two layouts of sharded state, one format (``format.py``, names in ``names.py``, so that either
restores onto another mesh, device count, worker count or layout):

- ``spmd``: torch_xla SPMD tensors (FSDPv2, ``TorchXLAConfig(spmd=True)``), through torch_xla's
  ``SPMDSavePlanner`` / ``SPMDLoadPlanner``: a rank writes the shards its devices hold and reads
  back exactly the pieces its devices need;
- ``dtensor``: DTensors (FSDP2 on the native stacks, ``TorchNeuronConfig`` / ``TorchTPUConfig``
  and their CPU twins), through DCP's default planners, and on loading torch's own
  ``get_state_dict`` / ``set_state_dict`` (``torch.distributed.checkpoint.state_dict``).

torch_xla is imported only for the ``spmd`` layout: native workers never import it.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from ray_train_xla.toolkit.checkpoint.files import load_small, read_file
from ray_train_xla.toolkit.checkpoint.format import (
    EXTRA_FILE,
    GROUPS_FILE,
    SHARDED_KEYS,
    SHARDED_MARKER,
    check_fits,
    reader_for,
    saved_specs,
    spec_of,
)
from ray_train_xla.toolkit.checkpoint.names import (
    FORMAT_VERSION,
    index_optimizer_state,
    module_name,
    name_optimizer_state,
    named_model_state,
    named_optimizer_state,
    optimizer_param_names,
)
from ray_train_xla.toolkit.sharding import DTENSOR, SPMD, ShardedStateError, walk_sharded


def layout_of(desc: str) -> str | None:
    """The layout of a sharded thing (``walk_sharded``'s description): spmd, dtensor, or None
    for sharded state neither restores (torch_xla FSDP v1 flat shards)."""
    if desc.startswith(("an SPMD tensor", "an XLAShardedTensor", "a torch_xla FSDPv2 module")):
        return SPMD
    if desc.startswith("a DTensor"):
        return DTENSOR
    return None


def sharded_layout(state: Any, helper: str, found: list | None = None) -> str | None:
    """spmd or dtensor for sharded ``state``, None for replicated state. Raises
    ShardedStateError for state that mixes the two or holds FSDP v1 shards. ``found``: the
    sharded things seen (``walk_sharded``'s), appended to it."""
    layouts: dict[str, str] = {}
    for path, desc in walk_sharded(state, ""):
        kind = layout_of(desc)
        if kind is None:
            raise ShardedStateError(
                f"{helper}: {path} is {desc}. The sharded checkpoint handles SPMD tensors (FSDPv2 "
                "under TorchXLAConfig(spmd=True)) and DTensors (FSDP2 on the native configs); save "
                "this state with its own library's per-rank checkpoint, or shard the model with "
                "rtx.prepare_sharded_model(model).")
        layouts.setdefault(kind, path)
        if found is not None:
            found.append((path, desc))
    if len(layouts) > 1:
        raise ShardedStateError(
            f"{helper}: the state mixes torch_xla SPMD tensors ({layouts[SPMD]}) and DTensors "
            f"({layouts[DTENSOR]}); a checkpoint holds one kind")
    return next(iter(layouts), None)


def process_info() -> tuple[bool, int, int]:
    """(whether a process group is initialised, this rank, the world size)."""
    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(), dist.get_world_size()
    return False, 0, 1


def describe(state: Mapping[str, Any], helper: str = "save_checkpoint") -> dict[str, Any]:
    """A save's first step: what ``state`` is, found once. ``layout``: spmd, dtensor, or None
    for replicated state, which is kept whole (``state``). Sharded state is split into
    ``named`` (``state["model"]`` and ``state["optimizer"]``'s state under the module's names),
    ``groups`` (the optimizer's parameter groups, which rank 0 writes as one small file) and
    ``extra`` (the rest of ``state``). Raises ShardedStateError as :func:`sharded_layout`
    does, and for sharded tensors outside the model's and the optimizer's state."""
    found: list[tuple[str, str]] = []
    layout = sharded_layout(state, helper, found)
    if layout is None:
        return {"layout": None, "state": dict(state)}
    for path, what in found:
        if not any(path == k or path.startswith(f"{k}.") for k in SHARDED_KEYS):
            raise ShardedStateError(
                f"{helper}: state entry {path} is {what}; sharded tensors must be under "
                f"{' or '.join(repr(k) for k in SHARDED_KEYS)} (the model's and optimizer's "
                "state dicts)")
    named: dict[str, Any] = {}
    groups = None
    if "model" in state:
        named["model"] = named_model_state(state["model"])
    if "optimizer" in state:
        optim = named_optimizer_state(state["optimizer"])
        named["optimizer"], groups = {"state": optim["state"]}, optim["param_groups"]
    return {"layout": layout, "named": named, "groups": groups,
            "extra": {k: v for k, v in state.items() if k not in SHARDED_KEYS}}


# ---- loading ------------------------------------------------------------------------------

def format_version(directory: str, filesystem=None) -> int:
    """The format version of a sharded checkpoint (1: written before names, see names.py)."""
    marker = read_file(directory, SHARDED_MARKER, filesystem)
    return 1 if marker is None else int(json.loads(marker).get("format_version", 1))


def _top_key(metadata, key: str) -> str:
    mappings = metadata.planner_data or {}
    return str(mappings[key][0]) if key in mappings else key.split(".")[0]


def _flatten(target: dict[str, Any], layout: str) -> dict[str, Any]:
    """The flat keys DCP gives ``target``'s entries under the planner of ``layout``."""
    if layout == SPMD:
        from torch_xla.experimental.distributed_checkpoint._helpers import flatten_state_dict
    else:
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    flat, _ = flatten_state_dict(target)
    return flat


def _check_target(metadata, target: dict[str, Any], layout: str, directory: str) -> None:
    """Every tensor of ``target`` of the shape and dtype the checkpoint saved, no key missing
    on either side (``format.check_fits``), before DCP reads anything: torch_xla's
    SPMDLoadPlanner compares sizes only for unsharded tensors."""
    saved = saved_specs(metadata)
    # Only the entries loaded: a checkpoint with an optimizer loads into a model alone.
    saved = {k: v for k, v in saved.items() if _top_key(metadata, k) in target}
    check_fits(saved, {k: spec_of(v) for k, v in _flatten(target, layout).items()},
               f"load_checkpoint: the sharded checkpoint {directory}",
               " and ".join(f"the {k}" for k in sorted(target)))


def _in_saved_keys(target: dict[str, Any], order: list[str], metadata, version: int) -> dict[str, Any]:
    """``target`` (named) under the keys a format-1 checkpoint used: FSDPv2's prefixed model
    keys, the optimizer state by position (``order``: the optimizer's parameter names in its
    order). Format 2 and later: ``target`` itself."""
    if version >= FORMAT_VERSION:
        return target
    out: dict[str, Any] = {}
    if "model" in target:
        keys = [k[len("model."):] for k in metadata.state_dict_metadata
                if _top_key(metadata, k) == "model"]
        saved = {module_name(k): k for k in keys}
        out["model"] = {saved.get(n, n): v for n, v in target["model"].items()}
    if "optimizer" in target:
        position = {n: i for i, n in enumerate(order)}
        out["optimizer"] = {"state": {position[n]: v
                                      for n, v in target["optimizer"]["state"].items()}}
    return out


def read_groups(directory: str, filesystem=None) -> list | None:
    """The optimizer's parameter groups a sharded checkpoint holds (``param_groups.pt``, format
    2 and later), None when it has none."""
    data = read_file(directory, GROUPS_FILE, filesystem)
    return None if data is None else torch.load(io.BytesIO(data), map_location="cpu",
                                                weights_only=True)


def load_sharded(
    directory: str,
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    process_group=None,
    filesystem=None,
) -> dict[str, Any]:
    """Restore sharded ``model`` and ``optimizer`` in place from a :func:`save_sharded`
    directory of either layout, onto whatever mesh, device count and worker count they now
    have. Call it on every rank (``process_group``: the gloo group DCP coordinates through,
    default the default group; ``filesystem``: a pyarrow filesystem the directory is on, default
    the local one).

    Returns the rest of the saved state (``extra.pt``: step, epoch, ...). Raises
    ``CheckpointMismatchError`` naming every tensor whose saved shape or dtype differs from the
    model's or optimizer's, and every key missing on either side, before anything is read.
    """
    import torch.distributed.checkpoint as dcp

    layout = sharded_layout({"model": model, "optimizer": optimizer}, "load_checkpoint") or DTENSOR
    reader, metadata = reader_for(directory, filesystem)
    version = format_version(directory, filesystem)
    saved = {_top_key(metadata, k) for k in metadata.state_dict_metadata}
    wanted = [k for k, v in (("model", model), ("optimizer", optimizer)) if v is not None]
    missing = sorted(set(wanted) - saved)
    if missing:
        raise KeyError(f"load_checkpoint: the sharded checkpoint {directory} has no {missing} "
                       f"(it holds {sorted(saved)})")
    if not wanted:
        return read_extra(directory, filesystem)
    names = optimizer_param_names(model, optimizer, "load_checkpoint") if optimizer else []
    order = [n for group in names for n in group]
    target: dict[str, Any] = {}
    if model is not None:
        target["model"] = _model_target(model, layout)
        # Before priming the optimizer, which steps the parameters.
        _check_target(metadata, _in_saved_keys(target, order, metadata, version), layout, directory)
    if optimizer is not None:
        target["optimizer"] = _optimizer_target(model, optimizer, names, layout)
    loaded = _in_saved_keys(target, order, metadata, version)
    _check_target(metadata, loaded, layout, directory)
    planner = None
    if layout == SPMD:
        from torch_xla.experimental.distributed_checkpoint import SPMDLoadPlanner

        planner, process_group = SPMDLoadPlanner(), None
    dcp.load(loaded, storage_reader=reader, planner=planner, process_group=process_group,
             no_dist=not process_info()[0])
    groups = read_groups(directory, filesystem) if version >= FORMAT_VERSION else None
    _apply(model, optimizer, target, groups, names, layout,
           f"load_checkpoint: the sharded checkpoint {directory}")
    return read_extra(directory, filesystem)


def read_extra(directory: str, filesystem=None) -> dict[str, Any]:
    """The rest of the state a sharded checkpoint holds (``extra.pt``: step, epoch, ...)."""
    extra = load_small(directory, EXTRA_FILE, filesystem)
    return {} if extra is None else extra


def _model_target(model: torch.nn.Module, layout: str) -> dict[str, Any]:
    if layout == SPMD:
        return named_model_state(model.state_dict())
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return named_model_state(get_model_state_dict(model))


def _optimizer_target(model, optimizer, names, layout: str) -> dict[str, Any]:
    """The optimizer's state, named, for DCP to load into in place (primed first: a zero-grad
    step creates the state an optimizer has none of before its first step)."""
    if layout == SPMD:
        if not optimizer.state:
            from torch_xla.experimental.distributed_checkpoint import prime_optimizer

            prime_optimizer(optimizer)
        return {"state": name_optimizer_state(optimizer.state_dict(), names)["state"]}
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    named = get_optimizer_state_dict(model, optimizer)  # primes an empty state
    return {"state": {module_name(k): v for k, v in named["state"].items()}}


def _apply(model, optimizer, target, groups, names, layout: str, where: str) -> None:
    """Put what DCP read into ``target`` into the model and optimizer: DCP filled the
    tensors in place; the saved parameter groups (learning rates, ...) are set here."""
    if model is not None:
        by_name = target["model"]
        if layout == SPMD:
            model.load_state_dict({k: by_name[module_name(k)] for k in model.state_dict()})
        else:
            from torch.distributed.checkpoint.state_dict import (
                get_model_state_dict,
                set_model_state_dict,
            )

            set_model_state_dict(model, {k: by_name[module_name(k)]
                                         for k in get_model_state_dict(model)})
    if optimizer is not None:
        osd = optimizer.state_dict()
        named = {"state": target["optimizer"]["state"],
                 "param_groups": groups or name_optimizer_state(osd, names)["param_groups"]}
        optimizer.load_state_dict(index_optimizer_state(named, osd, names, where))
    if layout == SPMD:
        import torch_xla

        torch_xla.sync()
