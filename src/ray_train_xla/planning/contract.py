"""The environment contract between the driver and the workers, in one place.

The driver plans every worker's environment (``planning.planner.plan``); the workers read it.
This module names every variable of that contract:

- the torchrun variables (``TORCHRUN_VARS``), the same for every device;
- our own ``RAY_TRAIN_XLA_*`` variables, through which the options reach the workers (there is no
  other channel: the worker-side code reads :class:`WorkerContext`, nothing else);
- the device variables each runtime plans (``PLANNED_BY_OPTION`` says which option controls each).

``check_user_env`` refuses a ``TorchXLAConfig.env`` (or ``plan --env``) entry that would override
a planned variable, naming the option that controls it. :class:`WorkerContext` is the typed view
of the planned environment on a worker, read once per planned environment.

Pure: no Ray, no torch.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# ---- runtime kinds and process-group names -------------------------------------------------
# The runtime kind of TorchNeuronConfig and TorchTPUConfig (native TorchNeuron/TorchTPU, no XLA).
NATIVE = "native"
# The torch.distributed backend of the CPU development mode (registered by ``startup/devmode.py``):
# one backend for CPU and XLA tensors, which runs every operation on host copies through gloo.
# Not "cpu:gloo,xla:xla_host": torch makes a Python ProcessGroup backend the whole group, so the
# gloo backend it creates first for "cpu" is connected to every rank and then dropped, closing
# its connections while the other ranks may still be connecting to it (gloo's "connectFullMesh
# failed ... Connection closed by peer" at process-group start).
DEVMODE_BACKEND = "xla_host"
# SPMD: the ``xla`` backend asserts it is not in SPMD; a CPU process group through the xla://
# handler takes rank and world from PJRT (process_index, process_count), as torch_xla documents.
SPMD_PROCESS_GROUP = ("gloo", "xla://")
# Every XLA worker drives one XLA device, xla:0 (Accelerate reads this, as Ray's TorchConfig sets it).
XLA_TORCH_DEVICE = "xla:0"
# Transformers' and Accelerate's switch for their torch_xla path: "0" on native workers.
USE_TORCH_XLA_VAR = "USE_TORCH_XLA"

# How long rendezvous, process-group initialisation and its operations may wait (timeout_s).
DEFAULT_TIMEOUT_S = 1800

# ---- our own variables: the options as the workers see them ---------------------------------
DEVICE_VAR = "RAY_TRAIN_XLA_DEVICE"
RUNTIME_VAR = "RAY_TRAIN_XLA_RUNTIME"
PG_BACKEND_VAR = "RAY_TRAIN_XLA_PG_BACKEND"
INIT_METHOD_VAR = "RAY_TRAIN_XLA_INIT_METHOD"
TIMEOUT_VAR = "RAY_TRAIN_XLA_TIMEOUT_S"
# "1" with spmd=True: the backend calls xr.use_spmd() before the process group.
SPMD_VAR = "RAY_TRAIN_XLA_SPMD"
# "1" for several CPU workers outside SPMD: the backend installs the CPU development mode.
DEVMODE_VAR = "RAY_TRAIN_XLA_CPU_DEVMODE"
# "1" with neuron_parallel_compile=True: the worker compiles the extracted graphs at shutdown.
PARALLEL_COMPILE_VAR = "RAY_TRAIN_XLA_PARALLEL_COMPILE"
# When the driver started this worker group (Unix seconds, the backend's on_start): where a
# run's wall clock starts for goodput (``toolkit/observability/goodput.py``). Absent in plans
# made offline.
GROUP_START_VAR = "RAY_TRAIN_XLA_GROUP_START"
# When fit() handed the config to Ray (Unix seconds, set when the config is pickled for Ray's
# controller): where the run's goodput clock starts. Absent in plans made offline.
RUN_START_VAR = "RAY_TRAIN_XLA_RUN_START"
# The attribute that carries that time in the pickled config (driver/config.py sets it, the
# backend reads it): the user's own config object never has it.
SUBMITTED_AT = "_rtx_submitted_at"
# "start,count" with profile_steps=(start, count): every rank profiles those steps.
PROFILE_STEPS_VAR = "RAY_TRAIN_XLA_PROFILE_STEPS"
# The memory tier (memory_every=N): its cadence; the run's tier (one for every worker group of
# a fit) and the nodes of this group, whose memory stores hold the checkpoint (the backend).
MEMORY_EVERY_VAR = "RAY_TRAIN_XLA_MEMORY_EVERY"
MEMORY_TIER_VAR = "RAY_TRAIN_XLA_MEMORY_TIER"
MEMORY_NODES_VAR = "RAY_TRAIN_XLA_MEMORY_NODES"
# recovery="in_place": "in_place:<max_in_place_restarts>" (``startup/recovery.py``); absent: a
# fault fails the worker and Ray Train restarts the group.
RECOVERY_VAR = "RAY_TRAIN_XLA_RECOVERY"
# peak_tflops=X: the peak TFLOP/s of one device that MFU is taken against (the timeline's).
PEAK_TFLOPS_VAR = "RAY_TRAIN_XLA_PEAK_TFLOPS"
# parallelism=...: the layout resolved for the job (``planning/layout.py``, ``Layout.to_text``).
LAYOUT_VAR = "RAY_TRAIN_XLA_LAYOUT"
OUR_VARS = (DEVICE_VAR, RUNTIME_VAR, PG_BACKEND_VAR, INIT_METHOD_VAR, TIMEOUT_VAR, SPMD_VAR,
            DEVMODE_VAR, PARALLEL_COMPILE_VAR, GROUP_START_VAR, RUN_START_VAR, PROFILE_STEPS_VAR,
            MEMORY_EVERY_VAR, MEMORY_TIER_VAR, MEMORY_NODES_VAR, RECOVERY_VAR, PEAK_TFLOPS_VAR,
            LAYOUT_VAR)
# Not planned: a knob users may set (where XRT server records live, ``startup/xrt.py``).
STATE_DIR_VAR = "RAY_TRAIN_XLA_STATE_DIR"

# ---- torch_xla and device variables the plan owns -------------------------------------------
# torch_xla's compilation analysis, planned with compile_causes=True (a file per worker); a user
# may set them in env otherwise (the analysis then goes where they say).
XLA_DEBUG_VARS = ("PT_XLA_DEBUG_LEVEL", "PT_XLA_DEBUG_FILE")
XLA_SPMD_VAR = "XLA_USE_SPMD"  # torch_xla's own SPMD switch, read at ``import torch_xla``
RUN_ID_VAR = "TORCHELASTIC_RUN_ID"
NEURON_VISIBLE_CORES_VAR = "NEURON_RT_VISIBLE_CORES"
NEURON_ROOT_COMM_VAR = "NEURON_RT_ROOT_COMM_ID"
# The graph-extraction switches of a Neuron parallel-compile run (Neuron's own variables).
PARALLEL_COMPILE_ENV = {
    "NEURON_EXTRACT_GRAPHS_ONLY": "1",
    "NEURON_PARALLEL_COMPILE": "1",
    "NEURON_FALL_BACK_TO_NULL_NEFF": "1",
}

TORCHRUN_VARS = (
    "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
    "GROUP_WORLD_SIZE", "ROLE_NAME", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
    RUN_ID_VAR, "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
    "TORCHELASTIC_USE_AGENT_STORE",
)

# Neuron's EFA variables (libfabric): planned where the node has EFA devices, or with efa=True.
EFA_ENV = {"FI_PROVIDER": "efa", "FI_EFA_USE_DEVICE_RDMA": "1", "FI_EFA_FORK_SAFE": "1"}

_RANKS = "Ray's ScalingConfig (ranks and world sizes follow the worker group Ray starts)"
_PORTS = "the backend (it reserves free ports on rank 0's node at every start)"
# Planned variable -> what controls it (the message of a refused ``env`` entry).
PLANNED_BY_OPTION: dict[str, str] = {
    **{var: _RANKS for var in TORCHRUN_VARS},
    "MASTER_ADDR": "the backend (rank 0's node address)",
    "MASTER_PORT": _PORTS,
    **{var: "the backend (one id per worker-group start)" for var in TORCHRUN_VARS
       if var.startswith("TORCHELASTIC_")},
    "PJRT_DEVICE": "the device option",
    "PJRT_LOCAL_PROCESS_RANK": _RANKS,
    "PJRT_LOCAL_PROCESS_COUNT": _RANKS,
    XLA_SPMD_VAR: "the spmd option",
    "CPU_NUM_DEVICES": "the cpu_devices_per_worker option",
    "XLA_PERSISTENT_CACHE_PATH": "the compile_cache option (TPU)",
    "XLA_PERSISTENT_CACHE_READ_ONLY": "the backend (local rank 0 writes the compile cache)",
    NEURON_VISIBLE_CORES_VAR: "ScalingConfig(resources_per_worker={'neuron_cores': ...})",
    NEURON_ROOT_COMM_VAR: _PORTS,
    "NEURON_PJRT_WORLD_SIZE": _RANKS,
    "NEURON_PJRT_PROCESS_INDEX": _RANKS,
    "NEURON_PJRT_PROCESSES_NUM_DEVICES": "ScalingConfig(resources_per_worker={'neuron_cores': ...})",
    **{var: "the neuron_parallel_compile option" for var in PARALLEL_COMPILE_ENV},
    "TPU_VISIBLE_CHIPS": "ScalingConfig(resources_per_worker={'TPU': ...})",
    "TPU_CHIPS_PER_PROCESS_BOUNDS": "ScalingConfig(resources_per_worker={'TPU': ...}) and spmd",
    "TPU_CHIPS_PER_HOST_BOUNDS": "ScalingConfig(resources_per_worker={'TPU': ...}) and spmd",
    "TPU_PROCESS_BOUNDS": "the tpu_process_bounds option",
    "TPU_HOST_BOUNDS": "the tpu_process_bounds option",
    "CLOUD_TPU_TASK_ID": _RANKS,
    "TPU_PROCESS_PORT": "the chips Ray assigns (8476 + the first chip id)",
    "TPU_PROCESS_ADDRESSES": _RANKS,
    **{var: "the config itself (our own variable)" for var in OUR_VARS},
    # Native TorchTPU (TorchTPUConfig; planning/runtimes/native_tpu.py).
    "TPU_VISIBLE_DEVICES": "ScalingConfig(resources_per_worker={'TPU': 1})",
    "TORCH_TPU_SLICEBUILDER_ADDRESSES": "the backend (one address per rank, hosts in "
                                        "TorchTPU's topological order)",
    "TORCH_TPU_TOPOLOGY": "the TPU slice the hosts report (TPU_TOPOLOGY or the GCE metadata)",
    "TORCH_TPU_XPROF_SESSION_ID": "the backend (one id per worker-group start)",
    "TORCH_TPU_INTERNAL_HANDSHAKE_PORT": _PORTS,
    "TORCH_TPU_DEVICES_PER_HOST": "the backend, which leaves it unset: with it TorchTPU's ranks "
                                  "of a host share a /dev/shm store keyed by the parent pid, "
                                  "which under Ray is the raylet, shared by every run on the node",
    "NNODES": _RANKS,
    "MEGASCALE_COORDINATOR_ADDRESS": "the backend (rank 0's host, TorchTPU's MegaScale port)",
    "MEGASCALE_NUM_SLICES": "the TPU slices the hosts report (slice names)",
    "MEGASCALE_SLICE_ID": "the TPU slices the hosts report (slice names)",
    "MEGASCALE_PORT": "TorchTPU itself (8080 + 2 x LOCAL_RANK)",
}


def check_user_env(env: Mapping[str, Any], err) -> None:
    """Refuse an ``env`` entry that would override a planned variable: ``err(field, value,
    expected)`` builds the error, naming the variable and what controls it."""
    for key in env:
        if not isinstance(key, str):
            continue
        owner = PLANNED_BY_OPTION.get(key)
        if owner is None and key.startswith("RAY_TRAIN_XLA_") and key != STATE_DIR_VAR:
            owner = "the config itself (RAY_TRAIN_XLA_* variables are ray_train_xla's own)"
        if owner is not None:
            raise err(f"env[{key!r}]", env[key],
                      f"no entry: {key} is planned for every worker and set by {owner}; "
                      "env may only add variables the plan does not own")


def timeout_text(timeout_s: float) -> str:
    """``timeout_s`` as an environment value, kept as given (``1800``, ``2.5``)."""
    return str(int(timeout_s)) if float(timeout_s).is_integer() else repr(float(timeout_s))


# ---- the worker's view ----------------------------------------------------------------------


def _int(environ: Mapping[str, str], name: str, default: int) -> int:
    value = environ.get(name, "")
    return int(value) if value.strip().lstrip("-").isdigit() else default


def _float(environ: Mapping[str, str], name: str, default: float) -> float:
    try:
        return float(environ.get(name, ""))
    except ValueError:
        return default


def _steps_pair(value: str) -> tuple[int, int] | None:
    start, _, count = value.partition(",")
    if start.strip().isdigit() and count.strip().isdigit():
        return int(start), int(count)
    return None


def compile_debug_file(run_id: str, rank: int) -> str:
    """Where a worker's torch_xla writes its compilation analysis (compile_causes=True)."""
    return f"/tmp/ray_train_xla-{run_id}-rank{rank}-compiles.txt"


