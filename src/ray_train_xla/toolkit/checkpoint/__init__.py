"""Checkpoints through Ray Train, saved and restored the same way on every device.

One seam, two implementations, picked from the state given:

- replicated state (every worker holds the whole model): rank 0 writes one plain torch file,
  ``checkpoint.pt``, that loads without torch_xla or this package (``replicated.py``);
- sharded state (SPMD tensors split over devices, e.g. ``prepare_sharded_model``): every rank
  writes only its own shards with ``torch.distributed.checkpoint`` into the same Ray checkpoint;
  loading restores onto any mesh shape, device count and worker count (``sharded.py``).

This module is the seam: it picks the implementation from the state given (``find_sharded``),
takes the snapshot, and hands the write and the report to the worker's background reporter
(``toolkit/reporting.py``). State neither can restore (torch_xla FSDP v1 flat shards,
DTensors) is refused. The on-disk format, shared with ``ray-train-xla consolidate``, is in
``format.py``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch

from ray_train_xla.toolkit.checkpoint.format import CHECKPOINT_FILE, is_sharded_checkpoint
from ray_train_xla.toolkit.checkpoint.replicated import (
    check_replicated,
    load_replicated,
    stage_replicated,
    write_replicated,
)
from ray_train_xla.toolkit.checkpoint.sharded import (
    load_sharded,
    stage_sharded,
    unsupported_sharding,
    write_staged,
)
from ray_train_xla.toolkit.device import sync
from ray_train_xla.toolkit.metrics import is_graph_extraction_run
from ray_train_xla.toolkit.ranks import rank
from ray_train_xla.toolkit.reporting import reporter
from ray_train_xla.toolkit.sharding import ShardedStateError, find_sharded

logger = logging.getLogger(__name__)


def _refuse_unsupported(value: Any, helper: str) -> None:
    found = unsupported_sharding(value)
    if found is not None:
        raise ShardedStateError(
            f"{helper}: {found[0]} is {found[1]}. {helper} restores replicated state (one file) and "
            "SPMD shards (torch.distributed.checkpoint); other sharded state would be silently "
            "wrong. Train with rtx.prepare_sharded_model(model) (FSDPv2 under "
            "TorchXLAConfig(spmd=True)), or save this state with its own library's per-rank checkpoint.")


_CHECKPOINT_GROUP: Any = None


def _checkpoint_group():
    """A gloo group of its own for the background writes of sharded checkpoints (created once,
    on every rank in the same order): they never share a communicator with the training
    thread."""
    global _CHECKPOINT_GROUP
    import torch.distributed as dist

    if _CHECKPOINT_GROUP is None and dist.is_available() and dist.is_initialized():
        _CHECKPOINT_GROUP = dist.new_group(backend="gloo")
    return _CHECKPOINT_GROUP


def save_checkpoint(
    state: Mapping[str, Any],
    metrics: Mapping[str, Any] | None = None,
    filename: str = CHECKPOINT_FILE,
    wait: bool = False,
) -> dict[str, Any] | None:
    """Report ``metrics`` and a checkpoint holding ``state`` through Ray Train, without waiting
    for Ray: the state is copied off the device now (a snapshot of this step), then written
    and reported in this worker's background reporter (``reporting.py``), in call order.

    Call it on every worker (like ``ray.train.report``). ``state`` is typically
    ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}``.
    Replicated state: rank 0's copy is written, as CPU tensors, to ``filename``. Sharded (SPMD)
    state: every rank writes its own shards of ``state["model"]`` and ``state["optimizer"]``
    with ``torch.distributed.checkpoint`` and reports its files; rank 0 adds the rest of
    ``state``.

    Returns None; with ``wait=True`` it returns once this checkpoint was reported, with what
    this rank wrote (``{"files", "bytes"}``, None for a rank that writes nothing). At most
    ``max_in_flight`` checkpoints wait for Ray at once (``configure_reports``, 2 by default):
    the call after waits for a slot. An error of an earlier checkpoint is raised here as
    ``ReportError``. In a Neuron graph-extraction run (``neuron_parallel_compile=True``) the state
    is a placeholder, so only the metrics are reported, marked ``graph_extraction_only``. Raises
    ShardedStateError for sharded state that neither format restores (torch_xla FSDP v1 shards,
    DTensors).
    """
    _refuse_unsupported(state, "save_checkpoint")
    sync()  # on every worker: the snapshot below only transfers materialised tensors
    metrics = dict(metrics or {})
    if is_graph_extraction_run():
        metrics["graph_extraction_only"] = 1
        if rank() == 0:
            logger.warning("neuron_parallel_compile run: not saving a placeholder checkpoint")
        return reporter().checkpoint(metrics, None, wait=wait)

    write = None
    if find_sharded(state) is not None:
        staged = stage_sharded(state)  # device -> host now; the files are written later
        group = _checkpoint_group()  # collective, on the training thread: every rank, in order

        def write(directory: str) -> dict[str, Any]:
            return write_staged(staged, directory, group)
    elif rank() == 0:
        cpu_state = stage_replicated(state)

        def write(directory: str) -> dict[str, Any]:
            return write_replicated(cpu_state, directory, filename)
    return reporter().checkpoint(metrics, write, wait=wait)


def load_checkpoint(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    checkpoint: Any = None,
    filename: str = CHECKPOINT_FILE,
) -> dict[str, Any] | None:
    """Load the state saved by ``save_checkpoint`` from ``checkpoint`` (default: the run's latest,
    ``ray.train.get_checkpoint()``); None when there is none (a fresh start). Call it on every
    worker.

    When given, ``model`` gets ``state["model"]`` and ``optimizer`` gets ``state["optimizer"]``,
    on the XLA device. A replicated checkpoint returns the whole state (CPU tensors) for the rest
    (step, epoch, ...). A sharded checkpoint is restored in place onto the shards ``model`` and
    ``optimizer`` have now (any mesh, device or worker count) and returns the rest of the state.
    Raises ShardedStateError for a sharded model a replicated file cannot fill (FSDP v1, DTensor),
    and ``CheckpointMismatchError`` (before anything is loaded) naming every tensor whose saved
    shape or dtype differs from the model's or the optimizer's, every key the checkpoint lacks
    and every saved tensor the model has no place for.
    """
    import ray.train

    _refuse_unsupported(model, "load_checkpoint")
    checkpoint = checkpoint if checkpoint is not None else ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as path:
        if is_sharded_checkpoint(path):
            return load_sharded(path, model, optimizer)
        where = f"rank {rank()}: checkpoint {checkpoint.path}"
        state = load_replicated(path, filename, where)
    check_replicated(state, model, optimizer, where)
    if model is not None:
        model.load_state_dict(state["model"])  # copies into the parameters, on their device
    if optimizer is not None:
        # Optimizer.load_state_dict moves the state onto each parameter's (XLA) device.
        optimizer.load_state_dict(state["optimizer"])
    sync()
    return state
