"""The seam: ``save_checkpoint`` and ``load_checkpoint``. Each describes the state once
(``describe.py``: a typed value and its kind) and hands it to its kind, which stages and writes
it, or restores it from either format (see the package's docstring)."""

from __future__ import annotations

import contextlib
import functools
import logging
import time
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ray_train_xla.planning.contract import worker_context
from ray_train_xla.toolkit import events, reporting, steps
from ray_train_xla.toolkit.checkpoint.describe import describe, target
from ray_train_xla.toolkit.checkpoint.format import CHECKPOINT_FILE
from ray_train_xla.toolkit.checkpoint.memory import tier as _memory
from ray_train_xla.toolkit.checkpoint.source import Source, open_source
from ray_train_xla.toolkit.checkpoint.writer import write_staged
from ray_train_xla.toolkit.device import sync
from ray_train_xla.toolkit.ranks import rank
from ray_train_xla.toolkit.reporting import reporter
from ray_train_xla.toolkit.runtime import runtime

logger = logging.getLogger(__name__)


def save_checkpoint(
    state: Mapping[str, Any],
    metrics: Mapping[str, Any] | None = None,
    filename: str = CHECKPOINT_FILE,
    wait: bool = False,
) -> dict[str, Any] | None:
    """Report ``metrics`` and a checkpoint holding ``state`` through Ray Train, without waiting
    for Ray: the state is copied off the device now (a snapshot of this step; DTensor state
    while the next forward and backward run, the next optimizer step waiting for the copy,
    ``staging.py``), then written and reported in this worker's background reporter
    (``reporting.py``), in call order.

    Call it on every worker (like ``ray.train.report``). ``state`` is a mapping of entries,
    typically ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step":
    step}``; an entry may also be a module, an optimizer or an object with ``state_dict()`` (an
    LR scheduler): ``{"model": model, "ema": ema, "optimizer": opt, "scheduler": sched, "step":
    step}``. Replicated state: rank 0's copy is written, as CPU tensors, to ``filename``.
    Sharded state (SPMD tensors of FSDPv2, DTensors of FSDP2 and tensor parallelism): every rank
    writes its own shards of each model and optimizer with ``torch.distributed.checkpoint``,
    under the module's parameter names, and reports its files; rank 0 adds the rest.

    Returns None; with ``wait=True`` it returns once this checkpoint was reported, with what
    this rank wrote (``{"files", "bytes"}``, None for a rank that writes nothing). At most
    ``max_in_flight`` checkpoints wait for Ray at once (``configure_reports``, 2 by default):
    the call after waits for a slot. An error of an earlier checkpoint is raised here as
    ``ReportError``. In a Neuron graph-extraction run (``neuron_parallel_compile=True``) the state
    is a placeholder, so only the metrics are reported, marked ``graph_extraction_only``. Raises
    ShardedStateError for sharded state that neither format restores (torch_xla FSDP v1 shards,
    SPMD tensors mixed with DTensors, sharded tensors outside a model's or an optimizer's state,
    an optimizer state dict without parameter names).
    """
    start = time.perf_counter()
    try:
        return _save_checkpoint(state, metrics, filename, wait)
    finally:  # the training thread was blocked this long: the step timeline's checkpoint stall
        events.add_stall(time.perf_counter() - start)
        events.checkpoint_saved()


def _save_checkpoint(state, metrics, filename: str, wait: bool) -> dict[str, Any] | None:
    """A save in its four steps: describe the state (``describe.py``), copy it to host memory
    and choose its writer (its kind's ``stage`` and ``writer``), and hand the writer to this
    worker's background reporter, which writes and reports it (``reporting.py``)."""
    described = describe(state, "save_checkpoint")
    sync()  # on every worker: the snapshot below only transfers materialised tensors
    metrics = dict(metrics or {})
    if worker_context().graph_extraction:  # neuron_parallel_compile: graphs only
        metrics["graph_extraction_only"] = 1
        if rank() == 0:
            logger.warning("neuron_parallel_compile run: not saving a placeholder checkpoint")
        return reporter().checkpoint(metrics, None, wait=wait)

    tier = _memory.memory_tier()
    # storage and memory number their saves together (memory/tier.py)
    gen = tier.next_generation() if tier is not None else None
    after = functools.partial(tier.note_storage, gen) if gen is not None and rank() == 0 else None
    write = None
    kind = described.kind
    if kind.sharded or rank() == 0:  # replicated state: rank 0 writes it
        options = reporting.report_options()
        # device -> host now, or while the next forward and backward run (the next optimizer
        # step waits for it); the files are written later, by the writer
        staged = kind.stage(described, overlap=options.overlap_snapshots,
                            shared=options.writer_process)
        write = kind.writer(staged, filename, options.writer_process)
    return reporter().checkpoint(metrics, write, wait=wait, after=after)


