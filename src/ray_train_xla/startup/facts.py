"""Start-up step 1, on every worker: report where this worker runs and what Ray gave it, and
take free ports on rank 0's node."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import ray

from ray_train_xla.planning.contract import worker_context
from ray_train_xla.planning.topology import PRESET_VARS, WorkerFacts
from ray_train_xla.startup import netinfo

logger = logging.getLogger(__name__)

TPU_METADATA_TIMEOUT_S = 10.0


def node_ip() -> str:
    """This node's Ray address (the host name outside Ray)."""
    try:
        return ray.util.get_node_ip_address()
    except Exception:  # outside Ray (unit tests): the host name still names the machine
        return socket.gethostname()


def who() -> str:
    """This worker, named for an error message (rank, local rank, node, pid)."""
    return worker_context().who(node_ip())


def gather_facts(timeout_s: float | None = None, device: str | None = None) -> WorkerFacts:
    """Report where this worker runs and what Ray gave it (``timeout_s`` and ``device``: the
    config's, unused here; every wait below has its own bound)."""
    ctx = ray.get_runtime_context()
    ip = ray.util.get_node_ip_address()
    accelerators = {name: tuple(str(i) for i in ids)
                    for name, ids in ctx.get_accelerator_ids().items() if ids}
    tpu: dict = {}
    if accelerators.get("TPU"):
        tpu = dict(zip(("tpu_worker_id", "tpu_name", "tpu_accelerator_type", "tpu_topology",
                        "tpu_slice_hosts"), tpu_host_identity()),
                   tpu_resource_per_chip=tpu_resource_per_chip())
    return WorkerFacts(
        node_id=ctx.get_node_id(),
        node_ip=ip,
        pid=os.getpid(),
        hostname=socket.gethostname(),
        accelerator_ids=accelerators,
        pjrt_device=os.environ.get("PJRT_DEVICE", ""),
        has_efa=netinfo.has_efa(),
        network_interface=netinfo.interface_for_ip(ip) or "",
        preset_env={k: os.environ[k] for k in PRESET_VARS if os.environ.get(k)},
        **tpu,
    )


def tpu_resource_per_chip() -> int | None:
    """How many Ray ``TPU`` resources one chip counts for on this node, as Ray reads it
    (``RAY_TPU_RESOURCE_PER_CHIP``, default 1; 2 counts TPU v7x devices); None if unreadable."""
    try:
        from ray._private.accelerators.tpu import get_tpu_resource_per_chip
    except ImportError:  # a Ray without per-device counting counts chips
        return 1
    try:
        return get_tpu_resource_per_chip()
    except ValueError:
        return None


def tpu_host_identity() -> tuple[int | None, str, str, str, int | None]:
    """This TPU host's worker id, slice name, slice accelerator type (``v4-64``), chip topology
    (``2x4x4``) and the slice's number of hosts, read the way Ray reads them (GKE's
    ``TPU_WORKER_ID``, ``TPU_NAME``, ``TPU_ACCELERATOR_TYPE``, ``TPU_TOPOLOGY``, else the GCE
    metadata server), so hosts can be ordered as torch_xla numbers them, the process bounds
    follow the slice's topology and a worker group holding part of a slice is refused.
    Everything within TPU_METADATA_TIMEOUT_S, else unknown (None, "", "", "", None)."""
    from ray._private.accelerators.tpu import TPUAcceleratorManager as tpu

    # Ray's metadata requests have no timeout; off GCE and GKE they must not hold up the start.
    found = _bounded(lambda: (tpu.get_current_node_tpu_worker_id(),
                              tpu.get_current_node_tpu_name() or "",
                              tpu.get_current_node_tpu_pod_type() or "",
                              tpu.get_current_node_tpu_topology() or "",
                              tpu.get_num_workers_in_current_tpu_pod()),
                     TPU_METADATA_TIMEOUT_S,
                     "the TPU worker id, accelerator type and topology (TPU_WORKER_ID, "
                     "TPU_ACCELERATOR_TYPE, TPU_TOPOLOGY or GCE metadata)",
                     "; hosts are ordered as Ray orders nodes and laid out as a TPU v4 slice")
    return found or (None, "", "", "", None)


# Native TorchTPU: how long the query of a host's chip coordinates may take at most (TorchTPU's
# own bound is 300 s); it is also bounded by the config's timeout_s.
TPU_COORDS_TIMEOUT_S = 300.0
COORDS_PREFIX = "TORCH_TPU_LOCAL_DEVICE_COORDS="  # what TorchTPU's query prints


