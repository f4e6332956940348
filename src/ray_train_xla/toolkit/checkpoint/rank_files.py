"""DCP checkpoints written rank by rank, in place, with no collective: the memory tier's format
for DTensor state, where the node has shared memory (torch_xla SPMD state goes through
``dcp.save``, ``memory/tier.py``; docs/sharded-models.md, "The memory tier").

``dcp.save`` plans every checkpoint collectively and formats each shard with ``torch.save`` at
each save. The memory tier saves the same structure again and again, so each rank lays its
shards out once per structure and then only copies them into place, through DCP's public
extension points (a ``StorageWriter`` and a ``StorageReader`` of its own):

- **Slots.** Each rank keeps two files in the node's shared memory (:class:`RankSlots`), used in
  turn: the generation being written, and the newest complete one (a rank starts a generation
  only once every rank completed the one before). A slot is the rank's data file
  (``__{rank}_0.distcp``): each shard's bytes as they lie in memory, at an offset laid out once
  per structure, allocated once; the snapshot copies the shards straight there.
- **Plan.** DCP's own planner over the rank's own shards and :class:`SlotWriter`, driven as
  ``dcp.save`` drives them without a process group, once per structure; the writer's storage
  data says where each chunk lies (:class:`SlotChunk`). Each generation gets the rank's
  metadata (``__{rank}.metadata``) and, for non-tensor values, a small file of their bytes
  (``__{rank}_1.distcp``, as the planner pickles them). An empty shard has no bytes.
- **Stamp.** A slot's first 8 bytes say which generation it holds (-1 while the snapshot
  copies into it): the store serves a slot only as the generation it says (``slot_stamp``).

:class:`SlotReader` merges the ranks' metadata (:func:`merge_metadata`) and reads their files
(``format.reader_for`` picks it): ``dcp.load`` like any DCP checkpoint, resharding included.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import itertools
import mmap
import os
import pickle
import secrets
from typing import Any

import torch
from torch.distributed.checkpoint import DefaultSavePlanner, StorageReader, StorageWriter
from torch.distributed.checkpoint.metadata import MetadataIndex, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadItemType, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ray_train_xla.toolkit.checkpoint.files import ROOT, SlotFile, files_at, read_file
from ray_train_xla.toolkit.checkpoint.memory.store import SLOT_PREFIX
from ray_train_xla.toolkit.checkpoint.staging import join_dtensors, structure

ALIGN = 64  # each shard's offset in a slot
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


@dataclasses.dataclass(frozen=True)
class SlotChunk:
    """Where one chunk of a checkpoint written by :class:`SlotWriter` lies (its
    ``WriteResult.storage_data``): ``length`` bytes from ``offset`` of the rank's file
    ``name``. A tensor's bytes as they lie in memory; a non-tensor value as the planner
    pickled it."""

    name: str
    offset: int
    length: int


def _done(value) -> Any:
    future = torch.futures.Future()
    future.set_result(value)
    return future


class _Storage:
    """What :class:`SlotWriter` and :class:`SlotReader` do alike: no checkpoint ids, the plans
    as the planner made them."""

    def reset(self, checkpoint_id=None) -> None:
        pass

    def prepare_local_plan(self, plan):
        return plan

    def prepare_global_plan(self, plans):
        return plans

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


class SlotWriter(_Storage, StorageWriter):
    """DCP's ``StorageWriter`` of one rank's generation, without a collective: each tensor
    chunk is where the snapshot copied it, in the rank's slot (:attr:`slot`; the writer notes
    where), each non-tensor value goes into the small file of the write (:attr:`small`);
    ``finish`` keeps the rank's ``Metadata`` (:attr:`metadata`)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.slot, self.small, self.metadata = rank, None, io.BytesIO(), None

    def set_up_storage_writer(self, is_coordinator: bool, *args, **kwargs) -> None:
        pass

    def write_data(self, plan, planner):
        results, self.small = [], io.BytesIO()
        for item in plan.items:
            data = planner.resolve_data(item)
            if item.type == WriteItemType.BYTE_IO:
                where = SlotChunk(rank_small_file(self.rank), self.small.tell(),
                                  self.small.write(data.getbuffer()))
            else:  # an empty shard has no bytes
                at = data.data_ptr() - self.slot.data.data_ptr() if data.numel() else 0
                if data.numel() and not (data.is_contiguous() and
                                         HEADER <= at <= self.slot.size - data.nbytes):
                    raise ValueError(f"{item.index.fqn}: not a shard of the slot")
                where = SlotChunk(rank_data_file(self.rank), at, data.nbytes)
            results.append(WriteResult(index=item.index, size_in_bytes=where.length,
                                       storage_data=where))
        return _done(results)

    def finish(self, metadata, results) -> None:
        self.metadata = dataclasses.replace(
            metadata, storage_data={r.index: r.storage_data for rank in results for r in rank})


