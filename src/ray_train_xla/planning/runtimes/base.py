"""The runtime interface, and the torchrun contract that every runtime speaks.

A runtime plans a worker's environment in the driver (pure, no Ray, no torch_xla). Device
modules (``cpu``, ``neuron``, ``native_neuron``, ``tpu``) add their own variables on top of
:func:`torchrun_env`. What a runtime does on the worker itself (XRT servers, Neuron's parallel
compile, native checks) lives in ``startup/runtime_steps.py``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ray_train_xla.errors import Term, XLAConfigError
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


# ---- the words of a fix: ScalingConfig's in the API, plan's flags in ``ray-train-xla plan`` ----

SPMD = Term("spmd=True", "--spmd")


def per_worker(count: int | str, resource: str) -> Term:
    """Accelerators per worker: ``resources_per_worker={'TPU': 2}`` / ``--accelerators-per-worker 2``."""
    return Term(f"resources_per_worker={{{resource!r}: {count}}}",
                f"--accelerators-per-worker {count}")


def job(per_host: list[int], each: int, resource: str, reserve: str = "") -> Term:
    """A worker group of ``per_host[n]`` workers on host n, each given ``each`` accelerators:
    ``ScalingConfig(num_workers=..., resources_per_worker=...)`` (``reserve``: more of its
    arguments) / ``--nodes H --workers-per-node W [--accelerators-per-worker K]``."""
    api = (f"ScalingConfig(num_workers={sum(per_host)}, resources_per_worker={{{resource!r}: "
           f"{each}}}{', ' + reserve if reserve else ''})")
    flags = (f"--nodes {len(per_host)} --workers-per-node {per_host[0]}"
             if len(set(per_host)) == 1 else f"--workers-per-node {','.join(map(str, per_host))}")
    return Term(api, flags + (f" --accelerators-per-worker {each}" if each != 1 else ""))


def workers_per_host(counts: list[int]) -> Term:
    """The workers of each host: the worker group's / ``--workers-per-node``."""
    shown = counts if len(counts) <= 8 else [*counts[:8], "..."]
    return Term(f"the worker group ({', '.join(map(str, shown))} workers per host)",
                f"--workers-per-node {','.join(map(str, counts))}")


def device(owner: str, name: str) -> Term:
    """The config and device: ``TorchTPUConfig(device='tpu')`` / ``--device tpu --runtime native``."""
    native = "" if owner == "TorchXLAConfig" else " --runtime native"
    return Term(f"{owner}(device={name!r})", f"--device {name}{native}")


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


def check_one_accelerator_each(topology: Topology, owner: str, name: str, units: str, unit: str,
                               resource: str, why: str, logger) -> None:
    """The native runtimes drive one accelerator (``unit``) per process: every worker given one
    of ``resource``, or none at all (a warning: each worker then takes the one numbered by its
    local rank); a mix, or several per worker, is refused."""
    counts = {len(w.accelerator_ids) for w in topology.workers}
    fix = per_worker(1, resource)
    if counts == {0}:
        logger.warning(
            "%s(device='%s') but Ray assigned no %s: each worker will use the %s numbered by its "
            "local rank. Request %s so Ray keeps jobs apart.", owner, name, units, unit, fix)
    elif 0 in counts:
        bare = [w.rank for w in topology.workers if not w.accelerator_ids][:8]
        raise XLAConfigError(f"{owner}: workers {bare} were given no {units} while others were: "
                             "request ", fix, " for every worker.")
    elif counts != {1}:
        many = max(counts)
        fix = job([len(n) * many for n in topology.nodes()], 1, resource)
        raise XLAConfigError(
            per_worker(many, resource), " is not valid with ", device(owner, name),
            f": {many} {units} per worker, but {why}. Use ",
            Term(f"{per_worker(1, resource)} and num_workers={topology.world_size * many}",
                 fix.plan), " instead.")


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
                raise XLAConfigError(
                    SPMD, " is not valid: it runs one worker per node owning all its devices, "
                    "but node "
                    f"{node[0].node_rank} ({node[0].node_ip}) has {len(node)} workers: give each "
                    "worker all of its node's devices (",
                    Term("ScalingConfig(num_workers=<nodes>, resources_per_worker={<device "
                         "resource>: <devices per node>})",
                         "--workers-per-node 1 --accelerators-per-worker <devices per node>"),
                    ") or ", Term("set spmd=False", "drop --spmd"), ".")

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
