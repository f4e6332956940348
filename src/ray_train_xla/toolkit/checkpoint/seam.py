"""The seam: ``save_checkpoint`` and ``load_checkpoint``, which pick the implementation
(replicated, sharded) from the state given and cross it both ways when loading (see the
package's docstring)."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Mapping
from typing import Any

import torch

from ray_train_xla.planning.contract import worker_context
from ray_train_xla.toolkit import events, reporting
from ray_train_xla.toolkit.checkpoint.format import (
    CHECKPOINT_FILE,
    check_fits,
    flat_specs,
    is_sharded_checkpoint,
    read_full_state,
)
from ray_train_xla.toolkit.checkpoint.memory import tier as _memory
from ray_train_xla.toolkit.checkpoint.names import (
    FORMAT_VERSION,
    index_optimizer_state,
    module_name,
    named_model_state,
    optimizer_param_names,
    positional_names,
)
from ray_train_xla.toolkit.checkpoint.replicated import check_replicated, load_replicated
from ray_train_xla.toolkit.checkpoint.sharded import (
    DTENSOR,
    describe,
    format_version,
    load_sharded,
    read_extra,
    read_groups,
    sharded_layout,
)
from ray_train_xla.toolkit.checkpoint.staging import stage
from ray_train_xla.toolkit.checkpoint.writer import writer_for
from ray_train_xla.toolkit.collectives import host_group
from ray_train_xla.toolkit.device import sync
from ray_train_xla.toolkit.ranks import rank
from ray_train_xla.toolkit.reporting import reporter

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

    Call it on every worker (like ``ray.train.report``). ``state`` is typically
    ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}``.
    Replicated state: rank 0's copy is written, as CPU tensors, to ``filename``. Sharded state
    (SPMD tensors of FSDPv2, DTensors of FSDP2): every rank writes its own shards of
    ``state["model"]`` and ``state["optimizer"]`` with ``torch.distributed.checkpoint``, under
    the module's parameter names, and reports its files; rank 0 adds the rest of ``state``.

    Returns None; with ``wait=True`` it returns once this checkpoint was reported, with what
    this rank wrote (``{"files", "bytes"}``, None for a rank that writes nothing). At most
    ``max_in_flight`` checkpoints wait for Ray at once (``configure_reports``, 2 by default):
    the call after waits for a slot. An error of an earlier checkpoint is raised here as
    ``ReportError``. In a Neuron graph-extraction run (``neuron_parallel_compile=True``) the state
    is a placeholder, so only the metrics are reported, marked ``graph_extraction_only``. Raises
    ShardedStateError for sharded state that neither format restores (torch_xla FSDP v1 shards,
    SPMD tensors mixed with DTensors, an optimizer state dict without parameter names).
    """
    start = time.perf_counter()
    try:
        return _save_checkpoint(state, metrics, filename, wait)
    finally:  # the training thread was blocked this long: the step timeline's checkpoint stall
        events.add_stall(time.perf_counter() - start)
        events.checkpoint_saved()


