"""Replicated checkpoints: every worker holds the whole model; rank 0 writes one plain torch file.

Saving follows the rules that avoid the known torch_xla hangs: every worker syncs the graph (so
nothing collective is left pending, done by the caller), then only rank 0 copies the state to
the CPU and writes it with ``torch.save``; no torch_xla collective and no ``xm.save``
rendezvous runs in a branch that only rank 0 takes. The file needs neither torch_xla nor this
package to load.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import torch

from ray_train_xla.toolkit.device import to_cpu


def stage_replicated(state: Mapping[str, Any]) -> dict[str, Any]:
    """A CPU copy of ``state`` (rank 0 only): what :func:`write_replicated` writes."""
    return to_cpu(dict(state))


def write_replicated(cpu_state: dict[str, Any], directory: str, filename: str) -> dict[str, Any]:
    """Write the staged state to ``directory/filename``; returns ``{"files", "bytes"}``."""
    path = os.path.join(directory, filename)
    torch.save(cpu_state, path)
    return {"files": [filename], "bytes": os.path.getsize(path)}


def load_replicated(path: str, filename: str, where: str) -> dict[str, Any]:
    """The state in ``path/filename`` (CPU tensors). ``where`` names the checkpoint and worker
    in the error when the file is missing."""
    file = os.path.join(path, filename)
    if not os.path.exists(file):
        raise FileNotFoundError(
            f"{where} has no {filename!r} (found {sorted(os.listdir(path))}); was it written by "
            "save_checkpoint()?")
    # weights_only: the file comes from shared storage; plain tensors, containers and
    # numbers (what save_checkpoint writes) load without unpickling arbitrary objects.
    return torch.load(file, map_location="cpu", weights_only=True)
