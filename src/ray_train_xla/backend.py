"""The Ray Train backend: gather facts from the workers, plan every environment, apply it.

The backend itself is a short story (``on_start``, ``on_training_start``, ``on_shutdown``) and
keeps no per-run state: what a worker needs later travels in its environment
(``RAY_TRAIN_XLA_*``). The work done on workers is the small module-level functions below, sent
with ``worker_group.execute``; each one is bounded in time on the worker, so no driver-side wait
can hang. Works with Ray Train V2 (default) and V1: only ``execute``/``execute_single`` are used.
"""

from __future__ import annotations

import logging
import os
import re
import socket
import sys
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import ray
from ray.exceptions import RayTaskError
from ray.train.backend import Backend

from ray_train_xla import _netinfo, rendezvous_store
from ray_train_xla.errors import (
    NeuronCompileError,
    RendezvousTimeoutError,
    WorkerSetupError,
    XLAInitError,
)
from ray_train_xla.neuron_options import NATIVE
from ray_train_xla.options import XLAOptions
from ray_train_xla.runtimes import Rendezvous, WorkerPlan, get_runtime, plan, resolve_device
from ray_train_xla.runtimes.base import (
    DEVICE_VAR,
    DEVMODE_VAR,
    INIT_METHOD_VAR,
    PG_BACKEND_VAR,
    RUNTIME_VAR,
    SPMD_VAR,
    TIMEOUT_VAR,
)
from ray_train_xla.topology import PRESET_VARS, Topology, WorkerFacts

logger = logging.getLogger(__name__)


class XLABackend(Backend):
    """Ray Train backend for PyTorch/XLA; selected by ``TorchXLAConfig.backend_cls``."""

    share_cuda_visible_devices: bool = False

    def on_start(self, worker_group, backend_config: XLAOptions) -> None:
        backend_config.validate()  # again: a field may have been changed after construction
        facts: list[WorkerFacts] = worker_group.execute(gather_facts)
        plans = plan_workers(
            facts, backend_config,
            lambda count: worker_group.execute_single(0, reserve_ports, count),
        )
        env0 = plans[0].env
        logger.info(
            "ray_train_xla: device=%s runtime=%s workers=%d nodes=%d master=%s:%s",
            env0[DEVICE_VAR], backend_config.runtime, len(plans), len({p.place.node_id for p in plans}),
            env0["MASTER_ADDR"], env0["MASTER_PORT"],
        )
        worker_group.execute(apply_env, distribute(facts, plans), runtime_options(backend_config))

    def on_training_start(self, worker_group, backend_config: XLAOptions) -> None:
        worker_group.execute(init_process_group)

    def on_shutdown(self, worker_group, backend_config: XLAOptions) -> None:
        try:
            worker_group.execute(
                shutdown_worker, runtime_options(backend_config), float(backend_config.timeout_s)
            )
        except RayTaskError as exc:
            # Ray Train logs and drops worker errors raised at shutdown (they usually follow a
            # crash). A failed Neuron compile is the run's result, so it must fail the run.
            if isinstance(exc, NeuronCompileError) or isinstance(exc.cause, NeuronCompileError):
                raise NeuronCompileError(str(exc.cause)) from None
            raise


def plan_workers(
    facts: Sequence[WorkerFacts], config: XLAOptions, reserve: Callable[[int], Sequence[int]]
) -> list[WorkerPlan]:
    """The driver's planning step: resolve the device, derive the topology, check the config
    against it, take the ports it needs on rank 0's node (``reserve(count)``), and plan every
    worker's environment (rank order)."""
    device = resolve_device(config.device, facts, config.runtime)
    runtime = get_runtime(device, config.runtime)
    topology = Topology.from_facts(facts, runtime.resource)
    runtime.check(config, topology)
    ports = reserve(1 + runtime.ports_needed(config))
    rdzv = Rendezvous(
        master_addr=facts[0].node_ip,
        master_port=ports[0],
        extra_ports=tuple(ports[1:]),
        run_id=uuid.uuid4().hex,  # fresh for every fit() and every restart
    )
    return plan(topology, config, rdzv, device, facts)


def envs_by_node(facts: Sequence[WorkerFacts], plans: Sequence[WorkerPlan]) -> dict[str, dict]:
    """Node id -> {worker key -> environment} for the workers on that node."""
    out: dict[str, dict[str, dict[str, str]]] = {}
    for f, p in zip(facts, plans):
        out.setdefault(f.node_id, {})[f.key] = p.env
    return out


# How the driver puts objects into Ray's store (a benchmark counts the bytes through it).
_put = ray.put


