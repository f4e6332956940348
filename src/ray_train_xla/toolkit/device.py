"""The device layer of the worker helpers: this worker's device and the few operations that
differ between stacks, each asked of the worker's stack object (``stacks.py``).

- ``xla`` (``TorchXLAConfig``): torch_xla's device; ``sync`` cuts the lazy graph.
- ``native`` (``TorchNeuronConfig``, ``TorchTPUConfig``): the native ``neuron`` or ``tpu``
  device, or the CPU on a development machine; eager, so ``sync`` has nothing to cut, and
  collectives are plain torch.distributed (``neuron``, ``tpu_dist`` or ``gloo``) on the tensor's
  own device. torch_xla is never imported on this path.

The family comes from the environment the backend planned (``WorkerContext.runtime``).
torch_xla 1.13 (XRT, torch-neuronx 1.x) has neither ``torch_xla.device()`` nor
``torch_xla.sync()``: :func:`get_device` and :func:`sync` fall back to ``xm.xla_device()`` and
``xm.mark_step()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ray_train_xla.toolkit.stacks import stack


def get_device() -> torch.device:
    """This worker's device: the XLA device (``torch_xla.device()``; ``xm.xla_device()`` on
    torch_xla 1.x, XRT), ``neuron:<local rank>``, ``tpu:0`` (TorchTPU binds every process to
    device 0, its one chip), or ``cpu``."""
    return stack().device()


def sync() -> None:
    """Cut and run the pending XLA graph (``torch_xla.sync()``; ``xm.mark_step()`` on torch_xla
    1.x); nothing to do on an eager (native) device."""
    stack().sync()


def wait() -> None:
    """Block until the device has finished the work queued so far."""
    stack().wait()


def comm_device(tensor: torch.Tensor) -> torch.device:
    """Where a torch.distributed collective on ``tensor`` runs: on its own device on the native
    path (``neuron``, ``tpu_dist``, or ``gloo`` on CPU), on a host copy on the XLA path (gloo)."""
    return stack().comm_device(tensor)


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