def load_checkpoint(
    model: torch.nn.Module | Mapping[str, Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    checkpoint: Any = None,
    filename: str = CHECKPOINT_FILE,
) -> dict[str, Any] | None:
    """Load the state saved by ``save_checkpoint`` from ``checkpoint`` (default: the run's latest,
    ``ray.train.get_checkpoint()``); None when there is none (a fresh start). Call it on every
    worker.

    When given, ``model`` gets ``state["model"]`` and ``optimizer`` gets ``state["optimizer"]``,
    on their device. A replicated checkpoint returns the whole state (CPU tensors) for the rest
    (step, epoch, ...); a sharded one returns the rest of the state. ``model`` may instead be a
    mapping of the entries to restore in place (modules, optimizers, objects with
    ``load_state_dict`` such as an LR scheduler), ``{"model": model, "ema": ema, "optimizer":
    opt, "scheduler": sched}``: it returns the rest of the saved state (and, from a replicated
    file, the models and optimizers it was not given).

    Any checkpoint loads into any model: a sharded checkpoint (FSDPv2, FSDP2, tensor parallel)
    restores in place onto the shards a sharded model and optimizer have now (any mesh,
    placements, device or worker count), or whole into a replicated model; a replicated
    checkpoint fills a sharded model's shards. Parameters and optimizer state are matched by the
    module's parameter names (a replicated file's optimizer state by the ``param_names`` its
    state dict carries, into sharded targets; else by position). Raises
    ``CheckpointMismatchError`` (before anything is loaded) naming every entry given that the
    checkpoint lacks, every tensor whose saved shape or dtype differs from the model's or the
    optimizer's, every key the checkpoint lacks and every saved tensor the model has no place
    for; ShardedStateError for torch_xla FSDP v1 models.
    """
    restoring = target(model, optimizer, "load_checkpoint")
    rt = runtime()
    if rt.ctx.in_place_restarts and not rt.recoverable:
        raise ValueError(
            "load_checkpoint: the config sets recovery='in_place', but the training function "
            "is not wrapped: pass TorchTrainer(train_loop_per_worker=rtx.recoverable("
            "train_func), ...), or a fault would restart the whole group")
    steps.set_guard(None)  # a recovery in place restores here (startup/recovery.py)
    with _source(checkpoint, filename) as source:
        return None if source is None else restoring.kind.restore(restoring, source)


@contextlib.contextmanager
def _source(checkpoint: Any, filename: str) -> Iterator[Source | None]:
    """Where a restore reads from: ``checkpoint``, else the memory tier's newest generation when
    it is newer than storage, else the run's latest checkpoint in storage; None on a fresh
    start. Logged and timed (the restore happens inside)."""
    import ray.train

    why = None  # why the memory tier did not serve
    tier = _memory.memory_tier() if checkpoint is None else None
    if tier is not None:
        choice = _memory.broadcast_from_rank0(tier.choose)  # rank 0 decides for every rank
        tier.continue_from(choice["next"])
        if choice["tier"] == "memory":
            start = time.perf_counter()
            fs, files = tier.filesystem(choice)
            yield open_source(_memory.ROOT, fs,
                              f"rank {rank()}: memory generation {choice['gen']}", filename)
            generators = tier.restore_generators(fs, choice)
            seconds = time.perf_counter() - start
            tier.restored = {"gen": choice["gen"], "world": choice["world"], "seconds": seconds,
                             "fetched_bytes": files.fetched_bytes, "stores": sorted(files.served),
                             "generators": generators}
            logger.info("rank %d: restored from memory (generation %d, saved by %d workers; %d "
                        "bytes read from %s) in %.2f s", rank(), choice["gen"], choice["world"],
                        files.fetched_bytes, ", ".join(sorted(files.served)), seconds)
            events.restored("memory", seconds)
            return
        why = choice["why"]
    resuming = checkpoint is None  # the run's latest: a restart resuming, not a chosen one
    checkpoint = checkpoint if checkpoint is not None else ray.train.get_checkpoint()
    if checkpoint is None:
        yield None
        return
    if why and rank() == 0:
        logger.warning("memory tier: restoring from storage: %s", why)
    start = time.perf_counter()
    with checkpoint.as_directory() as path:
        yield open_source(path, None, f"rank {rank()}: checkpoint {checkpoint.path}", filename)
    if resuming:
        seconds = time.perf_counter() - start
        logger.info("rank %d: restored from storage (%s) in %.2f s", rank(), checkpoint.path,
                    seconds)
        events.restored("storage", seconds)


# ---- in this thread, without Ray (tests, tools): a save's and a restore's steps at once

def save_sharded(state: Mapping[str, Any], directory: str) -> dict[str, Any]:
    """Write this rank's shards of ``state``'s model parts and optimizers into ``directory``
    (and, on rank 0, the rest of ``state`` and the metadata), in this thread: the three steps
    at once. Call it on every rank. Returns what this rank wrote, as :func:`write_staged`."""
    described = describe(state)
    kind = described.kind
    return write_staged(kind.stage(described), directory, planner=kind.save_planner())


def load_sharded(directory: str, model: torch.nn.Module | None = None,
                 optimizer: torch.optim.Optimizer | None = None, filesystem=None) -> dict[str, Any]:
    """Restore ``model`` and ``optimizer`` in place from the checkpoint in ``directory`` (on
    ``filesystem``, a pyarrow filesystem, when given), as ``load_checkpoint`` does with a
    checkpoint it is given. Call it on every rank. Returns the rest of the saved state."""
    state = target(model, optimizer, "load_checkpoint")
    return state.kind.restore(state, open_source(directory, filesystem))
