"""The Ray Train backends: gather facts from the workers, plan every environment, apply it.

Each backend is a short story (``on_start``, ``on_training_start``, ``on_shutdown``) and keeps no
per-run state: everything a worker needs later travels in its planned environment (read there
as ``WorkerContext``), the one channel from the config to the workers. The work done on the
workers is in ``startup/`` (module-level functions sent with ``worker_group.execute``), each
bounded in time on the worker, so no driver-side wait can hang. Works with Ray Train V2
(default) and V1: only ``execute``/``execute_single`` are used.

Elastic runs (V2, ``ScalingConfig(num_workers=(min, max))``): Ray starts a new worker group at
every resize or restart and calls ``on_start`` for it; the group is planned afresh from its own
facts (ranks, world sizes, rank 0's address, new ports, a new run id, the device mapping, the
development mode's world), and a group the device cannot use is refused here, before any worker
is set up. The range itself never reaches a Backend: ``check_scaling_config`` checks it.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable, Sequence

import ray
from ray.exceptions import RayTaskError
from ray.train.backend import Backend

from ray_train_xla.errors import NeuronCompileError
from ray_train_xla.planning.contract import DEVICE_VAR, SUBMITTED_AT
from ray_train_xla.planning.options import XLAOptions
from ray_train_xla.planning.planner import Rendezvous, WorkerPlan, get_runtime, plan, resolve_device
from ray_train_xla.planning.topology import Topology, WorkerFacts
from ray_train_xla.startup.environment import apply_env
from ray_train_xla.startup.facts import gather_facts, gather_native_tpu_facts, reserve_ports
from ray_train_xla.startup.process_group import init_native_process_group, init_process_group
from ray_train_xla.startup.shutdown import shutdown_worker
from ray_train_xla.startup.worker_patches import install_worker_patches

logger = logging.getLogger(__name__)


class XLABackend(Backend):
    """Ray Train backend of the three configs (torch_xla, native TorchNeuron, native TorchTPU);
    selected by each config's ``backend_cls``."""

    share_cuda_visible_devices: bool = False
    # What every worker runs first (given timeout_s and the device option): report its facts.
    gather = staticmethod(gather_facts)
    # What every worker runs at training start: create the process group.
    init_group = staticmethod(init_process_group)

    def on_start(self, worker_group, backend_config: XLAOptions) -> None:
        started_at = time.time()  # this worker group's start: goodput's clock starts here
        backend_config.validate()  # again: a field may have been changed after construction
        facts: list[WorkerFacts] = worker_group.execute(
            self.gather, backend_config.timeout_s, backend_config.device)
        plans = plan_workers(
            facts, backend_config,
            lambda worker, count: worker_group.execute_single(worker, reserve_ports, count),
            started_at=started_at,
            run_started_at=getattr(backend_config, SUBMITTED_AT, 0.0),
        )
        env0 = plans[0].env
        logger.info(
            "ray_train_xla: device=%s runtime=%s workers=%d nodes=%d master=%s:%s",
            env0[DEVICE_VAR], backend_config.runtime, len(plans), len({p.place.node_id for p in plans}),
            env0["MASTER_ADDR"], env0["MASTER_PORT"],
        )
        if getattr(backend_config, "memory_every", None):
            plan_memory_tier(backend_config, facts, plans)
        worker_group.execute(apply_env, distribute(facts, plans))

    def on_training_start(self, worker_group, backend_config: XLAOptions) -> None:
        worker_group.execute(self.init_group)
        worker_group.execute(install_worker_patches)

    def on_shutdown(self, worker_group, backend_config: XLAOptions) -> None:
        try:
            worker_group.execute(shutdown_worker)
        except RayTaskError as exc:
            # Ray Train logs and drops worker errors raised at shutdown (they usually follow a
            # crash). A failed Neuron compile is the run's result, so it must fail the run.
            if isinstance(exc, NeuronCompileError) or isinstance(exc.cause, NeuronCompileError):
                raise NeuronCompileError(str(exc.cause)) from None
            raise


