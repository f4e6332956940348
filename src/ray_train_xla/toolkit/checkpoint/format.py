"""The on-disk format of our checkpoints, shared by the toolkit and ``ray-train-xla consolidate``.

- replicated: one plain torch file, ``checkpoint.pt`` (rank 0 writes it), that loads without
  torch_xla or this package;
- sharded: ``torch.distributed.checkpoint``'s ``.metadata`` (rank 0) and one
  ``__<rank>_0.distcp`` file per rank holding each model part under its entry (``model``, and
  others a state names, e.g. ``ema``), under the plain module's names, and each optimizer's
  ``<entry>.state`` (under the same names; see ``names.py``), ``param_groups.pt`` (rank 0:
  each optimizer's parameter groups, hyperparameters and names, by entry), ``extra.pt`` (rank
  0: the small replicated rest of the state, e.g. the step and an LR scheduler's state) and
  ``sharded.json`` (what wrote it, the format version, and which entries are model parts and
  optimizers).

Format versions (``sharded.json``'s ``format_version``, ``names.FORMAT_VERSION`` the one
written; :class:`Source` reads every one): 3
has any number of model parts and optimizers (``param_groups.pt`` a dict by entry); 2 one
``model`` and one ``optimizer`` (``param_groups.pt`` its list); 1 (no version) FSDPv2's prefixed
model keys and the optimizer state under positions (``names.py``).

Reading needs torch (CPU) and neither Ray nor torch_xla.

Every load checks what it reads against what it fills (:func:`check_fits`, shared by the
sharded and replicated loads and by ``consolidate``): each tensor's shape and dtype, keys the
checkpoint lacks and tensors the target has no place for, all named in one
``CheckpointMismatchError``. Without it, torch_xla's ``SPMDLoadPlanner`` fills a smaller sharded
parameter with the first rows of the saved one and leaves a larger one at its initial values,
and ``load_state_dict`` casts to the model's dtype.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping
from typing import Any

from ray_train_xla.errors import CheckpointMismatchError

CHECKPOINT_FILE = "checkpoint.pt"
SHARDED_MARKER = "sharded.json"
EXTRA_FILE = "extra.pt"
GROUPS_FILE = "param_groups.pt"
METADATA_FILE = ".metadata"


class NotACheckpointError(FileNotFoundError):
    """A directory that holds neither kind of checkpoint."""


# What the check compares per key: (shape, dtype) of a tensor, None for any other value.
Spec = tuple[tuple[int, ...], Any] | None
# Mismatches of each kind named in the message; the rest are counted.
SHOWN = 6


def spec_of(value: Any) -> Spec:
    """(shape, dtype) of a tensor (an SPMD tensor's global shape), None for anything else."""
    import torch

    if isinstance(value, torch.Tensor) or (
            hasattr(value, "shape") and isinstance(getattr(value, "dtype", None), torch.dtype)):
        return tuple(value.shape), value.dtype
    return None


def flat_specs(state: Any, prefix: str = "") -> dict[str, Spec]:
    """``{"a.b.c": spec}`` for every leaf of nested mappings (keys joined with dots, as
    ``torch.distributed.checkpoint`` flattens them)."""
    if isinstance(state, Mapping) and spec_of(state) is None:
        return {flat: spec for key, value in state.items()
                for flat, spec in flat_specs(value, f"{prefix}{key}.").items()}
    return {prefix[:-1]: spec_of(state)}


def _shape(spec: Spec) -> str:
    assert spec is not None
    shape, dtype = spec
    return f"{list(shape)} {str(dtype).replace('torch.', '')}"


def _listed(items: list[str], shown: int = SHOWN) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more


def check_fits(saved: Mapping[str, Spec], target: Mapping[str, Spec], what: str,
               target_name: str = "the target") -> None:
    """Raise ``CheckpointMismatchError`` unless the checkpoint's entries (``saved``: flat key ->
    spec) fit ``target`` (the same for what is loaded into): every tensor of the same shape and
    dtype, every key of the target in the checkpoint, every tensor of the checkpoint in the
    target (other saved values, e.g. optimizer options, may be left out). ``what`` names the
    load in the message."""
    wrong, kinds = [], []
    for key in sorted(set(saved) & set(target)):
        s, t = saved[key], target[key]
        if s is None and t is None:
            continue
        if s is None or t is None:
            kinds.append(f"{key} (saved {'a tensor' if t is None else 'no tensor'}, "
                         f"{target_name} has {'a tensor' if s is None else 'no tensor'})")
        elif tuple(s[0]) != tuple(t[0]) or s[1] != t[1]:
            wrong.append(f"{key}: saved {_shape(s)}, into {_shape(t)}")
    missing = sorted(set(target) - set(saved))
    unexpected = sorted(k for k in set(saved) - set(target) if saved[k] is not None)
    problems = [label + _listed(items) for label, items in (
        ("tensors of another shape or dtype: ", wrong), ("values of another kind: ", kinds),
        ("missing from the checkpoint: ", missing),
        (f"in the checkpoint but not in {target_name}: ", unexpected)) if items]
    if problems:
        raise CheckpointMismatchError(
            f"{what} does not fit {target_name} (loading it would leave wrong or stale values): "
            + "; ".join(problems))


def check_chunks(metadata: Any, keys: tuple[str, ...], what: str) -> None:
    """Raise ``CheckpointMismatchError`` when the shards a sharded checkpoint's ``.metadata``
    lists for a tensor under ``keys`` lie outside it or leave part of it unwritten (read into
    an empty tensor, that part would hold whatever the memory held)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    mappings = metadata.planner_data or {}
    bad = []
    for key, md in metadata.state_dict_metadata.items():
        top = str(mappings[key][0]) if key in mappings else key.split(".")[0]
        if top not in keys or not isinstance(md, TensorStorageMetadata):
            continue
        size = tuple(md.size)
        inside = all(len(c.offsets) == len(size) and all(
            o >= 0 and o + n <= d for o, n, d in zip(c.offsets, c.sizes, size)) for c in md.chunks)
        covered = sum(math.prod(c.sizes) for c in md.chunks)
        if not inside or covered != math.prod(size):
            chunks = " ".join(f"{list(c.offsets)}+{list(c.sizes)}" for c in md.chunks)
            bad.append(f"{key}: {list(size)} {str(md.properties.dtype).replace('torch.', '')} "
                       f"from shards {chunks or '(none)'} ({covered} of {math.prod(size)} "
                       f"elements{'' if inside else ', some outside the tensor'})")
    if bad:
        raise CheckpointMismatchError(
            f"{what}: the shards do not make up the tensors its metadata declares: "
            + _listed(bad))


def saved_specs(metadata: Any) -> dict[str, Spec]:
    """Flat key -> spec of every entry a sharded checkpoint's ``.metadata`` declares."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    return {key: (tuple(md.size), md.properties.dtype)
            if isinstance(md, TensorStorageMetadata) else None
            for key, md in metadata.state_dict_metadata.items()}


