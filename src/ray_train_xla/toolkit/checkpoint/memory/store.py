"""The memory tier's stores: one per node (a Ray actor, ``MemoryStore``) holding every rank's
files of the newest generations, and their start by the backend (``start_stores``).

The driver imports this module: it imports no torch, and neither do the packages above it (they
import their names on first use); its methods use none either. The slot files'
names and stamps (``slot_owner``, ``slot_stamp``) are defined here, where the stores read them;
``rank_files.py`` writes them.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import threading
from typing import Any

import numpy as np
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

NAMESPACE = "ray_train_xla"
STORE_PREFIX = "ray_train_xla-memory"
SLOT_PREFIX = "slot-"  # a writer process's slot file: slot-<pid>-<rank>-<series>-<turn>.distcp


def slot_owner(path: str) -> tuple[int, int, int] | None:
    """(pid, rank, series) of a slot file's name, None for another file."""
    name = os.path.basename(path)
    if not name.startswith(SLOT_PREFIX):
        return None
    parts = name[len(SLOT_PREFIX):].split(".")[0].split("-")
    if len(parts) != 4 or not all(p.isdigit() for p in parts):
        return None
    return int(parts[0]), int(parts[1]), int(parts[2])


def slot_stamp(data) -> int:
    """The generation a slot holds (its first 8 bytes), -1 while it is being written."""
    return int.from_bytes(bytes(data[:8]), "little", signed=True)


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
                with contextlib.suppress(FileNotFoundError):
                    os.remove(os.path.join(directory, entry))
        if directory != tier_dir:
            with contextlib.suppress(OSError):  # not empty: a live tier's
                os.rmdir(directory)


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
        files = {name: bytes(data) for name, data in files.items()}
        files.update({name: _hold(path) for name, path in shared.items()})
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
        tier_dirs = ([os.path.dirname(p) for p in slots.values()]
                     + [os.path.dirname(os.path.dirname(p)) for p in shared.values()])
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
            keep = {gen, max((g for g in self._gens if g < gen), default=gen)}
            self._gens = {g: e for g, e in self._gens.items() if g in keep}
            entry = self._gens.setdefault(gen, {"world": world, "ranks": {}, "slots": {}})
            entry["ranks"][rank] = files
            entry["slots"][rank] = set(slots)
            self._forget_slots()
        return sum(len(b) for b in files.values())

    def _forget_slots(self) -> None:
        """Drop the mappings of slots no generation held here names, once their worker is gone
        or uses other slots or none (a live worker's slots are mapped once)."""
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
        entry = self._gens[gen]
        return all(slot_stamp(entry["ranks"][rank][n]) == gen
                   for n in entry["slots"].get(rank, ()))

    def held(self, gen: int, rank: int) -> bool:
        """Whether rank ``rank``'s files of ``gen`` are still held here as that generation
        (asked after a read of a slot: it was not written again meanwhile)."""
        with self._lock:
            return (gen in self._gens and rank in self._gens[gen]["ranks"]
                    and self._valid(gen, rank))

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