@dataclass(frozen=True)
class WorkerContext:
    """The planned environment of one worker, typed. Outside a planned worker (a plain process,
    a unit test) every field has the value of a single-worker run."""

    rank: int = 0
    local_rank: int = 0
    node_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    device: str = ""  # "" when no plan was applied to this process
    runtime: str = ""
    pg_backend: str = ""
    init_method: str = ""
    timeout_s: float = float(DEFAULT_TIMEOUT_S)
    spmd: bool = False
    devmode: bool = False
    parallel_compile: bool = False
    graph_extraction: bool = False
    master_addr: str = ""
    master_port: int = 0
    run_id: str = ""
    group_start: float = 0.0  # Unix seconds; 0.0 when unknown
    run_start: float = 0.0  # Unix seconds: when fit() handed the config to Ray; 0.0 when unknown
    profile_steps: tuple[int, int] | None = None
    memory_every: int = 0  # 0: no memory tier
    memory_tier: str = ""
    memory_nodes: tuple[str, ...] = ()
    in_place_restarts: int = 0  # recovery="in_place": its budget; 0: recovery by Ray's restart
    peak_tflops: float = 0.0  # 0.0: the config gives none
    layout: str = ""  # Layout.to_text() of the config's parallelism; "" when it gives none

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> WorkerContext:
        e = os.environ if environ is None else environ
        timeout = e.get(TIMEOUT_VAR, "")
        return cls(
            rank=_int(e, "RANK", 0),
            local_rank=_int(e, "LOCAL_RANK", 0),
            node_rank=_int(e, "GROUP_RANK", 0),
            world_size=_int(e, "WORLD_SIZE", 1),
            local_world_size=_int(e, "LOCAL_WORLD_SIZE", 1),
            device=e.get(DEVICE_VAR, ""),
            runtime=e.get(RUNTIME_VAR, ""),
            pg_backend=e.get(PG_BACKEND_VAR, ""),
            init_method=e.get(INIT_METHOD_VAR, ""),
            timeout_s=float(timeout) if timeout else cls.timeout_s,
            spmd=e.get(SPMD_VAR) == "1",
            devmode=e.get(DEVMODE_VAR) == "1",
            parallel_compile=e.get(PARALLEL_COMPILE_VAR) == "1",
            graph_extraction=e.get("NEURON_EXTRACT_GRAPHS_ONLY") == "1",
            master_addr=e.get("MASTER_ADDR", ""),
            master_port=_int(e, "MASTER_PORT", 0),
            run_id=e.get(RUN_ID_VAR, ""),
            group_start=_float(e, GROUP_START_VAR, 0.0),
            run_start=_float(e, RUN_START_VAR, 0.0),
            profile_steps=_steps_pair(e.get(PROFILE_STEPS_VAR, "")),
            memory_every=_int(e, MEMORY_EVERY_VAR, 0),
            memory_tier=e.get(MEMORY_TIER_VAR, ""),
            memory_nodes=tuple(n for n in e.get(MEMORY_NODES_VAR, "").split(",") if n),
            in_place_restarts=_in_place(e.get(RECOVERY_VAR, "")),
            peak_tflops=_float(e, PEAK_TFLOPS_VAR, 0.0),
            layout=e.get(LAYOUT_VAR, ""),
        )

    @property
    def planned(self) -> bool:
        """True once the backend applied a plan to this process."""
        return bool(self.device)

    @property
    def native(self) -> bool:
        """True on a ``TorchNeuronConfig`` or ``TorchTPUConfig`` worker (native neuron or tpu,
        or their CPU twin)."""
        return self.runtime == NATIVE

    @property
    def spmd_global(self) -> bool:
        """SPMD on an accelerator: one mesh over every worker, XLA tensors are global values."""
        return self.spmd and self.device not in ("", "cpu")

    def who(self, node: str | None = None) -> str:
        """This worker, named for an error message."""
        return (f"worker rank {self.rank} (local rank {self.local_rank}, node "
                f"{node or socket.gethostname()}, pid {os.getpid()})")


