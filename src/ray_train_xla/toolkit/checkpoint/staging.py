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

DTensor state is staged by its local shards, as plain tensors (:func:`split_dtensors`,
:meth:`StagingPool.stage_tensors`: the stager's storage copies without its deep copy of the
structure, whose new DTensors each cost a DTensor dispatch), and made DTensors again when the
snapshot is written (:func:`join_dtensors`), off the training thread: the blocking call costs
little more than the copy.

``allocated_bytes`` counts the host storages the pool allocated, for tests and benchmarks.
Replicated state that a writer process writes is staged the same way into shared-memory
buffers (:func:`shared_pool`), which the writer process maps instead of receiving a copy.

**Overlapped snapshots** (:class:`Snapshots`, the default for DTensor state): the copy into
those buffers runs in a background thread while the loop goes on to the next forward and
backward, which read the parameters and write only gradients. The state changes at the next
optimizer step, so torch's global optimizer step pre-hook makes that step wait for every
snapshot still being copied (the wait counts as checkpoint stall in the step timeline). This is
what DCP's ``use_async_staging`` does, hooked on the optimizer step instead of the next save.
Code that changes parameters or optimizer state in place outside an optimizer step
(``load_state_dict``, a manual update) before the next step calls :func:`wait_for_snapshots`
first, or turns overlapping off (``configure_reports(overlap_snapshots=False)``).
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass
from typing import Any

import torch

from ray_train_xla.toolkit.runtime import runtime


class StagingPool:
    """Stagers lent to one snapshot each, from the snapshot until its write ends."""

    def __init__(self, pin_memory: bool | None = None, share_memory: bool = False) -> None:
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.share_memory = share_memory  # buffers a writer process maps (writer.py)
        self._lock = threading.Lock()
        self._free: list[Any] = []
        self._stagers = 0
        self.allocated_bytes = 0
        self.snapshots = 0

    def _new_stager(self):
        from torch.distributed.checkpoint._state_dict_stager import StateDictStager

        stager = StateDictStager(pin_memory=self.pin_memory, share_memory=self.share_memory)
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
        stager = self._lend()
        return stager.stage(state), self._giving_back(stager)

    def stage_tensors(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor],
                                                                  Callable[[], None]]:
        """As :meth:`stage` for a list of plain tensors: the same stager and buffers (torch's
        ``StateDictStager``, storage by storage), without its deep copy of a structure."""
        stager = self._lend()
        out = []
        with torch.no_grad():
            for t in tensors:
                storage = stager._stage_untyped_storage(t.untyped_storage())
                out.append(torch.empty(0, dtype=t.dtype).set_(storage, t.storage_offset(),
                                                              t.size(), t.stride()))
        return out, self._giving_back(stager)

    def _lend(self):
        with self._lock:
            stager = self._free.pop() if self._free else None
        return self._new_stager() if stager is None else stager

    def _giving_back(self, stager) -> Callable[[], None]:
        with self._lock:
            self.snapshots += 1
        returned = threading.Event()

        def give_back() -> None:
            if not returned.is_set():
                returned.set()
                with self._lock:
                    self._free.append(stager)

        return give_back


@dataclass(frozen=True)
class _Shard:
    """Where a DTensor was in a state dict whose local shards are staged apart."""

    index: int

    def __deepcopy__(self, memo) -> _Shard:  # immutable: the stager keeps it as it is
        return self


def split_dtensors(tree: Any) -> tuple[Any, list[torch.Tensor], list[tuple]]:
    """(``tree`` with each tensor replaced by a marker; the tensors, a DTensor by its local
    shard; what makes each a DTensor again: mesh, placements, shape, stride, or None for a
    plain tensor). The stager copies plain local tensors, which costs a fraction of copying
    DTensors (each new DTensor is a DTensor dispatch): the DTensors are made again by
    :func:`join_dtensors` when the snapshot is written, off the training thread."""
    from torch.distributed.tensor import DTensor

    shards: list[torch.Tensor] = []
    specs: list[tuple] = []

    def leaf(value: Any) -> Any:
        if isinstance(value, DTensor):
            local = getattr(value, "_local_tensor", None)
            shards.append(value.to_local() if local is None else local)
            specs.append((value.device_mesh, value.placements, value.shape, value.stride()))
            return _Shard(len(shards) - 1)
        if isinstance(value, torch.Tensor):  # e.g. the optimizer's step count
            shards.append(value)
            specs.append(None)
            return _Shard(len(shards) - 1)
        if isinstance(value, (int, float, str, bytes, type(None), torch.dtype, torch.device)):
            return value
        return copy.deepcopy(value)  # as the stager would: the snapshot shares nothing mutable

    return _map_leaves(tree, leaf), shards, specs


