"""The writers: a save's third step (``writer_for``), run by the background reporter.

Sharded state: every rank writes its shards with ``torch.distributed.checkpoint``
(:func:`write_staged`), in the reporter's thread or, for DTensors in a process group, through
torch's writer process (``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS``: one spawned
Python per worker, started at its first save, joining a gloo group of every rank's writers; the
snapshot's host buffers move into shared memory once, the staging pool reuses them, and the
snapshot is taken as it is: ``AsIs``). Rank 0 adds the checkpoint's small files
(:func:`write_small_files`). Replicated state: rank 0 writes ``checkpoint.pt`` with
``torch.save`` (:func:`write_replicated`), in the reporter's thread or through its
:class:`SaveProcess`, a spawned Python handed the snapshot through a pipe, its tensors in shared
memory. The memory tier has a :class:`SaveProcess` of its own per worker (``memory/tier.py``).

Writer processes are used when ``configure_reports(writer_process=True)`` (the default);
torch_xla SPMD state is written in the reporter's thread. A writer process that dies (its pipe
closes) or a write that does not end within ``timeout_s`` reaches the training function as
``ReportError``, naming ``configure_reports(writer_process=False)``, which writes in the
reporter's thread instead (docs/sharded-models.md, "Asynchronous save").
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import os
import time
from collections import ChainMap
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch.multiprocessing as mp

from ray_train_xla.errors import ReportError
from ray_train_xla.planning.contract import worker_context
from ray_train_xla.toolkit.checkpoint.files import MemoryFiles, files_at, save_file
from ray_train_xla.toolkit.checkpoint.format import EXTRA_FILE, GROUPS_FILE, SHARDED_MARKER
from ray_train_xla.toolkit.checkpoint.names import FORMAT_VERSION
from ray_train_xla.toolkit.checkpoint.sharded import DTENSOR, SPMD, describe, process_info
from ray_train_xla.toolkit.checkpoint.staging import join_dtensors, stage
from ray_train_xla.toolkit.runtime import runtime

# A writer process starts with this many threads in its thread pools (OMP_NUM_THREADS; its
# parent's environment would give it one per core, which the steps it overlaps pay for:
# benchmarks/results/stall.md).
WRITER_THREADS = 1
PROCESS_PREFIX = "ray_train_xla-"  # the names of the processes this package starts
_FIX = "configure_reports(writer_process=False) writes in the training process instead"


# ---- the save's third step: the writers of a staged save (``staging.stage``)

def writer_for(staged: dict[str, Any], filename: str, group=None,
               writer_process: bool = False) -> Callable[[str, Any], dict[str, Any]]:
    """The one writer of a staged save: ``write(directory, filesystem)`` writes it and returns
    what this rank wrote (``{"files", "bytes"}``); the background reporter calls it.
    ``filesystem``: None for the local file system, a pyarrow filesystem (the run's storage) or
    a ``files.MemoryFiles`` (host memory). Sharded state: every rank writes its shards with DCP,
    collectively over ``group`` (default: the default group), DTensors through this worker's
    writer process where ``writer_process``. Replicated state (rank 0): ``filename``, through
    the save process where ``writer_process``."""
    if staged["layout"] is not None:
        def write(directory: str, filesystem) -> dict[str, Any]:
            return write_staged(staged, directory, group, filesystem=filesystem,
                                writer_process=writer_process)
    elif not writer_process:
        def write(directory: str, filesystem) -> dict[str, Any]:
            return write_replicated(staged["state"], directory, filename, filesystem)
    else:
        process = save_process()  # started at the first save, in the background

        def write(directory: str, filesystem) -> dict[str, Any]:
            try:
                return save_replicated(process, staged["state"], directory, filename, filesystem,
                                       worker_context().timeout_s, 0)
            finally:
                if staged["release"] is not None:
                    staged["release"]()
    return write


def _save_planner(layout: str):
    if layout != SPMD:
        from torch.distributed.checkpoint import DefaultSavePlanner

        return DefaultSavePlanner()
    from torch.distributed.checkpoint._dedup_save_plans import dedup_save_plans
    from torch_xla.experimental.distributed_checkpoint import SPMDSavePlanner

    class BalancedSPMDSavePlanner(SPMDSavePlanner):
        """SPMDSavePlanner whose duplicate shards go to the rank with the least to write
        (torch_xla's own keeps every duplicate on the lowest rank)."""

        def create_global_plan(self, all_plans):
            from torch.distributed.checkpoint.default_planner import create_default_global_save_plan

            all_plans = dedup_save_plans(all_plans, save_to_lowest_rank=False)
            global_plan, metadata = create_default_global_save_plan(all_plans, rewrite_index_hints=False)
            mappings = dict(ChainMap(*[p.planner_data for p in global_plan]))
            return global_plan, dataclasses.replace(metadata, planner_data=mappings)

    return BalancedSPMDSavePlanner()


def write_staged(staged: dict[str, Any], directory: str, process_group=None,
                 filesystem=None, writer_process: bool = False) -> dict[str, Any]:
    """Write staged sharded state into ``directory`` with ``torch.distributed.checkpoint``
    (collective: every rank calls it, in the same order; the arguments as :func:`writer_for`'s).
    Returns what this rank wrote: ``{"files": [...], "bytes": n}``. The snapshot's host buffers
    go back to the staging pool once the shards are written (or the write failed)."""
    import torch.distributed.checkpoint as dcp

    distributed, rank, world = process_info()
    if isinstance(staged["state"], Future):  # an overlapped snapshot: copied by now, or soon
        staged["state"], staged["release"] = staged["state"].result()
    if staged.get("specs") is not None:  # DTensors again, over their staged local shards
        if isinstance(filesystem, MemoryFiles):  # the data file's size, and some for its headers
            filesystem.expected_bytes = sum(t.numel() * t.element_size()
                                            for t in staged["state"]) + (1 << 20)

        staged["state"] = join_dtensors(staged.pop("tree"), staged["state"], staged.pop("specs"))
    files = files_at(filesystem)
    files.mkdir(directory)
    before = files.sizes(directory)
    try:
        if distributed and staged["layout"] == DTENSOR and writer_process and \
                not isinstance(files, MemoryFiles):
            save_in_writer_process(staged["state"], files.dcp_writer(directory), directory,
                                   process_group, worker_context().timeout_s, rank)
        else:
            dcp.save(staged["state"], storage_writer=files.dcp_writer(directory),
                     planner=_save_planner(staged["layout"]), process_group=process_group,
                     no_dist=not distributed)
    finally:
        if staged.get("release") is not None:
            staged["release"]()
    if rank == 0:
        write_small_files(files, directory, staged, sorted(staged["state"]), world)
    after = files.sizes(directory)
    new = sorted(set(after) - set(before))
    return {"files": new, "bytes": sum(after[f] for f in new)}


def write_small_files(files, directory: str, staged: dict[str, Any], keys: list[str],
                      world: int) -> None:
    """(rank 0) The checkpoint's own files beside DCP's: the rest of the state, the optimizer's
    param groups, and the marker that says how the shards were written."""
    devices = world
    if staged["layout"] == SPMD:
        import torch_xla.runtime as xr

        devices = xr.global_runtime_device_count()
    marker = json.dumps({
        "format": "torch.distributed.checkpoint",
        "format_version": FORMAT_VERSION,
        "names": "module",
        "layout": staged["layout"],
        "workers": world,
        "devices": devices,
        "keys": keys,
    })
    save_file(files, directory, EXTRA_FILE, staged["extra"])
    if staged["groups"] is not None:
        save_file(files, directory, GROUPS_FILE, staged["groups"])
    save_file(files, directory, SHARDED_MARKER, marker.encode())


def save_sharded(state: Mapping[str, Any], directory: str) -> dict[str, Any]:
    """Write this rank's shards of ``state["model"]`` / ``state["optimizer"]`` into ``directory``
    (and, on rank 0, the rest of ``state`` and the metadata), in this thread: the three steps
    at once. Call it on every rank. Returns what this rank wrote, as :func:`write_staged`."""
    return write_staged(stage(describe(state)), directory)


def write_replicated(cpu_state: dict[str, Any], directory: str, filename: str,
                     filesystem=None) -> dict[str, Any]:
    """Write the staged state to ``directory/filename`` (on ``filesystem``, a pyarrow filesystem,
    when given: the run's storage); returns ``{"files", "bytes"}``."""
    files = files_at(filesystem)
    files.mkdir(directory)
    save_file(files, directory, filename, cpu_state)
    return {"files": [filename], "bytes": files.sizes(directory)[filename]}


def _as_is_stager():
    from torch.distributed.checkpoint.staging import AsyncStager

    class AsIs(AsyncStager):
        """The snapshot as it is: it is in host buffers already."""

        _synchronize_after_execute = False

        def stage(self, state_dict):
            return state_dict

        def synchronize_staging(self) -> None:
            pass

    return AsIs()


def save_in_writer_process(state: dict[str, Any], storage_writer, directory: str,
                           process_group, timeout_s: float, rank: int) -> None:
    """Write ``state`` (host DTensors) with ``storage_writer`` (DCP's, into ``directory``)
    through this worker's writer process; collective over ``process_group`` like ``dcp.save``.
    Raises ``ReportError`` when the writer fails, dies or takes longer than ``timeout_s``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    tracker = _torch_writer()
    tracker.before_save()  # torch starts its writer process at the first save
    try:
        with _writer_threads(starting=tracker.process is None):
            future = dcp.async_save(state, storage_writer=storage_writer,
                                    planner=dcp.DefaultSavePlanner(), process_group=process_group,
                                    async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                                    async_stager=_as_is_stager())
            future.result(timeout=timeout_s)
    except FutureTimeout:
        raise ReportError(f"rank {rank}: the checkpoint writer process did not write "
                          f"{directory} within timeout_s={timeout_s:g}; {_FIX}") from None
    except Exception as exc:
        process = tracker.find()
        dead = "" if process is None or process.is_alive() else \
            f" (it is dead: pid {process.pid}, exit code {process.exitcode})"
        raise ReportError(f"rank {rank}: the checkpoint writer process failed on {directory}"
                          f"{dead}: {type(exc).__name__}: {exc}; {_FIX}") from exc
    tracker.find()


@contextlib.contextmanager
def _writer_threads(starting: bool) -> Iterator[None]:
    """While torch's writer process may start (``starting``): the environment it starts with
    says ``WRITER_THREADS`` threads (OMP_NUM_THREADS, MKL_NUM_THREADS; its thread pools are
    made at its start, from its parent's environment). This process's own pools are made
    already; its environment is put back after."""
    if not starting:
        yield
        return
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
    saved = {name: os.environ.get(name) for name in names}
    os.environ.update(dict.fromkeys(names, str(WRITER_THREADS)))
    try:
        yield
    finally:
        for name, value in saved.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


class _TorchWriterProcess:
    """torch's writer process of this worker, found through public process information
    (``multiprocessing``): the child process that torch's first ``async_save`` started, spawned
    and not one of ours. Found once."""

    def __init__(self) -> None:
        self.before: set[int] | None = None  # this process's children before the first save
        self.process: Any = None

    def before_save(self) -> None:
        if self.process is None and self.before is None:
            self.before = {p.pid for p in multiprocessing.active_children()}

    def find(self) -> Any:
        """The process (a ``multiprocessing.Process``), or None until it is told apart."""
        if self.process is None and self.before is not None:
            new = [p for p in multiprocessing.active_children() if p.pid not in self.before and
                   not p.name.startswith(PROCESS_PREFIX) and type(p).__name__ == "SpawnProcess"]
            if len(new) == 1:
                self.process = new[0]
        return self.process


def _torch_writer() -> _TorchWriterProcess:
    return runtime().part("torch_writer", _TorchWriterProcess)


def writer_process_pid() -> int | None:
    """The pid of this worker's writer process of sharded checkpoints, None before the first
    save through it."""
    return getattr(_torch_writer().find(), "pid", None)


def writer_process_pids() -> list[int]:
    """The pids of this worker's writer processes (sharded, replicated) started so far."""
    save = runtime().save_process
    pids = [writer_process_pid(), None if save is None else save.process.pid]
    return [pid for pid in pids if pid is not None]


class SaveProcess:
    """This worker's writer of replicated checkpoints: one spawned Python that writes each state
    it is handed with ``torch.save`` (see the module docstring)."""

    def __init__(self, checksums: bool = True) -> None:
        """``checksums``: whether the files' zip records carry their CRC-32 (torch's
        ``torch.utils.serialization.config.save.compute_crc32``; torch.load reads them either
        way). The memory tier's generations, which live in memory only, go without."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, checksums), daemon=True,
                                   name=PROCESS_PREFIX + "checkpoint-writer")
        with _writer_threads(starting=True):
            self.process.start()
        child.close()
        self._ready = False  # the process says so once it has imported what it needs

    def ready(self) -> bool:
        """Whether the process has started (imported torch) and takes saves; never waits."""
        if not self._ready and self.process.is_alive() and self.conn.poll(0):
            with contextlib.suppress(EOFError, OSError):
                self._ready = self.conn.recv() == "ready"
        return self._ready

    def wait_ready(self, timeout_s: float) -> bool:
        """Wait until :meth:`ready`, at most ``timeout_s``; False when it is not by then."""
        deadline = time.monotonic() + timeout_s
        while not self.ready() and self.process.is_alive() and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.ready()

    def save(self, state: dict[str, Any], directory: str, filename: str, filesystem,
             timeout_s: float, rank: int) -> dict[str, Any]:
        """``write_replicated`` in the writer process; raises ``ReportError`` when it fails,
        dies or takes longer than ``timeout_s`` (then it is ended: the next save starts
        another)."""
        try:
            if not self._ready and self.conn.poll(timeout_s):  # its first message: ready
                self._ready = self.conn.recv() == "ready"
            # The run's filesystem as Ray's workers got it (files.ArrowFileSystem pickles it by
            # value when its class cannot be imported: a handler of the driver script).
            self.conn.send((state, directory, filename, files_at(filesystem)))
            if not self.conn.poll(timeout_s):
                self.end()
                raise ReportError(f"rank {rank}: the checkpoint writer process did not write "
                                  f"{directory} within timeout_s={timeout_s:g}; {_FIX}")
            ok, result = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.process.join(1)
            self.end()
            raise ReportError(
                f"rank {rank}: the checkpoint writer process failed on {directory} (it is dead: "
                f"pid {self.process.pid}, exit code {self.process.exitcode}): "
                f"{type(exc).__name__}: {exc}; {_FIX}") from exc
        if not ok:
            raise ReportError(f"rank {rank}: the checkpoint writer process failed on "
                              f"{directory}: {result}; {_FIX}")
        return result

    def end(self) -> None:
        """Stop the process (it was started here) and forget it."""
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()
        rt = runtime()
        with rt.lock:
            if rt.save_process is self:
                rt.save_process = None


def save_process() -> SaveProcess:
    """This worker's writer of replicated checkpoints, started at the first call (in the
    background: :meth:`SaveProcess.ready` says when it takes saves; held by the runtime)."""
    return runtime().part("save_process", SaveProcess)


def save_replicated(writer: SaveProcess, state: dict[str, Any], directory: str, filename: str,
                    filesystem, timeout_s: float, rank: int) -> dict[str, Any]:
    """Write a replicated snapshot by ``writer`` once it takes saves; before that (it is still
    starting) in this thread, so that no save waits for the process to start."""
    if not writer.ready():
        return write_replicated(state, directory, filename, filesystem)
    return writer.save(state, directory, filename, filesystem, timeout_s, rank)


def _serve(conn, checksums: bool = True) -> None:
    """The writer process: each request (``write_replicated``'s arguments) until the pipe
    closes."""
    import torch.utils.serialization

    torch.utils.serialization.config.save.compute_crc32 = checksums

    conn.send("ready")
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = (True, write_replicated(*request))
        except Exception as exc:  # noqa: BLE001 (sent to the worker, raised there)
            result = (False, f"{type(exc).__name__}: {exc}")
        del request  # the shared buffers go back before the worker reuses them
        conn.send(result)
