"""The user's options and their validation, without Ray or torch.

- ``XLAOptions``: the options of ``TorchXLAConfig`` (torch_xla on Neuron, TPU, CPU);
- ``NeuronOptions``: the options of ``TorchNeuronConfig`` (native TorchNeuron, Neuron SDK 2.30+);
- ``TPUOptions``: the options of ``TorchTPUConfig`` (native TorchTPU, ``torch-tpu`` on PyPI).

The configs users pass to ``TorchTrainer`` (``driver/config.py``) are these options plus Ray's
``TorchConfig`` hooks. Planning (``planning.planner.plan``) and ``ray-train-xla plan`` use the
options alone, so they start fast and can be reasoned about without Ray. Every field is
keyword-only and checked by type when the object is built, and again when the backend starts (a
field changed after construction is caught there).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ray_train_xla.errors import config_error
from ray_train_xla.planning.contract import (
    DEFAULT_TIMEOUT_S,
    NATIVE,
    XLA_DEBUG_VARS,
    check_user_env,
)

DEVICES = ("auto", "neuron", "tpu", "cpu")
RUNTIMES = ("pjrt", "xrt")
MIN_TIMEOUT_S = 1


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_shared_options(options: Any, err: Callable[[str, Any, Any], Exception]) -> None:
    """The checks every config shares (``TorchXLAConfig``, ``TorchNeuronConfig``,
    ``TorchTPUConfig``): ``timeout_s``, ``env``, ``efa``, ``profile_steps``, ``memory_every``
    and ``peak_tflops``; ``err`` builds the error naming the config."""
    if not _is_number(options.timeout_s) or not options.timeout_s >= MIN_TIMEOUT_S:
        raise err("timeout_s", options.timeout_s, f"a number of seconds >= {MIN_TIMEOUT_S}")
    if not isinstance(options.env, Mapping):
        raise err("env", options.env, "a mapping of variable names to strings")
    for key, value in options.env.items():
        if not isinstance(key, str) or not key or "=" in key:
            raise err("env", dict(options.env), "variable names without '='")
        if not isinstance(value, (str, int)) or isinstance(value, bool):
            raise err(f"env[{key!r}]", value, "a string (or an int)")
    check_user_env(options.env, err)
    if options.efa is not None and not isinstance(options.efa, bool):
        raise err("efa", options.efa, "None (detect), True or False")
    steps = options.profile_steps
    if steps is not None and not (
            isinstance(steps, (tuple, list)) and len(steps) == 2
            and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in steps)):
        raise err("profile_steps", steps,
                  "None or (start, count): two ints >= 1, the first step to profile (steps count "
                  "from 1) and how many")
    every = options.memory_every
    if every is not None and (isinstance(every, bool) or not isinstance(every, int) or every < 1):
        raise err("memory_every", every,
                  "None (no memory tier) or an int >= 1: rtx.keep_in_memory(state, step) keeps "
                  "the state of every step that is a multiple of it")
    peak = options.peak_tflops
    if peak is not None and not (_is_number(peak) and 0 < peak < float("inf")):
        raise err("peak_tflops", peak,
                  "None (the device's published peak, or on CPU a matmul probe) or a number > 0: "
                  "the peak dense TFLOP/s of one device, which MFU is taken against")


@dataclass(kw_only=True)
class XLAOptions:
    """The options of ``TorchXLAConfig`` (see its docstring for each field's meaning)."""

    device: str = "auto"
    runtime: str = "pjrt"
    neuron_parallel_compile: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S
    env: Mapping[str, str] = field(default_factory=dict)
    efa: bool | None = None
    compile_cache: str | None = None
    spmd: bool = False
    cpu_devices_per_worker: int | None = None
    tpu_process_bounds: str | None = None
    compile_causes: bool = False
    profile_steps: tuple[int, int] | None = None
    memory_every: int | None = None
    peak_tflops: float | None = None

    _owner: ClassVar[str] = "TorchXLAConfig"  # the config, as errors name it

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise XLAConfigError for any option that cannot work, whatever the cluster."""
        err = config_error
        if not isinstance(self.compile_causes, bool):
            raise err("compile_causes", self.compile_causes, "True or False")
        if self.device not in DEVICES:
            raise err("device", self.device, DEVICES)
        if self.runtime not in RUNTIMES:
            raise err("runtime", self.runtime, RUNTIMES)
        if self.runtime == "xrt" and self.device not in ("auto", "neuron"):
            raise err("runtime", self.runtime, "'pjrt' with device=" + repr(self.device)
                      + " (XRT is only supported by legacy torch-neuronx 1.x on Neuron)")
        if not isinstance(self.neuron_parallel_compile, bool):
            raise err("neuron_parallel_compile", self.neuron_parallel_compile, "True or False")
        if self.neuron_parallel_compile and self.device not in ("auto", "neuron"):
            raise err("neuron_parallel_compile", self.neuron_parallel_compile,
                      f"False with device={self.device!r} (parallel compile is a Neuron feature)")
        check_shared_options(self, err)
        for var in XLA_DEBUG_VARS:
            if self.compile_causes and var in self.env:
                raise err(f"env[{var!r}]", self.env[var],
                          f"no entry with compile_causes=True, which plans {var} for every "
                          "worker (a file of its own)")
        if self.compile_cache is not None and (
            not isinstance(self.compile_cache, str) or not self.compile_cache.strip()
        ):
            raise err("compile_cache", self.compile_cache, "a path, an s3:// URL or None")
        if not isinstance(self.spmd, bool):
            raise err("spmd", self.spmd, "True or False")
        if self.spmd and self.runtime == "xrt":
            raise err("spmd", self.spmd, "False with runtime='xrt' (SPMD needs PJRT)")
        n = self.cpu_devices_per_worker
        if n is not None:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise err("cpu_devices_per_worker", n, "a positive integer or None")
            if self.device not in ("auto", "cpu"):
                raise err("cpu_devices_per_worker", n,
                          f"None with device={self.device!r} (it sets CPU_NUM_DEVICES)")
            if n > 1 and not self.spmd:
                raise err("cpu_devices_per_worker", n,
                          "1 or None without spmd=True (a non-SPMD worker uses one XLA device)")
        bounds = self.tpu_process_bounds
        if bounds is not None:
            parts = bounds.split(",") if isinstance(bounds, str) else []
            if len(parts) not in (3, 4) or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
                raise err("tpu_process_bounds", bounds,
                          "None or 3 (or 4) positive integers separated by commas, e.g. '4,1,1'")
            if self.device not in ("auto", "tpu"):
                raise err("tpu_process_bounds", bounds,
                          f"None with device={self.device!r} (it sets TPU_PROCESS_BOUNDS)")

    def to_dict(self) -> dict[str, Any]:
        return _plain(self, XLAOptions)


def _plain(options: Any, cls: type, **extra: Any) -> dict[str, Any]:
    """The options (the fields of ``cls``) as plain data, with ``extra`` entries."""
    out = {f.name: getattr(options, f.name) for f in fields(cls)}
    return {**out, "env": dict(options.env), **extra}


NEURON_OWNER = "TorchNeuronConfig"
TPU_OWNER = "TorchTPUConfig"


class _NativeOptions:
    """What the options of the native configs share. Planning reuses the XLA planner with the
    runtime kind ``"native"``: the class-level constants give it the answers it asks every
    config (no SPMD, no parallel compile)."""

    runtime: ClassVar[str] = NATIVE
    spmd: ClassVar[bool] = False
    neuron_parallel_compile: ClassVar[bool] = False  # XLA-only; native compiles just in time
    compile_causes: ClassVar[bool] = False  # XLA-only; Dynamo's guard failures need no switch
    cpu_devices_per_worker: ClassVar[None] = None
    tpu_process_bounds: ClassVar[None] = None
    native_device: ClassVar[str]  # what device="auto" picks when Ray gave accelerators
    _owner: ClassVar[str]  # the config, as errors name it
    _cache_expected: ClassVar[str]  # what compile_cache may be, as errors say it

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise XLAConfigError for any option that cannot work, whatever the cluster."""

        def err(name: str, value: Any, expected: Any):
            return config_error(name, value, expected, owner=self._owner)

        devices = ("auto", self.native_device, "cpu")
        if self.device not in devices:
            raise err("device", self.device, devices)
        check_shared_options(self, err)
        cache = self.compile_cache
        if cache is not None and (not isinstance(cache, str) or not cache.strip() or (
                self.native_device == "neuron" and "://" in cache)):
            raise err("compile_cache", cache, self._cache_expected)


@dataclass(kw_only=True)
class NeuronOptions(_NativeOptions):
    """The options of ``TorchNeuronConfig`` (see its docstring for each field's meaning)."""

    device: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    env: Mapping[str, str] = field(default_factory=dict)
    efa: bool | None = None
    compile_cache: str | None = None
    profile_steps: tuple[int, int] | None = None
    memory_every: int | None = None
    peak_tflops: float | None = None

    native_device: ClassVar[str] = "neuron"
    _owner: ClassVar[str] = NEURON_OWNER
    _cache_expected: ClassVar[str] = ("a directory path shared by every node "
                                      "(TORCH_NEURONX_NEFF_CACHE_DIR; no URLs) or None")

    def to_dict(self) -> dict[str, Any]:
        return _plain(self, NeuronOptions, runtime=NATIVE)


@dataclass(kw_only=True)
class TPUOptions(_NativeOptions):
    """The options of ``TorchTPUConfig`` (see its docstring for each field's meaning)."""

    device: str = "auto"
    timeout_s: float = DEFAULT_TIMEOUT_S
    env: Mapping[str, str] = field(default_factory=dict)
    compile_cache: str | None = None
    profile_steps: tuple[int, int] | None = None
    memory_every: int | None = None
    peak_tflops: float | None = None

    native_device: ClassVar[str] = "tpu"
    efa: ClassVar[None] = None  # no EFA on TPU hosts
    _owner: ClassVar[str] = TPU_OWNER
    _cache_expected: ClassVar[str] = ("a directory path every host shares "
                                      "(TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT) or None")

    def to_dict(self) -> dict[str, Any]:
        return _plain(self, TPUOptions, runtime=NATIVE)