def _in_place(text: str) -> int:
    """The budget of ``RECOVERY_VAR`` ("in_place:N"), 0 when it is absent."""
    kind, _, budget = text.partition(":")
    return int(budget) if kind == "in_place" and budget.isdigit() else 0


_cached: tuple[tuple, WorkerContext] | None = None
# The helpers ask for the context several times a step. ``os.environ``'s own mapping of encoded
# names (CPython's ``os._Environ._data``, kept in step with every change made through
# ``os.environ``) answers the staleness check in a fraction of ``os.environ.get``'s time, which
# encodes the name and decodes the value on every call.
_RAW = getattr(os.environ, "_data", None)
_KEY_NAMES = (RUN_ID_VAR, "RANK", "WORLD_SIZE")
_RAW_KEY_NAMES = tuple(os.environ.encodekey(n) for n in _KEY_NAMES) if _RAW is not None else ()


def _plan_key() -> tuple:
    if _RAW is not None:
        return tuple(map(_RAW.get, _RAW_KEY_NAMES))
    return tuple(map(os.environ.get, _KEY_NAMES))


def worker_context() -> WorkerContext:
    """This process's :class:`WorkerContext`, read again only when a new plan was applied (a new
    run id, rank or world size: a restarted or resized worker group) or after :func:`reload`."""
    global _cached
    key = _plan_key()
    cached = _cached
    if cached is None or cached[0] != key:
        cached = _cached = (key, WorkerContext.from_env(os.environ))
    return cached[1]


def reload() -> WorkerContext:
    """Read the environment again (the backend calls it after applying a plan)."""
    global _cached
    _cached = None
    return worker_context()
