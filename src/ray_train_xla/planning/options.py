"""The user's options and their validation, without Ray or torch.

- ``XLAOptions``: the options of ``TorchXLAConfig`` (torch_xla on Neuron, TPU, CPU);
- ``NeuronOptions``: the options of ``TorchNeuronConfig`` (native TorchNeuron, Neuron SDK 2.30+);
- ``TPUOptions``: the options of ``TorchTPUConfig`` (native TorchTPU, ``torch-tpu`` on PyPI).

The configs users pass to ``TorchTrainer`` (``driver/config.py``) are these options plus Ray's
``TorchConfig`` hooks. Planning (``planning.planner.plan``) and ``ray-train-xla plan`` use the
options alone, so they start fast and can be reasoned about without Ray. Every field is
keyword-only and checked by type when the object is built, and again when the backend starts (a
field changed after construction is caught there); a keyword that is no field raises
XLAConfigError too, naming the fields and the config whose option it is.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from ray_train_xla.errors import Term, XLAConfigError, config_error
from ray_train_xla.planning.contract import (
    DEFAULT_TIMEOUT_S,
    EFA_ENV,
    NATIVE,
    XLA_DEBUG_VARS,
    check_user_env,
)
from ray_train_xla.planning.layout import Parallelism

DEVICES = ("auto", "neuron", "tpu", "cpu")
RUNTIMES = ("pjrt", "xrt")
MIN_TIMEOUT_S = 1
XLA_OWNER = "TorchXLAConfig"
NEURON_OWNER = "TorchNeuronConfig"
TPU_OWNER = "TorchTPUConfig"


@dataclass(frozen=True)
class CompileCache:
    """What reads a config's ``compile_cache`` on one device: the variable it is planned as,
    the URL schemes that reader opens besides a directory path, and the reader."""

    variable: str
    schemes: tuple[str, ...]
    reader: str


# compile_cache, one rule for every config: a directory path, or a URL in a scheme the runtime
# that reads it opens. (config, device) -> that runtime's cache; a device not listed (the CPU)
# reads none, and takes what any device of its config takes.
COMPILE_CACHES: dict[tuple[str, str], CompileCache] = {
    # libneuronxla's CacheUrl: a path, or an s3:// URL for S3 (docs/trainium.md).
    (XLA_OWNER, "neuron"): CompileCache("NEURON_COMPILE_CACHE_URL", ("s3",),
                                        "the Neuron compiler's cache, a path or S3"),
    # torch_xla's persistent cache reads and writes files with std::fstream (runtime/cache.h).
    (XLA_OWNER, "tpu"): CompileCache("XLA_PERSISTENT_CACHE_PATH", (),
                                     "torch_xla's persistent cache, local or mounted files"),
    # torch-neuronx's NEFF cache writes with mkstemp and rename (PersistentCacheBackend.cpp).
    (NEURON_OWNER, "neuron"): CompileCache("TORCH_NEURONX_NEFF_CACHE_DIR", (),
                                           "torch-neuronx's NEFF cache, local or mounted files"),
    # TorchTPU's tier-3 cache goes through tsl::Env, whose file systems the wheel registers:
    # local paths (posix, file://), ram:// and gs:// (libxla_base.so: RetryingGcsFileSystem).
    (TPU_OWNER, "tpu"): CompileCache("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT", ("gs",),
                                     "TorchTPU's tier-3 cache, local files or Cloud Storage"),
}
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")


def check_compile_cache(options: Any, device: str | None = None, err: Callable | None = None) -> None:
    """``compile_cache`` against what reads it: a non-empty directory path, or a URL in a scheme
    the runtime of ``device`` opens (``COMPILE_CACHES``). ``device`` None: the config's own
    device; ``"auto"`` and ``"cpu"`` take what any device of the config takes (the backend
    checks again with the device it resolved)."""
    cache = options.compile_cache
    if cache is None:
        return
    owner = options._owner
    err = err or (lambda name, value, expected: config_error(name, value, expected, owner=owner))
    device = options.device if device is None else device
    caches = [c for (o, d), c in COMPILE_CACHES.items() if o == owner and d == device] or [
        c for (o, _), c in COMPILE_CACHES.items() if o == owner]
    schemes = sorted({s for c in caches for s in c.schemes})
    urls = " or ".join(f"{'an' if s[0] in 'aefhilmnorsx' else 'a'} {s}:// URL" for s in schemes)
    readers = "; ".join(f"{c.variable}: {c.reader}" for c in caches)
    expected = f"None, a directory path every node shares, or {urls} ({readers})" if schemes else (
        f"None or a directory path every node shares, no URL ({readers})")
    if device not in ("auto", "cpu") and len(caches) == 1:
        expected += f" with device={device!r}"
    if not isinstance(cache, str) or not cache.strip():
        raise err("compile_cache", cache, expected)
    scheme = _SCHEME.match(cache)
    if scheme and scheme.group(1).lower() not in schemes:
        raise err("compile_cache", cache, expected)


def cache_variables(owner: str) -> tuple[str, ...]:
    """The variables ``compile_cache`` is planned as under the config ``owner``."""
    return tuple(c.variable for (o, _), c in COMPILE_CACHES.items() if o == owner)


def check_env_against_fields(options: Any, err: Callable[[str, Any, Any], Exception]) -> None:
    """Refuse an ``env`` entry for a variable a field of the same config sets (``env`` would
    silently win): ``compile_cache``'s variable, and the EFA variables with ``efa=True``."""
    set_by = {}
    if options.compile_cache is not None:
        set_by.update(dict.fromkeys(cache_variables(options._owner),
                                    f"compile_cache={options.compile_cache!r}"))
    if options.efa is True:
        set_by.update(dict.fromkeys(EFA_ENV, "efa=True"))
    for var, by in set_by.items():
        if var in options.env:
            raise err(f"env[{var!r}]", options.env[var],
                      f"no entry beside {by}, which sets {var} too; set it once (the field, or "
                      "this env entry without the field)")


