"""TPU: one process per chip, or one SPMD process per host owning all its chips.

torch_xla derives the TPU topology in ``torch_xla._internal.tpu.configure_topology`` from GCE
metadata, but only with ``os.environ.setdefault``. Ray sets ``TPU_VISIBLE_CHIPS`` to
*all* chips it gave a worker, plus ``TPU_HOST_BOUNDS``/``TPU_CHIPS_PER_HOST_BOUNDS`` for partial
hosts, and those would win over torch_xla's per-process values. So the plan sets every
topology variable itself, from the chips Ray assigned each worker:

- ``TPU_VISIBLE_CHIPS``: the worker's own chip ids (one per process, or the host's chips in SPMD);
- ``TPU_CHIPS_PER_PROCESS_BOUNDS``: ``1,1,1`` per chip, or the host's chip grid in SPMD;
- ``TPU_PROCESS_BOUNDS``: the grid of processes: chips-per-host grid x host grid (per chip), or
  the host grid (SPMD). The host grid is the slice's chip topology divided by its hosts' chip
  grid (:class:`TPUSlice`), the topology as the workers report it (the accelerator type and
  topology Ray reads from GKE's ``TPU_ACCELERATOR_TYPE``/``TPU_TOPOLOGY`` or the GCE metadata,
  gathered with the worker facts): a v4-64 (2x4x4) has hosts ``1,2,4``, so ``2,4,4`` per chip,
  as torch_xla's ``configure_topology`` derives from the metadata's ``TPU_PROCESS_BOUNDS``.
  A multi-host job must then use every host of the slice with all its chips. Without a known
  topology, 2 or 4 hosts are laid out as a TPU v4 slice (``1,1,<hosts>``, as v4-16 and v4-32
  are) and other host counts are refused: set ``TorchXLAConfig(tpu_process_bounds=...)``;
  with a known topology that option must equal the derived grid;
- ``TPU_HOST_BOUNDS``/``TPU_CHIPS_PER_HOST_BOUNDS``: the same values as ``TPU_PROCESS_BOUNDS`` /
  ``TPU_CHIPS_PER_PROCESS_BOUNDS`` under the older names Ray sets (torch_xla falls back to them),
  always planned together, so that Ray's values for a partial host do not contradict ours;
- ``CLOUD_TPU_TASK_ID``: ``host * processes_per_host + slot``, where ``host`` is the host's place
  in TPU worker-id order (the id each host reports, as Ray reads it: ``TPU_WORKER_ID`` or the
  GCE metadata; Ray's node order only when no host reports one) and ``slot`` orders a host's
  workers by chip id: torch_xla's ``worker_id * n + local_rank``;
- ``TPU_PROCESS_PORT``: ``8476 + first chip id``. That is torch_xla's ``8476 + local_rank`` when
  a job owns whole hosts, and two jobs sharing a host (on different chips, which Ray keeps
  exclusive) never collide. No port is reserved: like torch_xla, we rely on the 8476+ range
  being free on TPU hosts, and every host computes its ports without asking rank 0's node;
- ``TPU_PROCESS_ADDRESSES``: ``host:port`` of every process in task-id order (``localhost`` on
  one host, as torch_xla does). This is the one variable whose size grows with the world
  (O(processes)): torch_xla's contract needs the full list in every process.
- ``XLA_USE_SPMD=1`` with ``spmd=True`` (planned for every device, see ``planning.planner``);
- ``XLA_PERSISTENT_CACHE_PATH`` / ``XLA_PERSISTENT_CACHE_READ_ONLY``: torch_xla's persistent
  compilation cache (what ``torch_xla.runtime.initialize_cache(path, readonly)`` sets), so a
  worker started again after a failure, or a resumed run, loads the executables it compiled
  instead of compiling them again: ``compile_cache`` (a directory every host shares) or
  ``DEFAULT_XLA_CACHE_DIR`` on each host; local rank 0 writes, the other workers of a host read.
  Not planned on CPU (torch_xla 2.9's CPU client cannot deserialize executables) nor on Neuron
  (Neuron keeps its own cache, ``NEURON_COMPILE_CACHE_URL``).

TPU v7x (two devices per chip): per process, one worker per device as torch_xla 2.9's
``configure_topology`` runs them (Ray counting devices, ``RAY_TPU_RESOURCE_PER_CHIP=2``; a
per-chip count is refused): ``TPU_VISIBLE_CHIPS`` the device, bounds with the trailing ``,2``;
in SPMD the chips of Ray's device ids, bounds without it.

Multislice (hosts of several TPU slices, which Ray's JAX support joins with ``MEGASCALE_*``
variables) is refused before start: torch_xla 2.9's PJRT TPU path has no multislice support.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ray_train_xla.errors import XLAConfigError, config_error
from ray_train_xla.planning.options import check_compile_cache
from ray_train_xla.planning.runtimes.base import Runtime
from ray_train_xla.planning.topology import WorkerPlace

BASE_PORT = 8476  # torch_xla's configure_topology default
DEFAULT_XLA_CACHE_DIR = "/tmp/ray_train_xla/xla-compile-cache"
# Chips on one host (or in one SPMD process) -> their grid, as Ray and the TPU VMs lay them out.
CHIP_GRIDS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}


# Generations whose slices are 2-D grids of chips ("AxB"); the rest are 3-D ("AxBxC").
TWO_D_GENERATIONS = ("v2", "v3", "v5litepod", "v5e", "v6e")
# Generations with one TensorCore per chip (the accelerator type counts chips); the others
# have two (v4-64 is 32 chips), as Ray's TPU support counts them.
ONE_CORE_GENERATIONS = ("v5litepod", "v5e", "v6e")
# Generations whose single-host slices hold up to 8 chips on one host (otherwise 4 per host).
EIGHT_CHIP_HOST_GENERATIONS = ("v5litepod", "v5e", "v6e")
# Chips -> the topology of the Cloud TPU accelerator type of that size (when only the type
# is known, e.g. ``plan --accelerator-type v4-64``).
DEFAULT_TOPOLOGIES_3D = {4: "2x2x1", 8: "2x2x2", 16: "2x2x4", 32: "2x4x4", 64: "4x4x4",
                         128: "4x4x8", 256: "4x8x8", 512: "8x8x8", 1024: "8x8x16",
                         2048: "8x16x16", 4096: "16x16x16", 6144: "16x16x24"}
DEFAULT_TOPOLOGIES_2D = {1: "1x1", 4: "2x2", 8: "2x4", 16: "4x4", 32: "4x8", 64: "8x8",
                         128: "8x16", 256: "16x16", 512: "16x32", 1024: "32x32"}
# Host counts laid out as a TPU v4 slice (hosts stacked along z) when no topology is known.
V4_STACKED_HOSTS = (1, 2, 4)
# Separately addressable devices per chip, by generation: TPU v7 (Ironwood, "tpu7x"/"v7x")
# exposes two (torch-tpu 0.2.0 ``hardware._DEVICES_PER_CHIP = {V7: 2}``, default 1; torch_xla
# 2.9 ``_internal/tpu.py`` appends ",2" to the v7 process bounds); every other generation one.
MULTI_DEVICE_GENERATIONS = {"v7": 2}
# Ray's setting that counts ``TPU`` resources per device instead of per chip (Ray 2.60
# ``ray._private.accelerators.tpu.get_tpu_resource_per_chip``).
PER_DEVICE_SETTING = "RAY_TPU_RESOURCE_PER_CHIP=2"


def tpu_generation(accelerator_type: str) -> str:
    """The generation of a TPU accelerator type as Ray spells it ("v7x"), from any spelling:
    "tpu7x-32", "v7x-32", Ray's "TPU-V7X"; "" when none is given."""
    normal = re.sub(r"^tpu-?v?", "v", (accelerator_type or "").strip().lower())
    return normal.split("-")[0] if normal.startswith("v") else ""


