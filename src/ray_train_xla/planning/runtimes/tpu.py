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
  grid (:class:`TPUSlice`, by the rules of :func:`tpu_slice`, which the native TorchTPU runtime
  shares; ``planning/hardware.py`` has each generation), the topology as the workers report it
  (the accelerator type and topology Ray reads from GKE's ``TPU_ACCELERATOR_TYPE``/
  ``TPU_TOPOLOGY`` or the GCE metadata, gathered with the worker facts; a type alone gives its
  standard topology): a v4-64 (2x4x4) has hosts ``1,2,4``, so ``2,4,4`` per chip,
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

from ray_train_xla.errors import Term, XLAConfigError
from ray_train_xla.planning.hardware import (
    MULTI_HOST_CHIPS,
    TPU_GENERATIONS,
    TPUGeneration,
    devices_per_chip,
    tpu_generation,
    tpu_generation_spec,
)
from ray_train_xla.planning.options import check_compile_cache
from ray_train_xla.planning.runtimes.base import (
    SPMD,
    Runtime,
    device,
    job,
    per_worker,
    workers_per_host,
)
from ray_train_xla.planning.topology import WorkerPlace

__all__ = ["TPUSlice", "devices_per_chip", "tpu_generation", "tpu_slice"]

BASE_PORT = 8476  # torch_xla's configure_topology default
DEFAULT_XLA_CACHE_DIR = "/tmp/ray_train_xla/xla-compile-cache"
# Chips on one host (or in one SPMD process) -> their grid, as Ray and the TPU VMs lay them out.
CHIP_GRIDS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
# Host counts laid out as a TPU v4 slice (hosts stacked along z) when no topology is known.
V4_STACKED_HOSTS = (1, 2, 4)
# Ray's setting that counts ``TPU`` resources per device instead of per chip (Ray 2.60
# ``ray._private.accelerators.tpu.get_tpu_resource_per_chip``).
PER_DEVICE_SETTING = "RAY_TPU_RESOURCE_PER_CHIP=2"
OWNER = "TorchXLAConfig"


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
    dims: int = 3  # as the slice is written: 2 (AxB) or 3 (AxBxC)

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

    @property
    def shape(self) -> str:
        """The topology as the slice is written: "4x4", "2x2x4"."""
        return "x".join(map(str, self.topology[:self.dims]))

    @property
    def comma(self) -> str:
        """The topology in libtpu's bounds form ("4,4,1"), as TorchTPU takes it."""
        return ",".join(map(str, self.topology))

    @property
    def reserve(self) -> str:
        """The ``ScalingConfig`` arguments that reserve this slice with Ray: ``use_tpu=True,
        topology='4x4', accelerator_type='TPU-V6E'`` (Ray's name of the generation)."""
        kind = f", accelerator_type='TPU-{self.generation.upper()}'" if self.generation else ""
        return f"use_tpu=True, topology={self.shape!r}{kind}"

    def __str__(self) -> str:
        name = f"{self.accelerator_type} " if self.accelerator_type else ""
        hosts = f"{self.hosts} host{'s' if self.hosts > 1 else ''}"
        devices = (f" ({self.chips_per_host * self.devices_per_chip} devices)"
                   if self.devices_per_chip > 1 else "")
        return f"{name}(topology {self.shape}: {hosts} of {self.chips_per_host} chips{devices})"


def slice_term(accelerator_type: str, topology: str) -> Term:
    """The slice the hosts report: in the API the reported facts, in ``plan`` its flags."""
    api = ", ".join(f"{what} {value}" for what, value in (
        ("accelerator type", accelerator_type), ("topology", topology)) if value)
    flags = " ".join(f"{flag} {value}" for flag, value in (
        ("--accelerator-type", accelerator_type), ("--tpu-topology", topology)) if value)
    return Term(f"the TPU slice the hosts report ({api})", flags)


