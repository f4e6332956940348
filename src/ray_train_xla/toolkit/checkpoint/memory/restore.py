"""A generation read back from the memory stores: a read-only pyarrow filesystem over them
(``StoreFiles``), through which ``dcp.load`` restores it as from storage (torch's
``FileSystemReader``; ``rank_files.SlotReader`` for a generation written rank by rank)."""

from __future__ import annotations

import threading

import pyarrow as pa
import pyarrow.fs as pafs
import ray

from ray_train_xla.toolkit.checkpoint.files import ROOT
from ray_train_xla.toolkit.checkpoint.memory.store import NAMESPACE


class StoreFiles:
    """pyarrow ``FileSystemHandler`` (read only) over one generation in the stores: a file is
    fetched from the first live store that holds it when opened, and counted."""

    def __init__(self, gen: int, holders: dict[str, list[tuple[str, int]]], timeout_s: float):
        self.gen, self.holders, self.timeout_s = gen, holders, timeout_s
        self.fetched_bytes = 0
        self.served: set[str] = set()  # the stores files were read from
        self._lock = threading.Lock()

    def _fetch(self, path: str):
        from ray_train_xla.toolkit.checkpoint.rank_files import rank_data_file

        name = path.rsplit("/", 1)[-1]
        if name not in self.holders:
            raise FileNotFoundError(path)
        errors = []
        for store, rank in self.holders[name]:
            try:
                handle = ray.get_actor(store, namespace=NAMESPACE)
                data = self._read(handle, rank, name)
                # A rank's data file may be a slot, which a live writer could take for a newer
                # generation while it is read: the read serves only if the slot still holds
                # this generation after it (it is stamped -1 before it is written again).
                if name == rank_data_file(rank) and not ray.get(
                        handle.held.remote(self.gen, rank), timeout=self.timeout_s):
                    raise ValueError(f"generation {self.gen} of rank {rank} was written over "
                                     "while it was read")
            except Exception as exc:  # noqa: BLE001 (the next holder serves)
                errors.append(f"{store}: {type(exc).__name__}: {exc}")
                continue
            with self._lock:
                self.fetched_bytes += data.nbytes
                self.served.add(store)
            return data
        raise OSError(f"memory tier: {name} of generation {self.gen} could not be read from any "
                      f"store ({'; '.join(errors)})")

    def _read(self, handle, rank: int, name: str):
        return ray.get(handle.get.remote(self.gen, rank, name), timeout=self.timeout_s)

    # pyarrow's FileSystemHandler
    def get_type_name(self) -> str:
        return "ray_train_xla-memory"

    def normalize_path(self, path: str) -> str:
        return path

    def equals(self, other) -> bool:
        return other is self

    def get_file_info(self, paths):
        def kind(path: str):
            if path.rstrip("/") == ROOT:
                return pafs.FileType.Directory
            found = path.rstrip("/").rsplit("/", 1)[-1] in self.holders
            return pafs.FileType.File if found else pafs.FileType.NotFound

        return [pafs.FileInfo(path, kind(path)) for path in paths]

    def get_file_info_selector(self, selector):
        return [pafs.FileInfo(f"{ROOT}/{n}", pafs.FileType.File) for n in sorted(self.holders)]

    def open_input_file(self, path: str):
        return pa.BufferReader(pa.py_buffer(self._fetch(path)))

    open_input_stream = open_input_file

    def _read_only(self, *args, **kwargs):
        raise OSError("the memory tier is read only here")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = _read_only
    delete_file = move = copy_file = open_output_stream = open_append_stream = _read_only
