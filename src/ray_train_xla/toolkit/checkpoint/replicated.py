"""Replicated checkpoints: every worker holds the whole model; rank 0 writes one plain torch file.

Saving follows the rules that avoid the known torch_xla hangs: every worker syncs the graph (so
nothing collective is left pending, done by the caller), then only rank 0 copies the state to
the CPU (``staging.stage``) and writes it with ``torch.save`` (``writer.write_replicated``); no
torch_xla collective and no ``xm.save`` rendezvous runs in a branch that only rank 0 takes. The
file needs neither torch_xla nor this package to load. Here: its loading and checks.
"""

from __future__ import annotations

import io
import os
from typing import Any

import torch

from ray_train_xla.toolkit.checkpoint.format import check_fits, flat_specs

FSDP_V2_PREFIX = "_orig_module."


def load_replicated(path: str, filename: str, where: str, filesystem=None) -> dict[str, Any]:
    """The state in ``path/filename`` (CPU tensors; ``filesystem``: a pyarrow filesystem the
    directory is on, default the local one). ``where`` names the checkpoint and worker in the
    error when the file is missing."""
    from ray_train_xla.toolkit.checkpoint.files import read_file

    file = os.path.join(path, filename)
    data = read_file(path, filename, filesystem) if filesystem is not None else None
    if data is None and (filesystem is not None or not os.path.exists(file)):
        found = sorted(os.listdir(path)) if filesystem is None else "other files"
        raise FileNotFoundError(
            f"{where} has no {filename!r} (found {found}); was it written by save_checkpoint()?")
    # weights_only: the file comes from shared storage; plain tensors, containers and
    # numbers (what save_checkpoint writes) load without unpickling arbitrary objects.
    return torch.load(file if data is None else io.BytesIO(data), map_location="cpu",
                      weights_only=True)


def _model_specs(state: Any) -> dict:
    """Flat specs of a model state dict (``model.<name>``), under the unwrapped model's names
    (an FSDPv2 model loads the plain model's keys)."""
    return {k.replace(FSDP_V2_PREFIX, ""): v for k, v in flat_specs(state, "model.").items()}


def check_replicated(state: Any, model: torch.nn.Module | None,
                     optimizer: torch.optim.Optimizer | None, where: str) -> None:
    """Raise ``CheckpointMismatchError`` (``format.check_fits``) unless the loaded ``state``
    fits: ``state["model"]`` every tensor of ``model``'s state dict, of the same shape and dtype
    (``load_state_dict`` would cast a dtype silently), no key missing on either side; and
    ``state["optimizer"]["state"]`` the optimizer's state, when the optimizer has some.
    ``where`` names the checkpoint and the worker."""
    if model is not None:
        if not isinstance(state.get("model"), dict):
            check_fits({}, {"model": None}, f"load_checkpoint: {where}", "the model")
        check_fits(_model_specs(state["model"]), _model_specs(model.state_dict()),
                   f"load_checkpoint: {where}", "the model")
    if optimizer is not None and optimizer.state:
        saved = state.get("optimizer")
        saved_state = saved.get("state") if isinstance(saved, dict) else None
        if saved_state is None:
            check_fits({}, {"optimizer": None}, f"load_checkpoint: {where}", "the optimizer")
        check_fits(flat_specs(saved_state, "optimizer.state."),
                   flat_specs(optimizer.state_dict()["state"], "optimizer.state."),
                   f"load_checkpoint: {where}", "the optimizer")