def tpu_slice(accelerator_type: str = "", topology: str = "",
              hosts: int | None = None) -> TPUSlice | None:
    """The layout of the slice named by an accelerator type (``v4-64``, ``v5litepod-16``,
    ``v6e-8``, ``v5p-128``, ``tpu7x-8``; Ray's ``TPU-V6E`` names the generation only) and/or a
    topology (``2x4x4``, ``4x4``); None when neither says the slice's size. One set of rules
    for every TPU runtime (``planning/hardware.py`` has the tables):

    - a type names a known generation (``TPU_GENERATIONS``) and a size of it, or a topology
      goes with it; the type alone gives its generation's standard topology;
    - a topology is 2-D on v5e and v6e (one of their published shapes), 3-D on the others, and
      holds the type's chips;
    - a slice up to a host's chips (8 on v5e and v6e, 4 otherwise; on 3-D generations 2x2x1)
      is one host; larger ones are hosts of 2x2x1 chips; ``hosts`` (the job's, when known)
      picks the 2-VM form where Google offers one (v6e's 2x4 on GKE).

    A type of a generation this package does not know is refused, whether or not a topology
    comes with it: the generation is what tells its devices per chip (2 on TPU v7x, which
    changes every variable) and its host size, which a topology does not, so a plan for it
    could be silently wrong. Raises ValueError naming the known types."""
    given, accelerator_type = accelerator_type.strip(), accelerator_type.strip().lower()
    topology = topology.strip().lower()
    if not accelerator_type and not topology:
        return None
    gen: TPUGeneration | None = None
    chips = None
    if accelerator_type:
        normal = re.sub(r"^tpu-?v?", "v", accelerator_type)
        match = re.fullmatch(r"(v\d+[a-z]*)(?:-(\d+))?", normal)
        if not match:
            raise ValueError(f"TPU accelerator type {accelerator_type!r} is not of the form "
                             "<generation>-<size>, e.g. v4-64, v5litepod-16, v6e-8, v5p-128")
        gen = tpu_generation_spec(accelerator_type)
        if gen is None:
            raise ValueError(f"TPU accelerator type {accelerator_type!r} is not of a generation "
                             f"this package knows: expected one of {', '.join(TPU_GENERATIONS)}, "
                             "with a slice size, e.g. v5p-32, v6e-16, tpu7x-32 (docs/spmd-tpu.md, "
                             "'TPU generations and slices', lists each generation's sizes)")
        if match.group(2):
            size = int(match.group(2))
            if size % gen.cores_per_chip:
                raise ValueError(f"TPU accelerator type {accelerator_type!r}: {size} TensorCores "
                                 f"is not a whole number of {gen.name} chips ({gen.cores_per_chip} "
                                 "each)")
            chips = size // gen.cores_per_chip
    if topology:
        if not re.fullmatch(r"\d+([x,]\d+){1,2}", topology):
            raise ValueError(f"TPU topology {topology!r} is not of the form AxB or AxBxC, e.g. "
                             "2x4x4 or 4x4")
        dims = tuple(int(d) for d in re.split("[x,]", topology))
        if min(dims) < 1:
            raise ValueError(f"TPU topology {topology!r} has an empty dimension")
        if gen and gen.dims == 2 and len(dims) == 3 and dims[2] == 1:
            dims = dims[:2]  # "4,4,1": a 2-D slice in libtpu's bounds form
        if gen and len(dims) != gen.dims:
            raise ValueError(f"TPU topology {topology!r} is {len(dims)}-D but {gen.name} slices "
                             f"are {gen.dims}-D")
        if chips is not None and math.prod(dims) != chips:
            raise ValueError(f"TPU topology {topology!r} has {math.prod(dims)} chips but "
                             f"{accelerator_type} has {chips}")
        if gen and gen.dims == 2 and sorted(dims) not in [
                sorted(int(d) for d in s.split("x")) for s in gen.shapes]:
            raise ValueError(f"TPU topology {topology!r} is not a {gen.name} slice: expected one "
                             f"of {', '.join(gen.shapes)}")
    elif chips is None:
        return None  # the generation alone: nothing of the slice's size
    elif chips not in gen.topologies:
        other = "" if gen.dims == 2 else " (another shape: give its topology too)"
        raise ValueError(f"TPU accelerator type {accelerator_type!r} ({chips} chips) is not a "
                         f"{gen.name} slice size: expected one of {', '.join(gen.sizes())}"
                         + other)
    else:
        dims = tuple(int(d) for d in gen.topologies[chips].split("x"))
    grid = (dims[0], dims[1], 1) if len(dims) == 2 else (dims[0], dims[1], dims[2])
    total, two_d = math.prod(grid), len(dims) == 2
    most = gen.single_host_chips if gen else (8 if two_d else 4)
    single = total <= most and (two_d or total < 4 or grid == MULTI_HOST_CHIPS)
    host_chips = grid if single else MULTI_HOST_CHIPS
    shape = "x".join(map(str, dims))
    if (single and hosts and hosts > 1 and total == hosts * math.prod(MULTI_HOST_CHIPS)
            and (gen is None or shape in gen.split_shapes)):
        host_chips = MULTI_HOST_CHIPS  # the same slice as 2 VMs of 4 chips
    if gen is None and any(t % c for t, c in zip(grid, host_chips)):
        # No generation to say a host's chips: as TorchTPU counts hosts without one, a host
        # holds at most the slice's extent along each axis (1x2x2: two hosts of 1x2 chips).
        host_chips = tuple(min(t, c) for t, c in zip(grid, host_chips))
    if any(t % c for t, c in zip(grid, host_chips)):
        raise ValueError(f"TPU topology {shape} is not a grid of hosts of "
                         f"{'x'.join(map(str, host_chips[:2]))} chips")
    return TPUSlice(accelerator_type=given, generation=gen.name if gen else "",
                    topology=grid, host_chips=host_chips, dims=len(dims))


