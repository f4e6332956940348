"""The runtime interface, and the torchrun contract that every runtime speaks.

A runtime plans a worker's environment in the driver (pure, no Ray, no torch_xla) and runs two
small hooks on the worker: ``prepare_worker`` after the environment is applied, and
``cleanup_worker`` at shutdown. Device modules (``cpu``, ``neuron``, ``tpu``) add their own
variables on top of :func:`torchrun_env`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ray_train_xla.errors import config_error
from ray_train_xla.topology import Topology, WorkerFacts, WorkerPlace

if TYPE_CHECKING:
    from ray_train_xla.options import XLAOptions

# Our own variables: how the worker-side helpers know what the backend chose.
DEVICE_VAR = "RAY_TRAIN_XLA_DEVICE"
RUNTIME_VAR = "RAY_TRAIN_XLA_RUNTIME"
PG_BACKEND_VAR = "RAY_TRAIN_XLA_PG_BACKEND"
INIT_METHOD_VAR = "RAY_TRAIN_XLA_INIT_METHOD"
TIMEOUT_VAR = "RAY_TRAIN_XLA_TIMEOUT_S"
# "1" when TorchXLAConfig.spmd: the backend calls xr.use_spmd() before the process group.
SPMD_VAR = "RAY_TRAIN_XLA_SPMD"
# "1" for several CPU workers (not SPMD): the backend installs the CPU development mode
# (ray_train_xla.worker.devmode) at process-group initialisation.
DEVMODE_VAR = "RAY_TRAIN_XLA_CPU_DEVMODE"
# Every worker drives one XLA device, xla:0 (Accelerate reads this, as Ray's TorchConfig sets it).
XLA_TORCH_DEVICE = "xla:0"
# torch_xla's own SPMD switch, read at ``import torch_xla`` (planned with SPMD_VAR).
XLA_SPMD_VAR = "XLA_USE_SPMD"


@dataclass(frozen=True)
class Rendezvous:
    """Where the workers meet: rank 0's address, ports taken there, and this run's id."""

    master_addr: str
    master_port: int
    run_id: str
    extra_ports: tuple[int, ...] = ()


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
        "TORCHELASTIC_RUN_ID": rdzv.run_id,
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        # No torchrun agent here: the xla:// handler must create its own TCPStore on rank 0.
        "TORCHELASTIC_USE_AGENT_STORE": "False",
    }


# SPMD: the ``xla`` backend asserts it is not in SPMD; a CPU process group through the xla://
# handler takes rank and world from PJRT (process_index, process_count), as torch_xla documents.
SPMD_PROCESS_GROUP = ("gloo", "xla://")


def check_spmd(config: XLAOptions, topology: Topology) -> None:
    """SPMD runs one process per host that owns all the host's devices: reject a node with
    several workers, naming it and the fix."""
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
        Subclasses that override it call ``super().check`` (it checks SPMD)."""
        check_spmd(config, topology)

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

    # ---- worker side ----
    def prepare_worker(self, options: Mapping[str, Any]) -> None:
        """Runs on each worker after its environment is applied, before the process group."""

    def cleanup_worker(self, options: Mapping[str, Any]) -> None:
        """Runs on each worker at shutdown, after the process group is destroyed."""
