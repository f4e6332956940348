"""Planning: from a Topology and the options (XLAOptions), every worker's complete environment.

This is the one place where worker environment variables come from (their names and owners are
listed in ``planning/contract.py``):

- ``runtimes/base.torchrun_env``: the torchrun contract (RANK, LOCAL_RANK, WORLD_SIZE, ...,
  MASTER_*, TORCHELASTIC_*), the same for every device;
- ``runtimes/<device>.py``: each runtime's own variables (PJRT_DEVICE, NEURON_*, TPU_*, ...);
- ``RAY_TRAIN_XLA_*`` (below): the options as the workers read them (``WorkerContext``);
- ``TorchXLAConfig.env``: the user's extra variables, applied last (it may not name a planned
  variable: the options validate that).

Nothing here imports Ray or torch_xla, so ``ray-train-xla plan`` can print and tests can check
any variable without hardware.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ray_train_xla.errors import Term, config_error
from ray_train_xla.planning.contract import (
    DEVICE_VAR,
    GROUP_START_VAR,
    INIT_METHOD_VAR,
    LAYOUT_VAR,
    MEMORY_EVERY_VAR,
    NATIVE,
    PEAK_TFLOPS_VAR,
    PG_BACKEND_VAR,
    PROFILE_STEPS_VAR,
    RECOVERY_VAR,
    RUN_START_VAR,
    RUNTIME_VAR,
    SPMD_VAR,
    TIMEOUT_VAR,
    USE_TORCH_XLA_VAR,
    XLA_SPMD_VAR,
    compile_debug_file,
    timeout_text,
)
from ray_train_xla.planning.layout import Layout, Parallelism
from ray_train_xla.planning.runtimes.base import Rendezvous, Runtime, torchrun_env
from ray_train_xla.planning.runtimes.cpu import CPURuntime
from ray_train_xla.planning.runtimes.native_neuron import RUNTIMES as NATIVE_RUNTIMES
from ray_train_xla.planning.runtimes.native_tpu import RUNTIMES as NATIVE_TPU_RUNTIMES
from ray_train_xla.planning.runtimes.neuron import NeuronRuntime, NeuronXRTRuntime
from ray_train_xla.planning.runtimes.tpu import TPURuntime
from ray_train_xla.planning.topology import Topology, WorkerFacts, WorkerPlace

if TYPE_CHECKING:
    from ray_train_xla.planning.options import XLAOptions

__all__ = ["Rendezvous", "Runtime", "WorkerPlan", "get_runtime", "plan", "resolve_device"]

# Ray resource name -> device, for device="auto".
_RESOURCE_DEVICES = {"neuron_cores": "neuron", "TPU": "tpu"}
_PJRT_DEVICES = {"NEURON": "neuron", "TPU": "tpu", "CPU": "cpu"}


def get_runtime(device: str, runtime: str = "pjrt") -> Runtime:
    """A new runtime object for a resolved device and runtime kind."""
    table = {
        ("cpu", "pjrt"): CPURuntime,
        ("neuron", "pjrt"): NeuronRuntime,
        ("neuron", "xrt"): NeuronXRTRuntime,
        ("tpu", "pjrt"): TPURuntime,
        **NATIVE_RUNTIMES,  # TorchNeuronConfig
        **NATIVE_TPU_RUNTIMES,  # TorchTPUConfig
    }
    try:
        return table[(device, runtime)]()
    except KeyError:
        valid = sorted(f"{d}/{r}" for d, r in table)
        raise config_error("device", f"{device}/{runtime}", valid) from None


def resolve_device(requested: str, facts: Sequence[WorkerFacts], runtime: str = "pjrt",
                   native_device: str = "neuron") -> str:
    """Resolve device="auto": accelerators Ray gave the workers, else the workers' PJRT_DEVICE,
    else CPU (XRT exists only on Neuron). A native config (``runtime="native"``) picks its
    ``native_device`` or CPU. An explicit device is returned as is."""
    if requested != "auto":
        return requested
    if runtime == "xrt":
        return "neuron"
    for resource, device in _RESOURCE_DEVICES.items():
        if (runtime != NATIVE or device == native_device) and any(
                f.accelerator_ids.get(resource) for f in facts):
            return device
    if runtime == NATIVE:
        return "cpu"
    found = {f.pjrt_device.upper() for f in facts if f.pjrt_device}
    if len(found) == 1:
        value = found.pop()
        if value in _PJRT_DEVICES:
            return _PJRT_DEVICES[value]
        raise config_error("device", "auto", f"an explicit device: workers have PJRT_DEVICE={value!r}")
    if len(found) > 1:
        raise config_error("device", "auto", f"an explicit device: workers disagree on PJRT_DEVICE "
                           f"({', '.join(sorted(found))})")
    return "cpu"


@dataclass(frozen=True)
class WorkerPlan:
    """One worker's place and the complete environment planned for it."""

    place: WorkerPlace
    env: dict[str, str]

    def to_json(self) -> dict:
        p = self.place
        return {
            "rank": p.rank,
            "local_rank": p.local_rank,
            "node_rank": p.node_rank,
            "local_world_size": p.local_world_size,
            "node_ip": p.node_ip,
            "accelerator_ids": list(p.accelerator_ids),
            "env": self.env,
        }


