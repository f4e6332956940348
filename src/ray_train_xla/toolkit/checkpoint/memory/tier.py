"""The worker's side of the memory tier (see the package's docstring): ``keep_in_memory``,
``MemoryTier`` (a rank's generations kept, handed to its node's store and its peer's, chosen and
read back at a restore), ``memory_tier``, ``flush_memory``, ``broadcast_from_rank0``."""

from __future__ import annotations

import atexit
import contextlib
import errno
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn

import numpy as np
import pyarrow.fs as pafs
import ray
import torch
import torch.distributed as dist
from ray.util import list_named_actors

from ray_train_xla.errors import ReportError
from ray_train_xla.toolkit import events, reporting
from ray_train_xla.toolkit.checkpoint.describe import describe
from ray_train_xla.toolkit.checkpoint.files import ROOT, MemoryFiles, SlotFile, save_file
from ray_train_xla.toolkit.checkpoint.format import write_small_files
from ray_train_xla.toolkit.checkpoint.memory import rng
from ray_train_xla.toolkit.checkpoint.memory.restore import StoreFiles
from ray_train_xla.toolkit.checkpoint.memory.store import NAMESPACE, STORE_PREFIX, store_name
from ray_train_xla.toolkit.checkpoint.writer import SaveProcess, write_staged
from ray_train_xla.toolkit.collectives import host_group
from ray_train_xla.toolkit.device import sync
from ray_train_xla.toolkit.runtime import runtime

logger = logging.getLogger(__name__)

SHARED_ROOT = "/dev/shm"  # tmpfs: where a writer process formats a generation for the store


def _shared_root() -> str:
    """The directory of this node's shared memory the tier's writer process writes into, ""
    when there is none (a generation is then formatted in the training process)."""
    path = os.path.join(SHARED_ROOT, STORE_PREFIX)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError:
        return ""
    return path if os.access(path, os.W_OK) else ""


