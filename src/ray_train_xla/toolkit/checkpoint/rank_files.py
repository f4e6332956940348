"""DCP checkpoints written rank by rank, in place, with no collective: the memory tier's format
for DTensor state.

torch's ``dcp.save`` plans every checkpoint collectively (every rank's plan gathered on the
coordinator, the global plan scattered back, the write results gathered for the one
``.metadata``) and then formats each shard with ``torch.save``: Python work, collectives and
copies at each save. The memory tier saves the same structure again and again, so each rank
lays its DCP data file out once per structure and then only copies its shards into it:

- **Slots.** Each rank keeps two files in the node's shared memory (:class:`RankSlots`), used in
  turn: the generation being written, and the newest complete one. A slot is laid out as DCP's
  data file of the rank (``__{rank}_0.distcp``): each shard's record as ``torch.save`` writes
  it (the record's frame taken from a save of a tensor of the same dtype and shape, written
  once), the shard's bytes where ``torch.save`` puts them. The snapshot copies the shards
  straight there: that copy is the only work that grows with the state. The slot's memory is
  allocated once. The slot of the newest complete generation serves until the generation
  after the next one starts (a rank starts a generation only once every rank completed the one
  before).
- **Plan.** DCP's own planner over the rank's own shards (``DefaultSavePlanner``:
  ``create_local_plan``, then ``create_global_plan`` over that one plan, as DCP does without a
  process group), once per structure. Each generation gets the rank's metadata
  (``__{rank}.metadata``: its chunks and where they lie) and a small file for what is not a
  shard's bytes (``__{rank}_1.distcp``: non-tensor values, empty shards).
- **Stamp.** A slot's first 8 bytes say which generation it holds (-1 while the snapshot
  copies into it): the store serves a slot only as the generation it says (``slot_stamp``).

A reader merges the ranks' metadata into the checkpoint's ``.metadata`` (:func:`merge_metadata`)
and reads it with torch's ``FileSystemReader`` like any DCP checkpoint, resharding included.

DTensor state (FSDP2), where the node has shared memory; torch_xla SPMD state goes through
``dcp.save`` (``memory/tier.py``).
"""

from __future__ import annotations

import itertools
import mmap
import os
import secrets
from concurrent.futures import Future
from typing import Any

import torch

from ray_train_xla.toolkit.checkpoint.memory.store import SLOT_PREFIX

ALIGN = 64  # each record's offset in a slot
HEADER = 64  # a slot's first bytes: the generation it holds (int64), then nothing
# This process's layouts, numbered from a random start: a slot's name is unique on its node even
# when a later worker gets the pid of one that died.
_SERIES = itertools.count(secrets.randbits(40))


def rank_data_file(rank: int) -> str:
    return f"__{rank}_0.distcp"


def rank_small_file(rank: int) -> str:
    return f"__{rank}_1.distcp"


def rank_metadata_file(rank: int) -> str:
    return f"__{rank}.metadata"


def is_rank_metadata(name: str) -> bool:
    return name.startswith("__") and name.endswith(".metadata") and name[2:-9].isdigit()


def record_frame(dtype: torch.dtype, shape: tuple) -> tuple[bytes, bytes, int]:
    """``torch.save`` of a tensor of ``dtype`` and ``shape`` (zeros) around its bytes: (what
    comes before them, what comes after, the record's whole length). The records, their order
    and offsets depend only on the dtype and shape. The record's checksum is the zeros':
    ``torch.load`` does not check it, and the tier's files live in memory only."""
    import io

    buf = io.BytesIO()
    torch.save(torch.zeros(shape, dtype=dtype), buf)
    buf.seek(0)
    at = torch._C.PyTorchFileReader(buf).get_record_offset("data/0")
    nbytes = dtype.itemsize * int(torch.Size(shape).numel())
    view = buf.getbuffer()
    head, tail, length = bytes(view[:at]), bytes(view[at + nbytes:]), len(view)
    del view
    return head, tail, length


