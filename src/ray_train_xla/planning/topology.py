"""Who is where: the facts each worker reports, and the ranks derived from them.

Pure data and functions: no Ray, no torch_xla. Workers are grouped by Ray **node id**, not by
IP, so the ranks are right both on real clusters and on ``ray.cluster_utils.Cluster`` test
clusters, where every node shares one IP.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property

# Worker variables that the planner respects when the user already set them on the workers.
PRESET_VARS = ("CCOM_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


@dataclass(frozen=True)
class WorkerFacts:
    """What one worker reports about itself at start (gathered in one parallel round)."""

    node_id: str
    node_ip: str
    pid: int
    hostname: str = ""
    # Accelerator ids Ray assigned to this worker, by resource name ("neuron_cores", "TPU").
    accelerator_ids: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    # PJRT_DEVICE as the worker found it before we touched its environment ("" if unset).
    pjrt_device: str = ""
    # Whether the node has EFA devices, and the network interface that carries node_ip.
    has_efa: bool = False
    network_interface: str = ""
    # Variables among PRESET_VARS that the worker already had (the user's choice wins).
    preset_env: Mapping[str, str] = field(default_factory=dict)
    # TPU hosts only: the host's TPU worker id (GKE ``TPU_WORKER_ID`` or the GCE metadata
    # ``agent-worker-number``, read as Ray reads it) and the name of its TPU slice. torch_xla and
    # libtpu number a slice's hosts by this id, which need not follow Ray's node order.
    tpu_worker_id: int | None = None
    tpu_name: str = ""
    # TPU hosts only: the slice's accelerator type ("v4-64", "v5litepod-16") and chip topology
    # ("2x4x4", "4x4"), as Ray reads them (GKE's TPU_ACCELERATOR_TYPE / TPU_TOPOLOGY, else the
    # GCE metadata); "" when unknown. The TPU process bounds follow from them.
    tpu_accelerator_type: str = ""
    tpu_topology: str = ""
    # TPU hosts only: how many hosts the slice has (Ray's pod type / chips per host), when known.
    tpu_slice_hosts: int | None = None
    # Native TorchTPU (TorchTPUConfig) only: the physical coordinates of one of the host's chips
    # (TorchTPU's own query, in a child process; None if unknown) and a port found free on the
    # host for this worker's slicebuilder address (None if not taken).
    tpu_chip_coords: tuple[int, ...] | None = None
    free_port: int | None = None
    # TPU hosts only: how many Ray ``TPU`` resources one chip counts for, as Ray reads
    # ``RAY_TPU_RESOURCE_PER_CHIP`` on the worker (1: per chip, Ray's default; 2: per device on
    # TPU v7x, whose chips expose two devices each); None when not read (described clusters).
    tpu_resource_per_chip: int | None = None

    @property
    def key(self) -> str:
        """Identifies the worker process across the driver and the worker."""
        return f"{self.node_id}/{self.pid}"


@dataclass(frozen=True)
class WorkerPlace:
    """One worker's place in the job, in torchrun's terms."""

    rank: int
    local_rank: int
    node_rank: int
    local_world_size: int
    node_id: str
    node_ip: str
    # This worker's accelerator ids for the job's device resource (as Ray assigned them).
    accelerator_ids: tuple[str, ...] = ()
    # From WorkerFacts (TPU hosts only): see there.
    tpu_worker_id: int | None = None
    tpu_name: str = ""
    tpu_accelerator_type: str = ""
    tpu_topology: str = ""
    tpu_slice_hosts: int | None = None
    tpu_chip_coords: tuple[int, ...] | None = None
    free_port: int | None = None
    tpu_resource_per_chip: int | None = None


@dataclass(frozen=True)
class Topology:
    """Every worker's place, in world-rank order, plus per-node views the runtimes need."""

    workers: tuple[WorkerPlace, ...]

    @property
    def world_size(self) -> int:
        return len(self.workers)

    @cached_property
    def num_nodes(self) -> int:
        return max((w.node_rank for w in self.workers), default=-1) + 1

    @cached_property
    def node_accelerator_ids(self) -> tuple[tuple[tuple[str, ...], ...], ...]:
        """Per node (index = node rank), each worker's accelerator ids in local-rank order."""
        return tuple(tuple(w.accelerator_ids for w in node) for node in self.nodes())

    def nodes(self) -> list[list[WorkerPlace]]:
        """All nodes (index = node rank), each a list of its workers ordered by local rank."""
        out: list[list[WorkerPlace]] = [[] for _ in range(self.num_nodes)]
        for w in self.workers:
            out[w.node_rank].append(w)
        for node in out:
            node.sort(key=lambda w: w.local_rank)
        return out

    @classmethod
    def from_facts(cls, facts: Sequence[WorkerFacts], resource: str | None = None) -> Topology:
        """Derive ranks from the facts, listed in Ray's world-rank order.

        Node rank follows the order in which nodes first appear in that order (so the node of
        rank 0 is node 0); local rank is the order of a node's workers by world rank.
        """
        if not facts:
            raise ValueError("a topology needs at least one worker")
        node_rank_of = {node: n for n, node in enumerate(dict.fromkeys(f.node_id for f in facts))}
        local_counts = Counter(f.node_id for f in facts)
        # What a place copies from its worker's facts: the node and the TPU host's details.
        copied = [f.name for f in fields(WorkerPlace) if f.name in WorkerFacts.__dataclass_fields__
                  and f.name != "accelerator_ids"]
        seen: dict[str, int] = {}
        places = []
        for rank, f in enumerate(facts):
            local_rank = seen.get(f.node_id, 0)
            seen[f.node_id] = local_rank + 1
            ids = tuple(str(i) for i in f.accelerator_ids.get(resource, ())) if resource else ()
            places.append(WorkerPlace(
                rank=rank, local_rank=local_rank, node_rank=node_rank_of[f.node_id],
                local_world_size=local_counts[f.node_id], accelerator_ids=ids,
                **{name: getattr(f, name) for name in copied}))
        return cls(workers=tuple(places))

    @classmethod
    def uniform(cls, workers_per_node: Sequence[int], accelerators_per_worker: int = 0) -> Topology:
        """A described topology (for ``plan`` and tests); see :func:`described_facts`."""
        facts = described_facts(workers_per_node, accelerators_per_worker)
        return cls.from_facts(facts, DESCRIBED_RESOURCE if accelerators_per_worker else None)


DESCRIBED_RESOURCE = "accelerator"


def described_facts(
    workers_per_node: Sequence[int],
    accelerators_per_worker: int = 0,
    has_efa: bool = False,
    network_interface: str = "",
    ip_prefix: str = "10.0.0.",
) -> list[WorkerFacts]:
    """Facts for a described cluster: node n (IP ``ip_prefix{n+1}``) has ``workers_per_node[n]``
    workers, with contiguous accelerator ids from 0 on each node (resource DESCRIBED_RESOURCE)."""
    facts = []
    for node, count in enumerate(workers_per_node):
        if count < 1:
            raise ValueError(f"node {node} has {count} workers; every node needs at least 1")
        for local in range(count):
            first = local * accelerators_per_worker
            ids = tuple(str(first + i) for i in range(accelerators_per_worker))
            facts.append(WorkerFacts(
                node_id=f"node{node}", node_ip=f"{ip_prefix}{node + 1}", pid=1000 + local,
                accelerator_ids={DESCRIBED_RESOURCE: ids}, has_efa=has_efa,
                network_interface=network_interface))
    return facts