def devices_per_chip(accelerator_type: str) -> int:
    """Devices per chip of a TPU accelerator type (2 on v7x, else 1; see
    MULTI_DEVICE_GENERATIONS)."""
    match = re.match(r"v(\d+)", tpu_generation(accelerator_type))
    return MULTI_DEVICE_GENERATIONS.get(f"v{match.group(1)}", 1) if match else 1


def check_per_device_count(topology, owner: str, runtime: str, per_chip: int,
                           alternative: str = "") -> None:
    """On TPU v7x a worker runs one device: refuse hosts where Ray counts ``TPU`` per chip
    (``RAY_TPU_RESOURCE_PER_CHIP`` unset or 1) and gave each worker a whole chip."""
    per_chip_hosts = sorted({w.node_ip for w in topology.workers
                             if w.tpu_resource_per_chip == 1 and w.accelerator_ids})
    if per_chip_hosts:
        raise XLAConfigError(
            f"{owner}: on TPU v7x each chip exposes {per_chip} devices and {runtime} runs one "
            f"process per device, but Ray counts TPU per chip on {', '.join(per_chip_hosts[:4])}"
            f"{' ...' if len(per_chip_hosts) > 4 else ''}, so each worker holds a whole chip. "
            f"Start Ray on every TPU node with {PER_DEVICE_SETTING} (a host of 4 chips then has "
            f"TPU=8) and keep resources_per_worker={{'TPU': 1}}, one worker per device"
            + alternative + ".")



