"""TorchNeuronConfig: native TorchNeuron (Neuron SDK 2.30+) for ``TorchTrainer(torch_config=...)``.

It is :class:`~ray_train_xla.neuron_options.NeuronOptions` plus Ray's ``TorchConfig`` hooks, the
way ``TorchXLAConfig`` is XLAOptions plus those hooks. Options are validated when the config is
built and again when the backend starts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ray.train.torch import TorchConfig

from ray_train_xla.config import _NoContext
from ray_train_xla.errors import config_error
from ray_train_xla.neuron_options import OWNER, NeuronOptions

__all__ = ["TorchNeuronConfig"]

# TorchConfig's own fields: the process group follows from the device.
_UNUSED = {"backend": "neuron", "init_method": "env"}


@dataclass(kw_only=True)
class TorchNeuronConfig(NeuronOptions, TorchConfig):
    """Configure every Ray Train worker for native TorchNeuron (``torch-neuronx`` 2.13+, no XLA).

    Every argument is keyword-only:

    Args:
        device: "auto" (default), "neuron" or "cpu". "auto" picks "neuron" when workers are
            given ``neuron_cores``, else "cpu". "cpu" runs the same training function with
            ``gloo`` on CPU workers (development without Trainium; torch_xla not needed).
        timeout_s: seconds (at least 1) that process-group initialisation may wait for the
            other workers; also the timeout of process-group operations and of its shutdown.
        env: extra environment variables for every worker, applied last (they win).
        efa: EFA variables (``FI_PROVIDER=efa``, ...): None (default) sets them only where the
            node has EFA devices, True always, False never.
        compile_cache: ``TORCH_NEURONX_NEFF_CACHE_DIR``, a directory every node shares (FSx,
            NFS) so graphs compiled once are reused by every worker and later runs. None keeps
            the native default, ``/tmp/neff_cache``, which is per node.

    Each worker uses one NeuronCore: request ``resources_per_worker={"neuron_cores": 1}``.
    ``backend`` and ``init_method`` (inherited from TorchConfig) are not options here.
    """

    backend: str | None = field(default=_UNUSED["backend"], repr=False)
    init_method: str = field(default=_UNUSED["init_method"], repr=False)

    def validate(self) -> None:
        for name, value in _UNUSED.items():
            if getattr(self, name) != value:
                raise config_error(
                    name, getattr(self, name),
                    "no value: TorchNeuronConfig uses the 'neuron' process group through "
                    "env:// on Neuron and 'gloo' on CPU", owner=OWNER)
        super().validate()

    @property
    def backend_cls(self):
        from ray_train_xla.native_backend import NativeNeuronBackend

        return NativeNeuronBackend

    @property
    def train_func_context(self):
        return _NoContext

    def to_dict(self) -> dict[str, Any]:
        return NeuronOptions.to_dict(self)
