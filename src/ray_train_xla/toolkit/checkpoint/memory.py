"""The memory tier: the newest checkpoint kept in host memory, on its own node and on a peer node.

With ``memory_every=N`` on the config, the backend starts one **memory store** per node of the
worker group (a Ray actor with no CPU, owned by Ray Train's controller, so it outlives every
worker group of the ``fit()`` and ends with it). :func:`keep_in_memory` (every rank, every
step; it keeps the steps that are multiples of N) takes the same snapshot as
``save_checkpoint`` and returns. DTensor state is written in place into the node's shared
memory: each rank copies its shards straight into one of its two slot files, laid out once as
its DCP data file, and writes its own DCP metadata, rank by rank with no collective
(``rank_files.py``). Replicated state is formatted by a writer process of the tier's own
(``writer.SaveProcess``, one per worker) into a file there: rank 0's ``checkpoint.pt``. In a
background thread, the worker then hands its files to the store of its node, which maps them
(and unlinks them: their memory goes back when the store drops them or ends, however it ends)
and hands them to the store of the next node of the group (its peer) through Ray's object
store. Without shared memory, for torch_xla SPMD state, and for replicated state until the
writer process takes work or without writer processes, the background thread writes the
generation itself into memory (``dcp.save``; ``torch.save`` for replicated state). A
generation is complete once every rank handed its files (a barrier of the ranks ends each one).

After a failure, ``load_checkpoint()`` asks the stores first: rank 0 takes the newest
generation whose files every rank of its world survive on some live store, and which is newer
than the newest checkpoint Ray took into storage (each ``save_checkpoint`` takes a generation
number too, and the stores note it once Ray took it); every rank then reads through torch's
``FileSystemReader`` over the stores, fetching only the files its shards need, so the restore
reshards onto another world size as from storage. Otherwise the restore comes from storage,
and the log says why. Each store holds at most two generations: the newest complete one and
the one being written.

Sharded (FSDP2 DTensors, torch_xla SPMD) and replicated state, on every config.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, NoReturn

import torch

from ray_train_xla.errors import ReportError
from ray_train_xla.toolkit.checkpoint.files import ROOT, MemoryFiles

logger = logging.getLogger(__name__)

NAMESPACE = "ray_train_xla"
METADATA = ".metadata"  # DCP's
STORE_PREFIX = "ray_train_xla-memory"


def store_name(tier: str, node_id: str) -> str:
    return f"{STORE_PREFIX}-{tier}-{node_id}"


def _hold(path: str) -> mmap.mmap | bytes:
    """The shared-memory file ``path``, held by this process: mapped, then unlinked, so that
    its memory goes back when the mapping is dropped or this process ends, however it ends."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        held = mmap.mmap(fd, size, prot=mmap.PROT_READ) if size else b""
    finally:
        os.close(fd)
        os.unlink(path)
    return held


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def _remove_stale(tier_dir: str, gen: int, every_tier: bool) -> None:
    """Files of ``tier_dir`` no store took (their worker died between its write and the
    store's take): generation directories (``<gen>-<rank>``) older than ``gen - 1``, slot files
    of workers that are gone; with ``every_tier``, the same slot files in every tier's
    directory of the node (an earlier run's too), and directories left empty."""
    import shutil

    from ray_train_xla.toolkit.checkpoint.rank_files import slot_owner

    for entry in os.listdir(tier_dir):
        older = entry.split("-")[0]
        if slot_owner(entry) is None and older.isdigit() and int(older) < gen - 1:
            shutil.rmtree(os.path.join(tier_dir, entry), ignore_errors=True)
    root = os.path.dirname(tier_dir)
    for tier in os.listdir(root) if every_tier else [os.path.basename(tier_dir)]:
        directory = os.path.join(root, tier)
        try:
            entries = os.listdir(directory)
        except OSError:  # not a directory, or removed meanwhile
            continue
        for entry in entries:
            owner = slot_owner(entry)
            if owner is not None and not _alive(owner[0]):
                try:
                    os.remove(os.path.join(directory, entry))
                except FileNotFoundError:
                    pass
        if directory != tier_dir:
            try:
                os.rmdir(directory)
            except OSError:  # not empty: a live tier's
                pass


