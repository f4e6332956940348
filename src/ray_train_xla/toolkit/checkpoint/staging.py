"""Host buffers for checkpoint snapshots, allocated once and reused from save to save.

A snapshot copies each storage its tensors view, whole, with ``copy_`` into a host buffer of a
set the pool lends it (:class:`StagingPool`), and each staged tensor is the same view of that
buffer (offset, strides): views of one storage, tied weights among them, share one buffer as
they share the storage. A buffer belongs to the position in the snapshot of its storage's first
tensor: the next save of the same structure fills it again; a storage of another size there
gets a new one. A set must not be overwritten while the background reporter still writes it
(up to ``max_in_flight`` checkpoints, plus the one waiting for a slot), so the pool lends each
snapshot a set of its own and takes it back when that checkpoint's files are written: in steady
state the pool holds ``max_in_flight + 1`` sets of buffers, allocated by the first saves, and
later saves allocate nothing that grows with the state. Buffers are pinned where CUDA is
available (torch pins host memory for CUDA only; the copies into them are waited for once).

DTensor state is staged by its local shards, as plain tensors (:func:`split_dtensors`,
:meth:`StagingPool.stage_tensors`: no copy of the structure, whose new DTensors would each cost
a DTensor dispatch), and made DTensors again when the snapshot is written
(:func:`join_dtensors`), off the training thread: the blocking call costs little more than the
copy.

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
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from dataclasses import dataclass, field
from typing import Any

import torch

from ray_train_xla.errors import ReportError
from ray_train_xla.planning.contract import worker_context
from ray_train_xla.toolkit import events
from ray_train_xla.toolkit.runtime import runtime


def tensors_in(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of ``value``'s dicts, lists and tuples, in order."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (Mapping, list, tuple)):
        for v in value.values() if isinstance(value, Mapping) else value:
            yield from tensors_in(v)


class StagingPool:
    """Sets of host buffers, each lent to one snapshot from the snapshot until its write ends:
    a set maps a position in the snapshot to the buffer of the storage first seen there."""

    def __init__(self, pin_memory: bool | None = None, share_memory: bool = False) -> None:
        self.share_memory = share_memory  # buffers a writer process maps (writer.py)
        # pinned where CUDA is available and not refused; shared memory is not pinned
        self.pin_memory = pin_memory is not False and torch.cuda.is_available() and not share_memory
        self._lock = threading.Lock()
        self._free: list[dict[int, torch.UntypedStorage]] = []
        self.stagers = 0  # how many sets of buffers the pool holds (each lent or free)
        self.allocated_bytes = 0  # the host buffers allocated, for tests and benchmarks

    def stage(self, state: Any) -> tuple[Any, Callable[[], None]]:
        """(a host copy of ``state``, DTensors kept DTensors on the CPU; the function that gives
        its buffers back once the copy is written). Call the second exactly once. The tensors of
        its dicts, lists and tuples are staged by :meth:`stage_tensors`, the rest deep-copied."""
        tensors = {id(t): t for t in tensors_in(state)}
        tree, shards, specs = split_dtensors(list(tensors.values()))
        staged, give_back = self.stage_tensors(shards)
        copies = dict(zip(tensors, join_dtensors(tree, staged, specs)))
        return copy.deepcopy(state, copies), give_back

    def stage_tensors(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor],
                                                                  Callable[[], None]]:
        """As :meth:`stage` for a list of plain tensors: each storage copied once, each tensor
        the same view of its copy."""
        lent, kept, copies, out = self._lend(), {}, {}, []
        for i, t in enumerate(tensors):
            source = t.untyped_storage()
            key = (t.device, source.data_ptr(), source.nbytes())  # views of one storage: one copy
            if key not in copies:
                buffer = lent.get(i)
                if buffer is None or buffer.nbytes() != source.nbytes():
                    host = torch.empty(source.nbytes(), dtype=torch.uint8, pin_memory=self.pin_memory)
                    buffer = (host.share_memory_() if self.share_memory else host).untyped_storage()
                    with self._lock:
                        self.allocated_bytes += buffer.nbytes()
                copies[key] = kept[i] = buffer.copy_(source, non_blocking=self.pin_memory)
            out.append(torch.empty(0, dtype=t.dtype).set_(copies[key], t.storage_offset(),
                                                          t.size(), t.stride()))
        for device in {t.device for t in tensors if t.is_cuda and self.pin_memory}:
            torch.cuda.current_stream(device).synchronize()  # the queued copies are done
        return out, self._giving_back(kept)

    def _lend(self) -> dict[int, torch.UntypedStorage]:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.stagers += 1
        return {}

    def _giving_back(self, buffers: dict[int, torch.UntypedStorage]) -> Callable[[], None]:
        returned = threading.Event()

        def give_back() -> None:  # once, whichever thread calls it first
            with self._lock:
                if not returned.is_set():
                    returned.set()
                    self._free.append(buffers)

        return give_back


@dataclass(frozen=True)
class _Shard:
    """Where a DTensor was in a state dict whose local shards are staged apart."""

    index: int


def split_dtensors(tree: Any) -> tuple[Any, list[torch.Tensor], list[tuple]]:
    """(``tree`` with each tensor replaced by a marker; the tensors, a DTensor by its local
    shard; what makes each a DTensor again: mesh, placements, shape, stride, or None for a
    plain tensor), made DTensors again by :func:`join_dtensors` (see the module docstring)."""
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


# ---- the save's second step: a described state (``describe.py``) copied to host memory, by
# its kind (``replicated.Replicated.stage``, ``sharded.Shards.stage``)

@dataclass
class Staged:
    """A snapshot in host memory: what the writers write (``writer.py``).

    ``state``: the host copy (replicated state: the state as saved; SPMD shards: DCP's state
    dict; DTensor shards: their local shards, a list, made DTensors again by
    :meth:`host_state`), or, while an overlapped copy runs, a future of (shards, release).
    ``release`` gives its buffers back once written (or None). Sharded state also has
    ``groups`` (each optimizer's parameter groups, by entry), ``extra`` (the replicated rest),
    its ``models`` and ``optimizers`` (the entries), and DTensor shards ``tree`` and ``specs``
    (:func:`split_dtensors`); SPMD shards the ``devices`` they are spread over."""

    kind: Any
    state: Any
    release: Callable[[], None] | None = None
    groups: dict[str, Any] | None = None
    extra: dict[str, Any] | None = None
    models: list[str] = field(default_factory=list)
    optimizers: list[str] = field(default_factory=list)
    tree: Any = None
    specs: list | None = None
    devices: int | None = None  # what the shards were spread over, when not one per worker

    def copied(self, timeout_s: float | None = None) -> Any:
        """The host copy, once an overlapped copy is done (waited for at most ``timeout_s``)."""
        if isinstance(self.state, Future):
            self.state, self.release = self.state.result(timeout=timeout_s)
        return self.state

    def host_state(self) -> Any:
        """What DCP writes: the host copy, DTensor shards made DTensors again over it."""
        state = self.copied()
        return state if self.specs is None else join_dtensors(self.tree, state, self.specs)

    def give_back(self) -> None:
        """Give the snapshot's buffers back to the pool (once written, or failed)."""
        release, self.release = self.release, None
        if release is not None:
            release()


def stage_dtensors(state: Any, overlap: bool = False, stager=None) -> tuple[Any, Any, list, Any]:
    """(``state`` with each tensor a marker, what makes each a DTensor again, the host copy of
    the local shards or a future of (it, release), release or None): the copy of DTensor state,
    in the background where ``overlap`` (the next optimizer step waits for it,
    :class:`Snapshots`). ``stager``: what copies the local shards (default: the pool's
    ``stage_tensors``)."""
    tree, shards, specs = split_dtensors(state)
    stager = stager or pool().stage_tensors
    if overlap:
        return tree, specs, snapshots().submit(stager, shards), None
    staged, release = stager(shards)
    return tree, specs, staged, release


class Snapshots:
    """Snapshots copied in a background thread, waited for by the next optimizer step."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(1, thread_name_prefix="ray_train_xla-snapshot")
        self._lock = threading.Lock()
        self._pending: set[Future] = set()
        self._hook = None
        self.waits = 0  # optimizer steps that waited for a snapshot

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
        timeout_s = worker_context().timeout_s if timeout_s is None else timeout_s
        start = time.perf_counter()
        _, left = wait_all(pending, timeout=timeout_s)
        self.waits += 1
        events.add_stall(time.perf_counter() - start)
        if left:
            raise ReportError(f"a checkpoint snapshot was not copied to host memory within "
                              f"timeout_s={timeout_s:g}")

    def _install(self) -> None:
        if self._hook is not None:
            return
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        def before_step(optimizer, args, kwargs) -> None:
            self.wait()

        hook = (torch._disable_dynamo(before_step) if hasattr(torch, "_disable_dynamo")
                else before_step)
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