class NativeNeuronBackend(XLABackend):
    """Native TorchNeuron: XLABackend's gather -> plan -> apply steps (the plan comes from
    ``planning/runtimes/native_neuron.py``), then the ``neuron`` process group created after
    ``torch_neuronx`` is imported (or ``gloo`` on CPU). Selected by
    ``TorchNeuronConfig.backend_cls``."""

    init_group = staticmethod(init_native_process_group)


class NativeTPUBackend(XLABackend):
    """Native TorchTPU: the gather also learns each TPU host's place in its slice (topology,
    chip coordinates, worker id, slice name; ``startup/facts.py``) and a free port per worker;
    the plan comes from ``planning/runtimes/native_tpu.py``; then the ``tpu_dist`` process group
    after ``torch_tpu`` is loaded (or ``gloo`` on CPU). Selected by
    ``TorchTPUConfig.backend_cls``."""

    gather = staticmethod(gather_native_tpu_facts)
    init_group = staticmethod(init_native_process_group)


def plan_workers(
    facts: Sequence[WorkerFacts], config: XLAOptions, reserve: Callable[[int, int], Sequence[int]],
    started_at: float = 0.0, run_started_at: float = 0.0,
) -> list[WorkerPlan]:
    """The driver's planning step: resolve the device, derive the topology, check the config
    against it, take the ports it needs on the node of the process group's rank 0
    (``reserve(worker, count)``: Ray's rank 0 unless the runtime renumbers ranks, as native
    TorchTPU does), and plan every worker's environment (Ray's rank order)."""
    device = resolve_device(config.device, facts, config.runtime,
                            getattr(config, "native_device", "neuron"))
    runtime = get_runtime(device, config.runtime)
    topology = Topology.from_facts(facts, runtime.resource)
    runtime.check(config, topology)
    master = runtime.master_worker(topology)
    ports = reserve(master, 1 + runtime.ports_needed(config))
    rdzv = Rendezvous(
        master_addr=facts[master].node_ip,
        master_port=ports[0],
        extra_ports=tuple(ports[1:]),
        run_id=uuid.uuid4().hex,  # fresh for every fit() and every restart
        started_at=started_at,
        run_started_at=run_started_at,
    )
    return plan(topology, config, rdzv, device, facts)


def plan_memory_tier(config, facts: Sequence[WorkerFacts], plans: Sequence[WorkerPlan]) -> None:
    """Start (or find) a memory store on every node of this group and tell the workers where
    they are (``toolkit/checkpoint/memory/``; the store's module loads no torch). The tier is
    one per ``fit()``: its id lives on the config object, which Ray Train's controller keeps
    across worker groups, and the stores it starts live as long as the controller (they end
    with the run)."""
    from ray_train_xla.planning.contract import MEMORY_NODES_VAR, MEMORY_TIER_VAR
    from ray_train_xla.toolkit.checkpoint.memory.store import start_stores

    tier = getattr(config, "_memory_tier_id", None)
    if tier is None:
        tier = uuid.uuid4().hex[:12]
        object.__setattr__(config, "_memory_tier_id", tier)
        object.__setattr__(config, "_memory_stores", {})  # their handles: they live with it
    nodes = sorted({f.node_id for f in facts})
    start_stores(tier, nodes, config.timeout_s, config._memory_stores)
    if len(nodes) == 1:
        logger.warning("ray_train_xla: memory tier on one node: no peer holds a copy, so a lost "
                       "node means a restore from storage")
    for p in plans:
        p.env[MEMORY_TIER_VAR] = tier
        p.env[MEMORY_NODES_VAR] = ",".join(nodes)


# How the driver puts objects into Ray's store (a benchmark counts the bytes through it).
put = ray.put


def distribute(facts: Sequence[WorkerFacts], plans: Sequence[WorkerPlan]):
    """One object per node holding only that node's environments, and a small index (node id ->
    that object) that every worker receives: a node fetches the index and its own workers'
    environments, so what it downloads grows with its workers, not with the world."""
    by_node: dict[str, dict[str, dict[str, str]]] = {}  # node id -> {worker key -> environment}
    for f, p in zip(facts, plans):
        by_node.setdefault(f.node_id, {})[f.key] = p.env
    return put({node: put(envs) for node, envs in by_node.items()})
