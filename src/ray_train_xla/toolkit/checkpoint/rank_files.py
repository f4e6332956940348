"""DCP checkpoints written rank by rank, with no collective: the memory tier's format when its
writer process formats each generation.

torch's ``dcp.save`` plans every checkpoint collectively (every rank's plan gathered on the
coordinator, the global plan scattered back, the write results gathered for the one
``.metadata``): Python work and collectives in the training process at each save. The memory
tier saves the same structure again and again, so each rank plans once per structure, with
DCP's own planner over its own shards (``DefaultSavePlanner``: ``create_local_plan``, then
``create_global_plan`` over that one plan, as DCP does without a process group), and stages its
shards into one shared host buffer (:class:`FlatStaging`). At each generation its writer
process (``writer.SaveProcess``) writes, from that buffer, the rank's data file
(``__{rank}_0.distcp``, with torch's own writer function) and the rank's metadata
(``__{rank}.metadata``: its chunks and where they lie). A reader merges the ranks' metadata
into the checkpoint's ``.metadata`` (:func:`merge_metadata`) and reads it with torch's
``FileSystemReader`` like any DCP checkpoint, resharding included.

DTensor state (FSDP2); torch_xla SPMD state and the first generations (before the writer
process has started) go through ``dcp.save`` as before.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch

ALIGN = 64  # each shard's offset in the shared buffer
_HELD: list[Any] = []  # (the writer process) the key and plan of the last generation


def rank_data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def rank_metadata_file(rank: int) -> str:
    return f"__{rank}.metadata"


def is_rank_metadata(name: str) -> bool:
    return name.startswith("__") and name.endswith(".metadata") and name[2:-9].isdigit()


class FlatStaging:
    """A rank's shards staged into one shared host buffer, reused from a generation to the next
    while their dtypes and shapes stay (a new one when they change). One generation at a time:
    the memory tier stages a generation only once the one before is written."""

    def __init__(self) -> None:
        self.key: tuple | None = None
        self.flat: torch.Tensor | None = None
        self.views: list[torch.Tensor] = []
        self.allocations = 0
        self._lock = threading.Lock()

    def stage_tensors(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor],
                                                                  Callable[[], None]]:
        """(the tensors copied into the buffer, as contiguous views of it; a no-op release)."""
        key = tuple((t.dtype, tuple(t.shape)) for t in tensors)
        with self._lock:
            if key != self.key:
                spans, end = [], 0
                for t in tensors:
                    spans.append(end)
                    end += -(-t.numel() * t.element_size() // ALIGN) * ALIGN
                flat = torch.empty(max(end, ALIGN), dtype=torch.uint8).share_memory_()
                self.views = [flat[o:o + t.numel() * t.element_size()].view(t.dtype).view(t.shape)
                              for o, t in zip(spans, tensors)]
                self.flat, self.key = flat, key
                self.allocations += 1
            with torch.no_grad():
                for view, t in zip(self.views, tensors):
                    view.copy_(t)
            return list(self.views), lambda: None


class RankPlan:
    """What this rank writes for one structure of its state: DCP's plan over its own shards,
    each tensor item's place in the shared buffer, and the metadata (without where the items
    lie, which the writer fills in)."""

    def __init__(self, state: dict[str, Any], flat: torch.Tensor) -> None:
        from torch.distributed.checkpoint import DefaultSavePlanner
        from torch.distributed.checkpoint.planner import WriteItemType

        planner = DefaultSavePlanner()
        planner.set_up_planner(state, storage_meta=None, is_coordinator=True)
        plans, self.metadata = planner.create_global_plan([planner.create_local_plan()])
        plan = planner.finish_plan(plans[0])
        base = flat.data_ptr()
        self.items, self.where = list(plan.items), []
        for item in self.items:
            if item.type == WriteItemType.BYTE_IO:
                self.where.append(None)
                continue
            data = planner.resolve_data(item)
            local = getattr(data, "_local_tensor", data)
            offset = local.data_ptr() - base
            if not (0 <= offset < flat.numel()) or not local.is_contiguous():
                raise ValueError(f"{item.index.fqn}: not a view of the staged buffer")
            self.where.append((offset, local.dtype, tuple(local.shape)))
        self.bytes_items = [i for i, w in zip(self.items, self.where) if w is None]

    def byte_values(self, state: dict[str, Any]) -> list[bytes]:
        """This generation's values of the plan's non-tensor items (DCP pickles them)."""
        if not self.bytes_items:
            return []
        from torch.distributed.checkpoint import DefaultSavePlanner

        planner = DefaultSavePlanner()
        planner.set_up_planner(state, storage_meta=None, is_coordinator=True)
        return [planner.resolve_data(item).getvalue() for item in self.bytes_items]


def write_dcp_files(files: list) -> list:
    """Write DCP data files as torch's ``FileSystemWriter`` does (its own function, one
    file after another), from items already resolved: ``[(path, storage_key, [(WriteItem,
    tensor or bytes)])]``. Returns the ``WriteResult``s."""
    import io
    import queue

    from torch.distributed.checkpoint.filesystem import (
        SerializationFormat,
        _StorageWriterTransforms,
        _write_files_from_queue,
    )

    data: dict[int, Any] = {}
    file_queue: queue.Queue = queue.Queue()
    for path, key, pairs in files:
        for item, value in pairs:
            data[id(item)] = value
        file_queue.put((path, key, [item for item, _ in pairs]))

    class Resolved:
        def resolve_data(self, item):
            value = data[id(item)]
            return io.BytesIO(value) if isinstance(value, (bytes, bytearray)) else value

    results: queue.Queue = queue.Queue()
    _write_files_from_queue(create_stream=open, file_queue=file_queue, result_queue=results,
                            planner=Resolved(), transforms=_StorageWriterTransforms(None),
                            inflight_threshhold=0, use_fsync=False, thread_count=1,
                            serialization_format=SerializationFormat.TORCH_SAVE)
    out: list = []
    while not results.empty():
        out += results.get_nowait()
    return out


def write_rank_files(key: Any, plan: tuple | None, byte_values: list[bytes], data_path: str,
                     metadata_path: str) -> dict[str, int]:
    """(the writer process) The rank's data file and its metadata, from the shared buffer:
    each tensor item a tensor over its own bytes of the buffer (so that ``torch.save`` writes
    those bytes, not the buffer). ``plan``: ``(buffer, items, where, metadata)``, sent with the
    first generation of each ``key`` and kept here (later generations send None: only this
    generation's non-tensor values travel). Returns each file's size."""
    import dataclasses
    import os
    import pickle

    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    if plan is not None:
        _HELD[:] = [key, plan]
    elif not _HELD or _HELD[0] != key:
        raise RuntimeError(f"no plan {key!r} in the writer process (it has {_HELD[:1]})")
    flat, items, where, metadata = _HELD[1]
    array = flat.numpy()
    values = iter(byte_values)
    pairs = []
    for item, place in zip(items, where):
        if place is None:
            pairs.append((item, next(values)))
            continue
        offset, dtype, shape = place
        size = dtype.itemsize * int(torch.Size(shape).numel())
        tensor = torch.frombuffer(array[offset:offset + size], dtype=dtype) if size \
            else torch.empty(0, dtype=dtype)
        pairs.append((item, tensor.view(shape)))
    results = write_dcp_files([(data_path, os.path.basename(data_path), pairs)])
    metadata = dataclasses.replace(metadata, version=CURRENT_DCP_VERSION,
                                   storage_data={r.index: r.storage_data for r in results})
    with open(metadata_path, "wb") as f:
        pickle.dump(metadata, f)
    return {path: os.path.getsize(path) for path in (data_path, metadata_path)}


def merge_metadata(parts: list[Any]):
    """One DCP ``Metadata`` from the ranks' own: every rank's chunks of each tensor (a chunk
    two ranks both wrote, a replicated one, once), where each lies, the planner's mappings."""
    import dataclasses

    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    tensors: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    mappings: dict[str, Any] = {}
    for part in parts:
        for fqn, entry in part.state_dict_metadata.items():
            if fqn not in tensors:
                tensors[fqn] = dataclasses.replace(entry, chunks=list(entry.chunks)) \
                    if isinstance(entry, TensorStorageMetadata) else entry
            elif isinstance(entry, TensorStorageMetadata):
                have = {tuple(c.offsets) for c in tensors[fqn].chunks}
                tensors[fqn].chunks.extend(c for c in entry.chunks if tuple(c.offsets) not in have)
        for index, info in part.storage_data.items():
            storage.setdefault(index, info)
        mappings.update(part.planner_data or {})
    return dataclasses.replace(parts[0], state_dict_metadata=tensors, storage_data=storage,
                               planner_data=mappings)


class RankWriter:
    """This rank's side of a generation written rank by rank: its shared buffer, and its plan
    for the state's current structure (made again when the structure changes)."""

    def __init__(self) -> None:
        self.staging = FlatStaging()
        self.plans = 0  # plans made (one per structure)
        self._plan: RankPlan | None = None
        self._key: tuple | None = None
        self._sent: tuple | None = None  # (writer pid, plan number) the writer process holds

    def write(self, staged: dict[str, Any], files, rank: int) -> None:
        """Write ``staged`` (``sharded.stage_sharded`` with :attr:`staging`) into ``files`` (a
        ``MemoryFiles`` with a writer process): this rank's data file and metadata, by the
        writer process (the checkpoint's small files are the caller's:
        ``sharded.write_small_files``)."""
        import os
        from concurrent.futures import Future

        from ray_train_xla.toolkit.checkpoint.files import ROOT, SharedFile
        from ray_train_xla.toolkit.checkpoint.staging import join_dtensors, structure

        if isinstance(staged["state"], Future):  # an overlapped snapshot: copied by now, or soon
            staged["state"], staged["release"] = staged["state"].result()
        views, tree, specs = staged["state"], staged["tree"], staged["specs"]
        key = (self.staging.key, structure(tree),
               tuple(None if s is None else (tuple(s[1]), tuple(s[2])) for s in specs))
        state = None
        if key != self._key:
            state = join_dtensors(tree, views, specs)
            self._plan, self._key = RankPlan(state, self.staging.flat), key
            self.plans += 1
        plan = self._plan
        values = plan.byte_values(state or join_dtensors(tree, views, specs)) \
            if plan.bytes_items else []
        data = os.path.join(files.shared_dir, rank_data_file(rank))
        metadata = os.path.join(files.shared_dir, rank_metadata_file(rank))
        sent = (files.writer.process.pid, self.plans)
        payload = None if sent == self._sent else (self.staging.flat, plan.items, plan.where,
                                                   plan.metadata)
        self._sent = None  # until this generation is written
        sizes = files.writer.write_rank(self.plans, payload, values, data, metadata,
                                        files.timeout_s, rank)
        self._sent = sent
        for path, size in sizes.items():
            files.files[files.concat_path(ROOT, os.path.basename(path))] = SharedFile(path, size)
