"""A checkpoint's files where they lie: on the local file system or on any pyarrow filesystem
(the one Ray Train's ``Checkpoint.filesystem`` holds: S3, GCS, a mounted one; the memory tier's
stores, ``memory/restore.py``). torch's ``FileSystemReader`` reads a DCP checkpoint through them, byte
ranges included (the memory tier's ``rank_files.SlotReader`` one it wrote rank by rank); the
small files (``extra.pt``, ``sharded.json``) are read whole."""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NamedTuple

import numpy as np
import torch

from ray_train_xla.toolkit.runtime import runtime

ROOT = "memory"  # a checkpoint's directory name inside a MemoryFiles


class LocalFiles:
    """The local file system, as the checkpoint writers below use it (DCP's own writer)."""

    def create_stream(self, path, mode: str):
        return open(path, mode)

    def concat_path(self, path, suffix: str) -> str:
        return os.path.join(str(path), suffix)

    def mkdir(self, path) -> None:
        os.makedirs(str(path), exist_ok=True)

    def sizes(self, directory: str) -> dict[str, int]:
        """Each file of ``directory`` with its size in bytes."""
        return {name: os.path.getsize(os.path.join(directory, name))
                for name in os.listdir(directory)}

    def dcp_writer(self, directory: str):
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(directory)


