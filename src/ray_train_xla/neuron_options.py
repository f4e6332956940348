"""NeuronOptions: the options of native TorchNeuron (Neuron SDK 2.30+), without Ray or torch.

``TorchNeuronConfig`` (``neuron_config.py``, what users pass to ``TorchTrainer``) is these options
plus Ray's ``TorchConfig`` hooks. Planning reuses the XLA planner (``runtimes.plan``) with the
runtime kind ``"native"``: the class-level constants below give it the answers it asks every
config (no SPMD, no parallel compile). Every field is keyword-only and checked by type when the
object is built, and again when the backend starts.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ray_train_xla.errors import config_error
from ray_train_xla.options import check_shared_options

NATIVE = "native"
NATIVE_DEVICES = ("auto", "neuron", "cpu")
OWNER = "TorchNeuronConfig"


@dataclass(kw_only=True)
class NeuronOptions:
    """The options of ``TorchNeuronConfig`` (see its docstring for each field's meaning)."""

    device: str = "auto"
    timeout_s: float = 1800
    env: Mapping[str, str] = field(default_factory=dict)
    efa: bool | None = None
    compile_cache: str | None = None

    # What the shared planner asks every config; fixed for native TorchNeuron.
    runtime: ClassVar[str] = NATIVE
    spmd: ClassVar[bool] = False
    neuron_parallel_compile: ClassVar[bool] = False  # XLA-only; native compiles just in time
    cpu_devices_per_worker: ClassVar[None] = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise XLAConfigError for any option that cannot work, whatever the cluster."""

        def err(name: str, value: Any, expected: Any):
            return config_error(name, value, expected, owner=OWNER)

        if self.device not in NATIVE_DEVICES:
            raise err("device", self.device, NATIVE_DEVICES)
        check_shared_options(self, err)
        if self.compile_cache is not None and (
            not isinstance(self.compile_cache, str) or not self.compile_cache.strip()
            or "://" in self.compile_cache
        ):
            raise err("compile_cache", self.compile_cache,
                      "a directory path shared by every node (TORCH_NEURONX_NEFF_CACHE_DIR; "
                      "no URLs) or None")

    def to_dict(self) -> dict[str, Any]:
        """The options as plain data (what the worker-side runtime hooks receive)."""
        out = {f.name: getattr(self, f.name) for f in fields(NeuronOptions)}
        out["env"] = dict(self.env)
        out["runtime"] = NATIVE
        return out
