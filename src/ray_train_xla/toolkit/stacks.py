"""One strategy object per stack: what the helpers do differently on torch_xla, on the CPU
development mode's host bridge, and on the native stacks (DTensor), chosen once per plan.

- :class:`XLAStack` (``TorchXLAConfig`` on Neuron or TPU, or one CPU worker): torch_xla's device,
  lazy graphs cut by ``sync``, collectives traced into the graph (``xm.all_reduce``); under SPMD
  on an accelerator an XLA tensor is one global value, and a CPU tensor crosses the hosts through
  the process group;
- :class:`HostBridgeStack` (several CPU workers under ``TorchXLAConfig``): the same device, but
  torch_xla 2.9's CPU client has no collectives across processes, so they run on host copies
  through gloo;
- :class:`NativeStack` (``TorchNeuronConfig``, ``TorchTPUConfig`` and their CPU twins): the
  ``neuron``, ``tpu`` or CPU device, eager, ``torch.distributed`` on the tensor's own device,
  FSDP2 and DTensor for sharded models. torch_xla is never imported on it.

:func:`stack` gives this worker's, made from its plan (``WorkerContext``) the first time a helper
asks and kept by the runtime until the plan changes (a restarted or resized worker group). The
helpers call it instead of asking which stack they are on.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch

from ray_train_xla.planning.contract import DEVMODE_BACKEND, WorkerContext, worker_context


class Stack:
    """What differs between the stacks (see the module docstring)."""

    name = ""
    native = False  # DTensor and FSDP2; torch_xla never imported
    # The kind of sharded state this stack makes (``sharding.SPMD``, ``sharding.DTENSOR``):
    # which implementation of ``prepare_sharded_model`` and of sharded checkpoints applies.
    sharded = "spmd"

    def __init__(self, ctx: WorkerContext) -> None:
        self.ctx = ctx

    @property
    def spmd_global(self) -> bool:
        """SPMD on an accelerator: one mesh over every worker, XLA tensors are global values."""
        return self.ctx.spmd_global

    def device(self) -> torch.device:
        raise NotImplementedError

    def sync(self) -> None:
        """Cut and run the pending graph (nothing on an eager device)."""

    def wait(self) -> None:
        """Block until the device has finished the work queued so far."""

    def comm_device(self, tensor: torch.Tensor) -> torch.device:
        """Where a ``torch.distributed`` collective on ``tensor`` runs."""
        return torch.device("cpu")

    def over_process_group(self) -> bool:
        """Whether the collectives go through ``torch.distributed`` (else the stack's own,
        traced into the graph)."""
        return True

    def background_loader(self, requested: bool | None) -> bool:
        """Whether ``prepare_data_loader`` moves batches in background threads."""
        return False

    def device_memory(self, state: list[bool]) -> tuple[float, float] | None:
        """(bytes in use, peak bytes) of the device, None when it reports none (``state``: the
        caller's memo of what the device said before)."""
        return None

    def barrier(self, tag: str) -> None:
        """Block until every worker reaches ``tag``."""
        import torch.distributed as dist

        dist.barrier()



class XLAStack(Stack):
    """torch_xla (see the module docstring)."""

    name = "xla"

    def device(self) -> torch.device:
        import torch_xla

        if hasattr(torch_xla, "device"):
            return torch_xla.device()
        import torch_xla.core.xla_model as xm  # torch_xla 1.x (XRT)

        return xm.xla_device()

    def sync(self) -> None:
        import torch_xla

        if hasattr(torch_xla, "sync"):
            torch_xla.sync()
            return
        import torch_xla.core.xla_model as xm

        xm.mark_step()

    def wait(self) -> None:
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()

    def barrier(self, tag: str) -> None:
        import torch_xla.core.xla_model as xm

        xm.rendezvous(tag)


    def over_process_group(self) -> bool:
        # Under SPMD on an accelerator a CPU tensor is host-local: it crosses the hosts through
        # the process group (an XLA tensor is global: nothing to reduce).
        return self.spmd_global

    def background_loader(self, requested: bool | None) -> bool:
        if requested is not None:
            return requested
        device = os.environ.get("PJRT_DEVICE", "")  # torch_xla's own variable, as it reads it
        if not device:
            import torch_xla.runtime as xr

            device = xr.device_type() or ""
        return device.upper() != "CPU"

    def device_memory(self, state: list[bool]) -> tuple[float, float] | None:
        if not state[0]:
            return None
        import torch_xla.core.xla_model as xm

        try:
            info = xm.get_memory_info(self.device())
        except RuntimeError:  # the XLA CPU device: "GetAllocatorStats is not supported"
            state[0] = False
            return None
        used = float(info.get("bytes_used", 0))
        return used, float(info.get("peak_bytes_used", used))


class HostBridgeStack(XLAStack):
    """Several CPU workers under torch_xla: collectives on host copies through gloo."""

    name = "xla-host"

    def over_process_group(self) -> bool:
        return True

    def barrier(self, tag: str) -> None:
        Stack.barrier(self, tag)


class NativeStack(Stack):
    """TorchNeuron, TorchTPU and their CPU twins (see the module docstring)."""

    name = "native"
    native = True
    sharded = "dtensor"

    def device(self) -> torch.device:
        if self.ctx.device == "neuron":
            import torch_neuronx

            return torch.device("neuron", torch_neuronx.current_device())
        if self.ctx.device == "tpu":
            return torch.device("tpu", 0)  # TorchTPU binds each process to its one chip
        return torch.device("cpu")

    def wait(self) -> None:
        if self.ctx.device in ("neuron", "tpu"):
            module = getattr(torch, self.ctx.device, None)  # torch.neuron, torch.tpu
            if module is not None and hasattr(module, "synchronize"):
                module.synchronize()

    def comm_device(self, tensor: torch.Tensor) -> torch.device:
        return tensor.device  # the neuron and tpu_dist groups take device tensors; gloo CPU ones


    def device_memory(self, state: list[bool]) -> tuple[float, float] | None:
        dev = self.device()
        if dev.type == "cpu":
            return None
        with contextlib.suppress(Exception):
            module = getattr(torch, dev.type, None)
            if not hasattr(module, "memory_allocated"):
                module = getattr(torch, "accelerator", None)
            if hasattr(module, "memory_allocated"):
                return float(module.memory_allocated()), float(module.max_memory_allocated())
        return None


def choose(ctx: WorkerContext) -> Stack:
    """The stack of a plan."""
    if ctx.native:
        return NativeStack(ctx)
    host = ((ctx.pg_backend == DEVMODE_BACKEND or "gloo" in ctx.pg_backend)
            and ctx.world_size > 1 and not ctx.spmd_global)
    return HostBridgeStack(ctx) if host else XLAStack(ctx)


def stack() -> Stack:
    """This worker's stack, made once per plan and kept by the runtime."""
    from ray_train_xla.toolkit.runtime import runtime

    rt = runtime()
    ctx = worker_context()
    current: Any = rt.stack
    if current is None or current.ctx is not ctx:
        current = rt.stack = choose(ctx)
    return current
