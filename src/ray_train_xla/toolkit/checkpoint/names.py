"""Names in sharded checkpoints: the module's own parameter names, on every path.

A sharded checkpoint stores the model under the plain module's names (``layers.0.attn.weight``,
without torch_xla FSDPv2's ``_orig_module.`` or torch's ``_checkpoint_wrapped_module.``) and
the optimizer state keyed by those names, in torch's own name-keyed form (what
``torch.distributed.checkpoint.state_dict.get_state_dict`` gives: ``{"state": {name: {...}},
"param_groups": [{"params": [name, ...], ...}]}``). So it loads into torch_xla's FSDPv2, FSDP2
and replicated models alike, on any mesh, and into an optimizer that lists its parameters in
another order.

``save_checkpoint`` is given ``optimizer.state_dict()``, which numbers the parameters. The names
come from the state dict's ``param_names`` (torch writes them for an optimizer built from
``model.named_parameters()``), or, for an optimizer over a model that ``prepare_sharded_model``
prepared, from a hook that adds them: the first ``step()`` of such an optimizer registers a
``state_dict`` post-hook writing ``param_names`` for its parameters. Given the optimizer itself,
as an entry of its own (``describe.py``), its parameters' names are those they have in the
module given beside it.

Format versions (``sharded.json``; ``format.py`` says what each holds): 3 holds any number of
model parts and optimizers, each under its entry; 2 is the named form above for one ``model``
and one ``optimizer``; 1 (no version: written before) holds FSDPv2's prefixed model keys and the
optimizer state under positions, matched here by position against the optimizer it is loaded
into.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping
from typing import Any

from ray_train_xla.errors import CheckpointMismatchError, ShardedStateError
from ray_train_xla.toolkit.runtime import runtime

FORMAT_VERSION = 3
WRAPPER_PREFIXES = ("_orig_module.", "_checkpoint_wrapped_module.")


def module_name(key: str) -> str:
    """``key`` without the wrappers' prefixes: the plain module's name."""
    for prefix in WRAPPER_PREFIXES:
        key = key.replace(prefix, "")
    return key


class PreparedModels:
    """The models ``prepare_sharded_model`` prepared on this worker (weakly; held by the
    runtime), and torch's optimizer step pre-hook that names their optimizers' state."""

    def __init__(self) -> None:
        self.models: weakref.WeakSet = weakref.WeakSet()
        self.seen: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # optimizers
        self.hook: Any = None

    def close(self) -> None:
        hook, self.hook = self.hook, None
        if hook is not None:
            hook.remove()


def _prepared() -> PreparedModels:
    return runtime().part("prepared", PreparedModels)


def remember(model) -> None:
    """Note a model ``prepare_sharded_model`` prepared: optimizers over its parameters write
    their parameters' names into their state dicts from their first step on."""
    prepared = _prepared()
    prepared.models.add(model)
    if prepared.hook is None:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        prepared.hook = register_optimizer_step_pre_hook(_on_step)


def prepared_models() -> list:
    """The models ``prepare_sharded_model`` prepared on this worker (still alive)."""
    return list(_prepared().models)


def _names_by_id() -> dict[int, str]:
    return {id(p): module_name(n) for model in prepared_models() for n, p in model.named_parameters()}


def _on_step(optimizer, args, kwargs) -> None:
    seen = _prepared().seen
    if optimizer in seen:
        return
    seen[optimizer] = True
    names = _names_by_id()
    if all(id(p) in names for g in optimizer.param_groups for p in g["params"]):
        optimizer.register_state_dict_post_hook(_add_names)


def _add_names(optimizer, state_dict: dict) -> dict:
    names = _names_by_id()
    for saved, group in zip(state_dict["param_groups"], optimizer.param_groups):
        if "param_names" not in saved:
            saved["param_names"] = [names.get(id(p), "") for p in group["params"]]
    return state_dict


def named_model_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A model state dict under the plain module's names."""
    return {module_name(k): v for k, v in state.items()}