def reported_slice(workers, hosts: int) -> TPUSlice | None:
    """The slice ``workers`` (on ``hosts`` hosts) report, by :func:`tpu_slice`; None when none
    reports one. Refuses workers that disagree, or a report the rules refuse (blaming it: the
    hosts' report in the API, ``--accelerator-type``/``--tpu-topology`` in ``plan``)."""
    reported = sorted({(w.tpu_accelerator_type, w.tpu_topology) for w in workers
                       if w.tpu_accelerator_type or w.tpu_topology})
    if len(reported) > 1:
        shown = "; ".join(f"{a or '?'} topology {t or '?'}" for a, t in reported[:4])
        raise XLAConfigError(f"The TPU hosts of one slice report different slices: {shown}.")
    if not reported:
        return None
    accelerator_type, topology = reported[0]
    dims = re.split("[x,]", topology)
    if len(dims) == 4:  # TorchTPU's v7 form, devices per chip last: the slice is the chips
        topology = ",".join(dims[:3])
    try:
        return tpu_slice(accelerator_type, topology, hosts=hosts)
    except ValueError as exc:
        raise XLAConfigError(slice_term(accelerator_type, topology),
                             f" is not valid: {exc}.") from None


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
        tpu = device(OWNER, "tpu")
        nodes = topology.nodes()
        for node in nodes:
            for w in node:
                chips = _chips(w, config.spmd)
                if config.spmd and not chips:
                    raise XLAConfigError(
                        SPMD, " is not valid: it needs TPU chips for every worker, but worker "
                        f"rank {w.rank} was given none: ask Ray for them, e.g. ",
                        Term("ScalingConfig(num_workers=<hosts>, resources_per_worker={'TPU': "
                             "<chips per host>})", "--accelerators-per-worker <chips per host>"),
                        ".")
                if not config.spmd and len(chips) != 1:
                    raise XLAConfigError(
                        per_worker(len(chips), "TPU"), " is not valid with ", tpu,
                        f": torch_xla runs one TPU chip per worker (one process per chip), but "
                        f"worker rank {w.rank} was given {len(chips)} ({','.join(chips)}): use ",
                        per_worker(1, "TPU"), ", or ", SPMD, " for one process per host.")
        self._check_hosts(nodes)
        per_chip = 1 if config.spmd else self.devices_per_chip(topology)
        if per_chip > 1:
            check_per_device_count(topology, OWNER, "torch_xla", per_chip,
                                   ", or spmd=True for one process per host owning its chips")
        per_host = [len(_chips(n[0], True)) if config.spmd else len(n) for n in nodes]
        unit = "chip" if per_chip == 1 else "device"
        what = ("chips per SPMD worker" if config.spmd else "workers (chips) per host"
                if per_chip == 1 else f"workers (devices, {per_chip} per TPU v7 chip) per host")
        given = (per_worker(",".join(map(str, sorted(set(per_host)))), "TPU") if config.spmd
                 else workers_per_host(per_host))
        if len(set(per_host)) != 1:
            raise XLAConfigError(given, " is not valid with ", tpu, f": it needs the same number "
                                 f"of {what} on every host (torch_xla assumes it), got {per_host}.")
        grids = sorted(c * per_chip for c in CHIP_GRIDS)
        if per_host[0] % per_chip or per_host[0] // per_chip not in CHIP_GRIDS:
            raise XLAConfigError(given, " is not valid with ", tpu,
                                 f": expected {what} in {grids}, got {per_host[0]}.")
        layout = self.slice_of(topology)
        hosts = len(nodes)
        capacity = layout.chips_per_host * (1 if config.spmd else per_chip) if layout else 0
        if layout is not None and (per_host[0] > capacity or hosts > 1 and (
                hosts != layout.hosts or per_host[0] != capacity)):
            each = capacity if config.spmd else 1
            fix = job([1 if config.spmd else capacity] * layout.hosts, each, "TPU",
                      layout.reserve)
            raise XLAConfigError(
                job(per_host if not config.spmd else [1] * hosts, 1 if not config.spmd else
                    per_host[0], "TPU"),
                " is not valid with ",
                slice_term(layout.accelerator_type, layout.shape if not layout.accelerator_type
                           else ""),
                f": torch_xla needs every host of the TPU slice with all its {unit}s: the slice "
                f"is {layout}, the job has {hosts} host{'s' if hosts > 1 else ''} of "
                f"{per_host[0]} {unit}s. Use ", fix, f" (one worker per {unit}), or ", SPMD,
                " with one worker per host.")
        bounds = config.tpu_process_bounds
        processes = hosts if config.spmd else topology.world_size
        if bounds is None:
            if layout is None and hosts not in V4_STACKED_HOSTS:
                raise XLAConfigError(
                    Term("The TPU hosts report no slice (TPU_ACCELERATOR_TYPE / TPU_TOPOLOGY, or "
                         "the GCE metadata)", "No --accelerator-type or --tpu-topology is given"),
                    f", and TPU_PROCESS_BOUNDS depends on the TPU slice's topology for {hosts} "
                    "hosts (a v4-64 is 1,2,4 hosts, a v5litepod-64 4,4,1): set ",
                    Term("TorchXLAConfig(tpu_process_bounds='x,y,z')",
                         "--tpu-topology or --accelerator-type (or --tpu-process-bounds x,y,z)"),
                    ".")
            return
        option = Term(f"{OWNER}.tpu_process_bounds={bounds!r}", f"--tpu-process-bounds {bounds}")
        parts = bounds.split(",")
        if len(parts) in (3, 4) and math.prod(int(b) for b in parts) != processes:
            raise XLAConfigError(
                option, f" is not valid: expected a grid of {processes} processes (the product "
                f"of its entries = the number of {'hosts' if config.spmd else 'workers'}).")
        if layout is not None and hosts > 1:
            derived = self.planned_bounds(layout, hosts, per_host[0], config.spmd, per_chip)
            if bounds.replace(" ", "") != derived:
                raise XLAConfigError(
                    option, f" is not valid: expected None or {derived!r}: the slice is {layout}, "
                    f"which gives TPU_PROCESS_BOUNDS (and TPU_HOST_BOUNDS) {derived} with "
                    f"{per_host[0] if config.spmd else 1} chip(s) per process "
                    "(TPU_CHIPS_PER_PROCESS_BOUNDS); other bounds would contradict the chips "
                    "libtpu finds.")

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
        layout = reported_slice(topology.workers, topology.num_nodes)
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
            raise XLAConfigError(
                f"The worker group is not valid for {OWNER}(device='tpu'): it needs hosts of one "
                f"TPU slice, but the workers run on {len(names)} slices ({', '.join(names[:4])}): "
                "multislice (MEGASCALE_*) is not supported by torch_xla's PJRT TPU runtime here; "
                "run one job per slice, use TorchTPUConfig, or Ray's JAX trainer for multislice.")
        hosts = max((w.tpu_slice_hosts or 0 for node in nodes for w in node), default=0)
        if hosts and len(nodes) != hosts:
            held = ", ".join(str(node[0].tpu_worker_id) for node in nodes[:8])
            raise XLAConfigError(
                f"The worker group is not valid for {OWNER}(device='tpu'): it needs every host "
                f"of the TPU slice ({hosts} hosts{' of ' + names[0] if names else ''}), but the "
                f"worker group runs on {len(nodes)} (TPU worker ids {held}): torch_xla's TPU "
                "runtime waits for every host of its slice. Ask Ray for whole slices: "
                "ScalingConfig(use_tpu=True, topology=..., accelerator_type=...) with num_workers "
                "a multiple of the workers per slice; with an elastic range Ray then counts only "
                "intact slices.")
        if len(nodes) < 2:
            return
        ids = [node[0].tpu_worker_id for node in nodes]
        if all(i is None for i in ids):
            return
        if any(i is None for i in ids) or len(set(ids)) != len(ids):
            shown = ", ".join(f"node {n} ({node[0].node_ip}): {i}"
                              for n, (node, i) in enumerate(zip(nodes, ids)))
            raise XLAConfigError(
                f"The TPU hosts are not valid for {OWNER}(device='tpu'): it needs one distinct "
                "TPU worker id per host (TPU_WORKER_ID or the GCE metadata agent-worker-number), "
                f"got {shown}.")

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
