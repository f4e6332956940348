"""AWS Neuron (Trainium, Inferentia2): PJRT (torch-neuronx 2.x) and legacy XRT (1.x).

torch_xla configures Neuron **at ``import torch_xla``** (``_aws_ec2_inf_trn_init`` ->
``torch_xla._internal.neuron.configure_pjrt_environment``), so everything below must be on the
worker before its first import. Variables planned here, per worker:

- ``PJRT_DEVICE=NEURON``.
- ``NEURON_RT_VISIBLE_CORES``: the node-local list of this trainer's NeuronCores, ordered by
  local rank. Ray gives each worker its own core and Train V2 does not share them across a
  node's workers; torch_xla's ``remap_visible_cores`` needs exactly ``LOCAL_WORLD_SIZE`` entries
  and keeps ``cores[LOCAL_RANK]``, which is then the core Ray assigned this worker.
- ``NEURON_RT_ROOT_COMM_ID``: rank 0's address and a second free port taken there, never
  torch_xla's fixed default 62182 (two jobs on one host would collide; ray#65070).
- ``NEURON_PJRT_WORLD_SIZE``, ``PJRT_LOCAL_PROCESS_COUNT``, ``NEURON_PJRT_PROCESS_INDEX``,
  ``PJRT_LOCAL_PROCESS_RANK``: what ``configure_pjrt_environment`` derives from the torchrun
  contract, set up front so torch-neuronx's own init (which may replace torch_xla's) agrees.
  ``NEURON_PJRT_WORLD_SIZE`` keeps the env O(1) per worker (no per-process device list).
- ``FI_PROVIDER=efa``, ``FI_EFA_USE_DEVICE_RDMA=1``, ``FI_EFA_FORK_SAFE=1``: only where the node
  has EFA devices (detected on the worker) or ``efa=True``.
- ``CCOM_SOCKET_IFNAME``, ``NCCL_SOCKET_IFNAME``: the interface carrying the node's Ray IP
  (detected on the worker), unless the worker already had them set.
- ``NEURON_COMPILE_CACHE_URL``: from ``compile_cache``.
- ``NEURON_EXTRACT_GRAPHS_ONLY``, ``NEURON_PARALLEL_COMPILE``, ``NEURON_FALL_BACK_TO_NULL_NEFF``:
  with ``neuron_parallel_compile=True`` (see ``startup/neuron_compile.py``).

SPMD (``spmd=True``): one worker per node owning all of the node's cores it was given;
``NEURON_RT_VISIBLE_CORES`` is that list and ``NEURON_PJRT_PROCESSES_NUM_DEVICES`` the core count
of every process (O(nodes), one process per node).

One NeuronCore per worker otherwise: under torchrun-style launch torch_xla's init always narrows a process
to ``cores[LOCAL_RANK]`` (``neuron_utils.remap_visible_cores``), so a worker given several cores
would use one and strand the rest. ``check`` rejects that, naming the fix.
"""

from __future__ import annotations

import logging

from ray_train_xla.errors import Term, XLAConfigError
from ray_train_xla.planning.contract import (
    EFA_ENV,
    NEURON_ROOT_COMM_VAR,
    NEURON_VISIBLE_CORES_VAR,
    PARALLEL_COMPILE_ENV,
    PARALLEL_COMPILE_VAR,
)
from ray_train_xla.planning.runtimes.base import Runtime, check_one_accelerator_each

logger = logging.getLogger(__name__)

