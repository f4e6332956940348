"""The configs users pass to ``TorchTrainer(torch_config=...)``.

- ``TorchXLAConfig``: PyTorch/XLA on Trainium, TPU or CPU;
- ``TorchNeuronConfig``: native TorchNeuron (Neuron SDK 2.30+, no XLA);
- ``TorchTPUConfig``: native TorchTPU (``torch-tpu`` on PyPI, no XLA).

Each is its options class (``planning/options.py``: the options and their validation, no Ray,
when the config is built and again when the backend starts) plus Ray's ``TorchConfig`` hooks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from ray.train.torch import TorchConfig

from ray_train_xla.errors import XLAConfigError, config_error
from ray_train_xla.planning.contract import SUBMITTED_AT
from ray_train_xla.planning.options import NeuronOptions, TPUOptions, XLAOptions
from ray_train_xla.planning.runtimes.native_neuron import import_env
from ray_train_xla.startup.import_env import rebuild_config

__all__ = ["TorchNeuronConfig", "TorchTPUConfig", "TorchXLAConfig", "XLAConfigError",
           "check_scaling_config"]


class _RayHooks:
    """Ray's ``TorchConfig`` hooks, the same for every config: ``backend`` and ``init_method``
    (TorchConfig's own fields) must keep their defaults, as the process group follows from the
    device; the Backend class (``_backend``, in ``driver/backend.py``); the training function's
    context; and pickling records when the config left the driver (``SUBMITTED_AT``)."""

    _owner: ClassVar[str]  # from the options class
    _backend: ClassVar[str]
    _process_group: ClassVar[str]  # why backend and init_method take no value

    def validate(self) -> None:
        for name in ("backend", "init_method"):
            value = getattr(self, name)
            if value != self.__dataclass_fields__[name].default:
                raise config_error(name, value, f"no value: {self._process_group}",
                                   owner=self._owner)
        super().validate()

    @property
    def backend_cls(self):
        from ray_train_xla.driver import backend  # the one place config names the backends

        return getattr(backend, self._backend)

    @property
    def train_func_context(self):
        """Ray Train's public hook around the training function on every worker (in place of
        TorchConfig's, which selects a CUDA device): ``startup/train_function.py``."""
        from ray_train_xla.startup.train_function import training_function

        return training_function

    def __getstate__(self) -> dict[str, Any]:
        """The config's state with when fit() handed it to Ray (``SUBMITTED_AT``): set in the
        pickled copy only (Ray pickles the config for its controller when fit() starts; the
        user's object is unchanged), kept by later pickles of that copy. The backend passes it
        to the workers: the run's goodput clock starts there."""
        import time

        state = dict(self.__dict__)
        state.pop("_memory_stores", None)  # the controller's handles of the memory stores
        state.setdefault(SUBMITTED_AT, time.time())
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)


