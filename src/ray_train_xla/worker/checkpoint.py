"""Checkpoints that load with plain torch, saved and restored the same way on every device.

Saving follows the rules that avoid the known torch_xla hangs: every worker syncs the graph
(so nothing collective is left pending), then only rank 0 copies the state to the CPU and writes
it with ``torch.save``; no torch_xla collective and no ``xm.save`` rendezvous runs in a branch
that only rank 0 takes. The file needs neither torch_xla nor this package to load.
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from typing import Any

import torch

import ray_train_xla.worker.device as _device
from ray_train_xla.worker.collectives import rank
from ray_train_xla.worker.metrics import is_graph_extraction_run

logger = logging.getLogger(__name__)

CHECKPOINT_FILE = "checkpoint.pt"


def to_cpu(value: Any) -> Any:
    """A copy of ``value`` with every tensor (in nested dicts, lists, tuples) on the CPU."""
    if isinstance(value, torch.Tensor):
        return value.detach().to("cpu", copy=True)
    if isinstance(value, Mapping):
        return {k: to_cpu(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(to_cpu(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(to_cpu(v) for v in value)
    return value


def save_checkpoint(
    state: Mapping[str, Any],
    metrics: Mapping[str, Any] | None = None,
    filename: str = CHECKPOINT_FILE,
) -> None:
    """Report ``metrics`` and a checkpoint holding ``state`` with ``ray.train.report``.

    Call it on every worker (like ``ray.train.report``). ``state`` is typically
    ``{"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step}``;
    rank 0's copy is written, as CPU tensors, to ``filename`` in the checkpoint directory.
    In a Neuron graph-extraction run (``neuron_parallel_compile=True``) the state is a
    placeholder, so only the metrics are reported, marked ``graph_extraction_only``.
    """
    import ray.train

    _device.sync()  # on every worker: rank 0 below only transfers materialised tensors
    metrics = dict(metrics or {})
    if is_graph_extraction_run():
        metrics["graph_extraction_only"] = 1
        if rank() == 0:
            logger.warning("neuron_parallel_compile run: not saving a placeholder checkpoint")
        ray.train.report(metrics, checkpoint=None)
        return
    if rank() != 0:
        ray.train.report(metrics, checkpoint=None)
        return
    with tempfile.TemporaryDirectory(prefix="ray-train-xla-ckpt-") as tmp:
        torch.save(to_cpu(dict(state)), os.path.join(tmp, filename))
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def load_checkpoint(
    model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    checkpoint: Any = None,
    filename: str = CHECKPOINT_FILE,
) -> dict[str, Any] | None:
    """Load the state saved by ``save_checkpoint`` from ``checkpoint`` (default: the run's latest,
    ``ray.train.get_checkpoint()``); None when there is none (a fresh start).

    When given, ``model`` gets ``state["model"]`` and ``optimizer`` gets ``state["optimizer"]``,
    on the XLA device. Returns the whole state (CPU tensors) for the rest (step, epoch, ...).
    """
    import ray.train

    checkpoint = checkpoint if checkpoint is not None else ray.train.get_checkpoint()
    if checkpoint is None:
        return None
    with checkpoint.as_directory() as path:
        file = os.path.join(path, filename)
        if not os.path.exists(file):
            raise FileNotFoundError(
                f"rank {rank()}: checkpoint {checkpoint.path} has no {filename!r} "
                f"(found {sorted(os.listdir(path))}); was it written by save_checkpoint()?"
            )
        state = torch.load(file, map_location="cpu", weights_only=False)
    if model is not None:
        model.load_state_dict(state["model"])  # copies into the parameters, on their device
    if optimizer is not None:
        # Optimizer.load_state_dict moves the state onto each parameter's (XLA) device.
        optimizer.load_state_dict(state["optimizer"])
    _device.sync()
    return state