def distribute(facts: Sequence[WorkerFacts], plans: Sequence[WorkerPlan]):
    """One object per node holding only that node's environments, and a small index (node id ->
    that object) that every worker receives: a node fetches the index and its own workers'
    environments, so what it downloads grows with its workers, not with the world."""
    return _put({node: _put(envs) for node, envs in envs_by_node(facts, plans).items()})


def runtime_options(config: XLAOptions) -> dict[str, Any]:
    """The config options the worker-side runtime hooks need (plain data, cheap to send)."""
    return config.to_dict()


# ---------------------------------------------------------------------------------------------
# Functions run on the workers.
# ---------------------------------------------------------------------------------------------


def _who() -> str:
    rank = os.environ.get("RANK", "?")
    return (
        f"worker rank {rank} (local rank {os.environ.get('LOCAL_RANK', '?')}, "
        f"node {ray.util.get_node_ip_address()}, pid {os.getpid()})"
    )


def gather_facts() -> WorkerFacts:
    """Report where this worker runs and what Ray gave it."""
    ctx = ray.get_runtime_context()
    ip = ray.util.get_node_ip_address()
    accelerators = {
        name: tuple(str(i) for i in ids)
        for name, ids in ctx.get_accelerator_ids().items()
        if ids
    }
    tpu_worker_id, tpu_name = _tpu_host_identity() if accelerators.get("TPU") else (None, "")
    return WorkerFacts(
        node_id=ctx.get_node_id(),
        node_ip=ip,
        pid=os.getpid(),
        hostname=socket.gethostname(),
        accelerator_ids=accelerators,
        pjrt_device=os.environ.get("PJRT_DEVICE", ""),
        has_efa=_netinfo.has_efa(),
        network_interface=_netinfo.interface_for_ip(ip) or "",
        preset_env={k: os.environ[k] for k in PRESET_VARS if os.environ.get(k)},
        tpu_worker_id=tpu_worker_id,
        tpu_name=tpu_name,
    )


TPU_METADATA_TIMEOUT_S = 10.0


def _tpu_host_identity() -> tuple[int | None, str]:
    """This TPU host's worker id and slice name, read the way Ray reads them (GKE variables,
    else the GCE metadata server), so hosts can be ordered as torch_xla numbers them."""
    from ray._private.accelerators.tpu import TPUAcceleratorManager

    found: list = []

    def read() -> None:
        found.append((TPUAcceleratorManager.get_current_node_tpu_worker_id(),
                      TPUAcceleratorManager.get_current_node_tpu_name() or ""))

    # Ray's metadata requests have no timeout; off GCE and GKE they must not hold up the start.
    thread = threading.Thread(target=read, name="ray_train_xla-tpu-metadata", daemon=True)
    thread.start()
    thread.join(TPU_METADATA_TIMEOUT_S)
    if not found:
        logger.warning("%s: no TPU worker id within %.0f s (TPU_WORKER_ID or GCE metadata); "
                       "hosts are ordered as Ray orders nodes", _who(), TPU_METADATA_TIMEOUT_S)
        return None, ""
    return found[0]


def reserve_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on this node."""
    return _netinfo.free_ports(count, ipv6=":" in ray.util.get_node_ip_address())


def apply_env(index: Mapping[str, Any], options: Mapping[str, Any]) -> None:
    """Fetch this node's environments (see ``distribute``), set this worker's, then run the
    runtime's worker preparation."""
    node = ray.get_runtime_context().get_node_id()
    envs = ray.get(index[node]) if node in index else {}
    env = envs.get(f"{node}/{os.getpid()}")
    if env is None:
        raise WorkerSetupError(f"pid {os.getpid()}: no environment was planned for this worker")
    runtime = get_runtime(env[DEVICE_VAR], env[RUNTIME_VAR])
    if runtime.env_read_at_import and "torch_xla" in sys.modules:
        raise WorkerSetupError(
            f"worker rank {env['RANK']} (pid {os.getpid()}): torch_xla was imported before "
            f"ray_train_xla set the {runtime.name} environment, so torch_xla would ignore it. "
            "Import torch_xla inside the training function, not in a worker setup hook or at "
            "the top of a module Ray imports when the worker starts."
        )
    os.environ.update(env)
    runtime.prepare_worker(options)


