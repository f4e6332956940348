"""TPU: one process per chip, or one SPMD process per host owning all its chips.

torch_xla derives the TPU topology in ``torch_xla._internal.tpu.configure_topology`` from GCE
metadata, but only with ``os.environ.setdefault``. Ray sets ``TPU_VISIBLE_CHIPS`` to
*all* chips it gave a worker, plus ``TPU_HOST_BOUNDS``/``TPU_CHIPS_PER_HOST_BOUNDS`` for partial
hosts, and those would win over torch_xla's per-process values. So the plan sets every
topology variable itself, from the chips Ray assigned each worker:

- ``TPU_VISIBLE_CHIPS``: the worker's own chip ids (one per process, or the host's chips in SPMD);
- ``TPU_CHIPS_PER_PROCESS_BOUNDS``: ``1,1,1`` per chip, or the host's chip grid in SPMD;
- ``TPU_PROCESS_BOUNDS``: the grid of processes: chips-per-host grid x host grid (per chip), or
  the host grid (SPMD). The host grid is ``1,1,<hosts>`` (TPU v4 stacks hosts along z); for
  slices laid out otherwise (v5e/v6e pods, v7's trailing ``,2``) set
  ``TorchXLAConfig(tpu_process_bounds=...)``;
- ``TPU_HOST_BOUNDS``/``TPU_CHIPS_PER_HOST_BOUNDS``: the same values under the older names Ray
  sets, so that Ray's values for a partial host do not contradict ours;
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

Multislice (hosts of several TPU slices, which Ray's JAX support joins with ``MEGASCALE_*``
variables) is refused before start: torch_xla 2.9's PJRT TPU path has no multislice support.
"""

from __future__ import annotations

import math

from ray_train_xla.errors import config_error
from ray_train_xla.planning.runtimes.base import Runtime
from ray_train_xla.planning.topology import WorkerPlace

BASE_PORT = 8476  # torch_xla's configure_topology default
DEFAULT_XLA_CACHE_DIR = "/tmp/ray_train_xla/xla-compile-cache"
# Chips on one host (or in one SPMD process) -> their grid, as Ray and the TPU VMs lay them out.
CHIP_GRIDS = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}


def _bounds(grid: tuple[int, ...]) -> str:
    return ",".join(str(d) for d in grid)


def _chips(place: WorkerPlace, spmd: bool) -> tuple[str, ...]:
    """The chips this worker owns: as Ray assigned them, else (per chip) its local rank."""
    if place.accelerator_ids:
        return place.accelerator_ids
    return () if spmd else (str(place.local_rank),)


def _chip_key(chip: str) -> tuple[int, str]:
    return (int(chip), chip) if chip.isdigit() else (1 << 30, chip)


class TPURuntime(Runtime):
    name = "tpu"
    pjrt_device = "TPU"
    resource = "TPU"

    def check(self, config, topology) -> None:
        super().check(config, topology)
        if config.compile_cache and "://" in config.compile_cache:
            raise config_error("compile_cache", config.compile_cache,
                               "a directory path with device='tpu' (torch_xla's persistent "
                               "cache is a local or mounted directory, not a URL)")
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
        per_host = [len(_chips(n[0], True)) if config.spmd else len(n) for n in nodes]
        what = "chips per SPMD worker" if config.spmd else "workers (chips) per host"
        if len(set(per_host)) != 1:
            raise config_error("device", "tpu", f"the same number of {what} on every host "
                               f"(torch_xla assumes it), got {per_host}")
        if per_host[0] not in CHIP_GRIDS:
            raise config_error("device", "tpu", f"{what} in {sorted(CHIP_GRIDS)}, got "
                               f"{per_host[0]}")
        bounds = (config.tpu_process_bounds or "").split(",")
        processes = len(nodes) if config.spmd else topology.world_size
        if len(bounds) == 3 and math.prod(int(b) for b in bounds) != processes:
            raise config_error("tpu_process_bounds", config.tpu_process_bounds,
                               f"a grid of {processes} processes (x*y*z = the number of "
                               f"{'hosts' if config.spmd else 'workers'})")

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
                if len(nodes) == 1:
                    host = "localhost"
                else:
                    host = f"[{w.node_ip}]" if ":" in w.node_ip else w.node_ip
                addresses.append(f"{host}:{port}")
                by_rank[w.rank] = (host_index * per_host + slot, port)
        layout = (",".join(addresses), by_rank)
        self._cache = (topology, spmd, layout)
        return layout

    def device_env(self, place, topology, rdzv, config, facts):
        spmd = config.spmd
        num_hosts = topology.num_nodes
        hosts = (1, 1, num_hosts)
        if spmd:
            chip_grid = CHIP_GRIDS[len(_chips(place, True))]
            process_grid = hosts
        else:
            chip_grid = (1, 1, 1)
            per_host = place.local_world_size
            process_grid = tuple(a * b for a, b in zip(CHIP_GRIDS[per_host], hosts))
        addresses, by_rank = self._layout(topology, spmd)
        task_id, port = by_rank[place.rank]
        chips = sorted(_chips(place, spmd), key=_chip_key)
        process_bounds = config.tpu_process_bounds or _bounds(process_grid)
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