class SlotReader(_Storage, StorageReader):
    """DCP's ``StorageReader`` of a checkpoint written by :class:`SlotWriter` in directory
    ``path`` (on ``filesystem``, a pyarrow filesystem such as the stores', ``StoreFiles``;
    default the local file system): its metadata is the ranks' own merged; each file a chunk
    lies in is opened once per read, each chunk read where it lies."""

    def __init__(self, path: str, filesystem=None) -> None:
        self.path, self.filesystem, self.metadata = path, filesystem, None

    def read_metadata(self, *args, **kwargs):
        names = [n for n in files_at(self.filesystem).sizes(self.path) if is_rank_metadata(n)]
        return merge_metadata([pickle.loads(read_file(self.path, name, self.filesystem))
                               for name in sorted(names, key=lambda n: int(n[2:-9]))])

    def set_up_storage_reader(self, metadata, is_coordinator: bool, *args, **kwargs) -> None:
        self.metadata = metadata

    def read_data(self, plan, planner):
        entries, files = self.metadata.state_dict_metadata, files_at(self.filesystem)
        sizes = {MetadataIndex(fqn, c.offsets): c.sizes for fqn, entry in entries.items()
                 for c in getattr(entry, "chunks", ())}
        with contextlib.ExitStack() as streams:
            opened: dict[str, Any] = {}
            for item in plan.items:
                where = self.metadata.storage_data[item.storage_index]
                if where.name not in opened:
                    opened[where.name] = streams.enter_context(files.create_stream(
                        files.concat_path(self.path, where.name), "rb"))
                f = opened[where.name]
                f.seek(where.offset)
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(f.read(where.length)))
                    continue
                # A whole chunk into a CPU tensor of its dtype is read straight into it; else
                # through a tensor of its own, from which the part the target needs is copied.
                target, size = planner.resolve_tensor(item).detach(), sizes[item.storage_index]
                dtype = entries[item.storage_index.fqn].properties.dtype
                whole = (target.device.type == "cpu" and target.dtype == dtype
                         and target.is_contiguous() and target.shape == size)
                chunk = target if whole else torch.empty(size, dtype=dtype)
                if where.length and f.readinto(
                        chunk.reshape(-1).view(torch.uint8).numpy()) != where.length:
                    raise OSError(f"{where.name}: {where.length} bytes from {where.offset} "
                                  "not there")
                if not whole:
                    for dim, (start, length) in enumerate(zip(item.storage_offsets,
                                                              item.lengths)):
                        chunk = chunk.narrow(dim, start, length)
                    target.copy_(chunk)
                planner.commit_tensor(item, target)
        return _done(None)


