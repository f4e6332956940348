"""TorchXLAConfig: the one object a user passes to ``TorchTrainer(torch_config=...)``.

Everything here runs in the driver. Options are validated when the config is built, so a bad
value fails before any worker starts, with a message that names the field and the valid choices.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ray.train.torch import TorchConfig

DEVICES = ("auto", "neuron", "tpu", "cpu")
RUNTIMES = ("pjrt", "xrt")


class XLAConfigError(ValueError):
    """A configuration mistake that can be named and fixed before training starts."""


def config_error(field_name: str, value: Any, expected: str | Iterable[str]) -> XLAConfigError:
    """Build the one error type for bad options: the field, the bad value, the valid choices."""
    if not isinstance(expected, str):
        expected = "one of " + ", ".join(repr(c) for c in expected)
    return XLAConfigError(f"TorchXLAConfig.{field_name}={value!r} is not valid: expected {expected}.")


@dataclass
class TorchXLAConfig(TorchConfig):
    """Configure every Ray Train worker for PyTorch/XLA: environment, process group, clean-up.

    Args:
        device: "auto" (default), "neuron", "tpu" or "cpu". "auto" picks "neuron" when workers
            are given ``neuron_cores``, "tpu" when they are given ``TPU``, else the
            ``PJRT_DEVICE`` already set on the workers, else "cpu".
        runtime: "pjrt" (default) or "xrt" (legacy torch-neuronx 1.x; Neuron only).
        neuron_parallel_compile: run a short graph-extraction pass and compile every graph into
            the Neuron cache at shutdown, so the real run starts without compiling (Neuron only).
        timeout_s: seconds that rendezvous and process-group initialisation may wait for the
            other workers before failing; also the timeout of process-group operations and of
            destroying the process group at shutdown.
        env: extra environment variables for every worker, applied last (they win).
        efa: Neuron EFA variables: None (default) sets them only where the node has EFA
            devices, True always, False never.
        compile_cache: Neuron compile cache (``NEURON_COMPILE_CACHE_URL``): a shared local path
            or an ``s3://`` URL. None keeps the Neuron default.
        spmd: SPMD mode: one worker per host owns all of that host's devices, ``xr.use_spmd()``
            runs before any XLA tensor exists and the process group is ``gloo`` (through
            ``xla://``; the ``xla`` backend refuses SPMD). Shard with ``get_mesh()``.
        cpu_devices_per_worker: XLA CPU devices per worker (``CPU_NUM_DEVICES``), so SPMD can be
            developed on CPU; None means 1 (CPU only).

    ``backend`` and ``init_method`` (inherited from TorchConfig) are not used: the process group
    follows from the device (``xla`` through ``xla://``, or ``gloo`` for several CPU workers)
    and from ``spmd`` (``gloo`` through ``xla://``).
    """

    device: str = "auto"
    runtime: str = "pjrt"
    neuron_parallel_compile: bool = False
    timeout_s: int = 1800
    env: Mapping[str, str] = field(default_factory=dict)
    efa: bool | None = None
    compile_cache: str | None = None
    spmd: bool = False
    cpu_devices_per_worker: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise XLAConfigError for any option that cannot work, whatever the cluster."""
        if self.device not in DEVICES:
            raise config_error("device", self.device, DEVICES)
        if self.runtime not in RUNTIMES:
            raise config_error("runtime", self.runtime, RUNTIMES)
        if self.runtime == "xrt" and self.device not in ("auto", "neuron"):
            raise config_error(
                "runtime", self.runtime, "'pjrt' with device=" + repr(self.device)
                + " (XRT is only supported by legacy torch-neuronx 1.x on Neuron)")
        if not isinstance(self.neuron_parallel_compile, bool):
            raise config_error("neuron_parallel_compile", self.neuron_parallel_compile, "True or False")
        if self.neuron_parallel_compile and self.device not in ("auto", "neuron"):
            raise config_error(
                "neuron_parallel_compile", self.neuron_parallel_compile,
                f"False with device={self.device!r} (parallel compile is a Neuron feature)")
        value = self.timeout_s
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise config_error("timeout_s", value, "a positive number of seconds")
        if not isinstance(self.env, Mapping):
            raise config_error("env", self.env, "a mapping of variable names to strings")
        for key, value in self.env.items():
            if not isinstance(key, str) or not key or "=" in key:
                raise config_error("env", dict(self.env), "variable names without '='")
            if not isinstance(value, (str, int)) or isinstance(value, bool):
                raise config_error(f"env[{key!r}]", value, "a string (or an int)")
        if self.efa not in (None, True, False):
            raise config_error("efa", self.efa, "None (detect), True or False")
        if self.compile_cache is not None and (
            not isinstance(self.compile_cache, str) or not self.compile_cache.strip()
        ):
            raise config_error("compile_cache", self.compile_cache, "a path, an s3:// URL or None")
        if not isinstance(self.spmd, bool):
            raise config_error("spmd", self.spmd, "True or False")
        if self.spmd and self.runtime == "xrt":
            raise config_error("spmd", self.spmd, "False with runtime='xrt' (SPMD needs PJRT)")
        n = self.cpu_devices_per_worker
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise config_error("cpu_devices_per_worker", n, "a positive integer or None")
            if self.device not in ("auto", "cpu"):
                raise config_error("cpu_devices_per_worker", n,
                                   f"None with device={self.device!r} (it sets CPU_NUM_DEVICES)")
            if n > 1 and not self.spmd:
                raise config_error(
                    "cpu_devices_per_worker", n,
                    "1 or None without spmd=True (a non-SPMD worker uses one XLA device)")

    @property
    def backend_cls(self):
        from ray_train_xla.backend import XLABackend

        return XLABackend

    @property
    def train_func_context(self):
        return _NoContext

    def to_dict(self) -> dict[str, Any]:
        return {
            "device": self.device,
            "runtime": self.runtime,
            "neuron_parallel_compile": self.neuron_parallel_compile,
            "timeout_s": self.timeout_s,
            "env": dict(self.env),
            "efa": self.efa,
            "compile_cache": self.compile_cache,
            "spmd": self.spmd,
            "cpu_devices_per_worker": self.cpu_devices_per_worker,
        }


class _NoContext:
    """Train-function context: XLA needs none (TorchConfig's default selects a CUDA device)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