def init_process_group() -> None:
    """Initialise torch.distributed as planned, bounded by the configured timeout.

    Three steps, each reported as what it is when it fails: torch_xla's initialisation
    (``import torch_xla``, which reads the planned environment, and SPMD), the rendezvous on a
    store we own (bounded by ``timeout_s``, naming ranks that did not arrive), and the process
    group itself."""
    import torch.distributed as dist

    backend = os.environ[PG_BACKEND_VAR]
    init_method = os.environ[INIT_METHOD_VAR]
    timeout = timedelta(seconds=float(os.environ[TIMEOUT_VAR]))
    if dist.is_initialized():
        return
    xla_pg = backend == "xla" or init_method == "xla://"
    devmode = os.environ.get(DEVMODE_VAR) == "1"
    try:
        if xla_pg or os.environ.get(SPMD_VAR) == "1":
            _init_torch_xla(xla_pg)
    except Exception as exc:
        raise XLAInitError(f"{_who()}: {describe_xla_init_error(exc)}") from exc
    try:
        store = rendezvous_store.join(timeout)
    except RendezvousTimeoutError as exc:
        raise RendezvousTimeoutError(f"{_who()}: {exc}") from exc.__cause__
    try:
        if devmode:
            from ray_train_xla.worker import devmode as cpu_devmode

            cpu_devmode.register_backend()
        if init_method == "xla://" and rendezvous_store.install_for_xla_handler(store):
            dist.init_process_group(backend, init_method=init_method, timeout=timeout)
        else:
            dist.init_process_group(backend, store=store, rank=int(os.environ["RANK"]),
                                    world_size=int(os.environ["WORLD_SIZE"]), timeout=timeout)
    except Exception as exc:
        raise WorkerSetupError(
            f"{_who()}: every rank arrived at the rendezvous, then init_process_group("
            f"{backend!r}, init_method={init_method!r}) failed within timeout_s="
            f"{timeout.total_seconds():g}: {type(exc).__name__}: {exc}. If another worker failed "
            "first, its error is the cause."
        ) from exc
    if devmode:
        cpu_devmode.install(dist.get_rank(), dist.get_world_size())
    if os.environ.get(RUNTIME_VAR) != NATIVE:  # native TorchNeuron points Ray at its own device
        from ray_train_xla.worker import ray_compat

        ray_compat.install()


def _init_torch_xla(xla_pg: bool) -> None:
    """Import torch_xla (it reads the planned environment now), enable SPMD where planned, and
    register the ``xla`` backend and ``xla://`` handler."""
    import torch_xla  # noqa: F401

    if os.environ.get(SPMD_VAR) == "1":
        import warnings

        import torch_xla.runtime as xr

        # The plan sets XLA_USE_SPMD (read at import); use_spmd() still does what the running
        # device needs (Neuron re-initialises for SPMD) and only warns that the variable is set.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="XLA_USE_SPMD is being deprecated")
            xr.use_spmd()
    if xla_pg:
        import torch_xla.distributed.xla_backend  # noqa: F401


_VAR_NAME = re.compile(r"\b[A-Z][A-Z0-9]*_[A-Z0-9_]+\b")


def describe_xla_init_error(exc: BaseException) -> str:
    """Say that torch_xla's initialisation rejected this worker's environment, with the value of
    every variable the error names (the one at fault is among them)."""
    text = f"{type(exc).__name__}: {exc}"
    if isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] == "torch_xla":
        return f"torch_xla cannot be imported on this worker ({text}): install torch-xla there."
    named = list(dict.fromkeys(_VAR_NAME.findall(str(exc))))
    values = ", ".join(f"{k}={os.environ[k]!r}" if k in os.environ else f"{k} unset"
                       for k in named)
    where = f" Variables it names, as this worker has them: {values}." if values else ""
    return (
        f"torch_xla's initialisation failed (import torch_xla / SPMD set-up, before any "
        f"rendezvous): {text}.{where} They come from the plan (see `ray-train-xla plan`) or "
        "from TorchXLAConfig.env; a variable set before ray_train_xla applied the plan (or "
        "torch_xla imported too early) also ends here."
    )


def shutdown_worker(options: Mapping[str, Any], timeout_s: float) -> None:
    """Destroy the process group (bounded by ``timeout_s``: a dead peer must not hang it), then
    run the runtime's clean-up (stopping XRT servers, or the Neuron parallel compile, which runs
    to completion: it is the point of a precompile run)."""

    def destroy() -> None:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                dist.destroy_process_group()
        except Exception as exc:
            logger.warning("%s: destroy_process_group failed: %s", _who(), exc)

    thread = threading.Thread(target=destroy, name="ray_train_xla-shutdown", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        logger.warning("%s: destroy_process_group did not finish within %.0f s; leaving it",
                       _who(), timeout_s)
    if "ray_train_xla.worker.ray_compat" in sys.modules:
        from ray_train_xla.worker import devmode, ray_compat

        ray_compat.uninstall()
        devmode.uninstall()
    device, kind = os.environ.get(DEVICE_VAR), os.environ.get(RUNTIME_VAR)
    if device and kind:
        get_runtime(device, kind).cleanup_worker(options)