def check_keywords(cls: type, kwargs: Mapping[str, Any]) -> None:
    """Refuse a keyword that is no field of the config ``cls`` with XLAConfigError: the fields
    it has, and the configs that have it (or the field it is close to)."""
    names = [f.name for f in fields(cls) if f.init]
    for key in kwargs:
        if key in names:
            continue
        owners = [o._owner for o in (XLAOptions, NeuronOptions, TPUOptions)
                  if o._owner != cls._owner and key in {f.name for f in fields(o)}]
        close = difflib.get_close_matches(key, names, n=1)
        why = (f"{key} is an option of {' and '.join(owners)}, not of {cls._owner}" if owners
               else f"{cls._owner} has no option {key}"
               + (f" (did you mean {close[0]}?)" if close else ""))
        base = next(o for o in (XLAOptions, NeuronOptions, TPUOptions) if issubclass(cls, o))
        public = [f.name for f in fields(base)]  # in their order (not TorchConfig's first)
        raise XLAConfigError(f"{cls._owner}.{key}={kwargs[key]!r} is not valid: expected no "
                             f"value: {why}; its options are {', '.join(public)}.")


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check_shared_options(options: Any, err: Callable[[str, Any, Any], Exception]) -> None:
    """The checks every config shares (``TorchXLAConfig``, ``TorchNeuronConfig``,
    ``TorchTPUConfig``): ``timeout_s``, ``env``, ``efa``, ``profile_steps``, ``memory_every``,
    ``peak_tflops``, ``compile_cache``, and ``env`` against the fields; ``err`` builds the error
    naming the config."""
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
    check_compile_cache(options, err=err)
    check_env_against_fields(options, err)
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
    check_recovery(options, err)
    peak = options.peak_tflops
    if peak is not None and not (_is_number(peak) and 0 < peak < float("inf")):
        raise err("peak_tflops", peak,
                  "None (the device's published peak, or on CPU a matmul probe) or a number > 0: "
                  "the peak dense TFLOP/s of one device, which MFU is taken against")
    Parallelism.of(options.parallelism, f"{options._owner}: parallelism")