def named_optimizer_state(osd: Mapping[str, Any], where: str = "save_checkpoint") -> dict[str, Any]:
    """``optimizer.state_dict()`` in torch's name-keyed form. Raises ShardedStateError when its
    state cannot be put under names (no ``param_names``: an optimizer that is neither built from
    ``named_parameters()`` nor over a prepared model, or saved before its first step)."""
    groups = osd.get("param_groups", [])
    ids = [i for g in groups for i in g["params"]]
    names = [module_name(n) for g in groups for n in g.get("param_names", [])]
    if len(names) != len(ids) or "" in names or len(set(names)) != len(names):
        if osd.get("state"):
            raise ShardedStateError(
                f"{where}: the optimizer's state dict does not name its parameters, so its "
                "sharded state could not be matched to them on another mesh. Build the optimizer "
                "over the model prepare_sharded_model returned (its first step() adds the names), "
                "or from model.named_parameters().")
        names = [str(i) for i in ids]
    by_id = dict(zip(ids, names))
    return {
        "state": {by_id[i]: value for i, value in osd.get("state", {}).items()},
        "param_groups": [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                          "params": [by_id[i] for i in g["params"]]} for g in groups],
    }


def optimizer_param_names(model, optimizer, where: str) -> list[list[str]]:
    """The names (in ``model``) of ``optimizer``'s parameters, per group. Raises
    ShardedStateError for a parameter ``model`` does not hold."""
    by_id = {id(p): module_name(n) for n, p in model.named_parameters()}
    out = []
    for g, group in enumerate(optimizer.param_groups):
        missing = [i for i, p in enumerate(group["params"]) if id(p) not in by_id]
        if missing:
            raise ShardedStateError(
                f"{where}: param_groups[{g}].params[{missing[0]}] of the optimizer is not a "
                "parameter of the model given with it; pass the model the optimizer steps")
        out.append([by_id[id(p)] for p in group["params"]])
    return out


def name_optimizer_state(osd: Mapping[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """``optimizer.state_dict()`` under ``names`` (per group, in the optimizer's order)."""
    by_id = {i: n for g, group_names in zip(osd["param_groups"], names)
             for i, n in zip(g["params"], group_names)}
    return {
        "state": {by_id[i]: value for i, value in osd["state"].items()},
        "param_groups": [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                          "params": list(group_names)}
                         for g, group_names in zip(osd["param_groups"], names)],
    }


def index_optimizer_state(named: Mapping[str, Any], osd: Mapping[str, Any],
                          names: list[list[str]], where: str) -> dict[str, Any]:
    """The named optimizer state ``named`` in the numbered form of ``osd`` (the target
    optimizer's own state dict, whose parameters are ``names``), for ``load_state_dict``: the
    saved hyperparameters of each group, the target's parameters. Raises
    ``CheckpointMismatchError`` when the groups differ."""
    saved_groups = list(named.get("param_groups", []))
    if len(saved_groups) != len(osd["param_groups"]) or any(
            sorted(map(str, s["params"])) != sorted(t) for s, t in zip(saved_groups, names)):
        raise CheckpointMismatchError(
            f"{where}: the optimizer's parameter groups "
            f"{[len(t) for t in names]} do not match the saved ones "
            f"{[len(s['params']) for s in saved_groups]} (by parameter name)")
    ids = {n: i for g, group_names in zip(osd["param_groups"], names)
           for i, n in zip(g["params"], group_names)}
    return {
        "state": {ids[n]: value for n, value in named.get("state", {}).items()},
        "param_groups": [{**{k: v for k, v in s.items() if k != "params"}, "params": list(t["params"])}
                         for s, t in zip(saved_groups, osd["param_groups"])],
    }


def positional_names(named_or_indexed: Mapping[str, Any], names: list[list[str]]) -> dict[str, Any]:
    """A numbered optimizer state (a replicated ``checkpoint.pt``, or format 1) under ``names``,
    by position: the i-th saved parameter is the target optimizer's i-th (the plain file has no
    names unless the optimizer was built from ``named_parameters()``)."""
    groups = named_or_indexed.get("param_groups", [])
    if all("param_names" in g for g in groups) and groups:
        return named_optimizer_state(named_or_indexed, "load_checkpoint")
    flat_names = [n for group_names in names for n in group_names]
    ids = [i for g in groups for i in g["params"]]
    by_id = dict(zip(ids, flat_names)) if len(ids) == len(flat_names) else {}
    return {
        "state": {by_id.get(i, f"<position {i}>"): v for i, v in named_or_indexed.get("state", {}).items()},
        "param_groups": [{**{k: v for k, v in g.items() if k not in ("params", "param_names")},
                          "params": [by_id.get(i, f"<position {i}>") for i in g["params"]]}
                         for g in groups],
    }
