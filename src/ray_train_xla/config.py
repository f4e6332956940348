"""TorchXLAConfig: the one object a user passes to ``TorchTrainer(torch_config=...)``.

It is :class:`~ray_train_xla.options.XLAOptions` (the options and their validation, no Ray) plus
Ray's ``TorchConfig`` hooks. Options are validated when the config is built, so a bad value fails
before any worker starts, with a message that names the field and the valid choices; the
backend validates again at start.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray.train.torch import TorchConfig

from ray_train_xla.errors import XLAConfigError, config_error
from ray_train_xla.options import XLAOptions

__all__ = ["TorchXLAConfig", "XLAConfigError"]

# TorchConfig's own fields, which this config does not use: the process group follows from the
# device and spmd. They keep these values (Ray's V2 TorchTrainer fills in an empty backend).
_UNUSED = {"backend": "xla", "init_method": "env"}


@dataclass(kw_only=True)
class TorchXLAConfig(XLAOptions, TorchConfig):
    """Configure every Ray Train worker for PyTorch/XLA: environment, process group, clean-up.

    Every argument is keyword-only:

    Args:
        device: "auto" (default), "neuron", "tpu" or "cpu". "auto" picks "neuron" when workers
            are given ``neuron_cores``, "tpu" when they are given ``TPU``, else the
            ``PJRT_DEVICE`` already set on the workers, else "cpu".
        runtime: "pjrt" (default) or "xrt" (legacy torch-neuronx 1.x; Neuron only).
        neuron_parallel_compile: run a short graph-extraction pass and compile every graph into
            the Neuron cache at shutdown, so the real run starts without compiling (Neuron only).
        timeout_s: seconds (at least 1; kept as given) that rendezvous and process-group
            initialisation may wait for the other workers before failing; also the timeout of
            process-group operations and of destroying the process group at shutdown.
        env: extra environment variables for every worker, applied last (they win).
        efa: Neuron EFA variables: None (default) sets them only where the node has EFA
            devices, True always, False never.
        compile_cache: Neuron compile cache (``NEURON_COMPILE_CACHE_URL``): a shared local path
            or an ``s3://`` URL. None keeps the Neuron default.
        spmd: SPMD mode: one worker per host owns all of that host's devices, ``XLA_USE_SPMD=1``
            is set before torch_xla is imported, and the process group is ``gloo`` (through
            ``xla://``; the ``xla`` backend refuses SPMD). Shard with ``get_mesh()``.
        cpu_devices_per_worker: XLA CPU devices per worker (``CPU_NUM_DEVICES``), so SPMD can be
            developed on CPU; None means 1 (CPU only).

    ``backend`` and ``init_method`` (inherited from TorchConfig) are not options here: the
    process group follows from the device and ``spmd``; setting them is an error.
    """

    backend: str | None = field(default=_UNUSED["backend"], repr=False)
    init_method: str = field(default=_UNUSED["init_method"], repr=False)

    def validate(self) -> None:
        for name, value in _UNUSED.items():
            if getattr(self, name) != value:
                raise config_error(
                    name, getattr(self, name),
                    "no value: TorchXLAConfig chooses the process group from device and spmd "
                    "(for native TorchNeuron use ray_train_xla.TorchNeuronConfig)")
        super().validate()

    @property
    def backend_cls(self):
        from ray_train_xla.backend import XLABackend  # the one place config names the backend

        return XLABackend

    @property
    def train_func_context(self):
        return _NoContext

    def to_dict(self) -> dict[str, Any]:
        return XLAOptions.to_dict(self)


class _NoContext:
    """Train-function context: XLA needs none (TorchConfig's default selects a CUDA device)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