RECOVERIES = ("restart", "in_place")


def check_recovery(options: Any, err: Callable[[str, Any, Any], Exception]) -> None:
    """``recovery`` and ``max_in_place_restarts``: recovery in place restores from the memory
    tier, so it needs ``memory_every``, and runs on the native configs only: torch_xla cannot
    start its device runtime again inside a process (its PJRT client lives as long as the
    process)."""
    if options.recovery not in RECOVERIES:
        raise err("recovery", options.recovery,
                  "'restart' (Ray Train restarts the worker group, the default) or 'in_place' "
                  "(every rank re-enters rtx.recoverable(train_func) in its own process)")
    budget = options.max_in_place_restarts
    if isinstance(budget, bool) or not isinstance(budget, int) or budget < 1:
        raise err("max_in_place_restarts", budget,
                  "an int >= 1: the faults recovered in place before one fails the run")
    if options.recovery != "in_place":
        return
    if not options.memory_every:
        raise err("recovery", options.recovery,
                  "'restart' without memory_every: recovery in place restores from the memory "
                  "tier; set memory_every=N as well")
    if options.runtime != NATIVE:
        raise err("recovery", options.recovery,
                  "'restart' under torch_xla: its device runtime (its PJRT client) starts once "
                  "per process, so a process cannot join a new world; use TorchNeuronConfig or "
                  "TorchTPUConfig (native) for recovery in place")


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
    recovery: str = "restart"
    max_in_place_restarts: int = 3
    peak_tflops: float | None = None
    parallelism: Parallelism | Mapping[str, int] | None = None

    _owner: ClassVar[str] = XLA_OWNER  # the config, as errors name it

    def __new__(cls, *args: Any, **kwargs: Any):
        check_keywords(cls, kwargs)  # before dataclass's __init__ raises a bare TypeError
        return super().__new__(cls)

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
        if not isinstance(self.spmd, bool):
            raise err("spmd", self.spmd, "True or False")
        wanted = Parallelism.of(self.parallelism)
        if wanted is not None and not self.spmd and (wanted.tp > 1 or wanted.dp_replicate > 1):
            raise XLAConfigError(
                Term(f"{self._owner}.parallelism={wanted.to_dict()!r} is not valid: expected "
                     "None without spmd=True",
                     f"the layout (--tp, --dp-replicate) is not valid with {self._owner}: "
                     "expected it only with --spmd"),
                ": under torch_xla the layout is the SPMD mesh's axes (FSDPv2 x TP); pass ",
                Term("spmd=True", "--spmd"), ", or use ",
                Term("TorchNeuronConfig / TorchTPUConfig", "--runtime native"), " (FSDP2 x TP).")
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
    wanted = Parallelism.of(options.parallelism)
    return {**out, "env": dict(options.env),
            "parallelism": None if wanted is None else wanted.to_dict(), **extra}


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

    def __new__(cls, *args: Any, **kwargs: Any):
        check_keywords(cls, kwargs)  # before dataclass's __init__ raises a bare TypeError
        return super().__new__(cls)

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
    recovery: str = "restart"
    max_in_place_restarts: int = 3
    peak_tflops: float | None = None
    parallelism: Parallelism | Mapping[str, int] | None = None

    native_device: ClassVar[str] = "neuron"
    _owner: ClassVar[str] = NEURON_OWNER

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
    recovery: str = "restart"
    max_in_place_restarts: int = 3
    peak_tflops: float | None = None
    parallelism: Parallelism | Mapping[str, int] | None = None

    native_device: ClassVar[str] = "tpu"
    efa: ClassVar[None] = None  # no EFA on TPU hosts
    _owner: ClassVar[str] = TPU_OWNER

    def to_dict(self) -> dict[str, Any]:
        return _plain(self, TPUOptions, runtime=NATIVE)
