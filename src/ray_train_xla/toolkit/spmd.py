"""SPMD helpers for the training function (``TorchXLAConfig(spmd=True)``).

In SPMD one process per host drives all of its devices: build a mesh over every device with
:func:`get_mesh`, shard the batch along its data axis with :func:`shard_batch`, and XLA inserts
the collectives. The backend has already called ``xr.use_spmd()`` before any XLA tensor existed.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

from ray_train_xla.planning.contract import worker_context


def require_spmd() -> None:
    """Raise unless SPMD is enabled on this worker, naming the option that enables it."""
    import torch_xla.runtime as xr

    if not xr.is_spmd():
        hint = ("" if worker_context().spmd
                else " Set TorchXLAConfig(spmd=True) so the backend enables it on every worker.")
        raise RuntimeError(f"SPMD mode is not enabled on this worker.{hint}")


def get_mesh(shape: Sequence[int] | None = None, axis_names: Sequence[str] = ("data", "model")):
    """A ``torch_xla.distributed.spmd.Mesh`` over all devices of the job; by default every
    device is on the ``data`` axis (pure data parallelism) and the other axes have size 1."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    require_spmd()
    axis_names = tuple(axis_names)
    devices = xr.global_runtime_device_count()
    if shape is None:
        data = axis_names.index("data") if "data" in axis_names else 0
        shape = tuple(devices if i == data else 1 for i in range(len(axis_names)))
    shape = tuple(int(d) for d in shape)
    if len(shape) != len(axis_names):
        raise ValueError(f"get_mesh: shape {shape} has {len(shape)} axes but axis_names "
                         f"{axis_names} has {len(axis_names)}")
    if math.prod(shape) != devices:
        raise ValueError(f"get_mesh: shape {shape} holds {math.prod(shape)} devices, but the "
                         f"job has {devices}")
    return xs.Mesh(np.arange(devices), shape, axis_names)


# The data-parallel axes of a mesh, outermost first: "data" (replicas: get_mesh's, or HSDP's
# under a layout with dp_replicate) and "fsdp" (FSDPv2's shards). "model" is tensor parallelism.
DATA_AXES = ("data", "fsdp")


def data_axes(mesh) -> str | tuple[str, ...]:
    """The batch dimension's entry in a partition spec on ``mesh``: its data-parallel axes
    (``DATA_AXES`` it has), one name or a tuple of them. Devices that differ only along the
    other axes (``model``: tensor-parallel peers) hold the same rows."""
    axes = tuple(a for a in DATA_AXES if a in mesh.axis_names)
    if not axes:
        raise ValueError(f"the mesh axes {mesh.axis_names} have no data-parallel axis "
                         f"({' or '.join(DATA_AXES)})")
    return axes[0] if len(axes) == 1 else axes


def shard_batch(batch: Any, mesh=None, axis: str | tuple[str, ...] | None = None) -> Any:
    """Move a batch (tensor, or a dict/list/tuple of tensors) to the XLA device and shard dim 0
    of every tensor along the mesh's ``axis`` (a name or a tuple of names; default: the mesh's
    data-parallel axes, :func:`data_axes`: ``data`` on ``get_mesh()``'s, ``fsdp`` on
    ``get_sharded_mesh()``'s, both under a layout with ``dp_replicate``); other dims are
    replicated, so tensor-parallel peers (the ``model`` axis) see the same rows."""
    import torch
    import torch_xla
    import torch_xla.distributed.spmd as xs

    mesh = mesh if mesh is not None else get_mesh()
    if axis is None:
        axis = data_axes(mesh)
    missing = [a for a in ((axis,) if isinstance(axis, str) else axis) if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"shard_batch: axis {axis!r} is not in the mesh axes {mesh.axis_names}")

    def one(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            t = value if value.device.type == "xla" else value.to(torch_xla.device())
            if t.dim():
                xs.mark_sharding(t, mesh, (axis,) + (None,) * (t.dim() - 1))
            return t
        if isinstance(value, Mapping):
            return type(value)((k, one(v)) for k, v in value.items())
        if isinstance(value, (list, tuple)):
            return type(value)(one(v) for v in value)
        return value

    return one(batch)


def sharding_spec(tensor) -> str:
    """The XLA sharding of a tensor, e.g. ``{devices=[4,1]0,1,2,3}`` ("" when replicated or
    not annotated)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor)
