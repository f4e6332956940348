"""Checkpoints written by a writer process, apart from the training process.

**Sharded checkpoints: torch's own writer process.**

``torch.distributed.checkpoint.async_save(..., async_checkpointer_type=AsyncCheckpointerType.
PROCESS)`` starts one writer process per worker at its first save (a spawned Python that joins a
gloo group of the writers of every rank, a second or two in the background), and from then on
hands it each snapshot: the snapshot's host buffers move into shared memory once (the staging
pool reuses them, ``staging.py``), so later saves pass only their handles, and the writer runs
DCP's planning and writes the files. The training process keeps only the waiting, in the
background reporter's thread: the write no longer shares the training thread's interpreter
lock. The snapshot is taken as it is (no second staging: ``AsIs``).

Used for DTensor state (FSDP2) in a process group.

**Replicated checkpoints: a save process** (:class:`SaveProcess`). Rank 0's ``checkpoint.pt`` is
written by one spawned Python of rank 0's own (started at its first replicated save): it is
handed the snapshot through a pipe, its tensors as shared memory (the snapshot is staged into
shared host buffers reused from save to save, ``staging.py``; torch_xla's tensors, copied off
the device as before, move into shared memory in the reporter's thread), and writes it into
the file with ``torch.save``, locally or through the run's storage filesystem.

Both when ``configure_reports(writer_process=True)`` (the default); torch_xla SPMD state is
written in the reporter's thread. **The memory tier** has a :class:`SaveProcess` of its own per
worker for replicated state, which formats each generation's ``checkpoint.pt`` into the node's
shared memory (``memory.py``; DTensor state is written in place there, ``rank_files.py``).

A writer process that dies is reported (its pipe closes) and a write that does not end within
``timeout_s`` is an error: neither is waited for without end. Either way the error reaches the
training function as ``ReportError``, naming ``configure_reports(writer_process=False)``, which
writes in the reporter's thread instead.
"""

from __future__ import annotations

import time
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from ray_train_xla.errors import ReportError


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

    future = dcp.async_save(state, storage_writer=storage_writer,
                            planner=dcp.DefaultSavePlanner(), process_group=process_group,
                            async_checkpointer_type=AsyncCheckpointerType.PROCESS,
                            async_stager=_as_is_stager())
    fix = "configure_reports(writer_process=False) writes in the training process instead"
    try:
        future.result(timeout=timeout_s)
    except FutureTimeout:
        raise ReportError(f"rank {rank}: the checkpoint writer process did not write "
                          f"{directory} within timeout_s={timeout_s:g}; {fix}") from None
    except Exception as exc:
        process = _process()
        dead = "" if process is None or process.is_alive() else \
            f" (it is dead: pid {process.pid}, exit code {process.exitcode})"
        raise ReportError(f"rank {rank}: the checkpoint writer process failed on {directory}"
                          f"{dead}: {type(exc).__name__}: {exc}; {fix}") from exc


def _process():
    from torch.distributed.checkpoint import _async_process_executor as executor

    holder = getattr(executor, "_CHECKPOINT_PROCESS", None)
    return None if holder is None else holder._save_process


def writer_process_pid() -> int | None:
    """The pid of this worker's writer process of sharded checkpoints, None before the first
    save through it."""
    process = _process()
    return None if process is None else process.pid


def writer_process_pids() -> list[int]:
    """The pids of this worker's writer processes (sharded, replicated) started so far."""
    pids = [writer_process_pid(), None if _SAVE is None else _SAVE.process.pid]
    return [pid for pid in pids if pid is not None]


class SaveProcess:
    """This worker's writer of replicated checkpoints: one spawned Python that writes each state
    it is handed with ``torch.save`` (see the module docstring)."""

    def __init__(self, checksums: bool = True) -> None:
        """``checksums``: whether the files' zip records carry their CRC-32 (torch's
        ``torch.utils.serialization.config.save.compute_crc32``; torch.load reads them either
        way). The memory tier's generations, which live in memory only, go without."""
        import torch.multiprocessing as mp

        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=_serve, args=(child, checksums), daemon=True,
                                   name="ray_train_xla-checkpoint-writer")
        self.process.start()
        child.close()
        self._ready = False  # the process says so once it has imported what it needs

    def ready(self) -> bool:
        """Whether the process has started (imported torch) and takes saves; never waits."""
        if not self._ready and self.process.is_alive() and self.conn.poll(0):
            try:
                self._ready = self.conn.recv() == "ready"
            except (EOFError, OSError):
                pass
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
        return self._call(("replicated", state, directory, filename, filesystem), directory,
                          timeout_s, rank)

    def _call(self, request: tuple, directory: str, timeout_s: float, rank: int):
        fix = "configure_reports(writer_process=False) writes in the training process instead"
        try:
            if not self._ready and self.conn.poll(timeout_s):  # its first message: ready
                self._ready = self.conn.recv() == "ready"
            self.conn.send(request)
            if not self.conn.poll(timeout_s):
                self.end()
                raise ReportError(f"rank {rank}: the checkpoint writer process did not write "
                                  f"{directory} within timeout_s={timeout_s:g}; {fix}")
            ok, result = self.conn.recv()
        except (EOFError, OSError) as exc:
            self.process.join(1)
            self.end()
            raise ReportError(
                f"rank {rank}: the checkpoint writer process failed on {directory} (it is dead: "
                f"pid {self.process.pid}, exit code {self.process.exitcode}): "
                f"{type(exc).__name__}: {exc}; {fix}") from exc
        if not ok:
            raise ReportError(f"rank {rank}: the checkpoint writer process failed on "
                              f"{directory}: {result}; {fix}")
        return result

    def end(self) -> None:
        """Stop the process (it was started here) and forget it."""
        global _SAVE
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        self.conn.close()
        if _SAVE is self:
            _SAVE = None


_SAVE: SaveProcess | None = None


def save_process() -> SaveProcess:
    """This worker's writer of replicated checkpoints, started at the first call (in the
    background: :meth:`SaveProcess.ready` says when it takes saves)."""
    global _SAVE
    if _SAVE is None:
        _SAVE = SaveProcess()
    return _SAVE


def save_replicated(writer: SaveProcess, state: dict[str, Any], directory: str, filename: str,
                    filesystem, timeout_s: float, rank: int) -> dict[str, Any]:
    """Write a replicated snapshot by ``writer`` once it takes saves; before that (it is still
    starting) in this thread, so that no save waits for the process to start."""
    from ray_train_xla.toolkit.checkpoint.replicated import write_replicated

    if not writer.ready():
        return write_replicated(state, directory, filename, filesystem)
    return writer.save(state, directory, filename, filesystem, timeout_s, rank)


def _handle(request: tuple):
    from ray_train_xla.toolkit.checkpoint.replicated import write_replicated

    _, state, directory, filename, filesystem = request
    return write_replicated(state, directory, filename, filesystem)


def _serve(conn, checksums: bool = True) -> None:
    """The writer process: each request (a replicated file) until the pipe closes."""
    import torch.utils.serialization

    import ray_train_xla.toolkit.checkpoint.replicated  # noqa: F401 (imported before "ready")

    torch.utils.serialization.config.save.compute_crc32 = checksums

    conn.send("ready")
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return
        try:
            result = (True, _handle(request))
        except Exception as exc:  # noqa: BLE001 (sent to the worker, raised there)
            result = (False, f"{type(exc).__name__}: {exc}")
        del request  # the shared buffers go back before the worker reuses them
        conn.send(result)