def write_small_files(files, directory: str, staged, world: int) -> None:
    """(rank 0) A sharded checkpoint's own files beside DCP's (the module docstring): the rest of the
    state (``staged``: a ``staging.Staged``), each optimizer's parameter groups, and the marker
    that says how the shards were written and which entries are model parts and optimizers."""
    import json

    from ray_train_xla.toolkit.checkpoint.files import save_file
    from ray_train_xla.toolkit.checkpoint.names import FORMAT_VERSION

    marker = json.dumps({
        "format": "torch.distributed.checkpoint",
        "format_version": FORMAT_VERSION,
        "names": "module",
        "layout": staged.kind.layout,
        "workers": world,
        "devices": staged.devices or world,
        "keys": sorted([*staged.models, *staged.optimizers]),
        "models": staged.models,
        "optimizers": staged.optimizers,
    })
    save_file(files, directory, EXTRA_FILE, staged.extra)
    if staged.optimizers:
        save_file(files, directory, GROUPS_FILE, staged.groups)
    save_file(files, directory, SHARDED_MARKER, marker.encode())


def is_sharded_checkpoint(path: str, filesystem=None) -> bool:
    """True when the directory holds a sharded checkpoint (DCP's ``.metadata``, or rank 0's own
    of one the memory tier wrote rank by rank, ``rank_files.py``); ``filesystem``: a pyarrow
    filesystem the directory is on (default the local one)."""
    from ray_train_xla.toolkit.checkpoint.files import has_file
    from ray_train_xla.toolkit.checkpoint.rank_files import rank_metadata_file

    return any(has_file(path, n, filesystem) for n in (METADATA_FILE, rank_metadata_file(0)))