@dataclass(frozen=True)
class TPUSlice:
    """A TPU slice's layout: its chip grid (``topology``, 3-D), each host's chip grid, and from
    them the grid of hosts. ``generation`` is "" when only the topology is known."""

    accelerator_type: str
    generation: str
    topology: tuple[int, int, int]
    host_chips: tuple[int, int, int]

    @property
    def host_grid(self) -> tuple[int, ...]:
        return tuple(t // c for t, c in zip(self.topology, self.host_chips))

    @property
    def hosts(self) -> int:
        return math.prod(self.host_grid)

    @property
    def chips_per_host(self) -> int:
        return math.prod(self.host_chips)

    @property
    def devices_per_chip(self) -> int:
        return devices_per_chip(self.generation)

    def __str__(self) -> str:
        dims = self.topology[:2] if self.topology[2] == 1 and self.generation in TWO_D_GENERATIONS \
            else self.topology
        topo = "x".join(map(str, dims))
        name = f"{self.accelerator_type} " if self.accelerator_type else ""
        return (f"{name}(topology {topo}: {self.hosts} host{'s' if self.hosts > 1 else ''} of "
                f"{self.chips_per_host} chips)")


def tpu_slice(accelerator_type: str = "", topology: str = "") -> TPUSlice | None:
    """The layout of the slice named by an accelerator type (``v4-64``, ``v5litepod-16``,
    ``v6e-8``, ``v5p-128``, ``tpu7x-8``) and/or a topology (``2x4x4``, ``4x4``); None when
    neither is given. Raises ValueError for one that cannot be read, or when they disagree."""
    accelerator_type, topology = accelerator_type.strip().lower(), topology.strip().lower()
    if not accelerator_type and not topology:
        return None
    generation, chips = "", None
    if accelerator_type:
        normal = re.sub(r"^tpu-?v?", "v", accelerator_type)
        match = re.fullmatch(r"(v\d+[a-z]*)-(\d+)", normal)
        if not match:
            raise ValueError(f"TPU accelerator type {accelerator_type!r} is not of the form "
                             "<generation>-<size>, e.g. v4-64, v5litepod-16, v6e-8, v5p-128")
        generation, size = match.group(1), int(match.group(2))
        per_chip = 1 if generation in ONE_CORE_GENERATIONS else 2
        if size % per_chip:
            raise ValueError(f"TPU accelerator type {accelerator_type!r}: {size} TensorCores "
                             f"is not a whole number of {generation} chips ({per_chip} each)")
        chips = size // per_chip
    two_d = generation in TWO_D_GENERATIONS
    if topology:
        if not re.fullmatch(r"\d+x\d+(x\d+)?", topology):
            raise ValueError(f"TPU topology {topology!r} is not of the form AxB or AxBxC, e.g. "
                             "2x4x4 or 4x4")
        dims = tuple(int(d) for d in topology.split("x"))
        if min(dims) < 1:
            raise ValueError(f"TPU topology {topology!r} has an empty dimension")
        if generation and (len(dims) == 2) != two_d:
            raise ValueError(f"TPU topology {topology!r} is {len(dims)}-D but {generation} "
                             f"slices are {2 if two_d else 3}-D")
        two_d = len(dims) == 2
        if chips is not None and math.prod(dims) != chips:
            raise ValueError(f"TPU topology {topology!r} has {math.prod(dims)} chips but "
                             f"{accelerator_type} has {chips}")
    else:
        table = DEFAULT_TOPOLOGIES_2D if two_d else DEFAULT_TOPOLOGIES_3D
        if chips not in table:
            raise ValueError(f"TPU accelerator type {accelerator_type!r} ({chips} chips) has no "
                             "standard topology: give the topology too")
        dims = tuple(int(d) for d in table[chips].split("x"))
    grid = (dims[0], dims[1], 1) if len(dims) == 2 else (dims[0], dims[1], dims[2])
    total = math.prod(grid)
    eight = generation in EIGHT_CHIP_HOST_GENERATIONS or (not generation and two_d)
    single_host = total <= (8 if eight else 4) and (two_d or total < 4 or grid == (2, 2, 1))
    host_chips = grid if single_host else (2, 2, 1)
    if any(t % c for t, c in zip(grid, host_chips)):
        raise ValueError(f"TPU topology {'x'.join(map(str, dims))} is not a grid of hosts of "
                         f"{'x'.join(map(str, host_chips[:2]))} chips")
    return TPUSlice(accelerator_type=accelerator_type, generation=generation, topology=grid,
                    host_chips=host_chips)


def _bounds(grid: tuple[int, ...]) -> str:
    return ",".join(str(d) for d in grid)


def _chips(place: WorkerPlace, spmd: bool) -> tuple[str, ...]:
    """The chips this worker owns: as Ray assigned them, else (per chip) its local rank. In SPMD
    where Ray counts TPU per device (TPU v7x with ``RAY_TPU_RESOURCE_PER_CHIP=2``), Ray's device
    ids collapsed to their chips (id // devices per chip), as Ray masks ``TPU_VISIBLE_CHIPS``;
    one process per device keeps its device id (torch_xla's ``TPU_VISIBLE_CHIPS=local_rank``
    counts devices on v7)."""
    ids = place.accelerator_ids
    per = place.tpu_resource_per_chip or 1
    if ids and spmd and per > 1 and all(i.isdigit() for i in ids):
        return tuple(dict.fromkeys(str(int(i) // per) for i in ids))
    if ids:
        return ids
    return () if spmd else (str(place.local_rank),)


def _chip_key(chip: str) -> tuple[int, str]:
    return (int(chip), chip) if chip.isdigit() else (1 << 30, chip)


class TPURuntime(Runtime):
    name = "tpu"
    pjrt_device = "TPU"
    resource = "TPU"

    def check(self, config, topology) -> None:
        super().check(config, topology)
        check_compile_cache(config, "tpu")  # device "auto" was checked as Neuron or TPU
        nodes = topology.nodes()
        for node in nodes:
            for w in node:
                chips = _chips(w, config.spmd)
                if config.spmd and not chips:
                    raise config_error(
                        "spmd", True, f"TPU chips for every worker, but worker rank {w.rank} "
                        "was given none: ask Ray for them, e.g. ScalingConfig(num_workers="
                        "<hosts>, resources_per_worker={'TPU': <chips per host>})")
                if not config.spmd and len(chips) != 1:
                    raise config_error(
                        "device", "tpu", f"one TPU chip per worker (one process per chip), but "
                        f"worker rank {w.rank} was given {len(chips)} ({','.join(chips)}): use "
                        "resources_per_worker={'TPU': 1}, or spmd=True for one process per host")
        self._check_hosts(nodes)
        per_chip = 1 if config.spmd else self.devices_per_chip(topology)
        if per_chip > 1:
            check_per_device_count(topology, "TorchXLAConfig", "torch_xla", per_chip,
                                   ", or spmd=True for one process per host owning its chips")
        per_host = [len(_chips(n[0], True)) if config.spmd else len(n) for n in nodes]
        what = ("chips per SPMD worker" if config.spmd else "workers (chips) per host"
                if per_chip == 1 else f"workers (devices, {per_chip} per TPU v7 chip) per host")
        if len(set(per_host)) != 1:
            raise config_error("device", "tpu", f"the same number of {what} on every host "
                               f"(torch_xla assumes it), got {per_host}")
        grids = sorted(c * per_chip for c in CHIP_GRIDS)
        if per_host[0] % per_chip or per_host[0] // per_chip not in CHIP_GRIDS:
            raise config_error("device", "tpu", f"{what} in {grids}, got {per_host[0]}")
        layout = self.slice_of(topology)
        hosts = len(nodes)
        if layout is not None and hosts > 1 and (
                hosts != layout.hosts or per_host[0] != layout.chips_per_host * per_chip):
            raise config_error(
                "device", "tpu", f"every host of the TPU slice with all its chips: the slice is "
                f"{layout}, the job has {hosts} hosts of {per_host[0]} chips. Reserve the whole "
                "slice: ScalingConfig(use_tpu=True, topology=..., accelerator_type=...) with one "
                "worker per chip or (spmd=True) per host")
        bounds = config.tpu_process_bounds
        processes = hosts if config.spmd else topology.world_size
        if bounds is None:
            if layout is None and hosts not in V4_STACKED_HOSTS:
                raise config_error(
                    "device", "tpu", f"the TPU slice's topology for {hosts} hosts: the workers "
                    "reported none (TPU_ACCELERATOR_TYPE / TPU_TOPOLOGY, or the GCE metadata), "
                    "and TPU_PROCESS_BOUNDS depends on it (a v4-64 is 1,2,4 hosts, a "
                    "v5litepod-64 4,4,1). Set TorchXLAConfig(tpu_process_bounds='x,y,z') "
                    "(ray-train-xla plan: --tpu-topology or --accelerator-type)")
            return
        parts = bounds.split(",")
        if len(parts) in (3, 4) and math.prod(int(b) for b in parts) != processes:
            raise config_error("tpu_process_bounds", bounds,
                               f"a grid of {processes} processes (the product of its entries = "
                               f"the number of {'hosts' if config.spmd else 'workers'})")
        if layout is not None and hosts > 1:
            derived = self.planned_bounds(layout, hosts, per_host[0], config.spmd, per_chip)
            if bounds.replace(" ", "") != derived:
                raise config_error(
                    "tpu_process_bounds", bounds,
                    f"None or {derived!r}: the slice is {layout}, which gives TPU_PROCESS_BOUNDS "
                    f"(and TPU_HOST_BOUNDS) {derived} with {per_host[0] if config.spmd else 1} "
                    "chip(s) per process (TPU_CHIPS_PER_PROCESS_BOUNDS); other bounds would "
                    "contradict the chips libtpu finds")

    def devices_per_chip(self, topology) -> int:
        """Devices per chip of the workers' slice: 2 on TPU v7x (its accelerator type, or Ray
        counting TPU per device on a host), else 1."""
        layout = self.slice_of(topology)
        return max([layout.devices_per_chip if layout is not None else 1]
                   + [w.tpu_resource_per_chip or 1 for w in topology.workers])

    def slice_of(self, topology) -> TPUSlice | None:
        """The slice the workers' hosts report (see :func:`tpu_slice`), None when none does.
        Refuses hosts that disagree, or a report that cannot be read."""
        cached = getattr(self, "_slice_cache", None)
        if cached and cached[0] is topology:
            return cached[1]
        reported = sorted({(w.tpu_accelerator_type, w.tpu_topology) for w in topology.workers
                           if w.tpu_accelerator_type or w.tpu_topology})
        if len(reported) > 1:
            shown = "; ".join(f"{a or '?'} topology {t or '?'}" for a, t in reported[:4])
            raise config_error("device", "tpu", f"hosts of one TPU slice, but the workers "
                               f"report different slices: {shown}")
        try:
            layout = tpu_slice(*reported[0]) if reported else None
        except ValueError as exc:
            raise config_error("device", "tpu", f"a TPU slice the workers report correctly: "
                               f"{exc}") from None
        self._slice_cache = (topology, layout)
        return layout

    @staticmethod
    def _chip_grid(layout: TPUSlice | None, chips: int) -> tuple[int, ...]:
        """The grid of ``chips`` chips of one host: the slice's host grid when they are all of
        a host's chips, else the grid Ray and the TPU VMs use for that many."""
        if layout is not None and chips == layout.chips_per_host:
            return layout.host_chips
        return CHIP_GRIDS[chips]

    def planned_bounds(self, layout: TPUSlice | None, hosts: int, per_host: int,
                       spmd: bool, per_chip: int = 1) -> str:
        """TPU_PROCESS_BOUNDS as planned without ``tpu_process_bounds``: ``per_host`` is the
        chips of an SPMD worker, else the processes of a host. In SPMD the host grid; else the
        grid of each host's chips times the host grid. On TPU v7 (``per_chip`` 2) one process
        per device: the grid of the host's chips (``per_host // 2``) times the host grid, and
        torch_xla's trailing ``,2`` (``configure_topology``: ``if tpu_version == 7:
        process_bounds_str += ',2'``)."""
        host_grid = layout.host_grid if layout is not None and hosts > 1 else (1, 1, hosts)
        if spmd:
            return _bounds(host_grid)
        chip_grid = self._chip_grid(layout, per_host // per_chip)
        grid = _bounds(tuple(a * b for a, b in zip(chip_grid, host_grid)))
        return grid if per_chip == 1 else f"{grid},{per_chip}"

    @staticmethod
    def _check_hosts(nodes) -> None:
        """One slice, all of its hosts (where the hosts report the slice's size), and TPU worker
        ids known for every host or none, each id once."""
        names = sorted({w.tpu_name for node in nodes for w in node if w.tpu_name})
        if len(names) > 1:
            raise config_error(
                "device", "tpu", f"hosts of one TPU slice, but the workers run on {len(names)} "
                f"slices ({', '.join(names[:4])}): multislice (MEGASCALE_*) is not supported by "
                "torch_xla's PJRT TPU runtime here; run one job per slice, or use Ray's JAX "
                "trainer for multislice")
        hosts = max((w.tpu_slice_hosts or 0 for node in nodes for w in node), default=0)
        if hosts and len(nodes) != hosts:
            held = ", ".join(str(node[0].tpu_worker_id) for node in nodes[:8])
            raise config_error(
                "device", "tpu", f"every host of the TPU slice ({hosts} hosts"
                f"{' of ' + names[0] if names else ''}), but the worker group runs on "
                f"{len(nodes)} (TPU worker ids {held}): torch_xla's TPU runtime waits for every "
                "host of its slice. Ask Ray for whole slices: ScalingConfig(use_tpu=True, "
                "topology=..., accelerator_type=...) with num_workers a multiple of the workers "
                "per slice; with an elastic range Ray then counts only intact slices")
        if len(nodes) < 2:
            return
        ids = [node[0].tpu_worker_id for node in nodes]
        if all(i is None for i in ids):
            return
        if any(i is None for i in ids) or len(set(ids)) != len(ids):
            shown = ", ".join(f"node {n} ({node[0].node_ip}): {i}"
                              for n, (node, i) in enumerate(zip(nodes, ids)))
            raise config_error(
                "device", "tpu", "one distinct TPU worker id per host (TPU_WORKER_ID or the GCE "
                f"metadata agent-worker-number), got {shown}")

    @staticmethod
    def host_order(nodes) -> list[int]:
        """Node ranks in the order torch_xla numbers the hosts: by TPU worker id where the hosts
        report one, else Ray's node order."""
        ids = [node[0].tpu_worker_id for node in nodes]
        if len(nodes) < 2 or any(i is None for i in ids):
            return list(range(len(nodes)))
        return sorted(range(len(nodes)), key=lambda n: ids[n])

    def _layout(self, topology, spmd: bool) -> tuple[str, dict[int, tuple[int, int]]]:
        """Every process address in task-id order (joined), and rank -> (task id, port); computed once
        per topology, so planning stays linear in the number of workers."""
        cached = getattr(self, "_cache", None)
        if cached and cached[0] is topology and cached[1] == spmd:
            return cached[2]
        nodes = topology.nodes()
        per_host = len(nodes[0])
        addresses: list[str] = []
        by_rank: dict[int, tuple[int, int]] = {}
        for host_index, node_rank in enumerate(self.host_order(nodes)):
            node = nodes[node_rank]
            ordered = sorted(node, key=lambda w: _chip_key(min(_chips(w, spmd), key=_chip_key)))
            for slot, w in enumerate(ordered):
                first = min(_chips(w, spmd), key=_chip_key)
                port = BASE_PORT + (int(first) if first.isdigit() else w.local_rank)
                host = ("localhost" if len(nodes) == 1
                        else f"[{w.node_ip}]" if ":" in w.node_ip else w.node_ip)
                addresses.append(f"{host}:{port}")
                by_rank[w.rank] = (host_index * per_host + slot, port)
        layout = (",".join(addresses), by_rank)
        self._cache = (topology, spmd, layout)
        return layout

    def device_env(self, place, topology, rdzv, config, facts):
        spmd = config.spmd
        layout = self.slice_of(topology)
        chip_grid = self._chip_grid(layout, len(_chips(place, True))) if spmd else (1, 1, 1)
        addresses, by_rank = self._layout(topology, spmd)
        task_id, port = by_rank[place.rank]
        chips = sorted(_chips(place, spmd), key=_chip_key)
        process_bounds = (config.tpu_process_bounds or self.planned_bounds(
            layout, topology.num_nodes, place.local_world_size, spmd,
            1 if spmd else self.devices_per_chip(topology))).replace(" ", "")
        return {
            "PJRT_DEVICE": "TPU",
            "TPU_VISIBLE_CHIPS": ",".join(chips),
            "TPU_CHIPS_PER_PROCESS_BOUNDS": _bounds(chip_grid),
            "TPU_PROCESS_BOUNDS": process_bounds,
            "TPU_CHIPS_PER_HOST_BOUNDS": _bounds(chip_grid),
            "TPU_HOST_BOUNDS": process_bounds,
            "CLOUD_TPU_TASK_ID": str(task_id),
            "TPU_PROCESS_PORT": str(port),
            "TPU_PROCESS_ADDRESSES": addresses,
            "XLA_PERSISTENT_CACHE_PATH": config.compile_cache or DEFAULT_XLA_CACHE_DIR,
            "XLA_PERSISTENT_CACHE_READ_ONLY": "0" if place.local_rank == 0 else "1",
        }
