"""The on-disk format of our checkpoints, shared by the toolkit and ``ray-train-xla consolidate``.

- replicated: one plain torch file, ``checkpoint.pt`` (rank 0 writes it), that loads without
  torch_xla or this package;
- sharded: ``torch.distributed.checkpoint``'s ``.metadata`` (rank 0) and one
  ``__<rank>_0.distcp`` file per rank, ``extra.pt`` (rank 0: the small replicated rest of the
  state, e.g. the step) and ``sharded.json`` (what wrote it).

Reading needs torch (CPU) and neither Ray nor torch_xla.
"""

from __future__ import annotations

import os
from typing import Any

CHECKPOINT_FILE = "checkpoint.pt"
SHARDED_MARKER = "sharded.json"
EXTRA_FILE = "extra.pt"
METADATA_FILE = ".metadata"
# Entries of the state that may hold shards; everything else is small and replicated.
SHARDED_KEYS = ("model", "optimizer")


class NotACheckpointError(FileNotFoundError):
    """A directory that holds neither kind of checkpoint."""


def is_sharded_checkpoint(path: str) -> bool:
    """True when the directory holds a sharded checkpoint (DCP's ``.metadata``)."""
    return os.path.exists(os.path.join(path, METADATA_FILE))


def read_full_state(path: str, keys: tuple[str, ...] = ("model",),
                    filename: str = CHECKPOINT_FILE) -> dict[str, Any]:
    """The ``keys`` entries of the checkpoint in directory ``path``, as full CPU tensors (every
    shard of a sharded checkpoint joined into one tensor per entry)."""
    import torch

    if is_sharded_checkpoint(path):
        from torch.distributed.checkpoint import FileSystemReader
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        # As torch.distributed.checkpoint.format_utils.dcp_to_torch_save, in memory and only for
        # ``keys``: every shard of every rank's file is read into one tensor per entry.
        state: dict[str, Any] = {}
        _load_state_dict(state, storage_reader=FileSystemReader(path),
                         planner=_EmptyStateDictLoadPlanner(keys=set(keys)), no_dist=True)
        return state
    file = os.path.join(path, filename)
    if not os.path.exists(file):
        raise NotACheckpointError(
            f"{path} is neither a sharded checkpoint (no {METADATA_FILE}) nor a replicated one "
            f"(no {filename}); found {_found(path)}")
    state = torch.load(file, map_location="cpu", weights_only=False)
    return {k: state[k] for k in keys if k in state}


def _found(path: str, shown: int = 8) -> str:
    """What directory ``path`` holds, shortened to ``shown`` names (for error messages)."""
    if not os.path.isdir(path):
        return "no directory"
    names = sorted(os.listdir(path))
    if not names:
        return "an empty directory"
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more
