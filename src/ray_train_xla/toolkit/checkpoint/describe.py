"""A checkpoint's state as a typed value: the first step of a save (:func:`describe`) and of a
restore (:func:`target`).

A state is a list of model parts and a list of optimizers (the shape of torchtitan's
``ModelWrapper`` and ``OptimizersContainer``), each under the name of its entry, plus the
replicated rest, and the kind of state it is, found once: replicated, DTensor shards or torch_xla
SPMD shards (one object per kind, ``replicated.REPLICATED``, ``sharded.DTENSOR_SHARDS``,
``sharded.SPMD_SHARDS``). The kind then stages, writes and restores it.

What the entries of a state are, in ``save_checkpoint(state)`` and ``load_checkpoint(state)``:

- a module (``torch.nn.Module``): a model part; ``"model"`` holding a model's state dict is one too;
- an optimizer (``torch.optim.Optimizer``): an optimizer, its state under the names its
  parameters have in the model part that holds them; ``"optimizer"`` holding an optimizer's
  state dict is one too (named by the ``param_names`` its state dict carries, ``names.py``);
- an object with ``state_dict()`` and ``load_state_dict()`` (an LR scheduler): its state dict,
  saved with the rest and given back to it;
- anything else: the rest (step, epoch, ...), which must be replicated.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ray_train_xla.toolkit.checkpoint.names import (
    module_name,
    name_optimizer_state,
    named_model_state,
    named_optimizer_state,
    optimizer_param_names,
)
from ray_train_xla.toolkit.sharding import DTENSOR, SPMD, ShardedStateError, walk_sharded

# The entries of a state given as state dicts (``{"model": model.state_dict(), ...}``).
MODEL, OPTIMIZER = "model", "optimizer"


@dataclass
class ModelPart:
    """A model in a checkpoint, under its entry's name. ``state``: its tensors (a save's
    sharded state and a restore's, under the plain module's names); a restore's ``module``
    (what is filled) and ``keys`` (its state dict's keys -> the plain module's names)."""

    key: str
    state: dict[str, Any] | None = None
    module: torch.nn.Module | None = None
    keys: dict[str, str] = field(default_factory=dict)


@dataclass
class OptimizerPart:
    """An optimizer in a checkpoint, under its entry's name. A save's ``state`` (sharded state:
    ``{"state": {name: {...}}}``) and ``groups`` (its parameter groups, parameters by name); a
    restore's ``optimizer`` and the names of the parameters it steps in the model part that
    holds them (``names``, per group; None when no part given holds them)."""

    key: str
    state: dict[str, Any] | None = None
    groups: list[dict[str, Any]] | None = None
    optimizer: torch.optim.Optimizer | None = None
    names: list[list[str]] | None = None


@dataclass
class CheckpointState:
    """A checkpoint's state, typed: ``kind`` (replicated, DTensor or SPMD shards), the model
    parts, the optimizers, ``extras`` (the replicated rest a save writes), ``objects`` (what a
    restore gives its saved state back to: LR schedulers, ...) and ``whole_back`` (a restore
    given a model and an optimizer, not a mapping: it returns a replicated checkpoint whole)."""

    kind: Any
    models: list[ModelPart] = field(default_factory=list)
    optimizers: list[OptimizerPart] = field(default_factory=list)
    extras: dict[str, Any] = field(default_factory=dict)
    objects: dict[str, Any] = field(default_factory=dict)
    whole_back: bool = False

    def keys(self) -> list[str]:
        """The entries of the model parts and the optimizers."""
        return [p.key for p in self.models] + [o.key for o in self.optimizers]

    def restored(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """A restore's last step: give each object (an LR scheduler, ...) its saved state
        (``load_state_dict``; the kind checked first that ``saved`` holds it) and return what is
        left of the ``saved`` entries (all of a replicated checkpoint for a restore given a model
        and an optimizer, not a mapping)."""
        for key, obj in self.objects.items():
            obj.load_state_dict(saved[key])
        taken = set(self.keys()) | set(self.objects)
        return dict(saved) if self.whole_back else {k: v for k, v in saved.items()
                                                    if k not in taken}


def _stateful(value: Any) -> bool:
    """An object whose state is saved through its ``state_dict`` (an LR scheduler, ...)."""
    return not isinstance(value, (Mapping, torch.Tensor, torch.nn.Module,
                                  torch.optim.Optimizer)) and callable(
        getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


# What ``walk_sharded`` says of a sharded thing -> its layout; anything else (torch_xla FSDP v1
# flat shards) neither kind restores.
LAYOUTS = (("an SPMD tensor", SPMD), ("an XLAShardedTensor", SPMD),
           ("a torch_xla FSDPv2 module", SPMD), ("a DTensor", DTENSOR))


def kind_of(entries: Mapping[str, Any], helper: str, found: list | None = None):
    """The kind of the state ``entries`` hold (the object of its layout:
    ``replicated.REPLICATED`` for state no rank holds a shard of). Raises ShardedStateError for
    state that mixes SPMD tensors and DTensors or holds FSDP v1 shards. ``found``: the sharded
    things seen (``walk_sharded``'s), appended to it."""
    from ray_train_xla.toolkit.checkpoint.replicated import REPLICATED
    from ray_train_xla.toolkit.checkpoint.sharded import DTENSOR_SHARDS, SPMD_SHARDS

    layouts: dict[str, str] = {}
    sharded = (found for key, value in entries.items() for found in walk_sharded(
        value, key if isinstance(value, torch.nn.Module) else f"{key}."))
    for path, desc in sharded:
        kind = next((k for start, k in LAYOUTS if desc.startswith(start)), None)
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
    return {None: REPLICATED, DTENSOR: DTENSOR_SHARDS, SPMD: SPMD_SHARDS}[next(iter(layouts), None)]


def describe(state: Mapping[str, Any], helper: str = "save_checkpoint") -> CheckpointState:
    """A save's first step: ``state`` (a mapping of entries, see the module docstring) as a
    typed value. Sharded state's parts hold their tensors under the plain module's names and
    their optimizers' state by parameter name; replicated state's, their state dicts as given.
    Raises ShardedStateError as :func:`kind_of` does, for sharded tensors in the rest, and for
    an optimizer whose sharded state cannot be named."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{helper}: state must be a mapping of entries ({{'model': model, "
                        f"'optimizer': optimizer, 'step': step}}), not a {type(state).__name__}")
    modules = {k: v for k, v in state.items()
               if isinstance(v, torch.nn.Module) or (k == MODEL and isinstance(v, Mapping))}
    optimizers = {k: v for k, v in state.items()
                  if isinstance(v, torch.optim.Optimizer) or (k == OPTIMIZER and isinstance(v, Mapping))}
    extras = {k: v.state_dict() if _stateful(v) else v for k, v in state.items()
              if k not in modules and k not in optimizers}
    holders = {k: _holder(v, modules) for k, v in optimizers.items()}
    found: list[tuple[str, str]] = []
    kind = kind_of({k: extras.get(k, v) for k, v in state.items()}, helper, found)
    for path, what in found:
        if not any(path == k or path.startswith(f"{k}.") for k in [*modules, *optimizers]):
            raise ShardedStateError(
                f"{helper}: state entry {path} is {what}; sharded tensors must be under "
                f"{MODEL!r} or {OPTIMIZER!r} (the model's and optimizer's state dicts), or in a "
                "module or optimizer given as an entry of its own ({'ema': ema_model, ...})")
    parts = {k: v.state_dict() if isinstance(v, torch.nn.Module) else v for k, v in modules.items()}
    osds = {k: v.state_dict() if isinstance(v, torch.optim.Optimizer) else v
            for k, v in optimizers.items()}
    if not kind.sharded:  # replicated: the state dicts as given
        return CheckpointState(kind, [ModelPart(k, dict(s)) for k, s in parts.items()],
                               [OptimizerPart(k, s) for k, s in osds.items()], extras)
    named = {k: (name_optimizer_state(s, optimizer_param_names(holders[k], optimizers[k], helper))
                 if holders[k] is not None else named_optimizer_state(s, helper))
             for k, s in osds.items()}
    return CheckpointState(kind, [ModelPart(k, named_model_state(s)) for k, s in parts.items()],
                           [OptimizerPart(k, {"state": s["state"]}, s["param_groups"])
                            for k, s in named.items()], extras)


def _holder(optimizer, modules: Mapping[str, Any]):
    """The module among ``modules`` that holds every parameter of ``optimizer`` (None for
    anything but an optimizer, or when none does)."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        return None
    ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
    return next((m for m in modules.values() if isinstance(m, torch.nn.Module)
                 and ids <= {id(p) for p in m.parameters()}), None)


def target(model: Any = None, optimizer: torch.optim.Optimizer | None = None,
           helper: str = "load_checkpoint") -> CheckpointState:
    """A restore's first step: what it fills, typed (``model`` and ``optimizer``, or ``model``
    a mapping of entries: modules, optimizers, objects with ``load_state_dict``). Each
    optimizer's model part is the module given that holds its parameters. Raises
    ShardedStateError as :func:`kind_of` does, TypeError for an entry it cannot fill."""
    if isinstance(model, Mapping):
        if optimizer is not None:
            raise TypeError(f"{helper}: give the optimizer as an entry of the mapping, "
                            "{'model': model, 'optimizer': optimizer, ...}")
        entries, whole_back = dict(model), False
    else:
        entries = {k: v for k, v in ((MODEL, model), (OPTIMIZER, optimizer)) if v is not None}
        whole_back = True
    objects = {k: v for k, v in entries.items() if _stateful(v)}
    bad = [f"{k!r} ({type(v).__name__})" for k, v in entries.items() if k not in objects and
           not isinstance(v, (torch.nn.Module, torch.optim.Optimizer))]
    if bad:
        raise TypeError(f"{helper}: cannot restore the entries {', '.join(bad)}: give modules, "
                        "optimizers and objects with load_state_dict (an LR scheduler)")
    modules = {k: v for k, v in entries.items() if isinstance(v, torch.nn.Module)}
    optimizers = {k: v for k, v in entries.items() if isinstance(v, torch.optim.Optimizer)}
    holders = {k: _holder(v, modules) for k, v in optimizers.items()}
    kind = kind_of({k: v for k, v in entries.items() if k not in objects}, helper)
    models = {}
    for key, module in modules.items():
        own = module.state_dict()  # the tensors a restore fills in place
        models[key] = ModelPart(key, named_model_state(own), module, {k: module_name(k) for k in own})
    parts = []
    for key, value in optimizers.items():
        held = next((m for m in models.values() if m.module is holders[key]), None)
        names = None if held is None else optimizer_param_names(held.module, value, helper)
        parts.append(OptimizerPart(key, optimizer=value, names=names))
    return CheckpointState(kind, list(models.values()), parts, objects=objects,
                           whole_back=whole_back)


__all__ = ["CheckpointState", "ModelPart", "OptimizerPart", "describe", "kind_of", "target"]