def _save_checkpoint(state, metrics, filename: str, wait: bool) -> dict[str, Any] | None:
    """A save in its four steps: describe the state (``sharded.describe``), copy it to host
    memory (``staging.stage``), choose its writer (``writer.writer_for``), and hand both to
    this worker's background reporter, which writes and reports it (``reporting.py``)."""
    desc = describe(state, "save_checkpoint")
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
    if desc["layout"] is not None or rank() == 0:  # replicated state: rank 0 writes it
        options = reporting.report_options()
        # device -> host now, or while the next forward and backward run (the next optimizer
        # step waits for it); the files are written later
        staged = stage(desc, overlap=options.overlap_snapshots, shared=options.writer_process)
        # collective, on the training thread: every rank, in order
        group = host_group("checkpoint") if desc["layout"] is not None else None
        write = writer_for(staged, filename, group, options.writer_process)
    return reporter().checkpoint(metrics, write, wait=wait, after=after)


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
    on their device. A replicated checkpoint returns the whole state (CPU tensors) for the rest
    (step, epoch, ...); a sharded one returns the rest of the state. Any checkpoint loads into
    any model: a sharded checkpoint (FSDPv2 or FSDP2) restores in place onto the shards a sharded
    ``model`` and ``optimizer`` have now (any mesh, device or worker count, either layout), or
    whole into a replicated model; a replicated checkpoint fills a sharded model's shards.
    Parameters and optimizer state are matched by the module's parameter names (a replicated
    file's optimizer state, which has no names, by position). Raises ``CheckpointMismatchError``
    (before anything is loaded) naming every tensor whose saved shape or dtype differs from the
    model's or the optimizer's, every key the checkpoint lacks and every saved tensor the model
    has no place for; ShardedStateError for torch_xla FSDP v1 models.
    """
    import ray.train

    layout = sharded_layout(model, "load_checkpoint") or sharded_layout(optimizer, "load_checkpoint")
    why = None  # why the memory tier did not serve
    if checkpoint is None:
        restored, why = _from_memory(model, optimizer, filename, layout)
        if restored is not None:
            return restored[0]
    resuming = checkpoint is None  # the run's latest: a restart resuming, not a chosen one
    checkpoint = checkpoint if checkpoint is not None else ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    if why and rank() == 0:
        logger.warning("memory tier: restoring from storage: %s", why)
    start = time.perf_counter()
    with checkpoint.as_directory() as path:
        out = _load_from(path, None, f"rank {rank()}: checkpoint {checkpoint.path}", model,
                         optimizer, filename, layout)
    if resuming:
        seconds = time.perf_counter() - start
        logger.info("rank %d: restored from storage (%s) in %.2f s", rank(), checkpoint.path,
                    seconds)
        events.restored("storage", seconds)
    return out


def _from_memory(model, optimizer, filename: str, layout) -> tuple[tuple[Any] | None, str | None]:
    """((what load_checkpoint returns,), None) restored from the memory tier; (None, why not)
    when storage serves (rank 0 decides for every rank); (None, None) when the tier is off."""
    tier = _memory.memory_tier()
    if tier is None:
        return None, None
    start = time.perf_counter()
    choice = _memory.broadcast_from_rank0(tier.choose)
    tier.continue_from(choice["next"])
    if choice["tier"] != "memory":
        return None, choice["why"]
    fs, files = tier.filesystem(choice)
    out = _load_from(_memory.ROOT, fs, f"rank {rank()}: memory generation {choice['gen']}", model,
                     optimizer, filename, layout)
    seconds = time.perf_counter() - start
    tier.restored = {"gen": choice["gen"], "world": choice["world"], "seconds": seconds,
                     "fetched_bytes": files.fetched_bytes, "stores": sorted(files.served)}
    logger.info("rank %d: restored from memory (generation %d, saved by %d workers; %d bytes "
                "read from %s) in %.2f s", rank(), choice["gen"], choice["world"],
                files.fetched_bytes, ", ".join(sorted(files.served)), seconds)
    events.restored("memory", seconds)
    return (out,), None


def _load_from(path: str, filesystem, where: str, model, optimizer, filename: str, layout):
    if is_sharded_checkpoint(path, filesystem):
        if layout is not None:
            group = host_group("load") if layout == DTENSOR else None
            return load_sharded(path, model, optimizer, group, filesystem=filesystem)
        state, rest = _read_sharded_whole(path, model, optimizer, filesystem)
    else:
        state = load_replicated(path, filename, where, filesystem)
        rest = state
        if layout is not None:
            _fill_sharded(state, model, optimizer, layout, where)
            return state
    check_replicated(state, model, optimizer, where)
    if model is not None:
        model.load_state_dict(state["model"])  # copies into the parameters, on their device
    if optimizer is not None and "optimizer" in state:
        # Optimizer.load_state_dict moves the state onto each parameter's (XLA) device.
        optimizer.load_state_dict(state["optimizer"])
    sync()
    return rest


def _read_sharded_whole(path: str, model, optimizer,
                        filesystem=None) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the model's and the optimizer's state as whole CPU tensors, in the replicated form of
    ``model`` and ``optimizer``; the rest of the saved state) of a sharded checkpoint."""
    keys = ("model", "optimizer") if optimizer is not None else ("model",)
    full = read_full_state(path, keys, filesystem=filesystem)
    state: dict[str, Any] = {}
    if "model" in full:
        named = named_model_state(full["model"])
        state["model"] = {k: named.get(module_name(k), None) for k in model.state_dict()} \
            if model is not None and set(map(module_name, model.state_dict())) == set(named) else named
    if optimizer is not None and "optimizer" in full:
        saved = full["optimizer"]
        if format_version(path, filesystem) >= FORMAT_VERSION:
            groups = read_groups(path, filesystem)
            names = optimizer_param_names(model, optimizer, "load_checkpoint") if model is not None \
                else None
            if names is None or groups is None:
                raise KeyError(f"load_checkpoint: {path}: a sharded checkpoint's optimizer state "
                               "is named; give the model with the optimizer")
            named = {"state": saved.get("state", {}), "param_groups": groups}
            state["optimizer"] = index_optimizer_state(named, optimizer.state_dict(), names,
                                                       f"load_checkpoint: {path}")
        else:
            state["optimizer"] = saved
    return state, read_extra(path, filesystem)


def _fill_sharded(state: dict[str, Any], model, optimizer, layout: str, where: str) -> None:
    """Fill a sharded ``model`` and ``optimizer`` from a replicated checkpoint's whole tensors:
    every rank takes its own shards."""
    names = optimizer_param_names(model, optimizer, "load_checkpoint") if optimizer is not None else []
    saved_model = named_model_state(state.get("model") or {})
    if model is not None:
        target = named_model_state(model.state_dict())
        check_fits(flat_specs(saved_model, "model."), flat_specs(target, "model."),
                   f"load_checkpoint: {where}", "the model")
    named_optim = None
    if optimizer is not None and "optimizer" in state:
        named_optim = positional_names(state["optimizer"], names)
        params = {n: p for group in names for n in group
                  for n2, p in model.named_parameters() if module_name(n2) == n}
        saved = [(f"optimizer.state.{n}.{k}", n, v) for n, s in named_optim["state"].items()
                 for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        want = {key: (tuple(params[n].shape), v.dtype) for key, n, v in saved if n in params}
        have = {key: (tuple(v.shape), v.dtype) for key, n, v in saved}
        check_fits(have, want, f"load_checkpoint: {where}", "the optimizer")
    if layout == DTENSOR:
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        options = StateDictOptions(full_state_dict=True)
        if model is not None:
            set_model_state_dict(model, {k: saved_model[module_name(k)]
                                         for k in get_model_state_dict(model)}, options=options)
        if named_optim is not None:
            set_optimizer_state_dict(model, optimizer, named_optim, options=options)
        return
    if model is not None:
        model.load_state_dict({k: saved_model[module_name(k)] for k in model.state_dict()})
    if named_optim is not None:
        optimizer.load_state_dict(index_optimizer_state(named_optim, optimizer.state_dict(), names, where))
    sync()