class MemoryTier:
    """This worker's side of the memory tier (see the package's docstring)."""

    def __init__(self, ctx) -> None:
        self.tier, self.every, self.nodes = ctx.memory_tier, ctx.memory_every, ctx.memory_nodes
        self.rank, self.world, self.timeout_s = ctx.rank, ctx.world_size, ctx.timeout_s
        self.key = (ctx.memory_tier, ctx.run_id, ctx.rank, ctx.world_size)  # the plan it serves
        self.node = ray.get_runtime_context().get_node_id()
        self._next_gen: int | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="ray_train_xla-memory")
        self._pending: Future | None = None
        self._writer = None  # writer.SaveProcess: formats replicated generations
        self._shared: str | None = None  # _shared_root(), found at the first generation
        self._slots = None  # rank_files.RankSlots: DTensor generations written in place
        self._handles: dict[str, Any] = {}  # store name -> its actor handle
        self.kept = 0
        self.by_writer = 0  # generations whose data file the writer process formatted
        self.by_rank = 0  # DTensor generations written rank by rank, in place (rank_files)
        self.skipped = 0  # calls that kept nothing: the previous generation was still going
        self.restored: dict[str, Any] | None = None
        atexit.register(self.end)  # when the process ends normally (else the stores sweep)

    # -- where
    def my_stores(self) -> list[str]:
        """This node's store, then its peer's (the next node of the group), when there is one."""
        names = [store_name(self.tier, self.node)]
        nodes = sorted(self.nodes)
        if self.node in nodes and len(nodes) > 1:
            names.append(store_name(self.tier, nodes[(nodes.index(self.node) + 1) % len(nodes)]))
        return names

    def inventories(self) -> list[dict[str, Any]]:
        """Every live store of this tier (this group's nodes and earlier groups')."""
        names = [a["name"] for a in list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE
                 and a["name"].startswith(f"{STORE_PREFIX}-{self.tier}-")]
        out = []
        for name in sorted(names):
            try:
                out.append({**ray.get(ray.get_actor(name, namespace=NAMESPACE).inventory.remote(),
                                      timeout=self.timeout_s), "name": name})
            except Exception as exc:  # noqa: BLE001 (a store on a lost node: not there)
                logger.info("memory tier: store %s did not answer: %s", name, exc)
        return out

    # -- generations: the same numbers on every rank
    def next_generation(self) -> int:
        """The number of this rank's next save (memory or storage): agreed at the first one
        (rank 0 asks the stores and broadcasts), then counted on every rank."""
        if self._next_gen is None:
            self._next_gen = broadcast_from_rank0(
                lambda: 1 + max([-1] + [max([inv["storage_gen"], *inv["gens"]])
                                        for inv in self.inventories()]))
        gen = self._next_gen
        self._next_gen += 1
        return gen

    def continue_from(self, gen: int) -> None:
        """Number the next save ``gen`` (after a restore: every rank, from rank 0's choice)."""
        self._next_gen = gen

    # -- keeping
    def wait(self) -> None:
        """Wait for the generation in flight; raise its error. Each of its parts is bounded by
        ``timeout_s`` (the write, the store's take, the peer's, the ranks' barrier), so its
        own error comes first; the wait as a whole is bounded by four times that."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.result(timeout=4 * self.timeout_s)
        except TimeoutError:
            raise ReportError(f"rank {self.rank}: the memory tier's previous generation was not "
                              f"kept within 4 x timeout_s={self.timeout_s:g}") from None
        except ReportError:
            raise
        except Exception as exc:
            raise ReportError(f"rank {self.rank}: keeping a checkpoint in memory failed: "
                              f"{type(exc).__name__}: {exc}") from exc

    def poll(self, ready: bool = False) -> tuple[bool, bool]:
        """(whether the previous generation is still being kept on some rank; whether every
        rank's writer process is ``ready``). Every rank gets the same answers: one all-reduce
        of two numbers on a host group of its own."""
        busy = self._pending is not None and not self._pending.done()
        if self.world > 1:
            flags = torch.tensor([int(busy), int(not ready)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=host_group("memory-poll"))
            busy, ready = bool(flags[0].item()), not flags[1].item()
        return busy, ready

    def keep(self, state: Mapping[str, Any]) -> bool:
        """Keep ``state`` as the next generation; False (nothing kept) while the previous one
        is still being kept somewhere: the loop never waits for the memory tier."""
        described = describe(state, "keep_in_memory")
        kind = described.kind
        if self._shared is None:
            self._shared = _shared_root()  # once: it stays
        # DTensor state is written in place, rank by rank, when every rank has shared memory;
        # replicated state is formatted by the tier's writer process once it takes work.
        writer = self._writer_ready() if not kind.sharded else None
        busy, everywhere = self.poll(bool(self._shared) if kind.in_place else writer is not None)
        if busy:
            self.skipped += 1
            return False
        self.wait()
        gen = self.next_generation()
        sync()
        files = MemoryFiles()
        # this rank's generators as the next step finds them (written with its files, below)
        save_file(files, ROOT, rng.file_name(self.rank), rng.capture())
        if writer is not None:
            files.write_by(writer, os.path.join(self._shared, self.tier, f"{gen}-{self.rank}"),
                           self.timeout_s, self.rank)
        group = host_group("memory") if self.world > 1 else None
        if kind.sharded:
            slots = self._in_place() if kind.in_place and everywhere else None
            if slots is None:
                self._drop_slots()  # another way now: the store lets go of them too
            try:
                staged = kind.stage(described, overlap=reporting.report_options().overlap_snapshots,
                                    stager=slots.stager(gen) if slots is not None else None)
            except Exception as exc:  # copied here (no overlap): its error is this call's
                self._fail(exc, gen)

            planner = kind.save_planner() if slots is None else None

            def write() -> None:
                if slots is not None:
                    slots.write(staged, files, gen, self.timeout_s)
                    if self.rank == 0:
                        write_small_files(files, ROOT, staged, self.world)
                    self.by_rank += 1
                else:
                    write_staged(staged, ROOT, group, files, planner=planner)
        else:
            staged = kind.stage(described, shared=writer is not None) if self.rank == 0 else None

            def write() -> None:
                if staged is not None:
                    try:
                        files.save("checkpoint.pt", staged.state)
                    finally:
                        staged.give_back()

        self._pending = self._pool.submit(self._put, gen, write, files, group, time.time())
        return True

    def _in_place(self):
        """This rank's slots in the node's shared memory (``rank_files.RankSlots``, made at the
        first DTensor generation and again after one failed)."""
        if self._slots is None:
            from ray_train_xla.toolkit.checkpoint.rank_files import RankSlots

            # its directory is made with its first slot file (RankSlots.stager)
            self._slots = RankSlots(os.path.join(self._shared, self.tier), self.rank)
        return self._slots

    def _store(self, name: str):
        """The handle of the store ``name``, found once."""
        if name not in self._handles:
            self._handles[name] = ray.get_actor(name, namespace=NAMESPACE)
        return self._handles[name]

    def _writer_ready(self):
        """This worker's writer process of the tier when it takes work, else None (it is started
        at the first call, and again after one ended; until it has started, and without
        writer processes or shared memory, a generation is formatted in this process)."""
        if self._shared is None:
            self._shared = _shared_root()  # once: it stays
        if not reporting.report_options().writer_process or not self._shared:
            return None
        if self._writer is None or not self._writer.process.is_alive():
            self._writer = SaveProcess(checksums=False)  # generations live in memory only
        return self._writer if self._writer.ready() else None

    def wait_writer(self, timeout_s: float) -> bool:
        """Start the tier's writer process if it is not, and wait until it takes work (at most
        ``timeout_s``); False when it does not by then, or there is none to start."""
        return self._writer_ready() is not None or (
            self._writer is not None and self._writer.wait_ready(timeout_s))

    def writer_pid(self) -> int | None:
        """The pid of the tier's writer process, None before it started."""
        return None if self._writer is None else self._writer.process.pid

    def end(self) -> None:
        """End the tier's writer process (it was started here) and remove the slot files no
        store took, once the generation in flight ended (waited for at most ``timeout_s``; its
        error was the training function's to see)."""
        pending = self._pending
        if pending is not None:
            with contextlib.suppress(Exception):  # see above
                pending.result(timeout=self.timeout_s)
        if self._writer is not None:
            self._writer.end()
            self._writer = None
        self._drop_slots()

    def _fail(self, exc: BaseException, gen: int) -> NoReturn:
        """Raise generation ``gen``'s error ``exc`` (a full shared memory as ``ReportError``);
        the next generation writes into new slots, and once the node's shared memory is full,
        in the training process."""
        self._drop_slots()
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            self._shared = ""
            raise ReportError(f"rank {self.rank}: the memory tier could not keep generation "
                              f"{gen}: {exc}. The node's shared memory (/dev/shm) is full: give "
                              "it more (docker run --shm-size); later generations are "
                              "formatted in the training process") from exc
        raise exc

    def _drop_slots(self) -> None:
        """Remove this rank's slot files no store took (and the tier's directory when no other
        rank's files are there); the next DTensor generation makes new slots."""
        if self._slots is not None:
            self._slots.remove()
            with contextlib.suppress(OSError):  # another rank's files are there
                os.rmdir(self._slots.directory)
            self._slots = None

    def _put(self, gen: int, write, files: MemoryFiles, group, taken: float) -> None:
        try:
            write()
            shared = files.shared_files()
            slots = {name: f.path for name, f in files.by_name().items()
                     if isinstance(f, SlotFile)}
            self.by_writer += bool(set(shared) - set(slots))
            # uint8 arrays: sent without pickling (in the call when small, else through Ray's
            # object store, as Ray decides)
            rest = {name: np.frombuffer(b, dtype=np.uint8)
                    for name, b in files.by_name().items() if name not in shared}
            own, *peers = self.my_stores()
            # This node's store must take it (reading the shared files written on this node) and
            # hands it to the peer's; a peer that cannot (its node going away) leaves this
            # generation with one copy, and says so.
            try:
                call = self._store(own).take.remote(
                    gen, self.world, self.rank, rest,
                    {n: p for n, p in shared.items() if n not in slots}, peers, self.timeout_s,
                    slots, os.getpid())
                took = ray.get(call, timeout=2 * self.timeout_s)
            except Exception:
                self._handles.pop(own, None)  # found again next time (a store that died: its
                raise                         # replacement, or the error again)
            del rest
        except BaseException as exc:
            self._fail(exc, gen)
        finally:
            files.release()  # in the store by now (or failed): buffers serve the next generation
        for name, error in took["peers"].items():
            logger.warning("rank %d: memory tier: the peer store %s did not take generation %d "
                           "(%s): this node holds the only copy", self.rank, name, gen, error)
        if group is not None:  # every rank's files are in: the generation is complete
            dist.barrier(group=group)
        self.kept += 1
        events.memory_kept(taken)  # goodput: a restore from memory loses nothing before it

    def note_storage(self, gen: int) -> None:
        """(rank 0, once Ray took checkpoint ``gen`` into storage) tell this node's and its
        peer's store: memory older than ``gen`` no longer serves a restore."""
        for name in self.my_stores():
            try:
                ray.get(ray.get_actor(name, namespace=NAMESPACE).note_storage.remote(gen),
                        timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 (training goes on; a restore may read storage)
                logger.warning("memory tier: store %s did not note checkpoint %d: %s: %s", name,
                               gen, type(exc).__name__, exc)

    # -- restoring
    def choose(self) -> dict[str, Any]:
        """(rank 0) The generation to restore from memory, or why storage serves."""
        invs = self.inventories()
        storage_gen = max([-1] + [inv["storage_gen"] for inv in invs])
        newest = max([-1, storage_gen] + [g for inv in invs for g in inv["gens"]])
        gens = sorted({g for inv in invs for g in inv["gens"]}, reverse=True)
        why = "no generation in memory" if not gens else ""
        for gen in gens:
            world = next(inv["gens"][gen]["world"] for inv in invs if gen in inv["gens"])
            holders: dict[str, list[tuple[str, int]]] = {}
            sizes: dict[str, int] = {}
            ranks = set()
            for inv in sorted(invs, key=lambda i: i["node"] != self.node):  # this node first
                for rank, names in inv["gens"].get(gen, {}).get("ranks", {}).items():
                    ranks.add(int(rank))
                    for name, size in names.items():
                        holders.setdefault(name, []).append((inv["name"], int(rank)))
                        sizes[name] = size
            missing = sorted(set(range(world)) - ranks)
            if missing:
                why = why or (f"generation {gen}: the files of rank(s) {missing} of {world} are "
                              "on no live store (their node and its peer are gone)")
                continue
            if gen <= storage_gen:
                why = why or (f"the checkpoint in storage (generation {storage_gen}) is newer "
                              f"than memory's newest complete one ({gen})")
                break
            return {"tier": "memory", "gen": gen, "world": world, "holders": holders,
                    "next": newest + 1, "bytes": sum(sizes.values()),
                    "stores": sorted({s for h in holders.values() for s, _ in h})}
        return {"tier": "storage", "why": why, "next": newest + 1}

    def restore_generators(self, fs, choice: dict[str, Any]) -> bool:
        """Set this rank's random number generators as it kept them with generation
        ``choice["gen"]`` (read over ``fs``, :meth:`filesystem`'s), when the world has the same
        size and the generation has them; returns whether it did."""
        name = rng.file_name(self.rank)
        if choice["world"] != self.world or name not in choice["holders"]:
            logger.info("rank %d: random number generators not restored: generation %d was kept "
                        "by %d workers (now %d)%s", self.rank, choice["gen"], choice["world"],
                        self.world, "" if choice["world"] != self.world else " without them")
            return False
        with fs.open_input_file(f"{ROOT}/{name}") as f:
            rng.restore(f.read())
        return True

    def filesystem(self, choice: dict[str, Any]):
        handler_class = type("StoreFiles", (StoreFiles, pafs.FileSystemHandler), {})
        handler = handler_class(choice["gen"], choice["holders"], self.timeout_s)
        return pafs.PyFileSystem(handler), handler


def broadcast_from_rank0(value_of):
    """``value_of()`` on rank 0, given to every rank (the host group, on the training thread)."""
    from ray_train_xla.toolkit.ranks import rank

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value_of()

    box = [value_of() if rank() == 0 else None]
    # The training thread's group ("memory" is the background thread's: never both at once).
    dist.broadcast_object_list(box, src=0, group=host_group("memory-poll"))
    return box[0]


def memory_tier(required: str | None = None) -> MemoryTier | None:
    """This worker's memory tier (held by the runtime), None when the config has no
    ``memory_every`` (``required``: raise instead, naming the helper)."""
    rt = runtime()
    ctx = rt.ctx
    if not ctx.memory_every or not ctx.memory_tier:
        if required:
            raise ValueError(
                f"{required}: the memory tier is off. Set memory_every=N on the config "
                "(TorchXLAConfig, TorchNeuronConfig or TorchTPUConfig) to keep every N-th step's "
                "state in host memory")
        return None
    key = (ctx.memory_tier, ctx.run_id, ctx.rank, ctx.world_size)
    with rt.lock:
        tier = rt.memory_tier
        if tier is None or tier.key != key:  # another plan of this worker: another tier
            if tier is not None:
                tier.end()
            rt.memory_tier = tier = MemoryTier(ctx)
        return tier


def keep_in_memory(state: Mapping[str, Any], step: int) -> bool:
    """Keep ``state`` as the memory tier's newest checkpoint when ``step`` is a multiple of the
    config's ``memory_every``; returns whether it was kept. Call it on every worker, every step
    (like ``save_checkpoint``, with the same kind of state).

    The call takes the snapshot (for DTensor state, copied while the loop goes on: the next
    optimizer step waits for the copy) and this rank's random number generators' states
    (``rng.py``: a restore from memory in a world of the same size sets them again) and
    returns; the files are written into memory and handed to this node's and the peer node's
    store in the background. While the previous generation is still being kept on some rank,
    the call keeps nothing and returns False (every rank alike): the loop never waits for the
    tier. An error of the previous generation
    is raised here as ``ReportError``.
    """
    tier = memory_tier(required="keep_in_memory")
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"keep_in_memory: step must be an int, got {step!r}")
    if step % tier.every:
        return False
    start = time.perf_counter()
    try:
        return tier.keep(state)
    finally:
        events.add_stall(time.perf_counter() - start)


def flush_memory() -> None:
    """Wait for the generation in flight (the backend calls it when the training function ends)."""
    tier = runtime().memory_tier
    if tier is not None:
        tier.wait()