def join_dtensors(tree: Any, shards: list[torch.Tensor], specs: list[tuple]) -> Any:
    """``tree`` with each marker of :func:`split_dtensors` the DTensor of its staged shard
    (the same mesh, placements, shape and stride; no copy, no collective)."""
    from torch.distributed.tensor import DTensor

    def leaf(value: Any) -> Any:
        if not isinstance(value, _Shard):
            return value
        if specs[value.index] is None:
            return shards[value.index]
        mesh, placements, shape, stride = specs[value.index]
        return DTensor.from_local(shards[value.index], mesh, placements, run_check=False,
                                  shape=shape, stride=stride)

    return _map_leaves(tree, leaf)


def structure(tree: Any) -> Any:
    """The shape of a tree of :func:`split_dtensors` (dict keys, list lengths, each leaf's
    kind or shard), hashable: equal for two snapshots of the same structure."""
    if isinstance(tree, dict):
        return ("d", tuple((k, structure(v)) for k, v in tree.items()))
    if isinstance(tree, (list, tuple)) and not hasattr(tree, "_fields"):
        return ("l", tuple(structure(v) for v in tree))
    return tree.index if isinstance(tree, _Shard) else type(tree).__name__


def _map_leaves(value: Any, leaf: Callable[[Any], Any]) -> Any:
    """``value`` with its dicts, lists and tuples rebuilt and ``leaf`` applied to the rest."""
    if isinstance(value, dict):
        return {k: _map_leaves(v, leaf) for k, v in value.items()}
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_map_leaves(v, leaf) for v in value)
    return leaf(value)


def pool() -> StagingPool:
    """This worker's staging pool (held by the runtime)."""
    return runtime().part("pool", StagingPool)


def shared_pool() -> StagingPool:
    """This worker's staging pool of shared-memory buffers, for snapshots a writer process
    writes (replicated state, ``writer.py``; held by the runtime)."""
    return runtime().part("shared_pool", lambda: StagingPool(pin_memory=False, share_memory=True))


class Snapshots:
    """Snapshots copied in a background thread, waited for by the next optimizer step."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ray_train_xla-snapshot")
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._hook = None
        self.waits = 0  # optimizer steps that waited for a snapshot
        self.waited_s = 0.0

    def submit(self, stage: Callable[[Any], tuple[Any, Callable[[], None]]], state: Any) -> Future:
        """Copy ``state`` with ``stage`` (a pool's ``stage`` or ``stage_tensors``) in the
        background: a future of its (copy, give back)."""
        self._install()
        future = self._executor.submit(stage, state)
        with self._lock:
            self._pending.add(future)
        future.add_done_callback(self._done)
        return future

    def _done(self, future: Future) -> None:
        with self._lock:
            self._pending.discard(future)

    def wait(self, timeout_s: float | None = None) -> None:
        """Wait for every snapshot still being copied (within ``timeout_s``, default the run's)."""
        with self._lock:
            pending = list(self._pending)
        if not pending:
            return
        from ray_train_xla.planning.contract import worker_context
        from ray_train_xla.toolkit import events

        timeout_s = worker_context().timeout_s if timeout_s is None else timeout_s
        start = time.perf_counter()
        _, left = wait_all(pending, timeout=timeout_s)
        waited = time.perf_counter() - start
        self.waits += 1
        self.waited_s += waited
        events.add_stall(waited)
        if left:
            from ray_train_xla.errors import ReportError

            raise ReportError(f"a checkpoint snapshot was not copied to host memory within "
                              f"timeout_s={timeout_s:g}")

    def _install(self) -> None:
        if self._hook is not None:
            return
        import torch
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def before_step(optimizer, args, kwargs) -> None:
            self.wait()

        hook = torch._disable_dynamo(before_step) if hasattr(torch, "_disable_dynamo") \
            else before_step
        self._hook = register_optimizer_step_pre_hook(hook)

    def close(self) -> None:
        """Stop hooking optimizer steps (the runtime ends: its copies were waited for by the
        reports' flush, or the training function failed)."""
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        self._executor.shutdown(wait=False)


def snapshots() -> Snapshots:
    """This worker's background snapshots (held by the runtime)."""
    return runtime().part("snapshots", Snapshots)


def wait_for_snapshots() -> None:
    """Wait until every checkpoint snapshot of this worker is copied (the next optimizer step
    does it itself; call it before changing the state in place any other way)."""
    if runtime().snapshots is not None:
        runtime().snapshots.wait()