@dataclass(kw_only=True)
class TorchXLAConfig(_RayHooks, XLAOptions, TorchConfig):
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
        env: extra environment variables for every worker. A variable the plan owns (ranks,
            world sizes, master address and port, PJRT, Neuron cores and root comm, TPU task
            and bounds, ``RAY_TRAIN_XLA_*``) is refused, naming the option that controls it; so
            is one a field given beside it also sets (``compile_cache``, ``efa=True``).
        efa: Neuron EFA variables: None (default) sets them only where the node has EFA
            devices, True always, False never.
        compile_cache: the compile cache, a directory every node shares: on Neuron
            ``NEURON_COMPILE_CACHE_URL`` (or an ``s3://`` URL; None keeps the Neuron default), on
            TPU torch_xla's persistent cache ``XLA_PERSISTENT_CACHE_PATH`` (a directory; None: one
            per host). What each takes: ``planning/options.py``, ``COMPILE_CACHES``.
        spmd: SPMD mode: one worker per host owns all of that host's devices, ``XLA_USE_SPMD=1``
            is set before torch_xla is imported, and the process group is ``gloo`` (through
            ``xla://``; the ``xla`` backend refuses SPMD). Shard with ``get_mesh()``.
        cpu_devices_per_worker: XLA CPU devices per worker (``CPU_NUM_DEVICES``), so SPMD can be
            developed on CPU; None means 1 (CPU only).
        tpu_process_bounds: ``TPU_PROCESS_BOUNDS`` (and ``TPU_HOST_BOUNDS``) as "x,y,z", for
            TPU slices not laid out as TPU v4 (v5e/v6e pods; v7 takes a fourth entry); None
            plans the v4 layout (hosts stacked along z). TPU only.
        compile_causes: have torch_xla analyse every compilation (``PT_XLA_DEBUG_LEVEL=1``,
            written to a file per worker, ``PT_XLA_DEBUG_FILE``) so that the recompilation
            warning names the cause, the graph and the line that cut it. Costs time at each
            compilation only (measured in docs/debugging.md).
        profile_steps: (start, count): every worker captures a profile of steps start ..
            start + count - 1 (counted from 1 by ``optimizer_step``, ``step_done`` or a plain
            ``optimizer.step()``, each step once) into the run's storage,
            ``profiles/<start>/rank-<r>/``; None (default) profiles nothing
            (see ``rtx.profile_steps`` and ``ray-train-xla profile`` for other ways).
        memory_every: the memory tier's cadence, in steps: ``rtx.keep_in_memory(state, step)``
            keeps the state of every step that is a multiple of it in host memory, on the
            worker's node and on a peer node, and after a failure ``rtx.load_checkpoint``
            restores from there when every shard survived (docs/sharded-models.md, "The memory
            tier"); None (default): no memory tier.
        peak_tflops: the peak dense TFLOP/s of one device that MFU is taken against
            (``rtx.configure_timeline(flops_per_step=...)``, ``ray-train-xla check``); a
            ``configure_timeline(peak_tflops=...)`` that differs raises. None (default): the
            device's published figure (the TPU's accelerator type, the Trainium instance type
            and its logical NeuronCore configuration), on CPU a matmul probe.

    ``backend`` and ``init_method`` (inherited from TorchConfig) are not options here: the
    process group follows from the device and ``spmd``; setting them is an error.
    """

    backend: str | None = field(default="xla", repr=False)
    init_method: str = field(default="env", repr=False)

    _backend = "XLABackend"
    _process_group = ("TorchXLAConfig chooses the process group from device and spmd (for "
                      "native TorchNeuron use ray_train_xla.TorchNeuronConfig)")


@dataclass(kw_only=True)
class TorchNeuronConfig(_RayHooks, NeuronOptions, TorchConfig):
    """Configure every Ray Train worker for native TorchNeuron (``torch-neuronx`` 2.13+, no XLA).

    Every argument is keyword-only:

    Args:
        device: "auto" (default), "neuron" or "cpu". "auto" picks "neuron" when workers are
            given ``neuron_cores``, else "cpu". "cpu" runs the same training function with
            ``gloo`` on CPU workers (development without Trainium; torch_xla not needed).
        timeout_s: seconds (at least 1) that process-group initialisation may wait for the
            other workers; also the timeout of process-group operations and of its shutdown.
        env: extra environment variables for every worker; a variable the plan owns is
            refused, naming what controls it.
        efa: EFA variables (``FI_PROVIDER=efa``, ...): None (default) sets them only where the
            node has EFA devices, True always, False never.
        compile_cache: ``TORCH_NEURONX_NEFF_CACHE_DIR``, a directory every node shares (FSx,
            NFS; no URL) so graphs compiled once are reused by every worker and later runs. None
            keeps the native default, ``/tmp/neff_cache``, which is per node.
        profile_steps, memory_every, peak_tflops: as for ``TorchXLAConfig``.

    Each worker uses one NeuronCore: request ``resources_per_worker={"neuron_cores": 1}``.
    ``backend`` and ``init_method`` (inherited from TorchConfig) are not options here.
    """

    backend: str | None = field(default="neuron", repr=False)
    init_method: str = field(default="env", repr=False)

    _backend = "NativeNeuronBackend"
    _process_group = ("TorchNeuronConfig uses the 'neuron' process group through env:// on "
                      "Neuron and 'gloo' on CPU")

    def __reduce__(self):
        # Unpickling this module imports torch, which autoloads torch-neuronx, which reads its
        # settings at import: a worker gets them in its environment first (startup/import_env.py).
        cls = type(self)
        return rebuild_config, (cls.__module__, cls.__qualname__, self.__getstate__(),
                                import_env(self))


@dataclass(kw_only=True)
class TorchTPUConfig(_RayHooks, TPUOptions, TorchConfig):
    """Configure every Ray Train worker for native TorchTPU (``torch-tpu`` 0.2+, no XLA): the
    ``tpu`` device and the ``tpu_dist`` process group, one TPU chip per worker.

    Every argument is keyword-only:

    Args:
        device: "auto" (default), "tpu" or "cpu". "auto" picks "tpu" when workers are given
            ``TPU`` chips, else "cpu". "cpu" runs the same training function with ``gloo`` on
            CPU workers (development without a TPU; torch-tpu not needed).
        timeout_s, env: as for ``TorchNeuronConfig``.
        compile_cache: ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT``, a directory every host
            shares or a ``gs://`` URL. None keeps TorchTPU's default.
        profile_steps, memory_every, peak_tflops: as for ``TorchXLAConfig``.

    Each worker uses one TPU chip: request ``resources_per_worker={"TPU": 1}`` and one worker
    per chip of the slice (or slices). Ranks follow TorchTPU's order of the slice's hosts, not
    Ray's: use ``ray_train_xla.rank()`` (or ``torch.distributed.get_rank()``) in the training
    function. ``backend`` and ``init_method`` (inherited from TorchConfig) are not options here.
    """

    backend: str | None = field(default="tpu_dist", repr=False)
    init_method: str = field(default="env", repr=False)

    _backend = "NativeTPUBackend"
    _process_group = ("TorchTPUConfig uses the 'tpu_dist' process group through env:// on TPU "
                      "and 'gloo' on CPU")


def _check_layout(num: Any, torch_config: Any) -> None:
    """The config's ``parallelism`` against the worker count (each end of a range; SPMD workers
    hold several devices each, whose count the driver does not know)."""
    from ray_train_xla.planning.layout import Parallelism

    if torch_config is None or getattr(torch_config, "spmd", False):
        return
    owner = type(torch_config).__name__
    wanted = Parallelism.of(getattr(torch_config, "parallelism", None), f"{owner}: parallelism")
    if wanted is None:
        return
    for count in (num if isinstance(num, tuple) else (num,)):
        wanted.resolve(count, f"{owner}(parallelism={wanted.to_dict()}) with "
                              f"ScalingConfig(num_workers={num})")


def check_scaling_config(scaling_config: Any, torch_config: Any = None) -> tuple[int, int]:
    """Check an elastic ``ScalingConfig`` against this package before ``fit()``; return its
    ``(min_workers, max_workers)`` (``(n, n)`` for a fixed size).

    Ray's ``Backend`` never sees the range (each worker-group start gets only the group Ray
    chose, which the backend plans afresh and checks), so what can be known from the range alone
    is checked here, in the driver:

    - a range on Ray Train V1 (``RAY_TRAIN_V2_ENABLED=0``) or with V1's ``ScalingConfig``: V1 has
      no elastic training (its ``fit()`` fails in its own validation with a ``TypeError``);
    - TPU (``use_tpu=True``): Ray counts whole slices. With torch_xla the range must stay
      within one slice (its PJRT TPU runtime has no multislice), so ``max_workers`` may not
      exceed the workers per slice; ``TorchTPUConfig`` runs multislice (Ray's ``ScalingConfig``
      itself requires whole slices at both ends);
    - SPMD on the CPU (``TorchXLAConfig(device="cpu", spmd=True)``): one worker only (torch_xla's
      CPU client has no collectives across processes), so no range can grow past 1;
    - TPU v7x (``accelerator_type`` ``TPU-V7X``/``tpu7x-...``/``v7x-...``), fixed or a range:
      ``TorchTPUConfig`` and ``TorchXLAConfig`` without SPMD run one worker per device (two per
      chip), so Ray must count TPU per device (``RAY_TPU_RESOURCE_PER_CHIP=2``, read here as
      Ray's ``get_tpu_worker_resources`` reads it, in the driver) with ``{'TPU': 1}`` per
      worker; slices are then counted in devices (a 2x2x4 slice: 32 workers);
    - the config's ``parallelism``: its sizes must make the worker count (each end of a range).
    """
    import os

    _check_v7x_count(scaling_config, torch_config)
    num = scaling_config.num_workers
    _check_layout(num, torch_config)
    if not isinstance(num, tuple):
        return (num, num)
    v2 = os.environ.get("RAY_TRAIN_V2_ENABLED", "1") != "0"  # Ray's own switch (2.60: V2 default)
    from ray.train.v2.api.config import ScalingConfig as V2ScalingConfig

    if not v2 or not isinstance(scaling_config, V2ScalingConfig):
        raise config_error(
            "num_workers", num,
            "an int on Ray Train V1: an elastic (min, max) range needs Ray Train V2 (Ray's "
            "default; unset RAY_TRAIN_V2_ENABLED=0) and ray.train.ScalingConfig",
            owner="ScalingConfig")
    low, high = scaling_config.min_workers, scaling_config.max_workers
    device = getattr(torch_config, "device", "auto")
    if device == "cpu" and getattr(torch_config, "spmd", False) and high > 1:
        raise config_error(
            "num_workers", num,
            "num_workers=1 with TorchXLAConfig(device='cpu', spmd=True): SPMD on the CPU is one "
            "worker whose mesh is its cpu_devices_per_worker devices (torch_xla's CPU client has "
            "no collectives across processes), so it cannot grow; an elastic CPU run is "
            "replicated (spmd=False)", owner="ScalingConfig")
    if scaling_config.use_tpu or device == "tpu":
        if not (scaling_config.topology and scaling_config.accelerator_type):
            raise config_error(
                "num_workers", num, "topology= and accelerator_type= with use_tpu=True, so that "
                "Ray counts whole TPU slices when it resizes", owner="ScalingConfig")
        from ray.util.tpu import get_tpu_worker_resources

        per_slice, _ = get_tpu_worker_resources(
            topology=scaling_config.topology, accelerator_type=scaling_config.accelerator_type,
            resources_per_worker=scaling_config.resources_per_worker, num_slices=1)
        # TorchTPU runs multislice; Ray's ScalingConfig itself requires whole slices at both
        # ends of the range (multiples of the workers per slice).
        if isinstance(torch_config, TorchTPUConfig):
            return (low, high)
        if high > per_slice:
            unit = ("devices" if _v7x(scaling_config) and not getattr(torch_config, "spmd", False)
                    else "workers")
            raise config_error(
                "num_workers", num,
                f"at most {per_slice} workers (one TPU slice of topology "
                f"{scaling_config.topology}, counted in {unit}): torch_xla's PJRT TPU runtime has "
                "no multislice, so "
                f"an elastic TPU run is one whole slice, num_workers=({per_slice}, {per_slice})",
                owner="ScalingConfig")
    return (low, high)


def _v7x(scaling_config: Any) -> bool:
    from ray_train_xla.planning.runtimes.tpu import devices_per_chip

    return bool(getattr(scaling_config, "use_tpu", False)) and devices_per_chip(
        getattr(scaling_config, "accelerator_type", None) or "") > 1


def _check_v7x_count(scaling_config: Any, torch_config: Any) -> None:
    """TPU v7x with one worker per device: Ray counting TPU per device, one each."""
    if not _v7x(scaling_config) or getattr(torch_config, "spmd", False) or not isinstance(
            torch_config, (TorchTPUConfig, TorchXLAConfig)):
        return
    from ray._private.accelerators.tpu import get_tpu_resource_per_chip

    from ray_train_xla.planning.runtimes.tpu import PER_DEVICE_SETTING

    owner = type(torch_config).__name__
    tpus = (scaling_config.resources_per_worker or {}).get("TPU")
    if get_tpu_resource_per_chip() == 1:
        raise config_error(
            "accelerator_type", scaling_config.accelerator_type,
            f"TPU resources counted per device with {owner}: each TPU v7x chip exposes 2 devices "
            "and each worker runs one, but Ray counts TPU per chip here (RAY_TPU_RESOURCE_PER_CHIP "
            f"unset), so a worker would hold a whole chip. Set {PER_DEVICE_SETTING} in the "
            "driver and on every TPU node, with resources_per_worker={'TPU': 1}"
            + (", or TorchXLAConfig(spmd=True) for one worker per host"
               if owner == "TorchXLAConfig" else ""), owner="ScalingConfig")
    if tpus != 1:
        raise config_error(
            "resources_per_worker", scaling_config.resources_per_worker,
            f"{{'TPU': 1}} with {owner} on TPU v7x: one worker per device (Ray counts "
            f"devices, {PER_DEVICE_SETTING}), got {tpus} per worker", owner="ScalingConfig")