class MemoryStore:
    """One node's memory store (a Ray actor): per generation, every rank's checkpoint files.

    At most two generations: a put of generation ``g`` keeps ``g`` and the newest generation
    before it (complete: a rank starts ``g`` only after every rank finished the one before).
    A rank's data file written in place into one of its two slots (``rank_files.RankSlots``)
    is mapped once and serves as long as the slot says it holds that generation."""

    def __init__(self, node_id: str) -> None:
        self.node = node_id
        self._lock = threading.Lock()
        self._gens: dict[int, dict[str, Any]] = {}
        self._storage_gen = -1
        self._slots: dict[str, mmap.mmap] = {}  # slot file -> its mapping
        self._series: dict[tuple[int, int], int] = {}  # (pid, rank) -> the slots it uses now
        self._swept = False  # the node's other tiers' directories (at the first take)

    def ready(self) -> str:
        """This store's actor id (a store found again by name is the same actor)."""
        import ray

        return ray.get_runtime_context().get_actor_id()

    def take(self, gen: int, world: int, rank: int, files: dict[str, Any],
             shared: dict[str, str], peers: list[str], timeout_s: float,
             slots: dict[str, str] | None = None, pid: int = 0) -> dict[str, Any]:
        """A rank's files of generation ``gen``, from a worker of this node: ``files`` (their
        bytes), ``shared`` (files its writer process wrote into shared memory: mapped here,
        then unlinked, ``_hold``) and ``slots`` (its data file in one of its slots: mapped
        and unlinked the first time, then the same mapping). Then handed to each store of
        ``peers`` (within ``timeout_s`` each). ``pid``: the worker's (a take without slots says
        that its earlier slots are no longer used). Returns the bytes held and, per peer that
        did not take them, why."""
        import numpy as np
        import ray

        from ray_train_xla.toolkit.checkpoint.rank_files import slot_owner, slot_stamp

        files = {name: bytes(data) for name, data in files.items()}
        for name, path in shared.items():
            files[name] = _hold(path)
        slots = slots or {}
        with self._lock:
            self._series[pid, rank] = -1  # no slots, unless this take has some
            for name, path in slots.items():
                if path not in self._slots:
                    self._slots[path] = _hold(path)
                _, _, series = slot_owner(path)
                self._series[pid, rank] = series
                files[name] = self._slots[path]
                if slot_stamp(files[name]) != gen:
                    raise ValueError(f"rank {rank}: its slot {path} holds generation "
                                     f"{slot_stamp(files[name])}, not {gen}")
        tier_dirs = [os.path.dirname(p) for p in slots.values()] + \
            [os.path.dirname(os.path.dirname(p)) for p in shared.values()]
        if tier_dirs:  # the node's other tiers once, at this store's first take
            _remove_stale(tier_dirs[0], gen, every_tier=not self._swept)
            self._swept = True
        held = self.put(gen, world, rank, files, set(slots))
        errors: dict[str, str] = {}
        if peers:
            ref = ray.put({name: np.frombuffer(b, dtype=np.uint8) for name, b in files.items()})
            calls = {name: ray.get_actor(name, namespace=NAMESPACE).put.remote(gen, world, rank, ref)
                     for name in peers}
            for name, call in calls.items():
                try:
                    ray.get(call, timeout=timeout_s)
                except Exception as exc:  # noqa: BLE001 (the worker logs it: one copy)
                    errors[name] = f"{type(exc).__name__}: {exc}"
        return {"bytes": held, "peers": errors}

    def put(self, gen: int, world: int, rank: int, files: dict[str, Any],
            slots: set[str] | frozenset = frozenset()) -> int:
        """Hold a rank's ``files`` of generation ``gen`` (``slots``: the names that are slots)."""
        # Copied into this process: owned here, not by the worker that put them (a shared
        # file's mapping is this process's already).
        files = {name: data if isinstance(data, mmap.mmap) else bytes(data)
                 for name, data in files.items()}
        with self._lock:
            older = [g for g in self._gens if g < gen]
            keep = {gen, max(older)} if older else {gen}
            for g in list(self._gens):
                if g not in keep:
                    del self._gens[g]
            entry = self._gens.setdefault(gen, {"world": world, "ranks": {}, "slots": {}})
            entry["ranks"][rank] = files
            entry["slots"][rank] = set(slots)
            self._forget_slots()
        return sum(len(b) for b in files.values())

    def _forget_slots(self) -> None:
        """Drop the mappings of slots no generation held here names, once their worker is gone
        or uses other slots or none (a live worker's slots are mapped once)."""
        from ray_train_xla.toolkit.checkpoint.rank_files import slot_owner

        named = {id(e["ranks"][r][n]) for e in self._gens.values()
                 for r, names in e["slots"].items() for n in names}
        for path, held in list(self._slots.items()):
            pid, rank, series = slot_owner(path)
            if id(held) not in named and (not _alive(pid)
                                          or self._series.get((pid, rank), series) != series):
                del self._slots[path]

    def _valid(self, gen: int, rank: int) -> bool:
        """Whether rank ``rank``'s files of ``gen`` are still that generation (a slot may have
        been taken for a newer one since)."""
        from ray_train_xla.toolkit.checkpoint.rank_files import slot_stamp

        entry = self._gens[gen]
        return all(slot_stamp(entry["ranks"][rank][n]) == gen
                   for n in entry["slots"].get(rank, ()))

    def held(self, gen: int, rank: int) -> bool:
        """Whether rank ``rank``'s files of ``gen`` are still held here as that generation
        (asked after a read of a slot: it was not written again meanwhile)."""
        with self._lock:
            return gen in self._gens and rank in self._gens[gen]["ranks"] and \
                self._valid(gen, rank)

    def note_storage(self, gen: int) -> None:
        with self._lock:
            self._storage_gen = max(self._storage_gen, gen)

    def inventory(self) -> dict[str, Any]:
        with self._lock:
            return {
                "node": self.node, "storage_gen": self._storage_gen,
                "slots": len(self._slots),  # slot files mapped
                "gens": {g: {"world": e["world"],
                             "ranks": {r: {n: len(b) for n, b in f.items()}
                                       for r, f in e["ranks"].items() if self._valid(g, r)}}
                         for g, e in self._gens.items()},
            }

    def get(self, gen: int, rank: int, name: str):
        import numpy as np

        with self._lock:
            data = self._gens[gen]["ranks"][rank][name]
            if not self._valid(gen, rank):
                raise ValueError(f"generation {gen} of rank {rank} is no longer held here (its "
                                 "slot holds a newer one)")
        return np.frombuffer(data, dtype=np.uint8)  # sent out of band, without pickling

    def held_bytes(self) -> int:
        with self._lock:
            return sum(len(b) for e in self._gens.values() for f in e["ranks"].values()
                       for b in f.values())


