"""Native TorchTPU (``torch-tpu`` on PyPI: the ``tpu`` device and the ``tpu_dist`` process group,
no XLA), one TPU chip per worker.

TorchTPU expects a launcher parent to have called ``set_tpu_launch_env``
(``torch_tpu/_internal/distributed/distributed.py``) before spawning the ranks, and each rank's
native code then reads the result once (``docs/native-tpu-spec.md``). Under
Ray there is no such parent: the plan sets, per worker, what that call and torchrun would have
set, identically on every rank where TorchTPU requires it:

- the torchrun contract (``base.torchrun_env``), with ``RANK``, ``LOCAL_RANK``, ``NODE_RANK``
  (and ``GROUP_RANK``, ``ROLE_RANK``) **renumbered** the way TorchTPU numbers hosts: a slice's
  hosts by the position of their chips in the slice (host coordinates = chip coordinates //
  (2, 2, 1), sorted Z-major as ``_get_slice_host_coordinates``), falling back to the host's TPU
  worker id; a host's workers by the chip Ray gave them; slices by name. Ray's own world rank is
  left as it is; torch.distributed, TorchTPU and the helpers use these;
- ``MASTER_ADDR``: the host of (renumbered) rank 0, where TorchTPU's handshake listens;
  ``MASTER_PORT`` and ``TORCH_TPU_INTERNAL_HANDSHAKE_PORT`` are taken free there (TorchTPU's
  fixed 36423 would collide between two jobs on a host); ``NNODES``;
- ``TORCH_TPU_SLICEBUILDER_ADDRESSES``: one ``host:port`` per rank of the slice, host-major in
  node-rank order, the same list on every rank of the slice (TorchTPU takes entry
  ``RANK % len``); each port was found free on its host at start (``WorkerFacts.free_port``,
  else ``8070 + local rank``, TorchTPU's default); ``localhost`` on one host, as TorchTPU;
- ``TORCH_TPU_TOPOLOGY``: the whole slice in comma form (TorchTPU copies it verbatim into the
  libtpu bounds variables): the slice the hosts report (their topology, else their accelerator
  type's standard one), read by the rules ``TorchXLAConfig`` uses (``tpu.tpu_slice``: a known
  generation and size, 2-D on v5e/v6e, every host and chip of a multi-host slice); the chip
  grid of the workers on one host that holds part of its chips;
- ``TPU_VISIBLE_DEVICES`` and ``TPU_VISIBLE_CHIPS``: the one chip Ray assigned (TorchTPU
  overwrites ``TPU_VISIBLE_CHIPS`` from ``TPU_VISIBLE_DEVICES``, else from ``LOCAL_RANK``);
- ``TORCH_TPU_XPROF_SESSION_ID``: one id for the run; ``ACCELERATE_TORCH_DEVICE=tpu:0`` (every
  process's device is index 0);
- multislice (hosts reporting several slice names): ``MEGASCALE_COORDINATOR_ADDRESS`` (rank 0's
  host and local rank 0's MegaScale port, 8080), ``MEGASCALE_NUM_SLICES``, ``MEGASCALE_SLICE_ID``
  (by slice name, not by worker index) and ``MEGASCALE_PORT`` (8080 + 2 x local rank, what
  TorchTPU sets itself); ranks are slice-major, every slice the same shape;
- ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`` from ``compile_cache``.

TPU v7x (two devices per chip, torch-tpu 0.2.0 ``hardware._DEVICES_PER_CHIP``): one worker per
device, Ray counting ``TPU`` per device (``RAY_TPU_RESOURCE_PER_CHIP=2``; a per-chip count is
refused); ``TORCH_TPU_TOPOLOGY`` 4-D (chips and ``,2``; one host: ``hardware._V7_TOPOLOGY``),
addresses, ranks and ``TPU_VISIBLE_DEVICES`` per device.

``TORCH_TPU_DEVICES_PER_HOST`` is left unset on purpose: with it, the ranks of a host share a
FileStore under ``/dev/shm`` named after their parent pid, which under Ray is the raylet, the
same for every run on the node.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import re

from ray_train_xla.errors import Term, XLAConfigError
from ray_train_xla.planning.hardware import MULTI_HOST_CHIPS
from ray_train_xla.planning.options import TPU_OWNER
from ray_train_xla.planning.runtimes.base import (
    Runtime,
    check_one_accelerator_each,
    job,
    workers_per_host,
)
from ray_train_xla.planning.runtimes.tpu import (
    PER_DEVICE_SETTING,
    check_per_device_count,
    devices_per_chip,
    reported_slice,
    slice_term,
    tpu_slice,
)

logger = logging.getLogger(__name__)

TPU_RESOURCE = "TPU"
CHIPS_PER_HOST = MULTI_HOST_CHIPS  # torch_tpu's _CHIPS_PER_HOST for multi-host slices
BASE_PORT = 8070  # TORCH_TPU_BASE_PORT's default
MEGASCALE_BASE_PORT = 8080  # TorchTPU's AssignMegascalePorts: 8080 + 2 * LOCAL_RANK
# Chips on one host -> their grid (hardware.py's maps agree on 1, 2 and 4 chips; 8 chips on one
# host are v5e/v6e, "2,4,1").
HOST_GRIDS = {1: "1,1,1", 2: "1,2,1", 4: "2,2,1", 8: "2,4,1"}
# TPU v7 (two devices per chip): devices on one host -> TorchTPU's local topology, the chip grid
# with the devices per chip as a 4th entry (torch-tpu 0.2.0 ``hardware._V7_TOPOLOGY``, keyed by
# the devices its PCI scan counts).
V7_HOST_GRIDS = {2: "1,1,1,2", 4: "1,2,1,2", 8: "2,2,1,2"}
TPU = Term(f"{TPU_OWNER}(device='tpu')", "--device tpu --runtime native")


def _hosts_error(needs: str) -> XLAConfigError:
    """The TPU hosts (what they report, not an option) cannot run TorchTPU: ``needs`` says why."""
    return XLAConfigError(f"The TPU hosts are not valid for {TPU_OWNER}(device='tpu'): it needs "
                          f"{needs}.")


def parse_topology(text: str) -> tuple[int, ...] | None:
    """A topology as TorchTPU and Ray write it ("4x4x4", "2,2,1", "4x4", "2,2,1,2") as
    integers; None when it is not one."""
    parts = [p for p in re.split(r"[,xX]", text or "") if p.strip()]
    if not parts or not all(p.strip().isdigit() and int(p) > 0 for p in parts):
        return None
    return tuple(int(p) for p in parts)


def comma_topology(text: str) -> str:
    """The comma form TorchTPU copies into ``TPU_HOST_BOUNDS``: "4x4" -> "4,4,1"."""
    dims = list(parse_topology(text) or ())
    dims += [1] * (3 - len(dims))
    return ",".join(str(d) for d in dims)


def chips_in(topology: str) -> int:
    return math.prod(parse_topology(topology) or (0,))


def slice_hosts(topology: str) -> list[tuple[int, int, int]]:
    """Every host of a slice by its coordinates, in TorchTPU's order (Z-major, X-minor):
    ``_get_slice_host_coordinates``."""
    dims = list(parse_topology(topology) or (1,))[:3]
    dims += [1] * (3 - len(dims))
    bounds = [max(1, m // c) for m, c in zip(dims, CHIPS_PER_HOST)]
    return sorted(itertools.product(*map(range, bounds)), key=lambda h: h[::-1])


def host_position(coords, topology: str) -> int | None:
    """Where a host whose chip has ``coords`` sits in ``slice_hosts(topology)`` (TorchTPU's
    ``_calculate_topological_node_rank`` without a fallback); None if outside or unknown."""
    if not coords or parse_topology(topology) is None:
        return None
    padded = list(coords) + [0] * (3 - len(coords))
    host = tuple(c // k for c, k in zip(padded, CHIPS_PER_HOST))
    hosts = slice_hosts(topology)
    return hosts.index(host) if host in hosts else None


def slice_devices_per_chip(workers) -> int:
    """Devices per chip of the slice these workers run on: 2 where a host reports a TPU v7x
    accelerator type or Ray counts its TPU per device (``RAY_TPU_RESOURCE_PER_CHIP=2``)."""
    return max((max(devices_per_chip(w.tpu_accelerator_type), w.tpu_resource_per_chip or 1)
                for w in workers), default=1)


def _chip_key(w) -> tuple[int, str]:
    chip = w.accelerator_ids[0] if w.accelerator_ids else str(w.local_rank)
    return (int(chip), chip) if chip.isdigit() else (1 << 30, chip)


def session_id(run_id: str) -> str:
    """A decimal id (as TorchTPU's own ``time_ns``) derived from the run id: shared by all ranks."""
    return str(int(hashlib.sha256(run_id.encode()).hexdigest()[:15], 16))


class Layout:
    """Every worker's place as TorchTPU numbers it: slices by name, a slice's hosts in
    topological order, a host's workers by chip. Built once per topology."""

    def __init__(self, topology) -> None:
        nodes = topology.nodes()
        names = sorted({n[0].tpu_name for n in nodes})
        if len(names) > 1 and "" in names:
            unnamed = [n[0].node_ip for n in nodes if not n[0].tpu_name][:4]
            raise _hosts_error(f"a TPU slice name on every host (the hosts report "
                               f"{len(names) - 1} slices, and none for {', '.join(unnamed)})")
        slices = [[n for n in nodes if n[0].tpu_name == name] for name in names]
        shapes = {(len(s), len(s[0])) for s in slices}
        per_host = {len(n) for n in nodes}
        if len(slices) > 1 and len(shapes) > 1:
            raise _hosts_error("the same number of hosts and workers in every TPU slice (TorchTPU "
                               f"ranks slices alike), got {[(len(s), len(s[0])) for s in slices]}"
                               " (hosts, workers per host) for slices " + ", ".join(names))
        if len(nodes) > 1 and len(per_host) > 1:
            raise XLAConfigError(workers_per_host([len(n) for n in nodes]), " is not valid with ",
                                 TPU, ": it needs the same number of workers on every host.")
        self.num_slices = len(slices)
        self.topologies: list[str] = []
        self.addresses: list[str] = []
        self.by_rank: dict[int, dict] = {}
        hosts_per_slice = len(slices[0])
        slice_world = sum(len(n) for n in slices[0])
        self.master_host = ""
        per_chip = slice_devices_per_chip([n[0] for n in nodes])
        for slice_id, hosts in enumerate(slices):
            topo = self._topology(hosts, names[slice_id], per_chip)
            ordered = self._host_order(hosts, topo, names[slice_id])
            entries = []
            for host_index, node in enumerate(ordered):
                workers = sorted(node, key=_chip_key)
                ports = [w.free_port if w.free_port else BASE_PORT + slot
                         for slot, w in enumerate(workers)]
                if len(set(ports)) != len(ports):  # two workers found the same free port
                    ports = [BASE_PORT + slot for slot in range(len(workers))]
                host = "localhost" if len(hosts) == 1 else node[0].node_ip
                if ":" in host:
                    raise _hosts_error("IPv4 node addresses or host names: TorchTPU splits each "
                                       f"slicebuilder address at ':' and host {host} is IPv6")
                for slot, (w, port) in enumerate(zip(workers, ports)):
                    rank = slice_id * slice_world + host_index * len(workers) + slot
                    self.by_rank[w.rank] = {
                        "rank": rank, "local_rank": slot,
                        "node_rank": slice_id * hosts_per_slice + host_index,
                        "slice": slice_id}
                    entries.append(f"{host}:{port}")
                    if rank == 0:
                        self.master_host = node[0].node_ip
                        self.master_worker = w.rank
            self.topologies.append(topo)
            self.addresses.append(",".join(entries))

    @staticmethod
    def _topology(hosts, name: str, per_chip: int = 1) -> str:
        """The slice's topology in comma form, and checks that the workers fill it, by the
        slice rules every TPU runtime shares (``tpu.tpu_slice``: the hosts' accelerator type
        gives its standard topology). With two devices per chip (TPU v7x: one worker per
        device), TorchTPU's 4-D form: the chip grid and the devices per chip ("2,2,4,2"),
        whose product is the processes of the slice. One host may run part of its chips."""
        workers, per_host = sum(len(n) for n in hosts), len(hosts[0])
        where = f" (slice {name})" if name else ""
        suffix = f",{per_chip}" if per_chip > 1 else ""
        unit = "chip" if per_chip == 1 else "device"
        layout = reported_slice([n[0] for n in hosts], len(hosts))
        if layout is not None:
            capacity = layout.chips_per_host * per_chip
            if len(hosts) == layout.hosts and per_host == capacity:
                return layout.comma + suffix
            if len(hosts) > 1 or per_host > capacity:
                raise XLAConfigError(
                    job([len(n) for n in hosts], 1, TPU_RESOURCE), " is not valid with ",
                    slice_term(layout.accelerator_type,
                               "" if layout.accelerator_type else layout.shape),
                    f"{where}: TorchTPU needs every {unit} of the slice in the job: the slice is "
                    f"{layout}, the job has {len(hosts)} host{'s' if len(hosts) > 1 else ''} and "
                    f"{workers} workers. Use ", job([capacity] * layout.hosts, 1, TPU_RESOURCE,
                                                    layout.reserve),
                    f", one worker per device (Ray counting devices: {PER_DEVICE_SETTING})."
                    if per_chip > 1 else ".")
        elif len(hosts) > 1:
            missing = [n[0].node_ip for n in hosts][:4]
            raise XLAConfigError(
                Term(f"The TPU hosts{where} report no slice topology (TPU_TOPOLOGY on GKE, else "
                     f"the GCE metadata): {', '.join(missing)}",
                     "No --accelerator-type or --tpu-topology describes the slice"),
                ": TorchTPU needs TORCH_TPU_TOPOLOGY of the whole slice on every rank.")
        grids = HOST_GRIDS if per_chip == 1 else V7_HOST_GRIDS
        if workers not in grids:
            each = ("1, 2, 4 or 8 workers (one chip each" if per_chip == 1 else
                    f"2, 4 or 8 workers (one device each, {per_chip} devices per TPU v7x chip")
            raise XLAConfigError(workers_per_host([workers]), " is not valid with ", TPU,
                                 f": it needs {each}) on one TPU host{where}, got {workers}.")
        return grids[workers]

    @staticmethod
    def _host_order(hosts, topo: str, name: str) -> list:
        """The slice's hosts in TorchTPU's order: by the position of their chips in the slice,
        else by TPU worker id."""
        if len(hosts) == 1:
            return list(hosts)
        positions = [host_position(n[0].tpu_chip_coords, topo) for n in hosts]
        ranks = [n[0].tpu_worker_id if p is None else p for n, p in zip(hosts, positions)]
        where = f" of slice {name}" if name else ""
        if any(r is None for r in ranks):
            unknown = [n[0].node_ip for n, r in zip(hosts, ranks) if r is None][:4]
            raise _hosts_error(f"the place of every host{where} in the slice (TPU chip "
                               f"coordinates, or the TPU worker id), but {', '.join(unknown)} "
                               "report neither: TorchTPU numbers hosts by it, and Ray's node "
                               "order is not the slice's")
        if sorted(ranks) != list(range(len(hosts))):
            shown = ", ".join(f"{n[0].node_ip}: {r}" for n, r in zip(hosts, ranks))
            raise _hosts_error(f"hosts{where} at distinct places 0..{len(hosts) - 1} in the "
                               f"slice, got {shown} (chip coordinates, else TPU worker id)")
        return [node for _, node in sorted(zip(ranks, hosts), key=lambda p: p[0])]


class NativeTPURuntime(Runtime):
    """One TPU chip per worker, process group ``tpu_dist`` through ``env://``."""

    name = "tpu-native"
    resource = TPU_RESOURCE

    def check(self, config, topology) -> None:
        per_chip = slice_devices_per_chip(topology.workers)
        unit = "device" if per_chip > 1 else "chip"
        check_one_accelerator_each(
            topology, TPU_OWNER, "tpu", f"TPU {unit}s", unit, TPU_RESOURCE,
            f"TorchTPU drives exactly one {unit} per process (every process's device is tpu:0)",
            logger)
        if per_chip > 1:
            check_per_device_count(topology, "TorchTPUConfig", "TorchTPU", per_chip)
        self.layout(topology)

    def layout(self, topology) -> Layout:
        cached = getattr(self, "_cache", None)
        if cached and cached[0] is topology:
            return cached[1]
        layout = Layout(topology)
        self._cache = (topology, layout)
        return layout

    def master_worker(self, topology) -> int:
        return self.layout(topology).master_worker

    def ports_needed(self, config) -> int:
        return 1  # TORCH_TPU_INTERNAL_HANDSHAKE_PORT

    def process_group(self, topology, config) -> tuple[str, str]:
        return "tpu_dist", "env://"

    def device_env(self, place, topology, rdzv, config, facts) -> dict[str, str]:
        layout = self.layout(topology)
        mine = layout.by_rank[place.rank]
        chip = place.accelerator_ids[0] if place.accelerator_ids else str(mine["local_rank"])
        rank, node_rank = str(mine["rank"]), str(mine["node_rank"])
        env = {
            "RANK": rank, "ROLE_RANK": rank,
            "LOCAL_RANK": str(mine["local_rank"]),
            "NODE_RANK": node_rank, "GROUP_RANK": node_rank,
            "NNODES": str(topology.num_nodes),
            "MASTER_ADDR": layout.master_host,
            "TPU_VISIBLE_DEVICES": chip,
            "TPU_VISIBLE_CHIPS": chip,
            "TORCH_TPU_SLICEBUILDER_ADDRESSES": layout.addresses[mine["slice"]],
            "TORCH_TPU_TOPOLOGY": layout.topologies[mine["slice"]],
            "TORCH_TPU_XPROF_SESSION_ID": session_id(rdzv.run_id),
            "TORCH_TPU_INTERNAL_HANDSHAKE_PORT": str(rdzv.extra_ports[0]),
            "ACCELERATE_TORCH_DEVICE": "tpu:0",
        }
        if layout.num_slices > 1:
            env.update({
                "MEGASCALE_COORDINATOR_ADDRESS": f"{layout.master_host}:{MEGASCALE_BASE_PORT}",
                "MEGASCALE_NUM_SLICES": str(layout.num_slices),
                "MEGASCALE_SLICE_ID": str(mine["slice"]),
                "MEGASCALE_PORT": str(MEGASCALE_BASE_PORT + 2 * mine["local_rank"]),
            })
        if config.compile_cache:
            env["TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT"] = config.compile_cache
        return env


RUNTIMES = {("tpu", "native"): NativeTPURuntime}


def describe_slices(facts, accelerator_type: str = "", topology: str | None = None,
                    slices: int = 1) -> list:
    """Facts of a described TPU job (``ray-train-xla plan``): the nodes split evenly into
    ``slices`` slices named ``slice-<n>``, each reporting ``accelerator_type`` and ``topology``
    (default without either: one host's chip grid, or "2,2,<hosts>", hosts of four chips stacked
    along z); each slice's host n reports the n-th host position of the slice's topology (the
    type's standard one when only the type is given) as its chip coordinates and n as its TPU
    worker id. A slice the rules refuse is described as given: the runtime's check names it."""
    import dataclasses

    node_ids = list(dict.fromkeys(f.node_id for f in facts))
    if slices < 1 or len(node_ids) % slices:
        raise XLAConfigError(f"--tpu-slices {slices} does not divide the {len(node_ids)} nodes "
                             "evenly.")
    per_slice = len(node_ids) // slices
    if topology is None and not accelerator_type and per_slice > 1:
        topology = f"2,2,{per_slice}"
    try:
        layout = tpu_slice(accelerator_type, topology or "", hosts=per_slice)
    except ValueError:
        layout = None
    grid = layout.comma if layout is not None else topology
    hosts = slice_hosts(grid) if grid else [(0, 0, 0)]
    out = []
    for f in facts:
        index = node_ids.index(f.node_id)
        host = index % per_slice
        coords = hosts[host] if host < len(hosts) else None
        out.append(dataclasses.replace(
            f, tpu_name=f"slice-{index // per_slice}" if slices > 1 else "",
            tpu_accelerator_type=accelerator_type, tpu_topology=topology or "",
            tpu_worker_id=host,
            tpu_chip_coords=tuple(c * k for c, k in zip(coords, CHIPS_PER_HOST)) if coords else None))
    return out
