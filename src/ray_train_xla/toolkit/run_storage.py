"""The run's storage, from a worker and from the command line.

A run's directory (``RunConfig(storage_path=..., name=...)``: Ray's experiment directory) is the
same across the restarts and resizes of one run; what the toolkit keeps about a run (goodput
events, profiles) lives under it, beside Ray's checkpoints. It may be a local path or a URI
(``s3://``, ``gs://``...): files go through the ``pyarrow`` filesystem Ray itself uses.
"""

from __future__ import annotations

import os
from typing import Any


class RunStorage:
    """Files under one run's directory on its filesystem (a ``pyarrow.fs.FileSystem``)."""

    def __init__(self, filesystem: Any, path: str) -> None:
        self.filesystem = filesystem
        self.path = path.rstrip("/")

    @classmethod
    def of_worker(cls) -> RunStorage | None:
        """The run of this Ray Train worker (from Ray's StorageContext,
        ``ray.train.get_context().get_storage()``, a DeveloperAPI of Train V2 and V1); None
        outside one."""
        try:
            import ray.train

            storage = ray.train.get_context().get_storage()
        except Exception:  # noqa: BLE001 (not a Ray Train worker)
            return None
        if storage is None:
            return None
        return cls(storage.storage_filesystem, storage.experiment_fs_path)

    @classmethod
    def at(cls, run_path: str) -> RunStorage:
        """A run's directory given as a local path or a URI (what the CLI takes)."""
        import pyarrow.fs

        if "://" in run_path:
            fs, path = pyarrow.fs.FileSystem.from_uri(run_path)
            return cls(fs, path)
        return cls(pyarrow.fs.LocalFileSystem(), os.path.abspath(run_path))

    def full(self, relative: str) -> str:
        return f"{self.path}/{relative.lstrip('/')}" if relative else self.path

    def write_bytes(self, relative: str, data: bytes) -> None:
        """Write a whole file (written under a temporary name, then moved: readers never see
        half of it where the filesystem can move)."""
        target = self.full(relative)
        parent = target.rsplit("/", 1)[0]
        self.filesystem.create_dir(parent, recursive=True)
        tmp = f"{target}.tmp-{os.getpid()}"
        with self.filesystem.open_output_stream(tmp) as f:
            f.write(data)
        try:
            self.filesystem.move(tmp, target)
        except Exception:  # noqa: BLE001 (object stores cannot move: write in place)
            self.filesystem.delete_file(tmp)
            with self.filesystem.open_output_stream(target) as f:
                f.write(data)

    def read_bytes(self, relative: str) -> bytes | None:
        """A whole file, or None when it does not exist."""
        import pyarrow.fs

        target = self.full(relative)
        if self.filesystem.get_file_info(target).type != pyarrow.fs.FileType.File:
            return None
        with self.filesystem.open_input_stream(target) as f:
            return f.read()

    def list(self, relative: str = "", recursive: bool = False) -> list[str]:
        """Paths of the files under ``relative`` (relative to the run's directory), sorted."""
        import pyarrow.fs

        selector = pyarrow.fs.FileSelector(self.full(relative), allow_not_found=True,
                                           recursive=recursive)
        return sorted(info.path[len(self.path) + 1:] for info in self.filesystem.get_file_info(selector)
                      if info.type == pyarrow.fs.FileType.File)

    def upload_dir(self, local_dir: str, relative: str) -> list[str]:
        """Copy a local directory's files under ``relative``; returns their relative paths."""
        written = []
        for root, _, files in os.walk(local_dir):
            for name in files:
                src = os.path.join(root, name)
                rel = os.path.relpath(src, local_dir).replace(os.sep, "/")
                with open(src, "rb") as f:
                    self.write_bytes(f"{relative}/{rel}", f.read())
                written.append(f"{relative}/{rel}")
        return sorted(written)
