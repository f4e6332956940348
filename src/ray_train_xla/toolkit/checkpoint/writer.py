"""The writers: a save's third step, the one its kind gives (``Replicated.writer``,
``Shards.writer``), run by the background reporter.

Sharded state: every rank writes its shards with ``torch.distributed.checkpoint``
(:func:`write_staged`), in the reporter's thread or, for DTensors in a process group, through
torch's writer process (``dcp.async_save`` with ``AsyncCheckpointerType.PROCESS``: one spawned
Python per worker, started at its first save, joining a gloo group of every rank's writers; the
snapshot's host buffers move into shared memory once, the staging pool reuses them, and the
snapshot is taken as it is: ``AsIs``). Rank 0 adds the checkpoint's small files
(``format.write_small_files``). Replicated state: rank 0 writes ``checkpoint.pt`` with
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
import multiprocessing
import os
import time
from collections.abc import Iterator
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch.multiprocessing as mp

from ray_train_xla.errors import ReportError
from ray_train_xla.planning.contract import worker_context
from ray_train_xla.toolkit.checkpoint.files import MemoryFiles, files_at, save_file
from ray_train_xla.toolkit.checkpoint.format import write_small_files
from ray_train_xla.toolkit.checkpoint.staging import Staged
from ray_train_xla.toolkit.runtime import runtime

# A writer process starts with this many threads in its thread pools (OMP_NUM_THREADS; its
# parent's environment would give it one per core, which the steps it overlaps pay for:
# benchmarks/results/stall.md).
WRITER_THREADS = 1
PROCESS_PREFIX = "ray_train_xla-"  # the names of the processes this package starts
_FIX = "configure_reports(writer_process=False) writes in the training process instead"


# ---- the save's third step: the writers of a staged save (``staging.Staged``), which its kind
# hands to the background reporter (``replicated.Replicated.writer``, ``sharded.Shards.writer``)

def write_staged(staged: Staged, directory: str, process_group=None, filesystem=None,
                 writer_process: bool = False, planner=None) -> dict[str, Any]:
    """Write staged sharded state into ``directory`` with ``torch.distributed.checkpoint``
    (collective: every rank calls it, in the same order, over ``process_group``, default the
    default group; ``filesystem``: None for the local file system, a pyarrow filesystem (the
    run's storage) or a ``files.MemoryFiles`` (host memory); ``writer_process``: DTensors
    through this worker's writer process; ``planner``: DCP's save planner, default its own).
    Rank 0 adds the checkpoint's small files (``format.write_small_files``). Returns what this
    rank wrote: ``{"files": [...], "bytes": n}``. The snapshot's host buffers go back to the
    staging pool once the shards are written (or the write failed)."""
    import torch.distributed.checkpoint as dcp

    distributed, rank, world = process_info()
    files = files_at(filesystem)
    files.mkdir(directory)
    before = files.sizes(directory)
    try:
        if (distributed and writer_process and staged.kind.writer_process
                and not isinstance(files, MemoryFiles)):
            save_in_writer_process(staged, files.dcp_writer(directory), directory,
                                   process_group, worker_context().timeout_s, rank)
        else:
            if isinstance(files, MemoryFiles) and staged.specs is not None:
                # the data file's size, and some for its headers
                files.expected_bytes = (1 << 20) + sum(t.numel() * t.element_size()
                                                       for t in staged.copied())
            # an overlapped snapshot: copied by now, or soon
            dcp.save(staged.host_state(), storage_writer=files.dcp_writer(directory),
                     planner=planner or dcp.DefaultSavePlanner(), process_group=process_group,
                     no_dist=not distributed)
    finally:
        staged.give_back()
    if rank == 0:
        write_small_files(files, directory, staged, world)
    after = files.sizes(directory)
    new = sorted(set(after) - set(before))
    return {"files": new, "bytes": sum(after[f] for f in new)}


def process_info() -> tuple[bool, int, int]:
    """(whether a process group is initialised, this rank, the world size)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return True, dist.get_rank(), dist.get_world_size()
    return False, 0, 1


def write_replicated(cpu_state: dict[str, Any], directory: str, filename: str,
                     filesystem=None) -> dict[str, Any]:
    """Write the staged state to ``directory/filename`` (on ``filesystem``, a pyarrow filesystem,
    when given: the run's storage); returns ``{"files", "bytes"}``."""
    files = files_at(filesystem)
    files.mkdir(directory)
    save_file(files, directory, filename, cpu_state)
    return {"files": [filename], "bytes": files.sizes(directory)[filename]}


def write_file(staged: Staged, directory: str, filename: str, filesystem,
               process: SaveProcess | None = None) -> dict[str, Any]:
    """Write a replicated snapshot (``staged``) as ``directory/filename``: by ``process`` (the
    worker's save process) once it takes saves, else in this thread, so that no save waits for
    the process to start. Its buffers go back to the pool once written (or failed)."""
    try:
        if process is not None and process.ready():
            return process.save(staged.state, directory, filename, filesystem,
                                worker_context().timeout_s, 0)
        return write_replicated(staged.state, directory, filename, filesystem)
    finally:
        staged.give_back()


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


def save_in_writer_process(staged: Staged, storage_writer, directory: str,
                           process_group, timeout_s: float, rank: int) -> None:
    """Write ``staged`` (host DTensors, once copied) with ``storage_writer`` (DCP's, into
    ``directory``) through this worker's writer process; collective over ``process_group``
    like ``dcp.save``. Raises ``ReportError`` when the writer fails, dies or takes longer than
    ``timeout_s``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    state = staged.host_state()  # an overlapped snapshot: copied by now, or soon
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
        dead = ("" if process is None or process.is_alive() else
                f" (it is dead: pid {process.pid}, exit code {process.exitcode})")
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
