"""The runtime interface, and the torchrun contract that every runtime speaks.

A runtime plans a worker's environment in the driver (pure, no Ray, no torch_xla). Device
modules (``cpu``, ``neuron``, ``native_neuron``, ``tpu``) add their own variables on top of
:func:`torchrun_env`. What a runtime does on the worker itself (XRT servers, Neuron's parallel
compile, native checks) lives in ``startup/runtime_steps.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ray_train_xla.errors import XLAConfigError, config_error
from ray_train_xla.planning.contract import RUN_ID_VAR, SPMD_PROCESS_GROUP, XLA_TORCH_DEVICE
from ray_train_xla.planning.topology import Topology, WorkerFacts, WorkerPlace

if TYPE_CHECKING:
    from ray_train_xla.planning.options import XLAOptions

@dataclass(frozen=True)
class Rendezvous:
    """Where the workers meet: rank 0's address, ports taken there, and this run's id."""

    master_addr: str
    master_port: int
    run_id: str
    extra_ports: tuple[int, ...] = ()
    started_at: float = 0.0  # when the driver started this worker group (Unix seconds); 0: unknown
    run_started_at: float = 0.0  # when fit() handed the config to Ray (Unix seconds); 0: unknown


def torchrun_env(place: WorkerPlace, topology: Topology, rdzv: Rendezvous) -> dict[str, str]:
    """The variables torchrun (``torch/distributed/run.py``) gives each worker; every runtime
    reads these. ``TORCHELASTIC_RUN_ID`` makes torch_xla treat the process as torchrun-launched
    (``dist.is_torchelastic_launched``), which the ``xla://`` handler and Neuron's init need.
    ``NODE_RANK`` and ``ACCELERATE_TORCH_DEVICE`` are what Ray's ``TorchConfig`` adds
    (``ray/train/torch/config.py``, ``_set_torch_distributed_env_vars``)."""
    world = str(topology.world_size)
    return {
        "RANK": str(place.rank),
        "LOCAL_RANK": str(place.local_rank),
        "WORLD_SIZE": world,
        "LOCAL_WORLD_SIZE": str(place.local_world_size),
        "GROUP_RANK": str(place.node_rank),
        "NODE_RANK": str(place.node_rank),
        "ACCELERATE_TORCH_DEVICE": XLA_TORCH_DEVICE,
        "GROUP_WORLD_SIZE": str(topology.num_nodes),
        "ROLE_NAME": "default",
        "ROLE_RANK": str(place.rank),
        "ROLE_WORLD_SIZE": world,
        "MASTER_ADDR": rdzv.master_addr,
        "MASTER_PORT": str(rdzv.master_port),
        RUN_ID_VAR: rdzv.run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # No torchrun agent here: the xla:// handler must create its own TCPStore on rank 0.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


def check_one_accelerator_each(topology: Topology, owner: str, device: str, units: str, unit: str,
                               fix: str, why: str, logger) -> None:
    """The native runtimes drive one accelerator (``unit``) per process: every worker given one
    (``fix`` asks for it), or none at all (a warning: each worker then takes the one numbered by
    its local rank); a mix, or several per worker, is refused."""
    counts = {len(w.accelerator_ids) for w in topology.workers}
    if counts == {0}:
        logger.warning(
            "%s(device='%s') but Ray assigned no %s: each worker will use the %s numbered by its "
            "local rank. Request %s so Ray keeps jobs apart.", owner, device, units, unit, fix)
    elif 0 in counts:
        bare = [w.rank for w in topology.workers if not w.accelerator_ids][:8]
        raise XLAConfigError(f"{owner}: workers {bare} were given no {units} while others were: "
                             f"request {fix} for every worker.")
    elif counts != {1}:
        many = max(counts)
        raise XLAConfigError(
            f"{owner}: resources_per_worker asks for {many} {units} per worker, but {why}. Use "
            f"{fix} and num_workers={topology.world_size * many} instead.")


class Runtime:
    """One device runtime. Subclasses override what differs; defaults suit a plain PJRT device."""

    name: str = ""
    pjrt_device: str = ""
    # The Ray resource whose ids this runtime maps to devices ("neuron_cores", "TPU"), if any.
    resource: str | None = None
    # True where torch_xla reads the environment at import (Neuron): it must not be imported
    # on a worker before the backend applies the plan.
    env_read_at_import: bool = False

    # ---- driver side (pure) ----
    def check(self, config: XLAOptions, topology: Topology) -> None:
        """Raise XLAConfigError for a config that cannot work on this topology.
        Subclasses that override it call ``super().check``: SPMD runs one process per host that
        owns all the host's devices, so a node with several workers is refused."""
        if not config.spmd:
            return
        for node in topology.nodes():
            if len(node) > 1:
                raise config_error(
                    "spmd", True,
                    f"one worker per node, but node {node[0].node_rank} ({node[0].node_ip}) has "
                    f"{len(node)} workers: give each worker all of its node's devices (for example "
                    "ScalingConfig(num_workers=<nodes>, resources_per_worker={<device resource>: "
                    "<devices per node>})) or set spmd=False")

    def master_worker(self, topology: Topology) -> int:
        """The Ray rank of the worker that will be rank 0 of the process group: MASTER_ADDR is
        its node, and the ports are taken there. Ray's rank 0 unless the runtime renumbers."""
        return 0

    def ports_needed(self, config: XLAOptions) -> int:
        """Free ports to take on rank 0's node beyond MASTER_PORT."""
        return 0

    def process_group(self, topology: Topology, config: XLAOptions) -> tuple[str, str]:
        """(backend, init_method) for ``torch.distributed.init_process_group``."""
        if config.spmd:
            return SPMD_PROCESS_GROUP
        return "xla", "xla://"

    def device_env(
        self,
        place: WorkerPlace,
        topology: Topology,
        rdzv: Rendezvous,
        config: XLAOptions,
        facts: WorkerFacts | None,
    ) -> dict[str, str]:
        """This runtime's own variables for one worker."""
        return {"PJRT_DEVICE": self.pjrt_device}