class _Slot:
    """One slot file in shared memory, mapped here: the records' frames written once, a view of
    each shard's bytes."""

    def __init__(self, path: str, layout: list, size: int, shapes: list) -> None:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            # Allocated now (a full tmpfs is this error, not a SIGBUS at the first copy)
            os.posix_fallocate(fd, 0, size)
            self._map = mmap.mmap(fd, size)  # shared with the store, which maps it too
        except OSError as exc:
            os.close(fd)
            os.remove(path)
            raise OSError(exc.errno, f"{size} bytes of the node's shared memory for {path}: "
                                     f"{exc.strerror}") from exc
        os.close(fd)
        self.path, self.size = path, size
        data = torch.frombuffer(self._map, dtype=torch.uint8)
        self._stamp = data[:8].view(torch.int64)
        self.stamp(-1)
        self.views: list[torch.Tensor] = []
        for record, (dtype, shape) in zip(layout, shapes):
            if record is None:  # an empty shard: its record goes in the small file
                self.views.append(torch.empty(shape, dtype=dtype))
                continue
            start, head, tail, nbytes = record
            at = start + len(head)
            self._map[start:at] = head
            self._map[at + nbytes:at + nbytes + len(tail)] = tail
            self.views.append(data[at:at + nbytes].view(dtype).view(shape))

    def stamp(self, gen: int) -> None:
        self._stamp[0] = gen