class _FileSystem:
    """What :class:`ArrowFileSystem` and :class:`MemoryFiles` share of torch DCP's
    ``FileSystemBase``."""

    def concat_path(self, path, suffix: str) -> str:
        return f"{str(path).rstrip('/')}/{suffix}"

    def init_path(self, path) -> str:
        return str(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return True

    def dcp_writer(self, directory: str):
        """torch's ``FileSystemWriter`` writing into ``directory`` here (no ``fsync``: a remote
        store makes a file durable when it is closed)."""
        from torch.distributed.checkpoint import FileSystemWriter

        writer = FileSystemWriter(os.devnull, sync_files=False)  # a path FileSystem accepts
        writer.fs = self
        writer.path = directory
        return writer


class ArrowFileSystem(_FileSystem):
    """torch DCP's ``FileSystemBase`` over a pyarrow filesystem: what ``FileSystemReader`` needs
    to read a checkpoint where it lies (byte ranges included) and ``FileSystemWriter`` to write
    one there, straight into the run's storage (S3, GCS, any filesystem Ray Train was given)."""

    def __init__(self, filesystem) -> None:
        self.filesystem = filesystem

    def __reduce__(self):
        # A writer process gets this as Ray's workers got the filesystem: a handler class of the
        # driver script (defined in ``__main__``, or in a function) is pickled by value.
        return _arrow_file_system, (by_value(self.filesystem),)

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" in mode:
            with self.filesystem.open_output_stream(str(path)) as f:
                yield f
        else:
            with self.filesystem.open_input_file(str(path)) as f:
                yield f

    def rename(self, path, new_path) -> None:
        self.filesystem.move(str(path), str(new_path))

    def mkdir(self, path) -> None:
        self.filesystem.create_dir(str(path), recursive=True)

    def exists(self, path) -> bool:
        import pyarrow.fs

        return self.filesystem.get_file_info(str(path)).type != pyarrow.fs.FileType.NotFound

    def rm_file(self, path) -> None:
        self.filesystem.delete_file(str(path))

    def ls(self, path) -> list[str]:
        import pyarrow.fs

        return [info.path for info in self.filesystem.get_file_info(
            pyarrow.fs.FileSelector(str(path)))]

    def sizes(self, directory: str) -> dict[str, int]:
        """Each file of ``directory`` with its size in bytes."""
        import pyarrow.fs

        infos = self.filesystem.get_file_info(pyarrow.fs.FileSelector(directory,
                                                                      allow_not_found=True))
        return {info.base_name: info.size for info in infos
                if info.type == pyarrow.fs.FileType.File}


def by_value(obj: Any) -> bytes:
    """``obj`` pickled so that any process with this package can load it: with the standard
    pickler when it can, else with Ray's cloudpickle, as Ray pickled it to its workers (a class
    that is not importable, one of the driver script, goes by value)."""
    try:
        return pickle.dumps(obj)
    except (pickle.PicklingError, AttributeError, TypeError):
        from ray import cloudpickle

        return cloudpickle.dumps(obj)


def _arrow_file_system(data: bytes) -> ArrowFileSystem:
    return ArrowFileSystem(pickle.loads(data))


def files_at(filesystem=None):
    """How a checkpoint is written on ``filesystem``: None or pyarrow's local filesystem (the
    local file system), a ``MemoryFiles`` (host memory) or any other pyarrow filesystem."""
    if filesystem is None or isinstance(filesystem, (LocalFiles, MemoryFiles, ArrowFileSystem)):
        return LocalFiles() if filesystem is None else filesystem
    import pyarrow.fs

    if isinstance(filesystem, pyarrow.fs.LocalFileSystem):
        return LocalFiles()
    return ArrowFileSystem(filesystem)


def save_file(files, directory: str, name: str, obj: Any) -> None:
    """``torch.save(obj)`` as the file ``name`` of ``directory`` (streamed, never held whole)."""
    with files.create_stream(files.concat_path(directory, name), "wb") as f:
        if isinstance(obj, (bytes, bytearray)):
            f.write(obj)
        else:
            torch.save(obj, f)


def has_file(path: str, name: str, filesystem=None) -> bool:
    """Whether the checkpoint directory ``path`` holds ``name``."""
    if filesystem is None:
        return os.path.exists(os.path.join(path, name))
    return ArrowFileSystem(filesystem).exists(f"{path.rstrip('/')}/{name}")


def read_file(path: str, name: str, filesystem=None) -> bytes | None:
    """The bytes of ``name`` in the checkpoint directory ``path``, None when it is not there."""
    if not has_file(path, name, filesystem):
        return None
    files = files_at(filesystem)
    with files.create_stream(files.concat_path(path, name), "rb") as f:
        return f.read()


def load_small(path: str, name: str, filesystem=None) -> Any:
    """A small torch file of the checkpoint (``extra.pt``), or None."""
    data = read_file(path, name, filesystem)
    return None if data is None else torch.load(io.BytesIO(data), map_location="cpu",
                                                weights_only=False)


class _Buffer(io.RawIOBase):
    """A file written into one buffer of its expected size, reused from a generation to the
    next once released (no copy as it grows, unlike ``io.BytesIO``, and no allocation a
    generation; past that size it grows by doubling)."""

    def __init__(self, capacity: int) -> None:
        capacity = max(capacity, 1 << 16)
        spares = runtime().spare_buffers  # given back by MemoryFiles.release
        spare = next((b for b in spares if b.nbytes >= capacity), None)
        if spare is not None:
            spares.remove(spare)
        self.array = spare if spare is not None else np.empty(capacity, dtype=np.uint8)
        self._view = memoryview(self.array)
        self._n = 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        end = self._n + view.nbytes
        if end > self.array.nbytes:
            grown = np.empty(max(end, 2 * self.array.nbytes), dtype=np.uint8)
            grown[:self._n] = self.array[:self._n]
            self.array, self._view = grown, memoryview(grown)
        self._view[self._n:end] = view
        self._n = end
        return view.nbytes

    def tell(self) -> int:
        return self._n

    def written(self) -> memoryview:
        return self._view[:self._n]


class SharedFile(NamedTuple):
    """A file of a ``MemoryFiles`` that a writer process wrote into shared memory (tmpfs)."""

    path: str
    size: int


class SlotFile(SharedFile):
    """A rank's data file written in place into one of its slots in shared memory
    (``rank_files.RankSlots``): the store maps it once and serves it as the generation it
    says."""


class MemoryFiles(_FileSystem):
    """torch DCP's ``FileSystemBase`` over a dict: a checkpoint written into host memory.
    ``expected_bytes``: the size of the rank's data file (DCP's ``.distcp``), when known, so
    that it is written into one buffer of that size.

    With :meth:`write_by`, a replicated ``checkpoint.pt`` is formatted by a writer process
    (``writer.SaveProcess``) into a file of a shared-memory directory (``SharedFile``), off
    this process's interpreter lock; a rank's DCP data file written in place is one of its
    slots (``SlotFile``); the small files (DCP's ``.metadata``, ``extra.pt``) stay in this
    process."""

    def __init__(self) -> None:
        self.files: dict[str, Any] = {}  # path -> bytes, a memoryview of them, or a SharedFile
        self.expected_bytes = 0
        self._arrays: list[Any] = []
        self.writer, self.shared_dir, self.timeout_s, self.rank = None, "", 0.0, 0  # write_by's

    def write_by(self, writer, shared_dir: str, timeout_s: float, rank: int) -> None:
        """Have ``writer`` (a ready ``writer.SaveProcess``) format the files of :meth:`save`
        (a replicated ``checkpoint.pt``) into ``shared_dir``, within ``timeout_s``."""
        os.makedirs(shared_dir, exist_ok=True)
        self.writer, self.shared_dir, self.timeout_s, self.rank = writer, shared_dir, timeout_s, rank

    def shared_files(self) -> dict[str, str]:
        """The files written into shared memory (slots included): their names in the
        checkpoint, their paths."""
        return {name: f.path for name, f in self.by_name().items() if isinstance(f, SharedFile)}

    def release(self) -> None:
        """The files were copied elsewhere: their data buffers serve the next MemoryFiles of this
        process (at most two are kept spare), and shared files still there are removed. The
        files are gone."""
        for f in self.files.values():
            if isinstance(f, SharedFile) and os.path.exists(f.path):
                os.remove(f.path)
        # This generation's directory, then the tier's when no other rank's is left in it
        for directory in (self.shared_dir, os.path.dirname(self.shared_dir)):
            if directory and os.path.isdir(directory):
                try:
                    os.rmdir(directory)
                except OSError:  # not empty: another rank's files, not ours to remove
                    break
        self.files.clear()
        spares = runtime().spare_buffers
        spares.extend(self._arrays)
        del spares[:-2]
        self._arrays = []

    @contextmanager
    def create_stream(self, path, mode: str) -> Iterator[io.IOBase]:
        if "w" in mode:
            key = str(path)
            large = key.endswith(".distcp")
            buf = _Buffer(self.expected_bytes if large else 0)
            yield buf
            # Kept without a copy (DCP may have closed the stream itself: the buffer stays)
            self.files[key] = buf.written()
            if large:
                self._arrays.append(buf.array)
        else:
            data = self.files[str(path)]
            if isinstance(data, SharedFile):
                with open(data.path, "rb") as f:
                    yield f
            else:
                yield io.BytesIO(data)

    def rename(self, path, new_path) -> None:
        self.files[str(new_path)] = self.files.pop(str(path))

    def mkdir(self, path) -> None:
        pass

    def exists(self, path) -> bool:
        return str(path) in self.files

    def rm_file(self, path) -> None:
        self.files.pop(str(path), None)

    def ls(self, path) -> list[str]:
        prefix = str(path).rstrip("/") + "/"
        return [p for p in self.files if p.startswith(prefix)]

    def save(self, name: str, obj: Any) -> None:
        """A torch file ``name`` in the checkpoint's directory (by the writer process, when
        there is one: ``obj``'s tensors are then best in shared memory already)."""
        if self.writer is None:
            save_file(self, ROOT, name, obj)
            return
        result = self.writer.save(obj, self.shared_dir, name, None, self.timeout_s, self.rank)
        self.files[self.concat_path(ROOT, name)] = SharedFile(os.path.join(self.shared_dir, name),
                                                              result["bytes"])

    def sizes(self, directory: str) -> dict[str, int]:
        """Each file of the checkpoint with its size in bytes."""
        return {name: data.size if isinstance(data, SharedFile) else len(data)
                for name, data in self.by_name().items()}

    def dcp_writer(self, directory: str):
        return super().dcp_writer(ROOT)

    def by_name(self) -> dict[str, Any]:
        """The checkpoint's files under their names in its directory."""
        prefix = ROOT + "/"
        return {p[len(prefix):]: b for p, b in self.files.items() if p.startswith(prefix)}