class _Slot:
    """One slot file in shared memory, mapped here: a view of each shard's bytes."""

    def __init__(self, path: str, key: tuple, offsets: list[int], size: int) -> None:
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
        self.data = torch.frombuffer(self._map, dtype=torch.uint8)
        self._stamp = self.data[:8].view(torch.int64)
        self.stamp(-1)
        self.views = [self.data[at:at + dtype.itemsize * torch.Size(shape).numel()]
                      .view(dtype).view(shape) for at, (dtype, shape) in zip(offsets, key)]

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
        self._offsets: list[int] = []
        self._writer = SlotWriter(rank)
        self._plan: tuple | None = None
        self._plan_key: tuple | None = None

    def stager(self, gen: int):
        """What copies generation ``gen``'s shards (a staging function for
        ``Shards.stage``): into the slot whose turn it is, stamped -1 meanwhile."""

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
        offsets, end = [], HEADER
        for dtype, shape in key:
            offsets.append(end)
            end += -(-dtype.itemsize * torch.Size(shape).numel() // ALIGN) * ALIGN
        self.remove()  # the old layout's slot files no store took
        self._series, self._size = next(_SERIES), end
        self.slots = [None, None]
        self.key, self._offsets, self._turn = key, offsets, 0

    def _slot(self, turn: int) -> _Slot:
        """The slot of ``turn``, made at its first use (so that a worker that ends early leaves
        no file no store took but the one being written)."""
        if self.slots[turn] is None:
            path = os.path.join(self.directory, f"{SLOT_PREFIX}{os.getpid()}-{self.rank}-"
                                                f"{self._series}-{turn}.distcp")
            for last in (False, True):  # the directory may be swept as empty meanwhile
                os.makedirs(self.directory, exist_ok=True)
                try:
                    self.slots[turn] = _Slot(path, self.key, self._offsets, self._size)
                    break
                except FileNotFoundError:
                    if last:
                        raise
            self.allocations += 1
        return self.slots[turn]

    def write(self, staged: dict[str, Any], files, gen: int, timeout_s: float) -> None:
        """Generation ``gen`` (``staged``: its kind's ``stage`` with :meth:`stager`, whose
        copy is waited for at most ``timeout_s``) into ``files`` (a ``MemoryFiles``): the slot
        as the rank's data file, its small file and its metadata; the slot stamped ``gen``. The
        checkpoint's own small files are the caller's (``format.write_small_files``)."""
        try:
            views = staged.copied(timeout_s)  # an overlapped snapshot: copied by now, or soon
        except TimeoutError:
            raise TimeoutError(f"the snapshot was not copied into the slot within "
                               f"timeout_s={timeout_s:g}") from None
        tree, specs = staged.tree, staged.specs
        writer = self._writer
        writer.slot = self.slots[self._turn]
        key = (self.key, structure(tree),
               tuple(None if s is None else (tuple(s[1]), tuple(s[2])) for s in specs))
        if key != self._plan_key:  # DCP's plan, as dcp.save makes it without a process group
            planner = DefaultSavePlanner()
            planner.set_up_planner(join_dtensors(tree, views, specs),
                                   storage_meta=writer.storage_meta(), is_coordinator=True)
            writer.set_up_storage_writer(True)
            plans, metadata = planner.create_global_plan(
                [writer.prepare_local_plan(planner.create_local_plan())])
            plan = planner.finish_plan(writer.prepare_global_plan(plans)[0])
            small = [i for i in plan.items if i.type == WriteItemType.BYTE_IO]
            # Where each tensor chunk lies: the same in both slots, and every generation
            tensors = writer.write_data(dataclasses.replace(
                plan, items=[i for i in plan.items if i not in small]), planner).wait()
            writer.finish(metadata, [tensors])
            self._plan = (planner, dataclasses.replace(plan, items=small), metadata, tensors,
                          pickle.dumps(writer.metadata))
            self._plan_key = key
            self.plans += 1
        planner, small, metadata, tensors, pickled = self._plan
        if small.items:  # the non-tensor values: each generation's own
            planner.set_up_planner(join_dtensors(tree, views, specs), is_coordinator=True)
            writer.finish(metadata, [tensors + writer.write_data(small, planner).wait()])
            pickled = pickle.dumps(writer.metadata)
            small_file = files.concat_path(ROOT, rank_small_file(self.rank))
            files.files[small_file] = writer.small.getvalue()
        data_file = files.concat_path(ROOT, rank_data_file(self.rank))
        files.files[data_file] = SlotFile(writer.slot.path, writer.slot.size)
        files.files[files.concat_path(ROOT, rank_metadata_file(self.rank))] = pickled
        writer.slot.stamp(gen)
        self._turn ^= 1

    def remove(self) -> None:
        """Remove the slot files still on the file system (the store unlinks them once it maps
        them: these are the ones it never took)."""
        for slot in filter(None, self.slots):
            with contextlib.suppress(FileNotFoundError):
                os.remove(slot.path)


def merge_metadata(parts: list[Any]):
    """One DCP ``Metadata`` from the ranks' own: every rank's chunks of each tensor (a chunk
    two ranks both wrote, a replicated one, once), where each lies, the planner's mappings."""
    tensors: dict[str, Any] = {}
    storage: dict[Any, Any] = {}
    mappings: dict[str, Any] = {}
    for part in parts:
        for fqn, entry in part.state_dict_metadata.items():
            if fqn not in tensors:
                tensors[fqn] = (dataclasses.replace(entry, chunks=list(entry.chunks))
                                if isinstance(entry, TensorStorageMetadata) else entry)
            elif isinstance(entry, TensorStorageMetadata):
                have = {tuple(c.offsets) for c in tensors[fqn].chunks}
                tensors[fqn].chunks.extend(c for c in entry.chunks if tuple(c.offsets) not in have)
        for index, info in part.storage_data.items():
            storage.setdefault(index, info)
        mappings.update(part.planner_data or {})
    return dataclasses.replace(parts[0], state_dict_metadata=tensors, storage_data=storage,
                               planner_data=mappings)