def read_full_state(path: str, keys: tuple[str, ...] = ("model",),
                    filename: str = CHECKPOINT_FILE, filesystem=None) -> dict[str, Any]:
    """The ``keys`` entries of the checkpoint in directory ``path`` (on ``filesystem``, a
    pyarrow filesystem, when given), as full CPU tensors (every shard of a sharded checkpoint
    joined into one tensor per entry)."""
    import torch

    from ray_train_xla.toolkit.checkpoint.files import read_file

    if is_sharded_checkpoint(path, filesystem):
        from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
        from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

        # As torch.distributed.checkpoint.format_utils.dcp_to_torch_save, in memory and only for
        # ``keys``: every shard of every rank's file is read into one tensor per entry, after
        # checking that the shards make up each tensor, and the result against the metadata.
        reader, metadata = reader_for(path, filesystem)
        check_chunks(metadata, keys, f"checkpoint {path}")
        state: dict[str, Any] = {}
        _load_state_dict(state, storage_reader=reader,
                         planner=_EmptyStateDictLoadPlanner(keys=set(keys)), no_dist=True)
        declared = saved_specs(metadata)
        check_fits({k: v for k, v in declared.items() if v is not None and k.split(".")[0] in keys},
                   {k: v for k, v in flat_specs(state).items() if v is not None},
                   f"checkpoint {path}", "what was read")
        return state
    data = read_file(path, filename, filesystem)
    if data is None:
        raise NotACheckpointError(
            f"{path} is neither a sharded checkpoint (no {METADATA_FILE}) nor a replicated one "
            f"(no {filename}); found {_found(path) if filesystem is None else 'other files'}")
    state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
    return {k: state[k] for k in keys if k in state}


def _found(path: str) -> str:
    """What directory ``path`` holds, shortened to 8 names (for error messages)."""
    if not os.path.isdir(path):
        return "no directory"
    names = sorted(os.listdir(path))
    return _listed(names, 8) if names else "an empty directory"


def reader_for(path: str, filesystem=None):
    """torch's ``FileSystemReader`` for the checkpoint ``path`` (on ``filesystem``, a pyarrow
    filesystem, when given), reading its ``.metadata`` once; the memory tier's ``SlotReader``
    for one written rank by rank (``rank_files.py``), its ranks' own metadata merged once."""
    from torch.distributed.checkpoint import FileSystemReader

    from ray_train_xla.toolkit.checkpoint.files import ArrowFileSystem, has_file
    from ray_train_xla.toolkit.checkpoint.rank_files import SlotReader, rank_metadata_file

    if (not has_file(path, METADATA_FILE, filesystem)
            and has_file(path, rank_metadata_file(0), filesystem)):
        reader = SlotReader(path, filesystem)
    elif filesystem is None:
        reader = FileSystemReader(path)
    else:
        reader = FileSystemReader(os.devnull)  # a path FileSystem accepts; replaced here
        reader.fs, reader.path = ArrowFileSystem(filesystem), str(path)
    metadata = reader.read_metadata()
    reader.read_metadata = lambda *args, **kwargs: metadata  # one read per export, not per tensor
    return reader, metadata