NEURON_RESOURCE = "neuron_cores"
INTERFACE_VARS = ("CCOM_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def root_comm_id(master_addr: str, port: int) -> str:
    """``NEURON_RT_ROOT_COMM_ID``: ``host:port``, an IPv6 host in brackets."""
    host = f"[{master_addr.strip('[]')}]" if ":" in master_addr else master_addr
    return f"{host}:{port}"


class NeuronRuntime(Runtime):
    name = "neuron"
    pjrt_device = "NEURON"
    resource = NEURON_RESOURCE
    env_read_at_import = True

    # ---- driver side ----
    def check(self, config, topology) -> None:
        super().check(config, topology)  # SPMD: one worker per node
        # In SPMD a worker owns all of its node's cores; otherwise one core per worker.
        if not config.spmd or 0 in {len(w.accelerator_ids) for w in topology.workers}:
            check_one_accelerator_each(
                topology, "TorchXLAConfig", "neuron", "neuron_cores", "core", NEURON_RESOURCE,
                "torch_xla's Neuron runtime drives exactly one NeuronCore per process (it "
                "narrows NEURON_RT_VISIBLE_CORES to cores[LOCAL_RANK]), so the other cores "
                "would sit idle", logger)

    def ports_needed(self, config) -> int:
        return 1  # NEURON_RT_ROOT_COMM_ID

    def _cores_for_node(self, topology, node_rank: int) -> str:
        """This trainer's cores on one node, ordered by local rank (local ranks if Ray
        assigned none); computed once per node, so planning stays linear in the workers."""
        cached = getattr(self, "_node_cores", None)
        if cached is None or cached[0] is not topology:
            cached = (topology, [
                ",".join(i[0] if i else str(local) for local, i in enumerate(ids))
                for ids in topology.node_accelerator_ids])
            self._node_cores = cached
        return cached[1][node_rank]

    def device_env(self, place, topology, rdzv, config, facts) -> dict[str, str]:
        env = (self._spmd_env if config.spmd else self._per_core_env)(place, topology, rdzv)
        return {**env, **node_env(config, facts)}

    def _spmd_env(self, place, topology, rdzv) -> dict[str, str]:
        """SPMD: one process per node owning the node's cores. torch_xla's init skips its
        torchrun mapping under SPMD; torch-neuronx wants the per-process core counts."""
        return {
            "PJRT_DEVICE": "NEURON",
            NEURON_VISIBLE_CORES_VAR: ",".join(place.accelerator_ids),
            NEURON_ROOT_COMM_VAR: root_comm_id(rdzv.master_addr, rdzv.extra_ports[0]),
            "NEURON_PJRT_PROCESSES_NUM_DEVICES": ",".join(
                str(len(w.accelerator_ids)) for w in topology.workers),
            "NEURON_PJRT_PROCESS_INDEX": str(place.rank),
        }

    def _per_core_env(self, place, topology, rdzv) -> dict[str, str]:
        return {
            "PJRT_DEVICE": "NEURON",
            NEURON_VISIBLE_CORES_VAR: self._cores_for_node(topology, place.node_rank),
            NEURON_ROOT_COMM_VAR: root_comm_id(rdzv.master_addr, rdzv.extra_ports[0]),
            "NEURON_PJRT_WORLD_SIZE": str(topology.world_size),
            "PJRT_LOCAL_PROCESS_COUNT": str(place.local_world_size),
            "NEURON_PJRT_PROCESS_INDEX": str(place.rank),
            "PJRT_LOCAL_PROCESS_RANK": str(place.local_rank),
        }


def node_env(config, facts) -> dict[str, str]:
    """What PJRT and XRT workers share: EFA and socket-interface variables from what the node
    reported, the compile cache, and the graph-extraction switches."""
    env = network_env(config, facts)
    if config.compile_cache:
        env["NEURON_COMPILE_CACHE_URL"] = config.compile_cache
    if config.neuron_parallel_compile:
        env.update(PARALLEL_COMPILE_ENV)
        env[PARALLEL_COMPILE_VAR] = "1"
    return env


def network_env(config, facts) -> dict[str, str]:
    """EFA and socket-interface variables from what the node reported (every Neuron runtime)."""
    env: dict[str, str] = {}
    has_efa = facts.has_efa if facts is not None else False
    if config.efa is True or (config.efa is None and has_efa):
        env.update(EFA_ENV)
    if facts is not None and facts.network_interface:
        for var in INTERFACE_VARS:
            if not facts.preset_env.get(var):
                env[var] = facts.network_interface
    return env


class NeuronXRTRuntime(NeuronRuntime):
    """Legacy torch-neuronx 1.x (XRT). torch_xla's ``xla`` process group starts the XRT server
    on local rank 0 when ``TORCHELASTIC_RUN_ID`` is set (``init_xrt_context``); it reads the
    torchrun contract (with ``GROUP_RANK``) and sets its own ``XRT_*`` variables. We add the
    node-local core list, EFA where present, and Ray's two XRT-era settings."""

    name = "neuron-xrt"
    pjrt_device = ""

    def check(self, config, topology) -> None:
        super().check(config, topology)
        # init_xrt_context counts nodes as WORLD_SIZE // LOCAL_WORLD_SIZE (one XRT config entry
        # per node): with uneven nodes it would miscount them and wait for a node that is not there.
        sizes = [len(node) for node in topology.nodes()]
        if len(set(sizes)) > 1:
            raise XLAConfigError(
                Term("runtime='xrt'", "--runtime xrt"), " needs the same number of workers on "
                "every node (torch_xla's XRT init counts nodes as WORLD_SIZE // "
                f"LOCAL_WORLD_SIZE), got {sizes} per node: use ",
                Term("the same neuron_cores on every node", "one --workers-per-node count"),
                ", or ", Term("runtime='pjrt'", "--runtime pjrt"), ".")

    def ports_needed(self, config) -> int:
        return 0  # XRT takes its own root-comm port through the store

    def process_group(self, topology, config) -> tuple[str, str]:
        return "xla", "env://"

    def device_env(self, place, topology, rdzv, config, facts) -> dict[str, str]:
        return {
            NEURON_VISIBLE_CORES_VAR: self._cores_for_node(topology, place.node_rank),
            "XLA_TRANSFER_SEED_ASYNC": "1",
            "NCCL_ASYNC_ERROR_HANDLING": "1",
            **node_env(config, facts),
        }