# ---- the driver: one store per node -----------------------------------------------------------

def start_stores(tier: str, node_ids: list[str], timeout_s: float,
                 held: dict[str, tuple[Any, str]]) -> None:
    """Start (or find) the memory store of ``tier`` on each of ``node_ids``; called by the
    backend for every worker group, in the process that outlives them (Ray Train's controller).
    ``held``: store name -> (its handle, its actor id), kept by the caller: a store lives as
    long as its first handle (the backend keeps them on the run's config object)."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    actor = ray.remote(num_cpus=0, max_concurrency=16, max_restarts=0)(MemoryStore)
    names = [store_name(tier, node) for node in node_ids]
    handles = [actor.options(
        name=name, namespace=NAMESPACE, get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node, soft=False),
    ).remote(node) for name, node in zip(names, node_ids)]
    actor_ids = ray.get([h.ready.remote() for h in handles], timeout=timeout_s)
    for name, handle, actor_id in zip(names, handles, actor_ids):
        # The first handle is the owner's: dropping it would end the store (a store found again
        # for a later worker group keeps its first handle; one that died is replaced).
        if held.get(name, (None, None))[1] != actor_id:
            held[name] = (handle, actor_id)


# ---- DCP into memory, and back through a pyarrow filesystem ------------------------------------

class _StoreFiles:
    """pyarrow ``FileSystemHandler`` (read only) over one generation in the stores: a file is
    fetched from the first live store that holds it when opened, and counted."""

    def __init__(self, gen: int, holders: dict[str, list[tuple[str, int]]], timeout_s: float):
        self.gen, self.holders, self.timeout_s = gen, holders, timeout_s
        self.fetched_bytes = 0
        self.served: set[str] = set()  # the stores files were read from
        self._lock = threading.Lock()
        self._merged: bytes | None = None

    def _metadata(self) -> bytes:
        """A generation written rank by rank (``rank_files``): its ``.metadata``, the ranks'
        own merged (once)."""
        import pickle

        from ray_train_xla.toolkit.checkpoint.rank_files import is_rank_metadata, merge_metadata

        if self._merged is None:
            parts = [pickle.loads(self._fetch(name)) for name in sorted(self.holders)
                     if is_rank_metadata(name)]
            self._merged = pickle.dumps(merge_metadata(parts))
        return self._merged

    def _names(self) -> list[str]:
        from ray_train_xla.toolkit.checkpoint.rank_files import is_rank_metadata

        names = sorted(self.holders)
        if METADATA not in names and any(is_rank_metadata(n) for n in names):
            names.append(METADATA)
        return names

    def _fetch(self, path: str):
        import ray

        from ray_train_xla.toolkit.checkpoint.rank_files import rank_data_file

        name = path.rsplit("/", 1)[-1]
        if name == METADATA and name not in self.holders and name in self._names():
            return self._metadata()
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
        import ray

        return ray.get(handle.get.remote(self.gen, rank, name), timeout=self.timeout_s)

    # pyarrow's FileSystemHandler
    def get_type_name(self) -> str:
        return "ray_train_xla-memory"

    def normalize_path(self, path: str) -> str:
        return path

    def equals(self, other) -> bool:
        return other is self

    def get_file_info(self, paths):
        import pyarrow.fs as pafs

        out = []
        for path in paths:
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if path.rstrip("/") == ROOT:
                out.append(pafs.FileInfo(path, pafs.FileType.Directory))
            elif name in self._names():
                out.append(pafs.FileInfo(path, pafs.FileType.File))
            else:
                out.append(pafs.FileInfo(path, pafs.FileType.NotFound))
        return out

    def get_file_info_selector(self, selector):
        import pyarrow.fs as pafs

        return [pafs.FileInfo(f"{ROOT}/{n}", pafs.FileType.File) for n in self._names()]

    def open_input_file(self, path: str):
        import pyarrow as pa

        return pa.BufferReader(pa.py_buffer(self._fetch(path)))

    open_input_stream = open_input_file

    def _read_only(self, *args, **kwargs):
        raise OSError("the memory tier is read only here")

    create_dir = delete_dir = delete_dir_contents = delete_root_dir_contents = _read_only
    delete_file = move = copy_file = open_output_stream = open_append_stream = _read_only


# ---- the worker's side ------------------------------------------------------------------------

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
    """This worker's side of the memory tier (see the module docstring)."""

    def __init__(self, ctx) -> None:
        import ray

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
        import atexit

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
        import ray
        from ray.util import list_named_actors

        names = [a["name"] for a in list_named_actors(all_namespaces=True)
                 if a.get("namespace") == NAMESPACE
                 and a["name"].startswith(f"{STORE_PREFIX}-{self.tier}-")]
        out = []
        for name in sorted(names):
            try:
                inv = ray.get(ray.get_actor(name, namespace=NAMESPACE).inventory.remote(),
                              timeout=self.timeout_s)
            except Exception as exc:  # noqa: BLE001 (a store on a lost node: not there)
                logger.info("memory tier: store %s did not answer: %s", name, exc)
                continue
            inv["name"] = name
            out.append(inv)
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
            import torch.distributed as dist

            from ray_train_xla.toolkit.collectives import host_group

            flags = torch.tensor([int(busy), int(not ready)])
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=host_group("memory-poll"))
            busy, ready = bool(flags[0].item()), not flags[1].item()
        return busy, ready

    def keep(self, state: Mapping[str, Any]) -> bool:
        """Keep ``state`` as the next generation; False (nothing kept) while the previous one
        is still being kept somewhere: the loop never waits for the memory tier."""
        from ray_train_xla.toolkit import reporting
        from ray_train_xla.toolkit.checkpoint.replicated import (
            stage_replicated,
            stage_replicated_shared,
        )
        from ray_train_xla.toolkit.checkpoint.sharded import (
            DTENSOR,
            sharded_layout,
            stage_sharded,
            write_small_files,
            write_staged,
        )
        from ray_train_xla.toolkit.collectives import host_group
        from ray_train_xla.toolkit.device import sync

        layout = sharded_layout(state, "keep_in_memory")
        if self._shared is None:
            self._shared = _shared_root()  # once: it stays
        # DTensor state is written in place, rank by rank, when every rank has shared memory;
        # replicated state is formatted by the tier's writer process once it takes work.
        writer = self._writer_ready() if layout is None else None
        busy, everywhere = self.poll(bool(self._shared) if layout == DTENSOR
                                     else writer is not None)
        if busy:
            self.skipped += 1
            return False
        self.wait()
        gen = self.next_generation()
        sync()
        files = MemoryFiles()
        if writer is not None:
            files.write_by(writer, os.path.join(self._shared, self.tier, f"{gen}-{self.rank}"),
                           self.timeout_s, self.rank)
        group = host_group("memory") if self.world > 1 else None
        if layout is not None:
            slots = self._in_place() if layout == DTENSOR and everywhere else None
            if slots is None:
                self._drop_slots()  # another way now: the store lets go of them too
            try:
                staged = stage_sharded(state, overlap=reporting.report_options().overlap_snapshots,
                                       layout=layout,
                                       stager=slots.stager(gen) if slots is not None else None)
            except Exception as exc:  # copied here (no overlap): its error is this call's
                self._fail(exc, gen)

            def write() -> None:
                if slots is not None:
                    slots.write(staged, files, gen, self.timeout_s)
                    if self.rank == 0:
                        write_small_files(files, ROOT, staged, sorted(staged["tree"]), self.world)
                    self.by_rank += 1
                else:
                    write_staged(staged, ROOT, group, filesystem=files)
        else:
            cpu_state, release = None, None
            if self.rank == 0:
                cpu_state, release = stage_replicated_shared(state) if writer is not None \
                    else (stage_replicated(state), None)

            def write() -> None:
                if cpu_state is not None:
                    try:
                        files.save("checkpoint.pt", cpu_state)
                    finally:
                        if release is not None:
                            release()

        self._pending = self._pool.submit(self._put, gen, write, files, group, time.time())
        return True

    def _in_place(self):
        """This rank's slots in the node's shared memory (``rank_files.RankSlots``, made at the
        first DTensor generation and again after one failed)."""
        if self._slots is None:
            from ray_train_xla.toolkit.checkpoint.rank_files import RankSlots

            directory = os.path.join(self._shared, self.tier)
            os.makedirs(directory, exist_ok=True)
            self._slots = RankSlots(directory, self.rank)
        return self._slots

    def _store(self, name: str):
        """The handle of the store ``name``, found once."""
        import ray

        if name not in self._handles:
            self._handles[name] = ray.get_actor(name, namespace=NAMESPACE)
        return self._handles[name]

    def _writer_ready(self):
        """This worker's writer process of the tier when it takes work, else None (it is started
        at the first call, and again after one ended; until it has started, and without
        writer processes or shared memory, a generation is formatted in this process)."""
        from ray_train_xla.toolkit import reporting

        if self._shared is None:
            self._shared = _shared_root()  # once: it stays
        if not reporting.report_options().writer_process or not self._shared:
            return None
        if self._writer is None or not self._writer.process.is_alive():
            from ray_train_xla.toolkit.checkpoint.writer import SaveProcess

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
            try:
                pending.result(timeout=self.timeout_s)
            except Exception:  # noqa: BLE001 (see above)
                pass
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
            try:
                os.rmdir(self._slots.directory)
            except OSError:  # another rank's files are there
                pass
            self._slots = None

    def _put(self, gen: int, write, files: MemoryFiles, group, taken: float) -> None:
        import numpy as np
        import ray

        from ray_train_xla.toolkit.checkpoint.files import SlotFile

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
            import torch.distributed as dist

            dist.barrier(group=group)
        self.kept += 1
        from ray_train_xla.toolkit import events

        events.memory_kept(taken)  # goodput: a restore from memory loses nothing before it

    def note_storage(self, gen: int) -> None:
        """(rank 0, once Ray took checkpoint ``gen`` into storage) tell this node's and its
        peer's store: memory older than ``gen`` no longer serves a restore."""
        import ray

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

    def filesystem(self, choice: dict[str, Any]):
        import pyarrow.fs as pafs

        handler_class = type("StoreFiles", (_StoreFiles, pafs.FileSystemHandler), {})
        handler = handler_class(choice["gen"], choice["holders"], self.timeout_s)
        return pafs.PyFileSystem(handler), handler


def broadcast_from_rank0(value_of):
    """``value_of()`` on rank 0, given to every rank (the host group, on the training thread)."""
    import torch.distributed as dist

    from ray_train_xla.toolkit.ranks import rank

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return value_of()
    from ray_train_xla.toolkit.collectives import host_group

    box = [value_of() if rank() == 0 else None]
    # The training thread's group ("memory" is the background thread's: never both at once).
    dist.broadcast_object_list(box, src=0, group=host_group("memory-poll"))
    return box[0]


def memory_tier(required: str | None = None) -> MemoryTier | None:
    """This worker's memory tier (held by the runtime), None when the config has no
    ``memory_every`` (``required``: raise instead, naming the helper)."""
    from ray_train_xla.toolkit.runtime import runtime

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
    optimizer step waits for the copy) and returns; the files are written into memory and
    handed to this node's and the peer node's store in the background. While the previous
    generation is still being kept on some rank, the call keeps nothing and returns False
    (every rank alike): the loop never waits for the tier. An error of the previous generation
    is raised here as ``ReportError``.
    """
    from ray_train_xla.toolkit import events

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
    from ray_train_xla.toolkit.runtime import runtime

    tier = runtime().memory_tier
    if tier is not None:
        tier.wait()
