"""A pyarrow filesystem over the local one that logs every file opened for reading (one line per
open, ``<unix time> <bytes> <path>``) into a log file, and every file opened for writing (its
path) into ``<log>.writes``: a run's storage whose reads and writes a test counts
(``RunConfig(storage_filesystem=counting_filesystem(log))``); not pyarrow's local filesystem, so
it is written as remote storage is. Pickled to Ray's workers whole."""

from __future__ import annotations

import os
import time

import pyarrow.fs as pafs


class CountingHandler(pafs.FileSystemHandler):
    def __init__(self, log: str) -> None:
        self.log = log
        self._fs = pafs.LocalFileSystem()

    def __reduce__(self):
        return CountingHandler, (self.log,)

    def _logged(self, path: str) -> None:
        size = os.path.getsize(path) if os.path.isfile(path) else 0
        with open(self.log, "a") as f:
            f.write(f"{time.time()} {size} {path}\n")

    def get_type_name(self):
        return "counting-local"

    def normalize_path(self, path):
        return self._fs.normalize_path(path)

    def equals(self, other):
        return isinstance(other, CountingHandler) and other.log == self.log

    def get_file_info(self, paths):
        return self._fs.get_file_info(paths)

    def get_file_info_selector(self, selector):
        return self._fs.get_file_info(selector)

    def create_dir(self, path, recursive):
        self._fs.create_dir(path, recursive=recursive)

    def delete_dir(self, path):
        self._fs.delete_dir(path)

    def delete_dir_contents(self, path, missing_dir_ok=False):
        self._fs.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self):
        raise OSError("not here")

    def delete_file(self, path):
        self._fs.delete_file(path)

    def move(self, src, dest):
        self._fs.move(src, dest)

    def copy_file(self, src, dest):
        self._logged(src)
        self._fs.copy_file(src, dest)

    def open_input_stream(self, path):
        self._logged(path)
        return self._fs.open_input_stream(path)

    def open_input_file(self, path):
        self._logged(path)
        return self._fs.open_input_file(path)

    def open_output_stream(self, path, metadata):
        with open(self.log + ".writes", "a") as f:
            f.write(f"{path}\n")
        return self._fs.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path, metadata):
        return self._fs.open_append_stream(path, metadata=metadata)


def counting_filesystem(log: str) -> pafs.PyFileSystem:
    return pafs.PyFileSystem(CountingHandler(log))


def driver_script_filesystem(log: str) -> pafs.PyFileSystem:
    """``counting_filesystem`` whose handler class is defined as a driver script defines one: in
    ``__main__``, where no other process finds it. Ray pickles it to its workers by value
    (cloudpickle); the standard pickler refuses it."""

    class DriverHandler(CountingHandler):
        def __reduce__(self):
            return DriverHandler, (self.log,)

    DriverHandler.__module__, DriverHandler.__qualname__ = "__main__", "DriverHandler"
    return pafs.PyFileSystem(DriverHandler(log))


def checkpoint_reads(log: str) -> list[tuple[float, int, str]]:
    """The logged reads of files inside checkpoint directories (``checkpoint_<date>/``)."""
    if not os.path.exists(log):
        return []
    out = []
    with open(log) as f:
        for line in f:
            t, size, path = line.rstrip("\n").split(" ", 2)
            if "/checkpoint_2" in path:
                out.append((float(t), int(size), path))
    return out


def checkpoint_writes(log: str) -> list[str]:
    """The paths opened for writing through the filesystem, in order."""
    if not os.path.exists(log + ".writes"):
        return []
    with open(log + ".writes") as f:
        return f.read().split()


class SlowHandler(CountingHandler):
    """Writes that take ``seconds`` to start: a storage that hangs."""

    def __init__(self, log: str, seconds: float) -> None:
        super().__init__(log)
        self.seconds = seconds

    def __reduce__(self):
        return SlowHandler, (self.log, self.seconds)

    def open_output_stream(self, path, metadata):
        time.sleep(self.seconds)
        return super().open_output_stream(path, metadata)


def slow_filesystem(log: str, seconds: float) -> pafs.PyFileSystem:
    return pafs.PyFileSystem(SlowHandler(log, seconds))