def gather_native_tpu_facts(timeout_s: float, device: str = "auto") -> WorkerFacts:
    """``TorchTPUConfig``: the facts of :func:`gather_facts`, a port found free for this
    worker's slicebuilder address, and on a TPU host its place in its slice: topology,
    accelerator type, worker id and slice name (as Ray reads them), and the coordinates of a
    chip, which TorchTPU itself reports in a child process (:func:`tpu_chip_coords`). A TPU
    host is one where Ray gave the worker ``TPU`` chips, or any with ``device="tpu"``."""
    facts = gather_facts()
    port = netinfo.free_ports(1, ipv6=":" in facts.node_ip)[0]
    if not facts.accelerator_ids.get("TPU") and device != "tpu":
        return dataclasses.replace(facts, free_port=port)
    from ray._private.accelerators.tpu import TPUAcceleratorManager as tpu

    deadline = time.monotonic() + min(float(timeout_s), TPU_COORDS_TIMEOUT_S)
    slice_facts = _bounded(lambda: (tpu.get_current_node_tpu_worker_id(),
                                    tpu.get_current_node_tpu_name() or "",
                                    tpu.get_current_node_tpu_topology() or "",
                                    tpu.get_current_node_accelerator_type() or ""),
                           TPU_METADATA_TIMEOUT_S, "the TPU slice facts")
    worker_id, name, topology, accelerator_type = slice_facts or (None, "", "", "")
    coords = tpu_chip_coords(facts.node_id, deadline)
    return dataclasses.replace(
        facts, free_port=port, tpu_worker_id=worker_id, tpu_name=name,
        tpu_topology=topology, tpu_accelerator_type=accelerator_type,
        tpu_chip_coords=tuple(coords) if coords else None,
        tpu_resource_per_chip=tpu_resource_per_chip())


def _bounded(read, timeout_s: float, what: str, then: str = ""):
    """``read()`` in a daemon thread, given up after ``timeout_s``: None then, and a warning
    that names ``what`` was not read (and ``then``, what follows)."""
    found: list = []
    thread = threading.Thread(target=lambda: found.append(read()), daemon=True,
                              name="ray_train_xla-tpu-facts")
    thread.start()
    thread.join(timeout_s)
    if not found:
        logger.warning("pid %d: no answer for %s within %.0f s%s", os.getpid(), what, timeout_s,
                       then)
        return None
    return found[0]


def tpu_chip_coords(node_id: str, deadline: float) -> list[int] | None:
    """The physical coordinates of a TPU chip of this host, as TorchTPU's launcher learns them:
    its own query (``python -m torch_tpu._internal.distributed.distributed
    --print_local_device_coords``) in a child process, because the query starts a PJRT client,
    which would claim the chips of a process that is to train. One worker per node runs it (a
    file lock); the answer is kept for the node's lifetime (``node_id``) so that later runs do
    not query chips another job may hold. None when torch_tpu is missing, the query fails or
    ``deadline`` (``time.monotonic()``) passes."""
    import fcntl

    if importlib.util.find_spec("torch_tpu") is None:
        return None
    folder = os.path.join(tempfile.gettempdir(), "ray_train_xla")
    os.makedirs(folder, exist_ok=True)
    cache = os.path.join(folder, f"tpu-coords-{node_id}.json")
    with open(cache + ".lock", "w") as lock:
        while True:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    logger.warning("pid %d: another worker of this node held the TPU coordinate "
                                   "query past timeout_s", os.getpid())
                    return None
                time.sleep(0.05)
        if os.path.exists(cache):
            with open(cache) as f:
                return json.load(f)
        coords = _query_coords(deadline)
        if coords is not None:
            with open(cache + ".tmp", "w") as f:
                json.dump(coords, f)
            os.replace(cache + ".tmp", cache)
        return coords


def _query_coords(deadline: float) -> list[int] | None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch_tpu._internal.distributed.distributed",
         "--print_local_device_coords"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        start_new_session=True)  # its own process group: a timeout ends its children too
    try:
        out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        logger.warning("pid %d: TorchTPU's chip coordinate query did not answer within "
                       "timeout_s", os.getpid())
        return None
    for line in reversed(out.splitlines()):
        if line.startswith(COORDS_PREFIX):
            try:
                return [int(c) for c in json.loads(line[len(COORDS_PREFIX):])]
            except (ValueError, TypeError):
                break
    logger.warning("pid %d: TorchTPU's chip coordinate query gave no coordinates (exit %s): %s",
                   os.getpid(), proc.returncode, (err or out).strip()[-300:])
    return None


def reserve_ports(count: int) -> list[int]:
    """``count`` distinct free TCP ports on this node. The first (``MASTER_PORT``) stays bound
    and listening in this worker until its rendezvous store takes the socket over
    (``rendezvous.join``), so no other process can take it in between."""
    return netinfo.free_ports(count, ipv6=":" in ray.util.get_node_ip_address(), hold=1)
