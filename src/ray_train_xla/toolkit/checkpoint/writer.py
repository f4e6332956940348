"""Sharded checkpoints written by a writer process: torch's own.

``torch.distributed.checkpoint.async_save(..., async_checkpointer_type=AsyncCheckpointerType.
PROCESS)`` starts one writer process per worker at its first save (a spawned Python that joins a
gloo group of the writers of every rank, a second or two in the background), and from then on
hands it each snapshot: the snapshot's host buffers move into shared memory once (the staging
pool reuses them, ``staging.py``), so later saves pass only their handles, and the writer runs
DCP's planning and writes the files. The training process keeps only the waiting, in the
background reporter's thread: the write no longer shares the training thread's interpreter
lock. The snapshot is taken as it is (no second staging: ``AsIs``).

Used for DTensor state (FSDP2) in a process group, when ``configure_reports(writer_process=True)``
(the default); torch_xla SPMD state, the memory tier and single-process saves write in the
reporter's thread. A writer process that dies is reported (torch raises when its pipe closes)
and a write that does not end within ``timeout_s`` is an error: neither is waited for without
end. Either way the error reaches the training function as ``ReportError``, naming
``configure_reports(writer_process=False)``, which writes in the reporter's thread instead.
"""

from __future__ import annotations

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
    """The pid of this worker's writer process, None before the first save through it."""
    process = _process()
    return None if process is None else process.pid