def plan(
    topology: Topology,
    config: XLAOptions,
    rdzv: Rendezvous,
    device: str,
    facts: Sequence[WorkerFacts] | None = None,
) -> list[WorkerPlan]:
    """Every worker's environment, in rank order. ``device`` is already resolved (no "auto");
    ``facts`` (one per worker, rank order) carry node details such as EFA, when known."""
    runtime = get_runtime(device, config.runtime)
    runtime.check(config, topology)
    pg_backend, init_method = runtime.process_group(topology, config)
    ours = {
        DEVICE_VAR: device,
        RUNTIME_VAR: config.runtime,
        PG_BACKEND_VAR: pg_backend,
        INIT_METHOD_VAR: init_method,
        TIMEOUT_VAR: timeout_text(config.timeout_s),
    }
    if rdzv.started_at:
        ours[GROUP_START_VAR] = repr(float(rdzv.started_at))
    if rdzv.run_started_at:
        ours[RUN_START_VAR] = repr(float(rdzv.run_started_at))
    if config.spmd:
        ours[SPMD_VAR] = "1"
        # torch_xla reads it at import (Neuron's configure_pjrt_environment skips its per-process
        # core mapping only if it is already set); xr.use_spmd() after the import is too late.
        ours[XLA_SPMD_VAR] = "1"
    if config.runtime == NATIVE:
        # Transformers and Accelerate take their torch_xla path whenever torch_xla imports
        # (``USE_TORCH_XLA``, read at their import, default on), and importing it costs every
        # worker seconds: a native worker's device is native even where torch_xla is installed
        # (the Neuron DLAMI has both). Planned, not owned: ``env`` may set it back.
        ours[USE_TORCH_XLA_VAR] = "0"
    if config.profile_steps is not None:
        ours[PROFILE_STEPS_VAR] = ",".join(str(v) for v in config.profile_steps)
    if getattr(config, "memory_every", None):
        ours[MEMORY_EVERY_VAR] = str(config.memory_every)
    if getattr(config, "recovery", "restart") == "in_place":
        ours[RECOVERY_VAR] = f"in_place:{config.max_in_place_restarts}"
    if getattr(config, "peak_tflops", None):
        ours[PEAK_TFLOPS_VAR] = repr(float(config.peak_tflops))
    user = {k: str(v) for k, v in config.env.items()}
    plans = []
    for place in topology.workers:
        env = torchrun_env(place, topology, rdzv)
        env.update(runtime.device_env(place, topology, rdzv, config, facts[place.rank] if facts else None))
        env.update(ours)
        if config.compile_causes:  # torch_xla's compilation analysis, read at its first compile
            env["PT_XLA_DEBUG_LEVEL"] = "1"
            env["PT_XLA_DEBUG_FILE"] = compile_debug_file(rdzv.run_id, place.rank)
        env.update(user)
        plans.append(WorkerPlan(place=place, env=env))
    layout = plan_layout(config, plans)
    if layout is not None:
        for p in plans:
            p.env[LAYOUT_VAR] = layout.to_text()
    return plans


# How a layout's fix is said: which devices to add to each node.
NODE_FIX = Term("as many devices on every node as a multiple of tp (ScalingConfig: workers per "
                "node, resources_per_worker)",
                "as many devices on every node as a multiple of --tp (--workers-per-node, "
                "--accelerators-per-worker)")


def devices_per_worker(config: XLAOptions, place: WorkerPlace) -> int:
    """The devices one worker holds in the layout: under SPMD every device it owns (the
    accelerator ids Ray gave it, or ``cpu_devices_per_worker``), else one."""
    if not getattr(config, "spmd", False):
        return 1
    return len(place.accelerator_ids) or getattr(config, "cpu_devices_per_worker", None) or 1


def layout_owner(config: XLAOptions) -> Term:
    """Who asks for a layout, as an error names it: the config's field, or plan's flags."""
    owner = getattr(config, "_owner", "config")
    return Term(f"{owner}(parallelism=...)", "the layout")


def resolve_layout(wanted: Parallelism, node_of_device: Sequence[str], owner: str | Term,
                   fix: str | Term = NODE_FIX) -> Layout:
    """``wanted`` resolved for these devices (``node_of_device``: each device's node, in the
    order of the ranks the process group uses) and checked against their nodes."""
    layout = wanted.resolve(len(node_of_device), owner)
    layout.check_nodes(node_of_device, owner, fix)
    return layout


def plan_layout(config: XLAOptions, plans: Sequence[WorkerPlan], fix: str | Term = NODE_FIX
                ) -> Layout | None:
    """The config's ``parallelism`` resolved for the planned job (None when it gives none),
    checked against the nodes: the devices in the order of the ranks the process group uses
    (``RANK`` as planned: TorchTPU numbers them its own way), each with its node."""
    owner = layout_owner(config)
    wanted = Parallelism.of(getattr(config, "parallelism", None), owner)
    if wanted is None:
        return None
    ordered = sorted(plans, key=lambda p: int(p.env["RANK"]))
    nodes = [p.place.node_id for p in ordered for _ in range(devices_per_worker(config, p.place))]
    return resolve_layout(wanted, nodes, owner, fix)


def worker_layouts(config: XLAOptions, plans: Sequence[WorkerPlan]) -> list[dict] | None:
    """Each planned worker's place in its layout, in ``plans``' order (None without one): its
    coordinates and data-parallel rank (``Layout.coordinates``, ``dp_rank``, from its planned
    ``RANK``), or under SPMD, where a worker holds several devices, the first of its devices'
    ranks in the layout and how many it holds."""
    text = plans[0].env.get(LAYOUT_VAR) if plans else None
    if text is None:
        return None
    layout = Layout.from_text(text)
    if getattr(config, "spmd", False):
        ordered = sorted(plans, key=lambda p: int(p.env["RANK"]))
        first, start = {}, 0
        for p in ordered:
            first[id(p)] = (start, devices_per_worker(config, p.place))
            start += first[id(p)][1]
        return [{"first_device": first[id(p)][0], "devices": first[id(p)][1]} for p in plans]
    return [{**layout.coordinates(int(p.env["RANK"])), "dp_rank": layout.dp_rank(int(p.env["RANK"]))}
            for p in plans]