class RankSlots:
    """This rank's two slot files (see the module docstring), laid out again when the shards'
    dtypes or shapes change, and its plan for the state's structure. One generation at a time:
    :meth:`stager` then :meth:`write`; after an error, use a new one."""

    def __init__(self, directory: str, rank: int) -> None:
        self.directory, self.rank = directory, rank
        self.key: tuple | None = None
        self.slots: list[_Slot | None] = []  # each made at its first use
        self.allocations = 0  # slot files made (two per layout)
        self.plans = 0  # plans made (one per structure)
        self._turn = 0
        self._layout: list = []
        self._plan: dict[str, Any] | None = None
        self._plan_key: tuple | None = None

    def stager(self, gen: int):
        """What copies generation ``gen``'s shards (a staging function for
        ``sharded.stage_sharded``): into the slot whose turn it is, stamped -1 meanwhile."""

        def stage(tensors: list[torch.Tensor]):
            key = tuple((t.dtype, tuple(t.shape)) for t in tensors)
            if key != self.key:
                self._lay_out(key)
            slot = self._slot(self._turn)
            slot.stamp(-1)
            with torch.no_grad():
                for view, t in zip(slot.views, tensors):
                    view.copy_(t)
            return list(slot.views), lambda: None

        return stage

    def _lay_out(self, key: tuple) -> None:
        layout, end = [], HEADER
        for dtype, shape in key:
            nbytes = dtype.itemsize * int(torch.Size(shape).numel())
            if not nbytes:
                layout.append(None)
                continue
            head, tail, length = record_frame(dtype, shape)
            layout.append((end, head, tail, nbytes))
            end += -(-length // ALIGN) * ALIGN
        self.remove()  # the old layout's slot files no store took
        self._series, self._size = next(_SERIES), end
        self.slots = [None, None]
        self.key, self._layout, self._turn = key, layout, 0

    def _slot(self, turn: int) -> _Slot:
        """The slot of ``turn``, made at its first use (so that a worker that ends early leaves
        no file no store took but the one being written)."""
        if self.slots[turn] is None:
            path = os.path.join(self.directory, f"{SLOT_PREFIX}{os.getpid()}-{self.rank}-"
                                                f"{self._series}-{turn}.distcp")
            for last in (False, True):  # the directory may be swept as empty meanwhile
                os.makedirs(self.directory, exist_ok=True)
                try:
                    self.slots[turn] = _Slot(path, self._layout, self._size, list(self.key))
                    break
                except FileNotFoundError:
                    if last:
                        raise
            self.allocations += 1
        return self.slots[turn]

    def write(self, staged: dict[str, Any], files, gen: int, timeout_s: float) -> None:
        """Generation ``gen`` (``staged``: ``sharded.stage_sharded`` with :meth:`stager`, whose
        copy is waited for at most ``timeout_s``) into ``files`` (a ``MemoryFiles``): the slot
        as the rank's data file, its small file and its metadata; the slot stamped ``gen``. The
        checkpoint's own small files are the caller's (``sharded.write_small_files``)."""
        import dataclasses
        import io
        import pickle

        from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
        from torch.distributed.checkpoint.planner import WriteItemType

        from ray_train_xla.toolkit.checkpoint.files import ROOT, SlotFile
        from ray_train_xla.toolkit.checkpoint.staging import join_dtensors, structure

        if isinstance(staged["state"], Future):  # an overlapped snapshot: copied by now, or soon
            try:
                staged["state"], staged["release"] = staged["state"].result(timeout=timeout_s)
            except TimeoutError:
                raise TimeoutError(f"the snapshot was not copied into the slot within "
                                   f"timeout_s={timeout_s:g}") from None
        views, tree, specs = staged["state"], staged["tree"], staged["specs"]
        slot = self.slots[self._turn]
        key = (self.key, structure(tree),
               tuple(None if s is None else (tuple(s[1]), tuple(s[2])) for s in specs))
        state = None
        if key != self._plan_key:
            state = join_dtensors(tree, views, specs)
            self._plan, self._plan_key = self._make_plan(state, views), key
            self.plans += 1
        plan = self._plan
        data_name, small_name = rank_data_file(self.rank), rank_small_file(self.rank)
        storage = dict(plan["fixed"])
        small = io.BytesIO()
        if plan["small"]:
            from torch.distributed.checkpoint import DefaultSavePlanner

            planner = DefaultSavePlanner()
            planner.set_up_planner(state or join_dtensors(tree, views, specs), storage_meta=None,
                                   is_coordinator=True)
            for item in plan["small"]:
                value = planner.resolve_data(item)
                offset = small.tell()
                if item.type == WriteItemType.BYTE_IO:
                    small.write(value.getbuffer())
                else:  # an empty shard
                    torch.save(getattr(value, "_local_tensor", value), small)
                storage[item.index] = _StorageInfo(small_name, offset, small.tell() - offset)
        if plan["small"] or "pickled" not in plan:  # else the same every generation
            metadata = dataclasses.replace(plan["metadata"], version=CURRENT_DCP_VERSION,
                                           storage_data=storage)
            plan["pickled"] = pickle.dumps(metadata)
        files.files[files.concat_path(ROOT, data_name)] = SlotFile(slot.path, slot.size)
        if plan["small"]:
            files.files[files.concat_path(ROOT, small_name)] = small.getvalue()
        files.files[files.concat_path(ROOT, rank_metadata_file(self.rank))] = plan["pickled"]
        slot.stamp(gen)
        self._turn ^= 1

    def _make_plan(self, state: dict[str, Any], views: list[torch.Tensor]) -> dict[str, Any]:
        """DCP's plan over this rank's shards: where each tensor item's record lies in a slot
        (the same in both), and the items that go in the small file."""
        from torch.distributed.checkpoint import DefaultSavePlanner
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        from torch.distributed.checkpoint.planner import WriteItemType

        planner = DefaultSavePlanner()
        planner.set_up_planner(state, storage_meta=None, is_coordinator=True)
        plans, metadata = planner.create_global_plan([planner.create_local_plan()])
        plan = planner.finish_plan(plans[0])
        index = {v.data_ptr(): i for i, v in enumerate(views) if v.numel()}
        fixed, small = {}, []
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                small.append(item)
                continue
            data = planner.resolve_data(item)
            local = getattr(data, "_local_tensor", data)
            if not local.numel():
                small.append(item)
                continue
            i = index.get(local.data_ptr())
            if i is None or views[i].shape != local.shape:
                raise ValueError(f"{item.index.fqn}: not a shard of the slot")
            start, head, tail, nbytes = self._layout[i]
            fixed[item.index] = _StorageInfo(rank_data_file(self.rank), start,
                                             len(head) + nbytes + len(tail))
        return {"metadata": metadata, "fixed": fixed, "small": small}

    def remove(self) -> None:
        """Remove the slot files still on the file system (the store unlinks them once it maps
        them: these are the ones it never took)."""
        for slot in self.slots:
            try:
                if slot is not None:
                    os.remove(slot.path)
            except FileNotFoundError:
                pass


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
