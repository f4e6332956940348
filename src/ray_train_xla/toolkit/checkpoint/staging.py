"""Host buffers for checkpoint snapshots, allocated once and reused from save to save.

A sharded snapshot (FSDP2's DTensors) goes through torch's own ``StateDictStager``
(``torch.distributed.checkpoint._state_dict_stager``, what DCP's ``DefaultStager`` uses): it
keeps one host copy per source storage and, at the next save, copies into it again instead of
allocating. That copy must not be overwritten while the background reporter still writes it
(up to ``max_in_flight`` checkpoints, plus the one waiting for a slot), so the pool lends each
snapshot a stager of its own and takes it back when that checkpoint's files are written: in
steady state the pool holds ``max_in_flight + 1`` sets of buffers, allocated by the first saves,
and later saves allocate nothing that grows with the state. Buffers are pinned where CUDA is
available (torch pins host memory for CUDA only).

``allocated_bytes`` counts the host storages the pool allocated, for tests and benchmarks.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import torch


class StagingPool:
    """Stagers lent to one snapshot each, from the snapshot until its write ends."""

    def __init__(self, pin_memory: bool | None = None) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self._lock = threading.Lock()
        self._free: list[Any] = []
        self._stagers = 0
        self.allocated_bytes = 0
        self.snapshots = 0

    def _new_stager(self):
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager

        stager = StateDictStager(pin_memory=self.pin_memory)
        stage_storage = stager._stage_untyped_storage
        pool = self

        def counted(storage, non_blocking=False):
            cached = storage in stager._cached_storage_mapping
            out = stage_storage(storage, non_blocking=non_blocking)
            if not cached:
                with pool._lock:
                    pool.allocated_bytes += out.nbytes()
            return out

        stager._stage_untyped_storage = counted
        self._stagers += 1
        return stager

    @property
    def stagers(self) -> int:
        """How many sets of buffers the pool holds (each lent or free)."""
        return self._stagers

    def stage(self, state: Any) -> tuple[Any, Callable[[], None]]:
        """(a host copy of ``state``, DTensors kept DTensors on the CPU; the function that gives
        its buffers back once the copy is written). Call the second exactly once."""
        with self._lock:
            stager = self._free.pop() if self._free else None
        if stager is None:
            stager = self._new_stager()
        staged = stager.stage(state)
        with self._lock:
            self.snapshots += 1
        returned = threading.Event()

        def give_back() -> None:
            if not returned.is_set():
                returned.set()
                with self._lock:
                    self._free.append(stager)

        return staged, give_back


_POOL: StagingPool | None = None


def pool() -> StagingPool:
    """This worker's staging pool (one per process)."""
    global _POOL
    if _POOL is None:
        _POOL = StagingPool()
    return _POOL
